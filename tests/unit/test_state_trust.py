"""Issue 30 §1.1, §1.2 and §1.8 against a stage's sync, as pure logic (the records and the donors' states are given):
a served state is the believed peers' state in every tensor and count (the fingerprint covers anchor, outer momentum,
applied round and outer steps), a claim nobody else vouches for earns no priority, every metadata field of a state is
range-checked before use (and anything a donor's data makes fail is that donor's refusal, never a crash), and what a
stage that has met nobody believes. The network paths are ``tests/integration/test_hostile_state.py``."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.round.swarm_state import StateError
from tests.unit.test_swarm_state import Record, make_stage
from tests.unit.test_sync_trust import fingerprint, state_at, sync_of


def with_momentum(state, value: float):
    """``state`` with every outer momentum value set to ``value`` (the anchor untouched)."""
    meta, tensors = state
    count = len(make_stage().anchor)
    return dict(meta), tensors[:count] + [torch.full_like(t, value) for t in tensors[count:]]


def momentum_of(stage):
    return stage.outer_optimizer.momentum_buffers


def test_a_donor_serving_the_agreed_anchor_with_momentum_of_its_own_is_refused():
    """Issue 30 §1.1: the anchor's sha256 was all that was checked; momentum chosen by the donor then steers the
    taker's next outer step to any model. The record's fingerprint covers the momentum and the counts too."""
    honest = with_momentum(state_at(6, 5), 0.01)
    poisoned = with_momentum(honest, 123.0)  # the agreed anchor, crafted momentum
    assert all(torch.equal(a, b) for a, b in zip(honest[1][:2], poisoned[1][:2]))
    assert fingerprint(poisoned) != fingerprint(honest)
    records = [Record(6, 5, fingerprint(honest), node=n) for n in ("a", "b", "mallory")]  # mallory claims it too
    newcomer = make_stage()
    sync = sync_of(newcomer, records, {"a": honest, "b": honest, "mallory": poisoned})
    sync.witnesses.donors = lambda others, own_round=None, strangers=(): ["mallory", "a", "b"]  # the liar first
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"] and newcomer.averager.asked == ["mallory", "a"]
    assert all(torch.equal(m, torch.full_like(m, 0.01)) for m in momentum_of(newcomer))
    miscounted = (dict(honest[0], outer_steps=honest[0]["outer_steps"] + 1), honest[1])  # a count of its own
    assert sync.fetcher.refusal(*miscounted) == "its state after round 5 is not the one the swarm agrees on"


def test_a_claim_only_its_donor_vouches_for_is_asked_last_and_not_taken():
    """Issue 30 §1.1: a record one round ahead of the swarm with a state only it holds was ranked first and its state
    taken at once (the only vote for that round). It ranks last; its state waits for a second voucher and is
    refused while other believed peers say nothing of that round."""
    honest = state_at(6, 5)
    ahead = with_momentum(state_at(7, 6, poison=0.5), 7.0)
    records = [Record(6, 5, fingerprint(honest), node="a"), Record(6, 5, fingerprint(honest), node="b"),
               Record(7, 6, fingerprint(ahead), node="mallory", prior_anchor=fingerprint(honest))]
    newcomer = make_stage()
    sync = sync_of(newcomer, records, {"a": honest, "b": honest, "mallory": ahead})
    for _ in range(5):
        assert sync.witnesses.donors(records)[-1] == "mallory"
    assert sync.fetcher.refusal(*ahead) == "no two peers agree on the state after round 6"
    sync.witnesses.donors = lambda others, own_round=None, strangers=(): ["mallory", "a"]
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"] and newcomer.averager.asked == ["mallory", "a"]
    assert newcomer.applied_round == 5


def test_the_state_a_donor_serves_after_an_average_is_the_one_it_holds_once_applied():
    """What records vote on is each peer's own state after applying a round; what a donor serves while that average
    is pending is computed on copies (``peek``). The two must be bit-identical, momentum included, or every newcomer
    would be refused in overlap modes."""
    for mode in ("none", "delayed", "eager"):
        donor = make_stage(mode=mode, seed=3)
        donor.round_index, donor.applied_round = 4, 2
        donor.inner_step = 4 * donor.diloco_cfg.inner_steps
        for m in momentum_of(donor):
            m.copy_(torch.randn_like(m))
        donor.outer_optimizer.num_steps = 3
        average = [torch.randn_like(t) * 1e-2 for t in donor.anchor]
        from p2p_diloco.round.outcome import PendingRound
        donor.pending = PendingRound(3, [torch.zeros_like(t) for t in donor.anchor], 1.0)
        served = donor.shareable_state("run", finished_average=average)
        donor.pending = None
        donor.outer_optimizer.step(average)
        donor.applied_round = 3
        assert donor.served_fingerprint(*served) == donor.state_fingerprint()[0], mode


HOSTILE_FIELDS = [("seconds_per_step", 5e-320), ("seconds_per_step", 1e300), ("seconds_per_step", -1.0),
                  ("seconds_per_step", float("nan")), ("seconds_per_step", float("inf")), ("seconds_per_step", "1"),
                  ("seconds_per_step", True), ("seconds_per_step", None), ("seconds_per_step", 2),
                  ("round", 2 ** 62), ("round", -1), ("round", 6.0), ("round", None), ("applied_round", 7),
                  ("applied_round", -2), ("outer_steps", -1), ("outer_steps", 10 ** 6), ("inner_step", 2 ** 62),
                  ("inner_step", -1), ("round_start_step", -3), ("round_start_step", 2 ** 70), ("format", 2),
                  ("shapes", "x" * 10), ("run_id", ["run"])]


@pytest.mark.parametrize("key,value", HOSTILE_FIELDS)
def test_every_metadata_field_is_range_checked_before_use(key, value):
    """Issue 30 §1.2: ``seconds_per_step = 5e-320`` passed "positive and finite", then ``int(elapsed / step_s)``
    raised OverflowError and killed the downloader. Each field gets its range; only StateError escapes."""
    meta, tensors = state_at(6, 5)
    with pytest.raises(StateError):
        make_stage().check_state("run", dict(meta, **{key: value}), tensors)


def test_a_tiny_clock_or_any_failure_on_a_donors_data_refuses_that_donor_only():
    honest = state_at(6, 5)
    tiny = (dict(honest[0], seconds_per_step=5e-320), honest[1])

    class Hostile(dict):  # whatever it holds, reading it fails
        def get(self, *args):
            raise RuntimeError("crafted")

    for bad in (tiny, (Hostile(honest[0]), honest[1])):
        records = [Record(6, 5, fingerprint(honest), node=n) for n in ("mallory", "a")]
        newcomer = make_stage()
        sync = sync_of(newcomer, records, {"mallory": bad, "a": honest})
        sync.witnesses.donors = lambda others, own_round=None, strangers=(): ["mallory", "a"]
        sync.at_start(resumed=False)  # raised OverflowError (RuntimeError) out of the sync before
        assert [e["action"] for e in sync.events] == ["reload"] and newcomer.averager.asked == ["mallory", "a"]


def test_a_newcomer_believes_its_bootstrap_peers_before_a_majority_of_strangers():
    """Issue 30 §1.8: a stage that has met nobody believed every signed record, and identities are free. Its
    bootstrap peers' records (``dht.initial_peers``, who already decide its view of the DHT) count first; any peer
    holding the state they vouch for can serve it. Without a bootstrap record, every record counts (the residual
    risk the module docstring states)."""
    honest, forged = state_at(6, 5), with_momentum(state_at(6, 5, poison=3.0), 5.0)
    sybils = [Record(6, 5, fingerprint(forged), node=f"sybil{i}") for i in range(5)]
    records = [Record(6, 5, fingerprint(honest), node="boot"), Record(6, 5, fingerprint(honest), node="a")] + sybils
    states = {"boot": None, "a": honest, **{r.node: forged for r in sybils}}  # the bootstrap peer is busy
    newcomer = make_stage()
    sync = sync_of(newcomer, records, states, bootstrap=["boot"])
    assert [r.node for r in sync.witnesses.counted(records)] == ["boot"]
    counted = sync.witnesses.counted(records)
    assert sync.witnesses.donors(counted, strangers=records) == ["boot", "a"]  # a holds what boot vouches for
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"]
    assert all(torch.equal(x, y) for x, y in zip(newcomer.anchor, honest[1]))
    assert not set(newcomer.averager.asked) & {r.node for r in sybils}
    unbooted = sync_of(make_stage(), records, states)  # no bootstrap peer: the residual
    assert unbooted.witnesses.counted(records) == records


def test_when_the_peers_met_give_nothing_the_bootstrap_peers_count_before_strangers():
    """The widening after a hostile groupmate met alone (issue 16) went to every signed record at once: a majority of
    free identities then chose the state. It goes to the bootstrap peers first."""
    honest, forged = state_at(7, 6), state_at(7, 6, poison=2.0)
    liar = Record(8, 7, fingerprint(honest), node="liar", prior_anchor="c" * 64)
    sybils = [Record(7, 6, fingerprint(forged), node=f"sybil{i}") for i in range(4)]
    records = [liar, Record(7, 6, fingerprint(honest), node="boot")] + sybils
    peer = make_stage()
    peer.round_index, peer.applied_round, peer.inner_step = 6, 5, 6 * peer.diloco_cfg.inner_steps
    states = {"liar": state_at(7, 6, poison=1.0), "boot": honest, **{r.node: forged for r in sybils}}
    sync = sync_of(peer, records, states, bootstrap=["boot"])
    sync.witnesses.met_group(["me", "liar"])
    sync.after_round()
    assert [e["action"] for e in sync.events] == ["reload"], peer.averager.asked
    assert peer.averager.asked == ["liar", "boot"]
    assert all(torch.equal(x, y) for x, y in zip(peer.anchor, honest[1][:len(peer.anchor)]))


def test_a_state_this_stage_held_itself_after_that_round_needs_no_other_voucher():
    """A peer reloading onto a groupmate's state after a round they averaged together: the groupmate's record is the
    only other one (a hostile third member's lie, its own record a round further on in a fast swarm), and this
    stage's own remembered state after that round is the second voucher. A state it did not hold still waits."""
    honest = state_at(6, 5)
    records = [Record(7, 6, fingerprint(state_at(7, 6, poison=0.25)), node="a", prior_anchor=fingerprint(honest)),
               Record(8, 7, "e" * 64, node="mallory", prior_anchor="d" * 64)]  # lies about everything
    peer = make_stage()
    peer.round_index, peer.applied_round = 6, 5
    sync = sync_of(peer, records, {"a": honest})
    assert sync.fetcher.refusal(*honest) == "no two peers agree on the state after round 5"  # nobody else: refused
    sync.fingerprints[5] = fingerprint(honest)  # it held that state itself after round 5
    assert sync.fetcher.refusal(*honest) is None
    del sync.fingerprints[5]
    sync.fingerprints[4] = fingerprint(honest)  # a state of another round vouches for nothing here
    assert sync.fetcher.refusal(*honest) == "no two peers agree on the state after round 5"


def test_a_training_stage_waits_for_a_second_voucher_a_few_of_its_rounds_at_most():
    """The wait holds the stage's training: a stage that knows its step time waits at most 3 of its rounds (at least
    5 s), a newcomer the whole ``verify_wait_s``."""
    peer = make_stage()
    sync = sync_of(peer, [], {}, verify_wait_s=30.0)
    assert sync.fetcher.verify_wait() == 30.0  # no step time yet
    H = peer.diloco_cfg.inner_steps
    peer.seconds_per_step = 2.0 / (3 * H)  # rounds of 0.67 s
    assert sync.fetcher.verify_wait() == 5.0
    peer.seconds_per_step = 4.0 / H  # rounds of 4 s: 12 s
    assert sync.fetcher.verify_wait() == pytest.approx(12.0)
    peer.seconds_per_step = 60.0 / H
    assert sync.fetcher.verify_wait() == 30.0


def test_a_groupmate_whose_served_state_its_own_record_contradicts_no_longer_counts():
    """Seen in a fresh-clone run (test_churn.py's newcomer test): a hostile groupmate whose records claim a round more
    than it holds (with its real fingerprints) and which serves a poisoned state kept an honest peer that had fallen
    a round behind from ever reloading in a swarm of three. The one honest peer ahead had no second voucher (the
    liar's record names another state for that round), so the lagging peer trained alone to the run's end. A donor
    whose served state its own signed record contradicts now counts for nothing for a few rounds: the honest peer
    ahead is then the only one believed, and its state is taken."""
    honest6, honest7 = state_at(7, 6), state_at(8, 7, poison=0.25)
    poisoned = state_at(8, 7, poison=3.0)
    records = [Record(8, 7, fingerprint(honest7), node="a", prior_anchor=fingerprint(honest6)),
               Record(9, 8, fingerprint(honest7), node="x", prior_anchor=fingerprint(honest6))]  # a round "ahead"
    peer = make_stage()
    peer.round_index, peer.applied_round, peer.inner_step = 6, 5, 6 * peer.diloco_cfg.inner_steps
    sync = sync_of(peer, records, {"a": honest7, "x": poisoned})
    sync.witnesses.met_group(["me", "a", "x"])
    # x's record says otherwise
    assert sync.fetcher.refusal(*honest7) == "no two peers agree on the state after round 7"
    sync.witnesses.donors = lambda others, own_round=None, strangers=(): ["x", "a"]  # the liar first
    sync.after_round()
    assert [e["action"] for e in sync.events] == ["reload"], peer.averager.asked
    assert peer.averager.asked == ["x", "a"] and set(sync.witnesses.discredited) == {"x"}
    assert all(torch.equal(p, q) for p, q in zip(peer.anchor, honest7[1][:len(peer.anchor)]))
    assert [r.node for r in sync.witnesses.counted(records)] == ["a"]
    peer.round_index += 4  # DISCREDIT_ROUNDS later it counts again (and must be caught again)
    assert [r.node for r in sync.witnesses.counted(records)] == ["a", "x"]


def test_a_donor_that_serves_the_agreed_state_before_its_record_says_so_is_not_discredited():
    """A peer that has just resynced serves the agreed state while its record still names its old one: not a lie."""
    agreed, old = state_at(6, 5), state_at(6, 5, poison=1.0)
    records = [Record(6, 5, fingerprint(agreed), node=n) for n in ("a", "b")] + \
        [Record(6, 5, fingerprint(old), node="c")]
    newcomer = make_stage()
    sync = sync_of(newcomer, records, {"a": agreed, "b": agreed, "c": agreed})
    sync.witnesses.donors = lambda others, own_round=None, strangers=(): ["c", "a"]
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"] and newcomer.averager.asked == ["c"]
    assert not sync.witnesses.discredited
