"""SwarmLink's reading of the progress records (the DHT read replaced by a list: pure logic)."""

from __future__ import annotations

from p2p_diloco.swarm.discovery import progress
from p2p_diloco.swarm.discovery.progress import ProgressRecord, SwarmLink


def record(node: str, round_index: int) -> ProgressRecord:
    return ProgressRecord(peer=node, stage=0, num_stages=1, round=round_index, inner_step=10 * round_index,
                          tokens_per_s=1.0, loss=1.0, time=0.0, node=node)


def link(joined: bool = True) -> SwarmLink:
    swarm = SwarmLink.__new__(SwarmLink)  # no DHT: the read is replaced below
    swarm.dht, swarm.run_id, swarm.node, swarm.stage_index, swarm.num_stages = None, "run", "me", 0, 1
    swarm.joined_swarm, swarm.ttl_s, swarm._others_seen_at = joined, 120.0, float("-inf")
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
