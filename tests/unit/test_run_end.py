"""The run's end as pure logic (records and donors' states given): one final state for the whole swarm, the one most
finished peers hold, taken from peers never met only when it is a few outer steps from this peer's own
(``training/run_end.py``). Real swarms: ``tests/integration/test_swarm.py``."""

from __future__ import annotations

import time

import torch

from p2p_diloco.training.run_end import NEAR_STEPS
from p2p_diloco.training.sync import SyncGroup
from tests.unit.test_swarm_state import OneStage, Record, make_stage, make_sync

NUM_ROUNDS = 3
LAST = NUM_ROUNDS - 1


def finished(scale: float, seed: int = 0):
    """A stage at the run's end whose last outer step applied ``scale`` times a fixed pseudo-gradient to the state
    every peer shared before it (the run's initial one): two such stages are a split last round's two groups."""
    stage = make_stage(seed=0)
    torch.manual_seed(seed)
    stage.outer_optimizer.step([scale * 1e-3 * torch.randn_like(t) for t in stage.anchor])
    stage.round_index, stage.applied_round = NUM_ROUNDS, LAST
    stage.inner_step = NUM_ROUNDS * stage.diloco_cfg.inner_steps
    return stage


def at_end(peer, records, donor, met=()):
    """``peer``'s sync, its records showing ``records`` (anchor "x": the donor's state), the donor serving its state;
    ``met``: the groupmates of its rounds."""
    sync = make_sync(peer, records, donor.shareable_state("run"), num_rounds=NUM_ROUNDS)
    sync.remember(peer.state_fingerprint()[0])
    sync.witnesses.met_group(["me", *met])
    return sync


def test_a_group_that_met_only_itself_takes_the_state_most_finished_peers_hold():
    """A pair ("me", "mate") met only each other; three peers it never met hold another final state. Its believed
    peers all hold its own, so the run ended on two models; now the most-held state wins, and it is one outer step
    of another group from this pair's own: taken."""
    peer, donor = finished(1.0), finished(1.0, seed=1)
    mine = peer.state_fingerprint()[0]
    records = [Record(NUM_ROUNDS, LAST, mine, node="mate")] + \
        [Record(NUM_ROUNDS, LAST, "x", node=f"s{i}") for i in range(3)]
    sync = at_end(peer, records, donor, met=["mate"])
    assert sync.agreed_at_end(believed_only=True) and not sync.agreed_at_end()
    sync.at_end(deadline=time.monotonic() + 5)
    assert [e["action"] for e in sync.events] == ["resync"], sync.events
    assert all(torch.equal(a, b) for a, b in zip(peer.anchor, donor.anchor))
    assert peer.state_fingerprint()[0] == donor.state_fingerprint()[0]
    assert peer.round_index == NUM_ROUNDS and peer.inner_step == donor.inner_step


def test_a_far_final_state_that_only_strangers_vouch_for_is_refused():
    """Made-up identities outnumber the peers met and hold a state of their own choosing, 50 outer steps from this
    peer's: refused (and the believed peers' state kept), so that they can move the final model by a few outer
    steps at most. The same state vouched for by two believed peers is taken, as any resync."""
    peer, forged = finished(1.0), finished(50.0, seed=1)
    mine = peer.state_fingerprint()[0]
    sybils = [Record(NUM_ROUNDS, LAST, "x", node=f"sybil{i}") for i in range(5)]
    sync = at_end(peer, [Record(NUM_ROUNDS, LAST, mine, node="mate"), *sybils], forged, met=["mate"])
    sync.at_end(deadline=time.monotonic() + 5)
    assert not sync.events and peer.state_fingerprint()[0] == mine
    assert sync.end.reference.steps_from(forged.shareable_state("run")[1]) > NEAR_STEPS
    friends = [Record(NUM_ROUNDS, LAST, "x", node=n) for n in ("f1", "f2")]
    peer = finished(1.0)
    sync = at_end(peer, friends + sybils, forged, met=["f1", "f2"])
    sync.at_end(deadline=time.monotonic() + 5)
    assert [e["action"] for e in sync.events] == ["resync"]


def test_the_end_is_decided_again_as_the_others_take_the_final_state():
    """The votes move while the peers take the final state: "mate" holds this peer's state at first (two votes
    against one, this peer stays as a donor), then takes the other one ("b" is its groupmate too). Deciding once
    left this peer alone on its state; now it decides again and takes the state both others hold."""
    peer, donor = finished(1.0), finished(1.0, seed=1)
    mine = peer.state_fingerprint()[0]
    sync = at_end(peer, [Record(NUM_ROUNDS, LAST, mine, node="mate"), Record(NUM_ROUNDS, LAST, "x", node="b")],
                  donor, met=["mate", "b"])
    theirs = donor.state_fingerprint()[0]
    calls = []

    def on_change():
        calls.append(len(sync.events))
        if sync.events:  # as the trainer's ledger: note the new state
            sync.events.clear()
            sync.remember(peer.state_fingerprint()[0])
        sync.swarm.records[0] = Record(NUM_ROUNDS, LAST, theirs, node="mate")  # mate took the other state

    assert SyncGroup([sync], OneStage()).agree_at_end(time.monotonic() + 10, on_change, poll_s=0.01)
    assert calls[:2] == [0, 1], calls  # nothing the first time; the resync the second
    assert peer.state_fingerprint()[0] == theirs
