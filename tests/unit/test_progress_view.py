"""SwarmLink's reading of the progress records (the DHT read replaced by a list: pure logic)."""

from __future__ import annotations

from p2p_diloco.swarm.discovery import progress
from p2p_diloco.swarm.discovery.progress import ProgressRecord, SwarmLink


def record(node: str, round_index: int, applied_round: int = -1) -> ProgressRecord:
    return ProgressRecord(peer=node, stage=0, num_stages=1, round=round_index, inner_step=10 * round_index,
                          tokens_per_s=1.0, loss=1.0, time=0.0, node=node, applied_round=applied_round)


def link(joined: bool = True, num_rounds: int | None = None) -> SwarmLink:
    swarm = SwarmLink.__new__(SwarmLink)  # no DHT: the read is replaced below
    swarm.dht, swarm.run_id, swarm.node, swarm.stage_index, swarm.num_stages = None, "run", "me", 0, 1
    swarm.records_run = "run"
    swarm.num_rounds = num_rounds
    swarm.joined_swarm, swarm.ttl_s, swarm._others_seen_at = joined, 120.0, float("-inf")
    swarm.fresh_read_s, swarm._last_read = 1.0, None  # no watch has read the records: each read is a new one
    return swarm


def test_an_empty_read_soon_after_seeing_others_is_unknown_not_alone(monkeypatch):
    reads = [[record("other", 3)], [], []]
    monkeypatch.setattr(progress, "fetch_progress", lambda dht, run_id: reads.pop(0))
    swarm = link()
    assert swarm.expected_group_size(3) == 2
    assert swarm.expected_group_size(4) is None  # a failed read: try the network, bounded by matchmaking
    swarm._others_seen_at -= swarm.ttl_s  # past the records' lifetime: the others have really left
    assert swarm.expected_group_size(4) == 1


def test_a_peer_that_never_saw_another_is_alone_after_its_first_round(monkeypatch):
    monkeypatch.setattr(progress, "fetch_progress", lambda dht, run_id: [])
    assert link().expected_group_size(0) is None  # the first round of a joiner: records may not be in yet
    assert link().expected_group_size(2) == 1
    assert link(joined=False).expected_group_size(0) == 1


def test_a_groupmate_whose_records_run_far_ahead_is_still_expected(monkeypatch):
    """A peer met in this stage's recent groups whose records claim a round far ahead (false-state:1000 in
    benchmarks/byzantine.py) still joins the groups: counted, or the group forms one peer short every round; a
    record far ahead of a peer never met (a Sybil's) is not."""
    records = [record("honest", 3), record("liar", 1003), record("sybil", 1003), record("behind", 1)]
    monkeypatch.setattr(progress, "fetch_progress", lambda dht, run_id: records)
    assert link().expected_group_size(3) == 2
    assert link().expected_group_size(3, met=frozenset({"honest", "liar", "behind"})) == 3


def test_groupmates_that_finished_the_run_are_not_expected(monkeypatch):
    """Peers met in recent groups that have applied the run's last round (24 rounds here) never average again:
    a peer rounds behind them is alone, not waiting out each round's timeouts for them. One on the last round
    that has not applied it yet (delayed mode, its last average in flight) is still expected."""
    done = [record("a", 24, applied_round=23), record("b", 24, applied_round=23)]
    monkeypatch.setattr(progress, "fetch_progress", lambda dht, run_id: done)
    met = frozenset({"a", "b"})
    assert link(num_rounds=24).expected_group_size(15, met=met) == 1
    swarm = link(num_rounds=24)
    swarm._others_seen_at = progress.time.monotonic()  # others seen a moment ago: an empty read would be "unknown",
    assert swarm.expected_group_size(16, met=met) == 1  # but records that say they finished are an answer
    assert link().expected_group_size(15, met=met) == 3  # the run's end unknown: counted, as before
    flushing = [record("a", 24, applied_round=22), record("b", 24, applied_round=23)]
    monkeypatch.setattr(progress, "fetch_progress", lambda dht, run_id: flushing)
    assert link(num_rounds=24).expected_group_size(23, met=met) == 2
