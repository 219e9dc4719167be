"""Issue 16 §1-2 attacks on a stage's sync, as pure logic (the swarm's records and the donors' states are given):
whose records count, majority for "behind", donors chosen by the agreed anchor, every downloaded state checked
against the anchor the swarm agrees on (its full sha256), its round against this peer's, the swarm's and the run's
end. Real-network versions: ``tests/integration/test_hostile_state.py``."""

from __future__ import annotations

import torch

from p2p_diloco.round.swarm_state import anchor_digest
from p2p_diloco.training.sync import SwarmSync
from tests.unit.test_swarm_state import FakeSwarm, OneStage, Record, make_stage


class Donors:
    """An averager whose donors serve the given states (donor node -> (meta, tensors)); records who was asked."""

    def __init__(self, states: dict):
        self.states, self.asked, self.client_mode = states, [], False

    def download_state(self, donors, timeout_s):
        self.asked += list(donors)
        return self.states.get(donors[0])

    def abandon_round(self):
        pass


def state_at(round_index: int, applied_round: int, seed: int = 1, poison: float = 0.0):
    donor = make_stage(seed=seed)
    donor.round_index, donor.applied_round = round_index, applied_round
    donor.inner_step = round_index * donor.diloco_cfg.inner_steps
    if poison:
        with torch.no_grad():
            donor.anchor[0].view(-1)[0] += poison  # one value changed
    return donor.shareable_state("run")


def fingerprint(state) -> str:
    return make_stage().served_fingerprint(*state)


def sync_of(peer, records, states, **options) -> SwarmSync:
    peer.averager = Donors(states)
    options.setdefault("verify_wait_s", 0.0)
    return SwarmSync(peer, FakeSwarm(records, "me"), OneStage(), "run", download_timeout_s=5, **options)


def test_one_record_with_a_high_round_does_not_make_a_newcomer_reload():
    honest = state_at(3, 2)
    records = [Record(3, 2, fingerprint(honest), node=f"honest{i}") for i in range(3)]
    forged = Record(10**6, 10**6 - 1, "f" * 64, node="mallory")
    peer = make_stage()
    peer.round_index, peer.applied_round = 3, 2
    sync = sync_of(peer, records + [forged], {f"honest{i}": honest for i in range(3)})
    sync.at_start(resumed=True)
    assert not sync.events and peer.averager.asked == []
    sync.after_round()  # the same after a round
    assert not sync.events and peer.round_index == 3


def test_a_record_far_ahead_of_the_swarm_is_not_asked_for_its_state():
    honest = state_at(6, 5)
    records = [Record(6, 5, fingerprint(honest), node=n) for n in ("a", "b")] + \
        [Record(1006, 1005, "f" * 64, node="liar")]
    newcomer = make_stage()
    sync = sync_of(newcomer, records, {"a": honest, "b": honest, "liar": state_at(6, 5, poison=1.0)})
    assert sorted(sync.witnesses.donors(records)) == ["a", "b"]
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"] and "liar" not in newcomer.averager.asked


def test_once_a_peer_has_met_its_group_records_of_strangers_do_not_count():
    honest = state_at(3, 2)
    peer = make_stage()
    peer.round_index, peer.applied_round = 3, 2
    friend = Record(3, 2, fingerprint(honest), node="friend")
    strangers = [Record(9, 8, "e" * 64, node=f"sybil{i}") for i in range(5)]  # a majority of made-up identities
    sync = sync_of(peer, [friend] + strangers, {"friend": honest})
    sync.witnesses.met_group(["me", "friend"])
    sync.after_round()
    assert not sync.events and peer.averager.asked == [] and peer.round_index == 3
    assert [r.node for r in sync.witnesses.counted([friend] + strangers)] == ["friend"]
    private = sync_of(peer, [friend] + strangers, {}, allowlist=["friend"])  # a private swarm: members only
    assert [r.node for r in private.witnesses.counted([friend] + strangers)] == ["friend"]


def test_donors_are_the_holders_of_the_agreed_anchor_whatever_they_declare():
    honest, poisoned = state_at(6, 5), state_at(6, 5, poison=1.0)
    records = [Record(6, 5, fingerprint(honest), node="a"), Record(6, 5, fingerprint(honest), node="b"),
               Record(6, 5, fingerprint(poisoned), node="mallory")]
    newcomer = make_stage()
    sync = sync_of(newcomer, records, {"a": honest, "b": honest, "mallory": poisoned})
    assert sorted(sync.witnesses.donors(records)) == ["a", "b"]
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"] and "mallory" not in newcomer.averager.asked
    assert all(torch.equal(a, b) for a, b in zip(newcomer.anchor, honest[1]))


def test_a_donor_serving_another_anchor_than_it_announced_is_refused_and_the_next_one_asked():
    honest = state_at(6, 5)
    poisoned = state_at(6, 5, poison=1e-3)  # a single value changed by a little
    assert fingerprint(poisoned) != fingerprint(honest)
    records = [Record(6, 5, fingerprint(honest), node="a"), Record(6, 5, fingerprint(honest), node="b")]
    newcomer = make_stage()
    sync = sync_of(newcomer, records, {"a": poisoned, "b": poisoned})
    sync.at_start(resumed=False)
    assert not sync.events and newcomer.round_index == 0 and sorted(newcomer.averager.asked) == ["a", "b"]
    sync = sync_of(make_stage(), records, {"a": poisoned, "b": honest})
    sync.witnesses.donors = lambda others, own_round=None, strangers=(): ["a", "b"]  # the liar first
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"] and sync.stage.averager.asked == ["a", "b"]
    assert all(torch.equal(a, b) for a, b in zip(sync.stage.anchor, honest[1]))


def test_a_single_voucher_is_not_enough_where_two_peers_vouch_for_that_round():
    honest = state_at(6, 5)
    lone = state_at(6, 5, poison=0.25)  # a donor whose anchor nobody else holds
    records = [Record(6, 5, fingerprint(lone), node="a"), Record(6, 5, fingerprint(honest), node="b")]
    sync = sync_of(make_stage(), records, {"a": lone, "b": lone})  # a tie: no anchor has two votes
    sync.at_start(resumed=False)
    assert not sync.events
    # b says nothing of round 5 yet: a's record alone, a round ahead with a state only it holds, is what an attacker
    # publishes (it was taken at once)
    records = [Record(6, 5, fingerprint(lone), node="a"), Record(6, 4, "", node="b")]
    sync = sync_of(make_stage(), records, {"a": lone})
    sync.at_start(resumed=False)
    assert not sync.events
    records[1] = Record(6, 5, fingerprint(lone), node="b")  # b applied round 5 too: the state is the swarm's
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"]
    sync = sync_of(make_stage(), records[:1], {"a": lone})  # a swarm of one other peer: its word is all there is
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"]
    records = [Record(6, 5, fingerprint(honest), node="a"), Record(6, 5, fingerprint(honest), node="b")]
    sync = sync_of(make_stage(), records, {"a": honest})
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"]


def test_a_finished_run_is_taken_only_when_most_believed_peers_finished_it_and_a_state_behind_is_refused():
    """A newcomer to a run most of whose peers applied the last round takes its final state and has nothing left to
    train (training the whole run alone would end on a model nobody holds). One record claiming the end, or a
    finished peer among peers still training, does not end it: a state past the run's end is then refused (the
    peer would have finished at once with that model); and a state behind the peer is refused."""
    finished = state_at(20, 19)
    records = [Record(20, 19, fingerprint(finished), node=n) for n in ("a", "b")]
    # believed: its bootstrap peers (claims of peers it has no reason to believe end nothing: the next test)
    newcomer = make_stage()
    sync = sync_of(newcomer, records, {"a": finished, "b": finished}, num_rounds=20, bootstrap=("a", "b"))
    sync.at_start(resumed=False)
    assert [e["action"] for e in sync.events] == ["reload"] and "the run ended" in sync.events[0]["reason"]
    assert (newcomer.round_index, newcomer.applied_round) == (20, 19)
    assert newcomer.inner_step == 20 * newcomer.diloco_cfg.inner_steps  # the trainer's loop: nothing left
    assert fingerprint(newcomer.shareable_state("run")) == fingerprint(finished)

    running = state_at(6, 5)
    for claims in ([Record(20, 19, fingerprint(finished), node="mallory")],  # one identity's word
                   [Record(20, 19, fingerprint(finished), node="mallory"), Record(20, 19, "e" * 64, node="eve")]):
        records = claims + [Record(6, 5, fingerprint(running), node=n) for n in ("a", "b", "c")]
        newcomer = make_stage()
        sync = sync_of(newcomer, records, {n: running for n in "abc"} | {"mallory": finished}, num_rounds=20)
        sync.at_start(resumed=False)
        assert [e["action"] for e in sync.events] == ["reload"] and newcomer.round_index == 6, sync.events
        assert "mallory" not in newcomer.averager.asked
    records = [Record(20, 19, fingerprint(finished), node="a"), Record(4, 3, "", node="b"), Record(4, 3, "", node="c")]
    newcomer = make_stage()
    sync = sync_of(newcomer, records, {"a": finished}, num_rounds=20)
    sync.at_start(resumed=False)
    assert newcomer.round_index < 20
    old = state_at(3, 2)
    peer = make_stage()
    peer.round_index, peer.applied_round = 5, 4
    records = [Record(8, 7, "", node="x1"), Record(8, 7, "", node="x2"), Record(3, 2, fingerprint(old), node="a")]
    sync = sync_of(peer, records, {"a": old})
    sync.after_round()
    assert not sync.events and peer.round_index == 5


class Finishing(FakeSwarm):
    """A swarm on its last round's averaging: its records name the round past the run's end, the last round not yet
    applied; after ``polls`` reads they have applied it."""

    def __init__(self, before, after, polls):
        super().__init__(before)
        self.after, self.polls = after, polls

    def others(self):
        self.polls -= 1
        return self.records if self.polls >= 0 else self.after


def test_a_peer_behind_a_swarm_finishing_the_run_waits_for_its_final_state(monkeypatch):
    """The swarm trained its last round (records: round 20 of 20) and is still averaging it (applied 18). No round
    is left to reload into: a donor's state there is refused (past the run's end), and the peer trained the rest of
    the run alone on another model. It now waits for the swarm to apply the last round and takes its final state,
    with nothing left to train; it announces the swarm's round first (a finishing peer waits for a peer on the
    last round before it leaves). Where the final state does not come within the bound, nothing is downloaded and
    the peer trains on (it tries again after its round)."""
    monkeypatch.setattr("p2p_diloco.training.run_end.END_POLL_S", 0.01)
    finished, averaging = state_at(20, 19), state_at(20, 18)
    before = [Record(20, 18, fingerprint(averaging), node=n) for n in ("a", "b")]
    after = [Record(20, 19, fingerprint(finished), node=n) for n in ("a", "b")]
    for resumed, (round_index, applied) in ((False, (0, -1)), (True, (4, 3)), (True, (18, 17))):
        peer = make_stage()
        peer.round_index, peer.applied_round = round_index, applied
        peer.inner_step = round_index * peer.diloco_cfg.inner_steps
        peer.averager = Donors({"a": finished, "b": finished})
        swarm = Finishing(before, after, polls=5)
        sync = SwarmSync(peer, swarm, OneStage(), "run", download_timeout_s=5, num_rounds=20, verify_wait_s=0.0,
                         end_wait_s=30.0, bootstrap=("a", "b"))  # peers it believes (strangers' ends: not taken)
        if round_index == 18:
            sync.after_round()  # behind after its round 17 (a peer on round 19 would still join its average)
        else:
            sync.at_start(resumed=resumed)
        assert [e["action"] for e in sync.events] == ["reload"] and "the run ended" in sync.events[0]["reason"]
        assert (peer.round_index, peer.applied_round) == (20, 19)
        assert peer.inner_step == 20 * peer.diloco_cfg.inner_steps  # the trainer's loop: nothing left
        assert fingerprint(peer.shareable_state("run")) == fingerprint(finished)
        assert swarm.published and swarm.published[0] == 20
        assert peer.averager.asked in (["a"], ["b"]), peer.averager.asked  # the final state only, once

    peer = make_stage()
    peer.averager = Donors({"a": averaging, "b": averaging})
    sync = SwarmSync(peer, FakeSwarm(before), OneStage(), "run", download_timeout_s=5, num_rounds=20,
                     verify_wait_s=0.0, end_wait_s=0.2)
    sync.at_start(resumed=False)
    assert not sync.events and peer.averager.asked == [] and peer.round_index == 0


def test_a_resync_checks_the_whole_anchor_at_any_round():
    """The resync took a donor's anchor unchecked unless it was for the diverged round itself."""
    honest = state_at(8, 7)
    poisoned = state_at(8, 7, poison=0.5)
    peer = make_stage()
    peer.round_index, peer.applied_round = 8, 6
    records = [Record(8, 7, fingerprint(honest), node=n, prior_anchor="c" * 64) for n in ("a", "b")]
    sync = sync_of(peer, records, {"a": poisoned, "b": poisoned})
    sync.remember("mine")  # after round 6: off the swarm's ("c...")
    sync.after_round()
    assert not sync.events


def test_the_fingerprint_covers_every_value_of_a_large_anchor():
    big = [torch.zeros(3 << 20)]
    changed = [big[0].clone()]
    changed[0][1] = 1.0  # a value a strided sample of 2**20 values skips
    assert anchor_digest(big) != anchor_digest(changed)


def test_survivors_of_a_round_every_member_applied_alone_converge_on_the_tie_break():
    """Each member of a failed round applied its own pseudo-gradient: three anchors, one vote each. The stage off the
    tie-break's anchor (smallest node id) takes it from its holder at once (it waited for a second vote that never
    came and missed the next group: make test under load); the other anchor of the tie is not taken."""
    peer = make_stage()
    peer.round_index, peer.applied_round = 1, 0
    a = state_at(1, 0)
    b = state_at(1, 0, poison=0.3)
    records = [Record(1, 0, fingerprint(a), node="a"), Record(1, 0, fingerprint(b), node="b")]
    sync = sync_of(peer, records, {"a": a, "b": b}, verify_wait_s=30.0)
    sync.remember("mine")  # this stage's own anchor after round 0: the third single vote
    sync.after_round()
    assert [e["action"] for e in sync.events] == ["resync"] and sync.stage.averager.asked == ["a"]
    assert all(torch.equal(x, y) for x, y in zip(sync.stage.anchor, a[1]))
    sync.fetcher.verify_wait_s = 0.0  # the other anchor is off the tie-break: not taken (after waiting for more votes)
    assert sync.fetcher.refusal(*b) == "no two peers agree on the state after round 0"


def test_a_resync_asks_only_donors_not_on_a_later_round():
    """A peer whose anchor after round 4 differs from the swarm's resyncs at round 5. Peer b (round 6, its anchor
    after round 5, the agreed one after round 4 before it) ranks first as a donor, but a resync cannot take a later
    round's state (it would be refused after the download: seconds in which this peer's next group formed without
    it, in CI); a, on round 5, is asked and the resync happens. (d holds b's state: vouched, b ranks first.)"""
    at_a, at_b = state_at(5, 4), state_at(6, 5, poison=0.5)  # b's anchor has taken round 5 since
    agreed = fingerprint(at_a)
    records = [Record(5, 4, agreed, node="a"), Record(6, 5, fingerprint(at_b), node="b", prior_anchor=agreed),
               Record(5, 4, agreed, node="c"), Record(6, 5, fingerprint(at_b), node="d", prior_anchor=agreed)]
    peer = make_stage()
    peer.round_index, peer.applied_round, peer.inner_step = 5, 4, 5 * peer.diloco_cfg.inner_steps
    with torch.no_grad():
        peer.anchor[0].view(-1)[0] += 1.0  # its round 4 fell back while the others averaged
    sync = sync_of(peer, records, {"a": at_a, "b": at_b, "c": at_a, "d": at_b})
    sync.remember(peer.state_fingerprint()[0])  # this peer's own anchor after round 4: not the agreed one
    assert sync.witnesses.donors(records)[0] in ("b", "d")
    sync.after_round()
    assert not {"b", "d"} & set(peer.averager.asked)
    assert [e["action"] for e in sync.events] == ["resync"] and peer.state_fingerprint()[0] == agreed


def test_a_dead_peers_record_does_not_keep_the_survivor_off_the_tie_break_from_resyncing():
    """As in CI (test_churn's restarted peer): of 3 peers, one was killed during round 2's averaging; the two
    survivors each applied round 2 alone (two anchors, one vote each) and averaged every later round with each
    other, pseudo-gradients onto their two anchors, so they stayed apart to the run's end: the one off the
    tie-break's anchor asked only the dead peer for a state. The dead peer's record (round 2, still in the DHT for
    its TTL) made the lower median of the two others' rounds 2, and the live survivor on round 5 looked too far
    ahead of the swarm to be a donor. The resyncing stage is on the swarm's round itself: its round counts."""
    peer = make_stage()
    peer.round_index, peer.applied_round, peer.inner_step = 5, 4, 5 * peer.diloco_cfg.inner_steps
    with torch.no_grad():
        peer.anchor[0].view(-1)[0] += 1.0  # its round 2 fell back alone: its anchor differs from a's since
    at_a = state_at(5, 4)
    dead = state_at(2, 1)
    records = [Record(5, 4, fingerprint(at_a), node="a"), Record(2, 1, fingerprint(dead), node="dead")]
    sync = sync_of(peer, records, {"a": at_a})  # the dead peer serves nothing
    sync.remember(peer.state_fingerprint()[0])  # one vote each after round 4: the tie goes to "a" < "me"
    sync.after_round()
    assert [e["action"] for e in sync.events] == ["resync"], peer.averager.asked
    assert peer.averager.asked[0] == "a" and peer.state_fingerprint()[0] == fingerprint(at_a)


def test_a_hostile_groupmate_met_alone_does_not_keep_a_peer_from_the_swarms_state():
    """A peer whose only group of recent rounds was with a hostile one (``false-state``: records a round ahead,
    poisoned states) believed only that peer's records: "behind" at every round end, its state refused, and no
    honest donor asked, to the run's end (the shape of a newcomer's failure in a busy two-at-a-time make test).
    When the met peers give no usable state, every signed record counts, as for a newcomer."""
    honest = state_at(7, 6)
    liar = Record(8, 7, fingerprint(honest), node="liar", prior_anchor="c" * 64)  # a round ahead of where it is
    records = [Record(7, 6, fingerprint(honest), node=n) for n in ("a", "b")] + [liar]
    peer = make_stage()
    peer.round_index, peer.applied_round, peer.inner_step = 6, 5, 6 * peer.diloco_cfg.inner_steps
    sync = sync_of(peer, records, {"a": honest, "b": honest, "liar": state_at(7, 6, poison=1.0)})
    sync.witnesses.met_group(["me", "liar"])
    assert [r.node for r in sync.witnesses.counted(records)] == ["liar"]
    sync.after_round()
    assert [e["action"] for e in sync.events] == ["reload"], peer.averager.asked
    assert peer.averager.asked[0] == "liar" and peer.round_index == 7
    assert all(torch.equal(x, y) for x, y in zip(peer.anchor, honest[1][:len(peer.anchor)]))
    assert sync.witnesses.widening == 0  # the widening lasts one download
    # and the liar, caught serving a state its own record contradicts, counts for nothing for a few rounds: the
    # peers met are then none, and every signed record counts (the liar's aside)
    assert set(sync.witnesses.discredited) == {"liar"}
    assert [r.node for r in sync.witnesses.counted(records)] == ["a", "b"]


def test_a_strangers_final_anchor_is_waited_for_but_not_told_as_a_split_of_the_swarm():
    """At the run's end a peer holding the agreed final anchor stays (bounded) until the others hold it too, strangers
    included: a peer restarted late under a fresh identity downloads the final anchor from it meanwhile. But a
    stranger's other final anchor is a claim, not a split of the swarm: it had every honest peer warn that the models
    differ; a groupmate's other anchor still is one."""
    num_rounds, mine = 4, "a" * 64
    peer = make_stage()
    peer.round_index, peer.applied_round = num_rounds, num_rounds - 1
    friend = Record(num_rounds, num_rounds - 1, mine, node="friend")
    stranger = Record(num_rounds, num_rounds - 1, "f" * 64, node="outsider")
    sync = sync_of(peer, [friend, stranger], {}, num_rounds=num_rounds)
    sync.remember(mine)
    sync.witnesses.met_group(["me", "friend"])
    assert not sync.agreed_at_end() and sync.agreed_at_end(believed_only=True)
    sync.swarm.records[0] = Record(num_rounds, num_rounds - 1, "b" * 64, node="friend")  # a groupmate off it
    assert not sync.agreed_at_end(believed_only=True)
