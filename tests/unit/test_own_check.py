"""Issue 49 §1-3: no state from others replaces a peer's own without the peer's own check (its held-out loss), however
many identities vouch for it; a claim that the run is over never makes a peer train nothing or quit.

The records logic is driven as in ``test_sync_trust.py`` (given records, donors serving given states); the states are
real models of the tiny Transformer, judged by a real :class:`LocalExecutor` on held-out batches of a learnable
sequence. Real-network versions: ``tests/integration/test_collusion.py``."""

from __future__ import annotations

import torch

from p2p_diloco.training.executor import LocalExecutor
from p2p_diloco.training.own_check import GAIN_FROM_INIT, WORSE_BY, OwnCheck
from p2p_diloco.training.sync import SwarmSync, SyncGroup
from tests.unit.test_swarm_state import FakeSwarm, OneStage, Record, make_stage
from tests.unit.test_sync_trust import Donors

RUN = "run"


def counting_batches(seed: int, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of counting sequences mod the vocabulary: a tiny model learns them in tens of steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        seq = (torch.randint(0, 61, (8, 1), generator=g) + torch.arange(17)) % 61
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def trained_weights(steps: int, start=None) -> list[torch.Tensor]:
    """The tiny model's weights after ``steps`` AdamW steps on counting sequences (from ``start``, or its init)."""
    stage = make_stage()
    if start is not None:
        with torch.no_grad():
            stage.set_params(start)
    opt = torch.optim.AdamW(stage.module.parameters(), lr=3e-3)
    for step in range(steps):
        for x, y in counting_batches(1000 + step, 1):
            loss = torch.nn.functional.cross_entropy(stage.module(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [p.detach().clone() for p in stage.params]


TRAINED = trained_weights(40)
FURTHER = trained_weights(20, TRAINED)  # the honest swarm, some rounds on


def state_of(weights, round_index: int, applied_round: int):
    """A donor's served state: ``weights`` as its anchor (``None``: the run's initial model)."""
    donor = make_stage()
    if weights is not None:
        with torch.no_grad():
            for theta, w in zip(donor.anchor, weights):
                theta.copy_(w)
    donor.round_index, donor.applied_round = round_index, applied_round
    donor.inner_step = round_index * donor.diloco_cfg.inner_steps
    return donor.shareable_state(RUN)


def fingerprint(state) -> str:
    return make_stage().served_fingerprint(*state)


def judged_sync(peer, records, states, **options) -> SwarmSync:
    """A sync of ``peer`` with its own check: the real executor on held-out batches of its own."""
    peer.averager = Donors(states)
    options.setdefault("verify_wait_s", 0.0)
    sync = SwarmSync(peer, FakeSwarm(records, "me"), OneStage(), RUN, download_timeout_s=5, **options)
    check = OwnCheck(LocalExecutor(peer.module, torch.device("cpu")), counting_batches(7), [peer])
    SyncGroup([sync], sync.executor, check)
    return sync


def trained_peer(round_index: int = 3, applied_round: int = 2):
    peer = make_stage()
    with torch.no_grad():
        for theta, w in zip(peer.anchor, TRAINED):
            theta.copy_(w)
        peer.set_params(peer.anchor)
    peer.round_index, peer.applied_round = round_index, applied_round
    peer.inner_step = round_index * peer.diloco_cfg.inner_steps
    return peer


def anchor_of(stage) -> list[torch.Tensor]:
    return [t.clone() for t in stage.anchor]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_two_groupmates_vouching_for_a_wiped_state_do_not_make_a_peer_reload_it():
    """The victim averaged with one honest peer and two hostile ones (all believed). The two claim round 8 and serve
    an all-zero anchor that both vouch for: a majority of believed records say "behind" and the state is exactly the
    one they vouch for, so every record check passes. Its loss on the victim's own held-out batches is the uniform
    one, far above its own anchor's: refused, its vouchers discredited, and the victim is no longer behind."""
    wiped = state_of([torch.zeros_like(t) for t in TRAINED], 8, 7)
    honest = state_of(TRAINED, 3, 2)
    records = [Record(3, 2, fingerprint(honest), node="h1"),
               Record(8, 7, fingerprint(wiped), node="m1"), Record(8, 7, fingerprint(wiped), node="m2")]
    peer = trained_peer()
    before = anchor_of(peer)
    sync = judged_sync(peer, records, {"h1": honest, "m1": wiped, "m2": wiped})
    sync.witnesses.met_group(["h1", "m1", "m2"])
    sync.after_round()
    assert sync.refusals == 1 and not sync.events
    assert same(peer.anchor, before) and peer.round_index == 3
    assert {"m1", "m2"} <= set(sync.witnesses.discredited)
    assert "h1" not in sync.witnesses.discredited
    peer.averager.asked.clear()
    sync.after_round()  # their records count for nothing now: not behind, nothing downloaded
    assert peer.averager.asked == [] and sync.refusals == 1 and same(peer.anchor, before)


def test_the_swarms_state_far_ahead_passes_the_own_check():
    """The honest case of the same reload: two believed peers rounds ahead serve a state trained further; its loss on
    the peer's batches is lower: taken."""
    ahead = state_of(FURTHER, 8, 7)
    records = [Record(8, 7, fingerprint(ahead), node=n) for n in ("h1", "h2")]
    peer = trained_peer()
    sync = judged_sync(peer, records, {"h1": ahead, "h2": ahead})
    sync.witnesses.met_group(["h1", "h2"])
    sync.after_round()
    assert [e["action"] for e in sync.events] == ["reload"] and sync.refusals == 0
    assert same(peer.anchor, FURTHER) and peer.round_index == 8


def test_groupmates_claiming_the_run_over_with_a_wiped_state_do_not_stop_a_peer():
    """The same two believed identities claim the run is over (round 20 of 20 applied) and serve an all-zero "final"
    state: refused by the own check, the end given up, and the peer trains on (it is not behind: their end is not
    acted on again). Served nothing at all, the end is given up as well: the peer never exits on a claim."""
    peer = trained_peer()
    before = anchor_of(peer)
    wiped = state_of([torch.zeros_like(t) for t in TRAINED], 20, 19)
    records = [Record(3, 2, "", node="h1")] + [Record(20, 19, fingerprint(wiped), node=n) for n in ("m1", "m2")]
    sync = judged_sync(peer, records, {"m1": wiped, "m2": wiped}, num_rounds=20)
    sync.witnesses.met_group(["h1", "m1", "m2"])
    sync.at_start(resumed=True)
    assert sync.refusals == 1 and sync.end.given_up and not sync.events
    assert same(peer.anchor, before) and peer.round_index == 3
    sync.after_round()
    assert not sync.events and peer.round_index == 3

    peer = trained_peer()
    sync = judged_sync(peer, records, {}, num_rounds=20)  # they serve nothing
    sync.witnesses.met_group(["h1", "m1", "m2"])
    sync.at_start(resumed=True)  # before: SwarmError "run ... is over"
    assert sync.end.given_up and not sync.events and peer.round_index == 3


def test_a_newcomer_behind_a_plain_bootstrap_node_joins_the_honest_swarm_not_made_up_identities_end():
    """Two honest peers train round 6 of 20; three made-up identities claim the run is over. A newcomer that believes
    every signed record (its bootstrap node holds none) cannot verify an end claimed by identities it never met: it
    does not take their state (zeros), does not quit when they serve nothing, and reloads the honest swarm's state."""
    honest = state_of(TRAINED, 6, 5)
    for forged in (state_of([torch.zeros_like(t) for t in TRAINED], 20, 19), None):
        claims = [Record(20, 19, fingerprint(forged) if forged else "f" * 64, node=f"m{i}") for i in range(3)]
        records = claims + [Record(6, 5, fingerprint(honest), node=n) for n in ("h1", "h2")]
        newcomer = make_stage()
        states = {"h1": honest, "h2": honest} | ({f"m{i}": forged for i in range(3)} if forged else {})
        sync = judged_sync(newcomer, records, states, num_rounds=20)
        sync.at_start(resumed=False)
        assert [e["action"] for e in sync.events] == ["reload"], sync.events
        assert newcomer.round_index == 6 and same(newcomer.anchor, TRAINED)
        assert not any(node.startswith("m") for node in newcomer.averager.asked)


def test_a_newcomer_refuses_a_state_that_learned_nothing_however_many_vouch_for_it():
    """Only made-up identities (four, agreeing) offer a state, at round 6, and it is all zeros: its loss is the
    uniform one, a little below a random init's. A newcomer still holding the run's initial model takes a state only
    if it has learned at least GAIN_FROM_INIT on its own batches: refused, and it trains from its own init."""
    wiped = state_of([torch.zeros_like(t) for t in TRAINED], 6, 5)
    records = [Record(6, 5, fingerprint(wiped), node=f"m{i}") for i in range(4)]
    newcomer = make_stage()
    before = anchor_of(newcomer)
    sync = judged_sync(newcomer, records, {f"m{i}": wiped for i in range(4)})
    sync.at_start(resumed=False)
    assert sync.refusals == 1 and not sync.events and same(newcomer.anchor, before)
    assert sync.judge.last["offered_loss"] > sync.judge.last["own_loss"] * (1 - GAIN_FROM_INIT)


def test_a_shrunk_final_state_vouched_for_by_made_up_identities_is_refused_at_the_end():
    """Five made-up identities against one believed groupmate at the run's end: their final state is this peer's own,
    every weight shrunk by 7% (within a few outer steps of it, which the distance rule alone let through). Its loss
    on the peer's own batches is well above WORSE_BY: refused, and the peer keeps its own final state."""
    last = 9
    peer = trained_peer(round_index=last + 1, applied_round=last)
    outer = peer.outer_optimizer
    outer.last_grad_norm, outer.last_lr = 1.0, 0.7  # an outer step's size, so the distance rule could let it through
    shrunk = state_of([0.93 * t for t in TRAINED], last + 1, last)
    own = state_of(TRAINED, last + 1, last)
    records = [Record(last + 1, last, fingerprint(own), node="h1")] + \
        [Record(last + 1, last, fingerprint(shrunk), node=f"m{i}") for i in range(5)]
    sync = judged_sync(peer, records, {f"m{i}": shrunk for i in range(5)} | {"h1": own}, num_rounds=last + 1)
    sync.witnesses.met_group(["h1"])
    sync.remember(fingerprint(own))
    before = anchor_of(peer)
    sync.at_end(deadline=0.0)
    assert sync.refusals >= 1 and same(peer.anchor, before)
    assert sync.judge.last["offered_loss"] > sync.judge.last["own_loss"] * (1 + WORSE_BY)


def test_a_newcomer_sent_first_to_made_up_identities_state_reaches_the_swarms_in_the_same_decision():
    """Three made-up identities claim a round ahead of the two honest peers and vouch for an all-zero state: as the
    most advanced agreed state it is asked for first. The own check refuses it, its vouchers stop counting, and the
    newcomer decides again at once: it reloads the honest swarm's state without a round of training alone."""
    honest = state_of(TRAINED, 6, 5)
    wiped = state_of([torch.zeros_like(t) for t in TRAINED], 7, 6)
    records = [Record(7, 6, fingerprint(wiped), node=f"m{i}") for i in range(3)] + \
        [Record(6, 5, fingerprint(honest), node=n) for n in ("h1", "h2")]
    newcomer = make_stage()
    sync = judged_sync(newcomer, records, {"h1": honest, "h2": honest} | {f"m{i}": wiped for i in range(3)})
    sync.at_start(resumed=False)
    assert sync.refusals == 1 and newcomer.averager.asked[0].startswith("m"), newcomer.averager.asked
    assert [e["action"] for e in sync.events] == ["reload"] and newcomer.round_index == 6
    assert same(newcomer.anchor, TRAINED)
