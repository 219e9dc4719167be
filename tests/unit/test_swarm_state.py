"""Unit tests of state sharing and of the decisions that keep a stage in step with the swarm."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.model import ModelArgs, Transformer
from p2p_diloco.round.outcome import PendingRound, RoundOutcome, RoundReport
from p2p_diloco.round.swarm_state import StateError
from p2p_diloco.training import Stage
from p2p_diloco.training.sync import SwarmSync
from tests.helpers import TINY_ARGS


def make_stage(mode="delayed", seed=0) -> Stage:
    cfg = load_config(None, [("diloco.mode", mode)])
    torch.manual_seed(seed)
    return Stage(Transformer(ModelArgs(**TINY_ARGS)), stage_index=0, num_stages=1, inner_cfg=cfg.inner,
                 diloco_cfg=cfg.diloco, total_steps=100)


def nudge(stage: Stage, amount: float) -> None:
    with torch.no_grad():
        for p in stage.params:
            p.add_(amount)


def test_shareable_state_checks_and_round_trips():
    donor = make_stage()
    donor.round_index, donor.applied_round = 5, 3
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    meta, tensors = donor.shareable_state("run")
    donor.check_state("run", meta, tensors)
    assert meta["round"] == 5 and meta["applied_round"] == 3 and len(tensors) == 2 * len(donor.anchor)
    with pytest.raises(StateError, match="run/stage"):
        donor.check_state("other-run", meta, tensors)
    bad = [t.clone() for t in tensors]
    bad[0][0] = float("nan")
    with pytest.raises(StateError, match="non-finite"):
        donor.check_state("run", meta, bad)
    with pytest.raises(StateError, match="shapes"):
        donor.check_state("run", meta, tensors[:-1])
    with pytest.raises(StateError, match="count"):
        donor.check_state("run", dict(meta, round="5"), tensors)


def test_donor_serves_the_state_after_an_average_that_already_arrived():
    donor = make_stage()
    donor.round_index, donor.applied_round = 4, 2
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    average = [torch.full_like(t, 0.01) for t in donor.anchor]
    donor.pending = PendingRound(3, [torch.zeros_like(t) for t in donor.anchor], 1.0)
    before = [t.clone() for t in donor.anchor]
    meta, tensors = donor.shareable_state("run", finished_average=average)
    assert meta["applied_round"] == 3  # the state after round 3's average...
    expected = donor.outer_optimizer.peek(average)
    assert all(torch.equal(a, b) for a, b in zip(tensors[: len(before)], expected))
    mu = donor.outer_optimizer.momentum
    assert all(torch.equal(m, b * mu + a) for m, b, a in zip(tensors[len(before):],
                                                             donor.outer_optimizer.momentum_buffers, average))
    assert all(torch.equal(a, b) for a, b in zip(donor.anchor, before))  # ...computed without touching the donor
    # made in shared memory: the averager's process gets handles, not another copy of the state
    assert all(t.is_shared() for t in tensors)


@pytest.mark.parametrize("collected", [False, True])
def test_a_served_state_is_the_one_the_donor_reaches_when_its_step_grows_with_the_group(collected):
    """With diloco.outer_lr_group_exponent the outer step of an average depends on its group's size: a donor serving
    the state after a round in flight must step it as it will itself (else a newcomer starts from an anchor no peer
    holds), whether the average is still in the averager's buffers or already collected."""
    cfg = load_config(None, [("diloco.mode", "delayed"), ("diloco.outer_lr_group_exponent", "0.5")])
    torch.manual_seed(0)
    donor = Stage(Transformer(ModelArgs(**TINY_ARGS)), stage_index=0, num_stages=1, inner_cfg=cfg.inner,
                  diloco_cfg=cfg.diloco, total_steps=100)
    donor.round_index, donor.applied_round = 4, 2
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    average = [torch.full_like(t, 0.01) for t in donor.anchor]
    donor.pending = PendingRound(3, [torch.zeros_like(t) for t in donor.anchor], 1.0)
    outcome = RoundOutcome(average=average, averaged=True, group_size=4, group_tokens=4.0)
    if collected:
        donor.pending.outcome = outcome
        meta, tensors = donor.shareable_state("run")
    else:
        meta, tensors = donor.shareable_state("run", finished_average=average, finished_group_size=4)
    alone = donor.outer_optimizer.peek(average)  # the step of a group of 2 or of a fallback
    donor.pending.outcome = outcome
    donor.merge_now(RoundReport(4))
    count = len(donor.anchor)
    assert meta["applied_round"] == donor.applied_round == 3
    assert all(torch.equal(a, b) for a, b in zip(tensors[:count], donor.anchor))
    assert all(torch.equal(a, b) for a, b in zip(tensors[count:], donor.outer_optimizer.momentum_buffers))
    assert donor.outer_optimizer.last_lr == pytest.approx(cfg.diloco.outer_lr * 2 ** 0.5)
    assert max((a - b).abs().max().item() for a, b in zip(alone, donor.anchor)) > 1e-4  # the step did grow


def _group_rule_stage() -> Stage:
    cfg = load_config(None, [("diloco.mode", "delayed"), ("diloco.outer_lr_group_exponent", "0.5")])
    torch.manual_seed(0)
    return Stage(Transformer(ModelArgs(**TINY_ARGS)), stage_index=0, num_stages=1, inner_cfg=cfg.inner,
                 diloco_cfg=cfg.diloco, total_steps=100)


def _step_with_group(group_size: int) -> list[torch.Tensor]:
    """The anchor after a delayed round's average, averaged (as the all-reduce claims) in a group of ``group_size``."""
    stage = _group_rule_stage()
    stage.round_index = 1
    stage.inner_step = stage.diloco_cfg.inner_steps
    average = [torch.full_like(t, 0.01) for t in stage.anchor]
    stage.pending = PendingRound(0, [torch.zeros_like(t) for t in stage.anchor], 1.0)
    stage.pending.outcome = RoundOutcome(average=average, averaged=True, group_size=group_size, group_tokens=1.0)
    stage.merge_now(RoundReport(1))
    return stage.anchor


@pytest.mark.parametrize("crowd", [5, 255, 10 ** 9])
def test_identities_crowding_into_a_group_cannot_raise_the_outer_step_past_the_largest_group(crowd):
    """With the group rule on, the group size is what the leader relays: a crowd of identities joining one group (up to
    the 255 others a relayed group may hold, or any number a forged count could claim) steps the anchor exactly as
    a group of diloco.outer_lr_largest_group (4) does, never further."""
    capped = _step_with_group(4)
    crowded = _step_with_group(crowd)
    assert all(torch.equal(a, b) for a, b in zip(crowded, capped))
    pair = _step_with_group(2)
    assert max((a - b).abs().max().item() for a, b in zip(pair, capped)) > 1e-4  # the rule is on: 4 steps further


def test_reload_becomes_the_donor_and_resync_keeps_local_progress():
    donor, peer = make_stage(seed=1), make_stage(seed=2)
    donor.round_index, donor.applied_round = 7, 6
    H = donor.diloco_cfg.inner_steps
    donor.inner_step = 7 * H + 2  # part-way through its round
    nudge(donor, 0.0)
    with torch.no_grad():
        for t in donor.anchor:
            t.add_(0.5)
    meta, tensors = donor.shareable_state("run")

    reloaded = make_stage()
    reloaded.pending = PendingRound(1, [torch.zeros_like(t) for t in reloaded.anchor], 1.0)
    reloaded.adopt(meta, tensors, "reload")
    assert (reloaded.round_index, reloaded.applied_round, reloaded.pending) == (7, 6, None)
    assert reloaded.inner_step == reloaded.round_first_step == 7 * H + 2  # joins the round where the donor is
    reloaded.check_state("run", meta, tensors)
    with pytest.raises(StateError, match="steps do not fit"):
        reloaded.check_state("run", dict(meta, inner_step=9 * H), tensors)
    assert all(torch.equal(p.detach(), a) for p, a in zip(reloaded.params, donor.anchor))

    peer.round_index, peer.applied_round = 7, 6
    nudge(peer, 0.25)  # local progress since the round started
    progress = [p.detach() - s for p, s in zip(peer.params, peer.round_start)]
    peer.adopt(meta, tensors, "resync")
    assert all(torch.equal(a, b) for a, b in zip(peer.anchor, donor.anchor))
    for p, s, d in zip(peer.params, peer.round_start, progress):
        torch.testing.assert_close(p.detach() - s, d, rtol=0, atol=1e-6)  # the same progress, on the new anchor


@dataclass
class Record:
    round: int
    applied_round: int
    anchor: str
    node: str = "other"
    prior_anchor: str = ""


class FakeSwarm:
    def __init__(self, records, node="me"):
        self.records, self.node, self.published = records, node, []

    def announce(self, position, round_index, *args):
        self.published.append(round_index)

    def others(self):
        return self.records

    def wait_for_groupmates(self, nodes, applied_round, timeout_s, poll_s=0.05):
        """As SwarmLink's: until each of ``nodes`` with a record has applied ``applied_round``, or the timeout."""
        deadline = time.monotonic() + timeout_s
        while any(r.node in nodes and r.applied_round < applied_round for r in self.records) \
                and time.monotonic() < deadline:
            time.sleep(poll_s)


class FakeAverager:
    compresses, round_settled = False, False

    def __init__(self, state, result=None):
        self.state, self.downloads, self.state_sharing_priority, self.client_mode = state, 0, 0.0, False
        self.result, self.finished = result, 0

    def finish_round(self, timeout=None, hopeless=None, feedback=None):
        self.finished += 1
        return self.result or RoundOutcome(fallback_reason="it failed")

    def download_state(self, donors, timeout_s):
        self.downloads += 1
        self.asked = list(donors)
        return self.state

    def abandon_round(self):
        self.abandoned = True


class OneStage:
    def __init__(self, other_stage_flags: bool = False):
        # what the peer's other stages report to the first any_stage (whether to reload); then they agree
        self.other_stage_flags = [other_stage_flags]

    def common_value(self, value):
        return [value]

    def any_stage(self, flag: bool) -> bool:
        return flag or (self.other_stage_flags.pop(0) if self.other_stage_flags else False)


def make_sync(peer: Stage, records, state, other_stage_flags: bool = False, node: str = "me", **options):
    """A sync of ``peer`` whose swarm shows ``records`` (an anchor "x" stands for the anchor of ``state``) and whose
    averager serves ``state``."""
    if state is not None:
        served = peer.served_fingerprint(*state)
        records = [dataclasses.replace(r, anchor=served) if r.anchor == "x" else r for r in records]
    peer.averager = FakeAverager(state)
    options.setdefault("verify_wait_s", 0.0)
    return SwarmSync(peer, FakeSwarm(records, node), OneStage(other_stage_flags), "run", download_timeout_s=5,
                     **options)


def test_newcomer_and_laggard_reload_but_a_peer_on_the_swarms_round_rejoins():
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = 6, 5
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    state = donor.shareable_state("run")
    newcomer = make_stage()
    sync = make_sync(newcomer, [Record(6, 5, "x")], state)
    sync.at_start(resumed=False)
    assert newcomer.round_index == 6 and sync.events[0]["action"] == "reload"
    assert sync.swarm.published == [6]  # announced on the swarm's round before downloading: others wait for it

    on_time = make_stage()
    on_time.round_index = 6
    sync = make_sync(on_time, [Record(6, 4, "x")], state)
    sync.at_start(resumed=True)
    assert not sync.events and on_time.averager.downloads == 0

    behind = make_stage()
    behind.round_index = 4
    sync = make_sync(behind, [Record(6, 5, "x")], state)
    sync.after_round()
    assert behind.round_index == 6 and sync.events[0]["action"] == "reload"


def test_a_stage_reloads_when_another_stage_of_its_peer_does():
    """The stages of a pipeline read the swarm's records at slightly different times; one that sees no reason
    to reload still reloads with the others (else it trains on while they wait in the reload's collective)."""
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = 2, 0  # its round 1 still averaging: this peer can join it
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    state = donor.shareable_state("run")
    for at_start in (True, False):
        peer = make_stage()
        peer.round_index, peer.applied_round = 1, 0
        sync = make_sync(peer, [Record(2, 0, "x")], state, other_stage_flags=True)
        sync.at_start(resumed=False) if at_start else sync.after_round()
        assert [e["action"] for e in sync.events] == ["reload"] and peer.round_index == 2
        assert "another stage" in sync.events[0]["reason"]
    alone = make_stage()
    sync = make_sync(alone, [Record(0, -1, "")], state, other_stage_flags=False)
    sync.at_start(resumed=False)
    assert not sync.events and alone.averager.downloads == 0


def test_resync_only_when_the_others_agree_on_another_anchor():
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = 8, 7
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    state = donor.shareable_state("run")
    theirs = donor.state_fingerprint()[0]
    peer = make_stage()
    peer.round_index, peer.applied_round = 8, 7

    sync = make_sync(peer, [Record(8, 7, theirs), Record(8, 7, theirs)], state)
    sync.remember(theirs)
    sync.after_round()
    assert not sync.events  # in agreement

    sync = make_sync(peer, [Record(8, 7, "a"), Record(8, 7, "b"), Record(8, 7, "c")], state)
    sync.remember("mine")
    sync.after_round()
    assert not sync.events  # no majority to follow

    sync = make_sync(peer, [Record(8, 7, theirs), Record(8, 7, theirs)], state)
    sync.remember("mine")
    sync.after_round()
    assert [e["action"] for e in sync.events] == ["resync"]
    assert all(torch.equal(a, b) for a, b in zip(peer.anchor, donor.anchor))

    elsewhere = donor.shareable_state("run")
    elsewhere[0]["applied_round"] = 6  # a donor at another point: the resync waits
    peer.applied_round = 7
    sync = make_sync(peer, [Record(8, 7, theirs)], elsewhere)
    sync.remember("mine")
    sync.after_round()
    assert not sync.events


def test_resync_from_a_donor_that_already_applied_the_round_in_flight():
    """The donor has applied round 7 while this peer's round 7 is still averaging: the peer takes the donor's
    anchor and settles, then drops its round in flight (applying that average again would count it twice)."""
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = 8, 7
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    state = donor.shareable_state("run")
    peer = make_stage()
    peer.round_index, peer.applied_round = 8, 6
    peer.pending = PendingRound(7, [torch.zeros_like(t) for t in peer.anchor], 1.0)
    peer.pending.in_flight = True
    # the others applied round 7 too; their records still tell their anchor after round 6 (prior_anchor)
    sync = make_sync(peer, [Record(8, 7, "x", prior_anchor="theirs"), Record(8, 7, "x", prior_anchor="theirs")], state)
    sync.remember("mine")
    sync.after_round()
    assert [e["action"] for e in sync.events] == ["resync"]
    assert (peer.applied_round, peer.pending, peer.averager.finished) == (7, None, 1)
    assert all(torch.equal(a, b) for a, b in zip(peer.anchor, donor.anchor))


def _resync_dropping_round_7(peer: Stage, result: RoundOutcome | None):
    """Resync ``peer`` (round 8, its round 7 in flight with contribution 0.3 everywhere) from a donor that applied
    round 7; returns the donor and the peer's local progress of round 8 (0.05 everywhere)."""
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = 8, 7
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    meta, tensors = donor.shareable_state("run")
    peer.round_index, peer.applied_round = 8, 6
    peer.pending = PendingRound(7, [torch.full_like(t, 0.3) for t in peer.anchor], 1.0)
    peer.pending.in_flight = True
    peer.averager = FakeAverager(None, result)
    nudge(peer, -0.05)
    peer.adopt(meta, tensors, "resync")
    assert peer.pending is None and peer.averager.finished == 1
    return donor


def test_resync_dropping_an_averaged_round_keeps_its_residual_as_feedback():
    """This peer's round 7 was averaged (so the donor's anchor holds it): what compression left out of it (its
    residual) is what remains owed, not the feedback from before the round (that would be sent twice)."""
    peer = make_stage()
    peer.feedback = [torch.full_like(t, 0.7) for t in peer.anchor]  # stale: already inside round 7's contribution
    residual = [torch.full_like(t, 0.01) for t in peer.anchor]
    average = [torch.full_like(t, 0.2) for t in peer.anchor]
    donor = _resync_dropping_round_7(peer, RoundOutcome(average=average, averaged=True, group_size=2,
                                                        group_tokens=2.0, residual=residual))
    assert all(torch.equal(e, r) for e, r in zip(peer.feedback, residual))
    for p, s, theta in zip(peer.params, peer.round_start, donor.anchor):  # the round restarts on the donor's anchor
        assert torch.equal(s, theta)
        torch.testing.assert_close(s - p.detach(), torch.full_like(s, 0.05), rtol=0, atol=1e-6)


def test_resync_dropping_a_round_that_failed_here_carries_the_whole_contribution():
    """This peer's round 7 failed (the donor's group averaged without it): its whole contribution is still owed,
    as error feedback when compressing, else as progress in the next pseudo-gradient. Nothing is lost."""
    compressed = make_stage()
    compressed.feedback = [torch.full_like(t, 0.7) for t in compressed.anchor]
    _resync_dropping_round_7(compressed, None)
    assert all(torch.allclose(e, torch.full_like(e, 0.3)) for e in compressed.feedback)

    plain = make_stage()
    donor = _resync_dropping_round_7(plain, None)
    assert plain.feedback is None
    for p, s, theta in zip(plain.params, plain.round_start, donor.anchor):
        assert torch.equal(s, theta)  # next pseudo-gradient = round start - params = 0.3 + 0.05 + what follows
        torch.testing.assert_close(s - p.detach(), torch.full_like(s, 0.35), rtol=0, atol=1e-6)


def test_reload_and_resync_move_the_eager_state():
    """eager: a reload takes the donor's anchor and momentum as the peer's eager state; a resync that keeps the
    round in flight shifts the eager state by the anchor's and the momentum's change."""
    donor = make_stage("eager", seed=1)
    donor.round_index, donor.applied_round = 8, 7
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    with torch.no_grad():
        for t, m in zip(donor.anchor, donor.outer_optimizer.momentum_buffers):
            t.add_(0.5)
            m.fill_(0.1)
    meta, tensors = donor.shareable_state("run")
    reloaded = make_stage("eager")
    with torch.no_grad():
        for e in reloaded.eager_anchor:
            e.add_(3.0)
    reloaded.adopt(meta, tensors, "reload")
    assert all(torch.equal(e, a) for e, a in zip(reloaded.eager_anchor, donor.anchor))
    assert all(torch.equal(e, m) for e, m in zip(reloaded.eager_optimizer.momentum_buffers,
                                                 donor.outer_optimizer.momentum_buffers))

    peer = make_stage("eager")
    peer.round_index, peer.applied_round = 8, 7
    with torch.no_grad():
        for e, m in zip(peer.eager_anchor, peer.eager_optimizer.momentum_buffers):
            e.add_(0.25)
            m.fill_(0.02)
    gap = [e - a for e, a in zip(peer.eager_anchor, peer.anchor)]
    peer.adopt(meta, tensors, "resync")
    for e, a, g in zip(peer.eager_anchor, peer.anchor, gap):
        torch.testing.assert_close(e - a, g, rtol=0, atol=1e-6)
    for m in peer.eager_optimizer.momentum_buffers:
        torch.testing.assert_close(m, torch.full_like(m, 0.12), rtol=0, atol=1e-6)


def test_two_peers_with_different_anchors_converge_on_the_canonical_one():
    """No majority (one other peer, another anchor): the tie goes to the smallest node id, the same at every
    round whichever fingerprint is larger, so exactly one of the two resyncs wherever each compares."""
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = 8, 7
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    state = donor.shareable_state("run")
    donors = donor.state_fingerprint()[0]  # node-a holds the donor's anchor
    for off in ("0" * 32, "f" * 32):  # node-b's anchor sorts before node-a's, then after it
        outcomes = {}
        for me, mine, other, theirs in (("node-a", donors, "node-b", off), ("node-b", off, "node-a", donors)):
            peer = make_stage()
            peer.round_index, peer.applied_round = 8, 7
            sync = make_sync(peer, [Record(8, 7, theirs, node=other)], state, node=me)
            sync.remember(mine)
            sync.after_round()
            outcomes[me] = [e["action"] for e in sync.events]
            assert sync.holds_canonical == (me == "node-a")
        assert outcomes == {"node-a": [], "node-b": ["resync"]}


@pytest.mark.parametrize("overrides", [
    [], [("averaging.next_chunk_timeout_s", "5")],
    [("averaging.next_chunk_timeout_s", "60"), ("averaging.allreduce_timeout_s", "4")]])
def test_donors_wait_for_their_round_well_inside_the_newcomers_first_chunk_timeout(overrides):
    """A donor waits a little for its round in flight before it serves; a newcomer waits only
    next_chunk_timeout_s for the first chunk from each donor. Were the donor's wait as long, the newcomer
    would give up on every donor (seen in CI)."""
    from p2p_diloco.stage_process import donor_wait_s

    averaging = load_config(None, overrides).averaging
    wait = donor_wait_s(averaging)
    assert 0 < wait <= 0.5 * averaging.next_chunk_timeout_s and wait <= averaging.allreduce_timeout_s


@pytest.mark.parametrize("record, reloads", [
    (Record(1, -1, ""), False),  # delayed mode: its round 0 is still averaging, a newcomer can join it there
    (Record(1, 0, "x"), True),  # round 0 applied already (blocking mode): too late for it
    (Record(2, 0, "x"), True),  # a whole round ahead
])
def test_newcomer_joins_a_round_the_swarm_is_still_averaging_instead_of_reloading(record, reloads):
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = record.round, record.applied_round
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    newcomer = make_stage()
    sync = make_sync(newcomer, [record], donor.shareable_state("run"))
    sync.at_start(resumed=False)
    assert bool(sync.events) == reloads and newcomer.averager.downloads == int(reloads)


def test_a_reload_into_a_round_in_flight_resyncs_once_one_other_peer_published_past_it():
    """delayed mode: the donor trains round 7 with round 6 still averaging, so the reloaded anchor (after round 5)
    never gets round 6's average. When only one other peer has published an anchor after a later round, the tie
    between the two would go to the smaller node id ("me" here), yet this peer's anchor is known to be off: it
    resyncs. A peer reloaded from a donor with nothing in flight keeps the usual tie-break."""
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = 7, 5
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    later = make_stage(seed=2)  # the swarm's state once round 7 is applied
    later.round_index, later.applied_round = 8, 7
    later.inner_step = later.round_index * later.diloco_cfg.inner_steps
    theirs = later.state_fingerprint()[0]
    for in_flight in (True, False):
        if not in_flight:
            donor.applied_round = 6
        peer = make_stage()
        peer.round_index = 3
        sync = make_sync(peer, [Record(7, donor.applied_round, "x")], donor.shareable_state("run"))
        sync.after_round()
        assert [e["action"] for e in sync.events] == ["reload"]
        assert sync.missed_round == (6 if in_flight else None) and sync.holds_canonical == (not in_flight)
        peer.round_index, peer.applied_round = 8, 7  # it trained on and applied round 7 on its own anchor
        peer.averager.state = later.shareable_state("run")
        sync.swarm.records = [Record(8, 7, theirs, node="other")]
        sync.remember("mine")
        sync.after_round()
        assert [e["action"] for e in sync.events] == (["reload", "resync"] if in_flight else ["reload"])
        assert sync.missed_round is None


def test_a_peer_ending_its_round_after_the_others_applied_the_next_one_still_compares():
    """delayed mode applies round r's average a few steps into round r + 1: a peer that ends round r + 1 a little
    after the others finds them already at applied round r + 1. Their records still tell their anchor after
    round r (prior_anchor): a peer off it resyncs (before, it found no record to compare with, round after round:
    the CI failure of the churn test), a peer on it does nothing."""
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = 9, 8
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    theirs_7 = "7a"
    for mine, resyncs in (("7b", True), (theirs_7, False)):
        peer = make_stage()
        peer.round_index, peer.applied_round = 9, 7
        records = [Record(9, 8, "x", node="n1", prior_anchor=theirs_7),
                   Record(9, 8, "x", node="n2", prior_anchor=theirs_7)]
        sync = make_sync(peer, records, donor.shareable_state("run"), node="n0")
        sync.remember(mine)
        sync.after_round()
        assert [e["action"] for e in sync.events] == (["resync"] if resyncs else [])
        assert sync.canonical == theirs_7 and sync.holds_canonical == (not resyncs)
    # records without a prior anchor (reloaded or resynced since) give no vote on the earlier round
    peer = make_stage()
    peer.round_index, peer.applied_round = 9, 7
    sync = make_sync(peer, [Record(9, 8, "8a", node="n1"), Record(9, 8, "8a", node="n2")],
                     donor.shareable_state("run"), node="n0")
    sync.remember("7b")
    sync.after_round()
    assert not sync.events and sync.holds_canonical


def test_a_peer_resumed_with_a_round_in_flight_that_the_others_applied_reloads_at_once():
    """Resumed from its checkpoint (delayed mode) at round 3 with round 2's averaging pending: once another peer
    has applied round 2, that group is over and its average cannot be had; the peer reloads at start instead of
    waiting out the round's timeouts for it (a fast swarm then finished before the peer caught up: make test)."""
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = 4, 2
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    state = donor.shareable_state("run")
    for others, reloads in (([Record(4, 2, "x")], True),   # the others applied round 2 and are a round ahead
                            ([Record(3, 2, "x")], True),   # applied round 2 early in round 3 (the merge step)
                            ([Record(3, 1, "x")], False),  # round 2 still averaging: join it
                            ([Record(3, 2, "x"), Record(3, 1, "x")], False),  # one can still average it with this
                            ([Record(2, 1, "x")], False)):  # one still training round 2
        peer = make_stage()
        peer.round_index, peer.applied_round = 3, 1
        peer.pending = PendingRound(2, [], 100.0)
        sync = make_sync(peer, others, state)
        sync.at_start(resumed=True)
        assert [e["action"] for e in sync.events] == (["reload"] if reloads else []), others
        assert (peer.round_index == 4) == reloads
        assert not reloads or "averaged without this peer" in sync.events[0]["reason"]
    settled = make_stage()  # a pending round already settled (it fell back before the kill) is not waited for
    settled.round_index, settled.applied_round = 3, 1
    settled.pending = PendingRound(2, [], 100.0)
    settled.pending.outcome = RoundOutcome(fallback_reason="it failed")
    sync = make_sync(settled, [Record(3, 2, "x")], state)
    sync.at_start(resumed=True)
    assert not sync.events


@pytest.mark.parametrize("round_end, record, reloads", [
    # a peer that ended this stage's round is averaging it (it published the next round first): join it
    ("swarm", Record(3, 1, "x"), False),
    ("swarm", Record(3, 2, "x"), True),  # it applied this stage's round already: too late for it
    ("swarm", Record(4, 2, "x"), True),  # a whole round ahead
    ("steps", Record(3, 1, "x"), True),  # rounds of H steps: a round ahead is a whole round's compute ahead
])
def test_after_a_round_a_peer_the_swarm_ended_the_next_round_for_joins_it_instead_of_reloading(
        round_end, record, reloads):
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = record.round, record.applied_round
    donor.inner_step = donor.round_index * donor.diloco_cfg.inner_steps
    peer = make_stage()
    peer.diloco_cfg = dataclasses.replace(peer.diloco_cfg, round_end=round_end)
    peer.round_index, peer.applied_round = 2, 1
    peer.inner_step = 2 * peer.diloco_cfg.inner_steps
    sync = make_sync(peer, [record], donor.shareable_state("run"))
    sync.after_round()
    assert [e["action"] for e in sync.events] == (["reload"] if reloads else []), round_end
    assert peer.averager.downloads == int(reloads)


# ---- a stage process holding several fragments (diloco.fragments): one reload for all --------------------------

def fragment_stages(seed: int = 0, num_fragments: int = 2) -> list[Stage]:
    """The fragments of the tiny model, each a Stage of its own over the same module (as a P = 1 peer holds them)."""
    from p2p_diloco.model.fragments import FragmentView, fragment_parts, split_parameters

    cfg = load_config(None, [("diloco.mode", "delayed"), ("diloco.inner_steps", "50")])  # the steps the tests name
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**TINY_ARGS))
    parts = fragment_parts(model.args, num_fragments)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [Stage(FragmentView(params), stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                  total_steps=100, fragment=(f, num_fragments))
            for f, params in split_parameters(named, parts).items()]


def served(stage: Stage, round_index: int, applied_round: int, step_in_round: int = 0):
    stage.round_index, stage.applied_round = round_index, applied_round
    stage.inner_step = round_index * stage.diloco_cfg.inner_steps + step_in_round
    return stage.shareable_state("run")


class ChangingAverager(FakeAverager):
    """Serves one state after another (the donor moved on between two downloads); None: the download failed."""

    def __init__(self, states):
        super().__init__(states[0])
        self.states = list(states)

    def download_state(self, donors, timeout_s):
        self.downloads += 1
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


def group_of(peer: list[Stage], states: list[list], records: list[list[Record]]):
    from p2p_diloco.training.sync import SyncGroup

    syncs = []
    for stage, served_states, recs in zip(peer, states, records):
        first = next(s for s in served_states if s is not None)
        # "x": the served state of the record's applied round (else the first), the one before as its prior state
        held = {s[0]["applied_round"]: stage.served_fingerprint(*s) for s in served_states if s is not None}
        recs = [dataclasses.replace(r, anchor=held.get(r.applied_round, stage.served_fingerprint(*first)),
                                    prior_anchor=held.get(r.applied_round - 1, "")) if r.anchor == "x" else r
                for r in recs]
        stage.averager = ChangingAverager(served_states)
        syncs.append(SwarmSync(stage, FakeSwarm(recs), OneStage(), "run", download_timeout_s=5, verify_wait_s=0.0))
    return SyncGroup(syncs, OneStage()), syncs


def test_the_fragments_of_a_stage_process_reload_together_or_not_at_all():
    """Fragment 0's records show the swarm ahead, fragment 1's show nothing yet: both reload, to one round and inner
    step (the peer has one clock: the most advanced state's). One fragment's state a round behind the other's is
    downloaded again; a fragment whose state cannot be had keeps every fragment where it was."""
    donor = fragment_stages(seed=1)
    early = served(donor[1], 5, 4, step_in_round=3)
    state0, late = served(donor[0], 6, 5, step_in_round=2), served(donor[1], 6, 5, step_in_round=4)
    peer = fragment_stages()
    ahead = [Record(5, 4, "x", node="a"), Record(6, 5, "x", node="b"),  # fragment 1's holders, two a round on
             Record(6, 5, "x", node="c")]
    group, syncs = group_of(peer, [[state0], [early, late]], [[Record(6, 5, "x")], ahead])
    group.at_start(resumed=False)
    H = peer[0].diloco_cfg.inner_steps
    assert [(s.round_index, s.applied_round, s.inner_step) for s in peer] == [(6, 5, 6 * H + 4)] * 2
    assert peer[1].averager.downloads == 2  # round 5 first, then again for the round of fragment 0's state
    assert [e["action"] for s in syncs for e in s.events] == ["reload", "reload"]

    stuck = fragment_stages()
    group, syncs = group_of(stuck, [[state0], [late]], [[Record(6, 5, "x")], [Record(6, 5, "x")]])
    stuck[1].averager.states = [None]  # every download of fragment 1 fails
    group.after_round()
    assert [s.round_index for s in stuck] == [0, 0] and not any(s.events for s in syncs)
    assert stuck[1].averager.downloads == 3  # tried again twice, then given up until the next round


class TwoStages(OneStage):
    """This stage process and another of the same peer, whose reload points (window and step) are given in turn."""

    def __init__(self, theirs):
        super().__init__()
        self.theirs, self.agreements = list(theirs), 0

    def common_value(self, value):
        self.agreements += 1
        return [value, self.theirs.pop(0)]


def test_a_stage_process_whose_states_are_a_round_behind_its_other_stages_downloads_them_again():
    """The peer's other stage process got a state of round 6 while this one's came from round 5 (the swarm moved on
    while they travelled): this one downloads again from round 6 and both reload, instead of training a whole round
    alone before trying again (seen with a newcomer next to a fast swarm). A state that does not catch up (both
    donors still serve round 5, refused when round 6 is needed): the peer trains on, unchanged, and tries again
    after its round."""
    donor, peer = fragment_stages(seed=1), fragment_stages()
    H = peer[1].diloco_cfg.inner_steps
    early, late = served(donor[1], 5, 4, step_in_round=3), served(donor[1], 6, 5, step_in_round=4)
    theirs = (6 * H, 7 * H - 1, 6 * H + 4)  # the other stage's fragment 0: round 6, the donor at its step 4
    records = [[Record(5, 4, "x", node="a"), Record(6, 5, "x", node="b")]]
    group, syncs = group_of([peer[1]], [[early, late]], [records[0] + [Record(6, 5, "x", node="c")]])
    group.executor = TwoStages([theirs] * 3)
    group.at_start(resumed=False)
    assert (peer[1].round_index, peer[1].applied_round, peer[1].inner_step) == (6, 5, 6 * H + 4)
    assert peer[1].averager.downloads == 2 and group.executor.agreements == 2
    assert [e["action"] for e in syncs[0].events] == ["reload"]

    stuck = fragment_stages()
    group, syncs = group_of([stuck[1]], [[early]], records)
    group.executor = TwoStages([theirs] * 3)
    group.at_start(resumed=False)
    assert (stuck[1].round_index, stuck[1].inner_step) == (0, 0) and not syncs[0].events
    assert stuck[1].averager.downloads == 3 and group.executor.agreements == 2  # 1 + each donor once more


def test_a_fragment_takes_only_its_own_state():
    """A state is checked by run, fragment and fragment count (peers of any split serve it), not by stage."""
    donor, peer = fragment_stages(seed=1), fragment_stages()
    meta, tensors = served(donor[0], 2, 1)
    peer[0].check_state("run", dict(meta, stage=3, num_stages=4), tensors)  # the donor's own split does not matter
    with pytest.raises(StateError, match="run/fragment/num_fragments"):
        peer[1].check_state("run", meta, tensors)
    with pytest.raises(StateError, match="run/fragment/num_fragments"):
        peer[0].check_state("run", dict(meta, num_fragments=3), tensors)
    with pytest.raises(ValueError, match="checkpoint is of fragment 0 of 2, this is fragment 1 of 2"):
        peer[1].load_state_dict(*donor[0].state_dict())


def test_streamed_fragments_reload_to_one_step_inside_each_fragments_round():
    """Streaming sync: fragment 0's rounds end 25 steps before the regular round end (H = 50, F = 2), so at step 290
    it is in round 6 while fragment 1 is in round 5. States of those rounds fit one step (the most advanced of the
    donors' inside both rounds); a fragment-1 state of round 4 (its round ends at 250, before fragment 0's round 6
    begins at 275) does not, and is downloaded again."""
    donor, peer = fragment_stages(seed=1), fragment_stages()
    for stages in (donor, peer):
        stages[0].round_shift = 25
    H = peer[0].diloco_cfg.inner_steps
    assert H == 50 and peer[0].round_at(290) == 6 and peer[1].round_at(290) == 5
    state0 = served(donor[0], 6, 5, step_in_round=0)  # round 6 of fragment 0: inner steps 275 to 325
    donor[0].inner_step = 280
    state0 = donor[0].shareable_state("run")
    old = served(donor[1], 4, 3, step_in_round=10)
    state1 = served(donor[1], 5, 4, step_in_round=40)  # step 290
    group, syncs = group_of(peer, [[state0], [old, state1]],
                            [[Record(6, 5, "x")], [Record(4, 3, "x", node="a"), Record(5, 4, "x", node="b"),
                                                   Record(5, 4, "x", node="c")]])
    group.at_start(resumed=False)
    assert [(s.round_index, s.inner_step) for s in peer] == [(6, 290), (5, 290)]
    assert peer[1].averager.downloads == 2 and peer[0].round_first_step == 290


def test_at_the_runs_end_the_peers_off_the_canonical_final_anchor_take_it():
    """A run's last round split into two groups (or failed here): no round is left to resync, so at the end the peers
    off the canonical anchor after the last round download it, and those holding it say when everyone does."""
    num_rounds = 5
    last = num_rounds - 1
    donor = make_stage(seed=1)
    donor.round_index, donor.applied_round = num_rounds, last
    donor.inner_step = num_rounds * donor.diloco_cfg.inner_steps
    state = donor.shareable_state("run")
    theirs = donor.state_fingerprint()[0]

    def finished_peer():
        peer = make_stage()
        peer.round_index, peer.applied_round = num_rounds, last
        peer.inner_step = donor.inner_step
        return peer

    # the other pair of a split last group (smaller node ids: their anchor wins the tie of two votes each)
    others = [Record(num_rounds, last, theirs, node="a"), Record(num_rounds, last, theirs, node="b")]
    peer = finished_peer()
    sync = make_sync(peer, [*others, Record(num_rounds, last, "mine", node="m")], state, num_rounds=num_rounds)
    sync.remember("mine")
    assert not sync.agreed_at_end()
    sync.at_end(deadline=time.monotonic() + 5)
    assert [e["action"] for e in sync.events] == ["resync"]
    assert all(torch.equal(a, b) for a, b in zip(peer.anchor, donor.anchor))
    sync.remember(peer.state_fingerprint()[0])
    assert peer.round_index == num_rounds and peer.inner_step == donor.inner_step  # its progress is kept

    # everyone on the same final anchor (a calm run): nothing to agree on, nothing downloaded
    peer = finished_peer()
    sync = make_sync(peer, [Record(num_rounds, last, "mine", node="a")], state, num_rounds=num_rounds)
    sync.remember("mine")
    sync.at_end(deadline=time.monotonic() + 5)
    assert not sync.events and peer.averager.downloads == 0 and sync.agreed_at_end()

    # a round failed for the whole group before the last one: every peer on its own anchor, one vote each; the
    # tie goes to the smallest node id ("a"), and the others take its anchor
    peer = finished_peer()
    sync = make_sync(peer, [Record(num_rounds, last, theirs, node="a"), Record(num_rounds, last, "z1", node="z")],
                     state, num_rounds=num_rounds)
    sync.remember("mine")
    sync.at_end(deadline=time.monotonic() + 5)
    assert [e["action"] for e in sync.events] == ["resync"]

    # holding the canonical anchor: no download; agreed once the others' records hold it too
    peer = finished_peer()
    records = [Record(num_rounds, last, theirs, node="a"), Record(num_rounds, last, "other", node="z")]
    sync = make_sync(peer, records, state, num_rounds=num_rounds)
    sync.remember(theirs)
    sync.at_end(deadline=time.monotonic() + 5)
    assert not sync.events and peer.averager.downloads == 0
    assert not sync.agreed_at_end()  # "z" has not taken it yet
    sync.swarm.records[1] = Record(num_rounds, last, theirs, node="z")
    assert sync.agreed_at_end()

    # a peer still averaging the last round is waited for (here: until the deadline), then the votes decide
    peer = finished_peer()
    still = [Record(num_rounds, last - 1, "", node="a")]
    sync = make_sync(peer, still, state, num_rounds=num_rounds)
    sync.remember("mine")
    started = time.monotonic()
    sync.at_end(deadline=started + 0.6)
    assert time.monotonic() - started >= 0.5 and not sync.events

    # before the run's end a finished donor's state is still refused (a reload must not jump past the end)
    behind = make_stage()
    behind.round_index, behind.applied_round = 3, 2
    sync = make_sync(behind, others, state, num_rounds=num_rounds)
    assert "past the run's end" in sync.fetcher.refusal(*state)
