"""SwarmLink's reading of the progress records (the DHT read replaced by a list: pure logic)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from p2p_diloco.round.position import Position
from p2p_diloco.swarm.discovery import link as swarm_link
from p2p_diloco.swarm.discovery.link import SwarmLink
from p2p_diloco.swarm.discovery.pace import WATCH_CEILING_S, WATCH_FLOOR_S, WATCH_ROUND_SHARE, Pace, watch_interval
from p2p_diloco.swarm.discovery.progress import ProgressRecord

SYBILS = [f"sybil{i}" for i in range(5)]


def record(node: str, round_index: int, applied_round: int = -1) -> ProgressRecord:
    return ProgressRecord(peer=node, stage=0, num_stages=1, round=round_index, inner_step=10 * round_index,
                          tokens_per_s=1.0, loss=1.0, time=0.0, node=node, applied_round=applied_round)


def link(joined: bool = True, num_rounds: int | None = None, met: frozenset = frozenset(),
         allowlist: frozenset = frozenset()) -> SwarmLink:
    swarm = SwarmLink.__new__(SwarmLink)  # no DHT: the read is replaced below
    swarm.dht, swarm.run_id, swarm.node, swarm.stage_index, swarm.num_stages = None, "run", "me", 0, 1
    swarm.records_run, swarm.peer_name, swarm.inner_steps = "run", "me", 10
    swarm.num_rounds = num_rounds
    swarm.joined_swarm, swarm.ttl_s, swarm._others_seen_at = joined, 120.0, float("-inf")
    swarm.fresh_read_s, swarm._last_read = 1.0, None  # no watch has read the records: each read is a new one
    swarm.peers_met, swarm.allowlist, swarm.stranger_wait_s, swarm._matching_since = lambda: met, allowlist, 8.0, {}
    swarm.watch_every_s, swarm._watch, swarm._watch_at, swarm._watched = 0.5, None, float("-inf"), []
    swarm._pace, swarm.watch_reads, swarm.record_reads = Pace(), 0, 0
    swarm.publish_every_s, swarm._last_publish, swarm.fingerprint = 10.0, float("-inf"), None
    swarm.anchor_fingerprint = swarm.prior_anchor_fingerprint = ""
    swarm.facts = dict
    return swarm


def watched(swarm: SwarmLink, records: list[ProgressRecord], monkeypatch) -> SwarmLink:
    """Let the round-end watch of ``swarm`` read ``records`` (its DHT answer replaced by them)."""
    def answer(dht, run_id) -> Future:
        future = Future()
        future.set_result(records)
        return future

    monkeypatch.setattr(swarm_link, "request_progress", answer)
    monkeypatch.setattr(swarm_link, "parse_progress", lambda found: found)
    swarm.others_ended_round(0)  # starts the watch's read, answered at once
    return swarm


def test_an_empty_read_soon_after_seeing_others_is_unknown_not_alone(monkeypatch):
    reads = [[record("other", 3)], [], []]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: reads.pop(0))
    swarm = link()
    assert swarm.expected_group_size(3) == 2
    assert swarm.expected_group_size(4) is None  # a failed read: try the network, bounded by matchmaking
    swarm._others_seen_at -= swarm.ttl_s  # past the records' lifetime: the others have really left
    assert swarm.expected_group_size(4) == 1


def test_a_peer_that_never_saw_another_is_alone_after_its_first_round(monkeypatch):
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: [])
    assert link().expected_group_size(0) is None  # the first round of a joiner: records may not be in yet
    assert link().expected_group_size(2) == 1
    assert link(joined=False).expected_group_size(0) == 1


def test_a_groupmate_whose_records_run_far_ahead_is_still_expected(monkeypatch):
    """A peer met in this stage's recent groups whose records claim a round far ahead (false-state:1000 in
    benchmarks/byzantine.py) still joins the groups: counted, or the group forms one peer short every round; a
    record far ahead of a peer never met (a Sybil's) is not."""
    records = [record("honest", 3), record("liar", 1003), record("sybil", 1003), record("behind", 1)]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: records)
    assert link().expected_group_size(3) == 2
    assert link(met=frozenset({"honest", "liar", "behind"})).expected_group_size(3) == 3


def test_groupmates_that_finished_the_run_are_not_expected(monkeypatch):
    """Peers met in recent groups that have applied the run's last round (24 rounds here) never average again:
    a peer rounds behind them is alone, not waiting out each round's timeouts for them. One on the last round
    that has not applied it yet (delayed mode, its last average in flight) is still expected."""
    done = [record("a", 24, applied_round=23), record("b", 24, applied_round=23)]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: done)
    met = frozenset({"a", "b"})
    assert link(num_rounds=24, met=met).expected_group_size(15) == 1
    swarm = link(num_rounds=24, met=met)
    swarm._others_seen_at = swarm_link.time.monotonic()  # others seen a moment ago: an empty read would be "unknown",
    assert swarm.expected_group_size(16) == 1  # but records that say they finished are an answer
    assert link(met=met).expected_group_size(15) == 3  # the run's end unknown: counted, as before
    flushing = [record("a", 24, applied_round=22), record("b", 24, applied_round=23)]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: flushing)
    assert link(num_rounds=24, met=met).expected_group_size(23) == 2


def test_a_never_met_identitys_record_never_ends_a_round(monkeypatch):
    """``diloco.round_end = swarm``: a record naming round r + 1 ends round r at once. One of an identity this stage
    never averaged with does not (one such record ended every round of a peer after one inner step); a groupmate's
    does, an allowlisted member's does, and before its first group a stage follows every record."""
    ahead = [record("sybil", 4)]
    assert not watched(link(met=frozenset({"a"})), ahead, monkeypatch).others_ended_round(3)
    assert not watched(link(allowlist=frozenset({"a"})), ahead, monkeypatch).others_ended_round(3)
    assert watched(link(), ahead, monkeypatch).others_ended_round(3)  # met nobody yet: timing from every record
    # ... but not before half of the round: a stranger's record ended a fresh swarm's first rounds after one step
    assert not watched(link(), ahead, monkeypatch).others_ended_round(3, trained_fraction=0.1)
    assert watched(link(), ahead, monkeypatch).others_ended_round(3, trained_fraction=0.5)
    assert watched(link(met=frozenset({"a"})), [record("a", 4)], monkeypatch).others_ended_round(
        3, trained_fraction=0.1)  # a groupmate's record ends a round at any step
    ahead.append(record("a", 4))
    assert watched(link(met=frozenset({"a"})), ahead, monkeypatch).others_ended_round(3)
    assert watched(link(allowlist=frozenset({"a"})), ahead, monkeypatch).others_ended_round(3)


def test_strangers_never_outnumber_the_believed_peers_in_the_group_size(monkeypatch):
    """Five records of never-met identities on this stage's round: a stage that has met two peers waits for a
    group of at most five (the three believed ones a majority of it), not eight; one alone still waits for one
    (a newcomer announces the round it reloads into). In a private swarm outsiders count for nothing; a stage that
    has met nobody yet counts every record (its first group)."""
    records = [record("a", 3), record("b", 3)] + [record(node, 3) for node in SYBILS]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: records)
    assert link(met=frozenset({"a", "b"})).expected_group_size(3) == 5
    assert link(met=frozenset({"a"})).expected_group_size(3) == 3
    assert link(allowlist=frozenset({"a", "b"})).expected_group_size(3) == 3
    assert link().expected_group_size(3) == 8
    records[:2] = []  # the peers met have left: one stranger is waited for, bounded by the matchmaking time
    assert link(met=frozenset({"a", "b"})).expected_group_size(3) == 2
    assert link(met=frozenset({"a", "b"}), allowlist=frozenset({"a", "b"})).expected_group_size(3) == 1


def test_a_strangers_finished_record_does_not_make_a_stage_alone(monkeypatch):
    """Records that say their peers finished the run make a stage alone only when they are believed peers'."""
    done = [record(node, 24, applied_round=23) for node in SYBILS]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: done + [record("a", 15)])
    assert link(num_rounds=24, met=frozenset({"a"})).expected_group_size(15) == 2
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: done + [record("a", 24, applied_round=23)])
    assert link(num_rounds=24, met=frozenset({"a"})).expected_group_size(15) == 1


def test_only_strangers_keep_a_round_waiting_for_its_group_for_a_bounded_time(monkeypatch):
    """The hopeless check of a round's averaging: a believed peer that could still join keeps the round waiting
    (its own bounds); strangers that say they could keep it waiting ``stranger_wait_s`` after the stage began
    looking for its group, no longer (a lone peer next to a few never-met records waited out its whole round
    timeout every round); strangers that say they moved past end the wait only where no believed peer could join."""
    sybils = [record(node, 3) for node in SYBILS]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: sybils)
    swarm = link(met=frozenset({"a"}))
    assert swarm.expected_group_size(3) == 2  # looking for its group from now on, one stranger waited for
    assert not swarm.moved_past(3)
    swarm._matching_since[3] -= swarm.stranger_wait_s
    assert swarm.moved_past(3)
    assert not link().moved_past(3)  # met nobody yet: every record is believed, and waited for
    ahead = [record(node, 5, applied_round=4) for node in SYBILS]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: ahead + [record("a", 3)])
    assert not link(met=frozenset({"a"})).moved_past(3)
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: ahead + [record("a", 4, applied_round=3)])
    assert link(met=frozenset({"a"})).moved_past(3)


def test_a_lone_peer_ends_its_rounds_search_after_one_window_unless_others_were_seen_lately(monkeypatch):
    """Nobody else of the stage visible: the round's search is hopeless once it has looked for ``stranger_wait_s``
    (a matchmaking window and a request), not after its whole round timeout (a lone peer of peers/peer.toml waited
    180 s for its first round); an empty read within a record's lifetime of seeing others is a failed read, and
    the round keeps waiting."""
    reads = [[]]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: list(reads[-1]))
    alone = link()
    assert alone.expected_group_size(0) is None  # a peer that joined a swarm: its first round tries the network
    assert not alone.moved_past(0)  # within the window
    alone._matching_since[0] -= alone.stranger_wait_s
    assert alone.moved_past(0)
    reads.append([record("other", 1)])
    seen = link()
    assert seen.expected_group_size(1) == 2
    reads.append([])  # the others' records vanish from one read
    seen._matching_since[1] -= seen.stranger_wait_s
    assert not seen.moved_past(1)
    seen._others_seen_at -= seen.ttl_s
    assert seen.moved_past(1)


def test_a_groupmate_that_ended_the_next_round_and_still_collects_this_one_keeps_it_alive(monkeypatch):
    """Eager and delayed modes: a peer that ended round r + 1 announces r + 2 before it collects round r's average
    (its record then names r + 2 with r not applied). Until it applies r it is still in r's group: the slower peer
    waiting for r must not call the round hopeless (it did, while the others were in r's all-reduce with it, and
    the whole group fell back on r). Once it applied r, or if it names a round further ahead, it has moved past."""
    def moved_past(*records):
        monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: list(records))
        return link(met=frozenset({"a", "b"})).moved_past(3)

    assert not moved_past(record("a", 5, applied_round=2), record("b", 5, applied_round=2))
    assert not moved_past(record("a", 5, applied_round=3), record("b", 5, applied_round=2))
    assert moved_past(record("a", 5, applied_round=3), record("b", 5, applied_round=3))
    assert moved_past(record("a", 4, applied_round=3), record("b", 5, applied_round=4))
    # a stranger's such record keeps the round waiting for the strangers' bound only, as every stranger's does
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: [record(n, 5, applied_round=2)
                                                                            for n in SYBILS])
    stranger_view = link(met=frozenset({"a"}))
    assert not stranger_view.moved_past(3)
    stranger_view._matching_since[3] -= stranger_view.stranger_wait_s
    assert stranger_view.moved_past(3)


def test_a_peer_waiting_for_others_is_told_how_many_are_here_as_it_changes_and_every_while(monkeypatch):
    """``train.wait_for_peers``: the wait shows progress (a first peer may wait half an hour, silent before)."""
    monkeypatch.setattr(SwarmLink, "publish", lambda self, *args, **kwargs: None)

    def told_while_waiting(every_s: float) -> list[tuple[int, int]]:
        reads = [[], [], [record("a", 0)], [record("a", 0)], [record("a", 0), record("b", 0)]]
        monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: reads.pop(0))
        told = []
        assert link().wait_for_peers(Position(0, 0, -1), 3, timeout_s=30, poll_s=0.001, progress_every_s=every_s,
                                     progress=lambda here, left: told.append((here, round(left)))) == 3
        return told

    assert told_while_waiting(every_s=1000) == [(2, 30)]  # when the count changes
    assert told_while_waiting(every_s=0) == [(1, 30), (1, 30), (2, 30), (2, 30)]  # and every while meanwhile


def test_waiting_for_peers_in_a_private_swarm_counts_its_members_only(monkeypatch):
    """``train.wait_for_peers``: outsiders' records of a private swarm do not end the wait before its members came."""
    records = [record(node, 0) for node in SYBILS]
    monkeypatch.setattr(swarm_link, "fetch_progress", lambda dht, run_id: records)
    here = Position(0, 0, -1)
    assert link(allowlist=frozenset({"a"})).wait_for_peers(here, 2, timeout_s=0.1, poll_s=0.05) == 1
    assert link().wait_for_peers(here, 2, timeout_s=0.1, poll_s=0.05) == 6


def paced(node: str, round_index: int, step: int, at: float) -> ProgressRecord:
    return ProgressRecord(peer=node, stage=0, num_stages=1, round=round_index, inner_step=step, tokens_per_s=1.0,
                          loss=1.0, time=at, node=node)


def test_the_soonest_round_end_follows_each_writers_pace():
    pace = Pace()
    first = [paced("a", 2, 20, at=100.0), paced("b", 1, 15, at=100.0)]  # H = 10: a is on round 2, b behind
    pace.update(first)
    assert pace.seconds_to_end(first, 2, 10, now=101.0) is None  # one record each: no pace known yet
    later = [paced("a", 2, 24, at=110.0), paced("b", 2, 25, at=105.0)]  # a: 0.4 steps/s, b: 2 steps/s
    pace.update(later)
    # a needs 6 more steps (15 s after its record), b 5 (2.5 s after its record, written 5 s before now)
    assert pace.seconds_to_end(later, 2, 10, now=110.0) == -2.5
    assert pace.seconds_to_end([later[0]], 2, 10, now=110.0) == 15.0
    assert pace.seconds_to_end([paced("a", 3, 30, at=112.0)], 2, 10, now=112.0) == float("inf")  # ended already
    pace.update([paced("a", 2, 3, at=120.0)])  # its step count went back (a restart): pace unknown again
    assert pace.seconds_to_end([paced("a", 2, 3, at=120.0)], 2, 10, now=120.0) is None
    pace.update([])  # a writer no longer read is forgotten
    assert pace.seconds_to_end([paced("a", 2, 3, at=121.0)], 2, 10, now=121.0) is None


def test_the_watch_reads_seldom_only_while_no_believed_peer_can_end_the_round_soon():
    assert watch_interval(None) == WATCH_FLOOR_S  # a pace unknown: read as often as ever
    assert watch_interval(-1.0) == watch_interval(0.2) == WATCH_FLOOR_S
    assert watch_interval(4.0) == 2.0
    assert watch_interval(600.0) == watch_interval(float("inf")) == WATCH_CEILING_S < 5.0  # under matchmaking time
    # never more than a share of a round: short rounds are watched at the floor, long ones up to the ceiling
    assert watch_interval(600.0, round_s=5.0) == watch_interval(float("inf"), round_s=5.0) == WATCH_FLOOR_S
    assert watch_interval(600.0, round_s=40.0) == 40.0 * WATCH_ROUND_SHARE
    assert watch_interval(600.0, round_s=600.0) == WATCH_CEILING_S
    assert watch_interval(0.2, round_s=600.0) == WATCH_FLOOR_S and watch_interval(None, round_s=600.0) == WATCH_FLOOR_S


def test_a_round_lasts_what_the_fastest_known_pace_says():
    pace = Pace()
    pace.update([paced("a", 0, 0, at=100.0), paced("b", 0, 0, at=100.0), paced("c", 0, 0, at=100.0)])
    assert pace.round_s([paced("a", 0, 0, at=100.0)], 10) is None  # no pace known yet
    pace.update([paced("a", 0, 4, at=110.0), paced("b", 0, 20, at=110.0), paced("c", 0, 0, at=100.0)])
    assert pace.round_s([paced("a", 0, 4, at=110.0)], 10) == 25.0  # 0.4 steps/s
    assert pace.round_s([paced("a", 0, 4, at=110.0), paced("b", 0, 20, at=110.0)], 10) == 5.0  # b's 2 steps/s


def test_a_link_watches_at_the_pace_of_the_records_it_read(monkeypatch):
    from hivemind.utils import get_dht_time

    now = get_dht_time()
    swarm = link(met=frozenset({"a"}))
    for records in ([paced("a", 0, 1, now - 20.0)], [paced("a", 0, 2, now - 10.0)]):  # 0.1 steps/s, 8 to go
        swarm._watch_at = float("-inf")
        watched(swarm, records, monkeypatch)
        swarm.others_ended_round(0)  # takes the answer
    assert swarm.watch_every_s == WATCH_CEILING_S and swarm.watch_reads == 2
    swarm._watch_at = float("-inf")
    watched(swarm, [paced("a", 0, 9, now)], monkeypatch)  # 0.7 steps/s now, 1 step to go: an end is near
    swarm.others_ended_round(0)
    assert abs(swarm.watch_every_s - (1 / 0.7) / 2) < 0.05  # half the 1.4 s it needs at most
    # a stranger's records (not met) never slow the watch: they are not believed, and nobody believed is in view
    stranger = link(met=frozenset({"a"}))
    for records in ([paced("s", 0, 1, now - 20.0)], [paced("s", 0, 2, now - 10.0)]):
        stranger._watch_at = float("-inf")
        watched(stranger, records, monkeypatch)
        stranger.others_ended_round(0)
    assert stranger.watch_every_s == WATCH_FLOOR_S


@pytest.mark.parametrize("steps, seconds", [(10**18, 1e-6), (1, 1e9), (10**9, 1.0), (1, 1e-300)])
def test_a_believed_writers_claimed_pace_moves_the_watch_only_within_its_bounds(steps, seconds):
    """A believed peer's records claim any pace (a step count and times of its choice): the watch's next read stays
    between the floor (the reads of the watch before pace.py) and the ceiling (under matchmaking time), so a claim
    of a slow pace delays the notice of its round end by the ceiling at most, a fast one reads at the floor."""
    pace = Pace()
    first, later = paced("h", 0, 0, at=100.0), paced("h", 0, steps, at=100.0 + seconds)
    pace.update([first])
    pace.update([later])
    for round_index in (0, 10**6):
        interval = watch_interval(pace.seconds_to_end([later], round_index, 10, now=100.0 + seconds),
                                  pace.round_s([later], 10))
        assert WATCH_FLOOR_S <= interval <= WATCH_CEILING_S, (steps, seconds, round_index, interval)


def test_a_minority_of_believed_peers_cannot_end_a_round():
    """Issue 49: identities that averaged honestly with a peer (believed) and then name the next round in their
    records ended its rounds after a step or two. A round now ends when at least half of the believed peers on it or
    the next have ended it: 2 colluders among 7 groupmates do not end it, 4 of 7 do, and one peer of unequal speed
    still follows the others (1 of 1, 1 of 2, 2 of 3)."""
    colluders = [record(f"c{i}", 4) for i in range(2)]
    training = [record(f"h{i}", 3) for i in range(5)]
    assert not swarm_link.ended_by_half(colluders + training, 3)
    assert swarm_link.ended_by_half(colluders + [record(f"h{i}", 4) for i in range(2)] + training[:3], 3)
    assert swarm_link.ended_by_half([record("a", 4)], 3)
    assert swarm_link.ended_by_half([record("a", 4), record("b", 3)], 3)
    assert swarm_link.ended_by_half([record("a", 4), record("b", 4), record("c", 3)], 3)
    assert not swarm_link.ended_by_half([record("a", 3)], 3)
    # records read just as a round begins (the others' not yet refreshed: still on the previous round) count as
    # peers on it: the colluders alone do not end it
    assert not swarm_link.ended_by_half(colluders + [record(f"h{i}", 2) for i in range(5)], 3)
    # a peer further ahead (this one will be reloaded) or further behind is not counted either way
    assert not swarm_link.ended_by_half([record("a", 6), record("b", 1)], 3)
