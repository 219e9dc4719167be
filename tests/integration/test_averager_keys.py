"""The averagers' unsigned DHT keys with real hivemind DHTs and averagers on 127.0.0.1: a squatter's plain value under a
round's group key (or under any key of the run's records) lands on no node that checks, and a group still forms."""

from __future__ import annotations

from functools import partial

import hivemind
import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from p2p_diloco.config import AveragingConfig, DHTConfig
from p2p_diloco.swarm import PseudoGradientAverager, start_dht, visible_maddrs
from p2p_diloco.swarm.averaging.averager import group_prefix, round_bits
from p2p_diloco.swarm.discovery.records import swarm_validators

pytestmark = pytest.mark.timeout(180)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN, FRAGMENT_RUN = "squat", "squat-fragments"
CFG = AveragingConfig(matchmaking_time_s=3, request_timeout_s=1, round_timeout_s=12, allreduce_timeout_s=15,
                      next_chunk_timeout_s=5, compression="none")
TEMPLATES = [torch.zeros(40, 7), torch.zeros(13)]


def validators() -> list:
    """A node of both runs: ``RUN`` averaged by stage (P = 1), ``FRAGMENT_RUN`` by 2 fragments."""
    return swarm_validators(RUN) + swarm_validators(FRAGMENT_RUN, fragments=2)


@pytest.fixture
def swarm():
    """A bootstrap node and two peers' nodes, started as ``p2p-diloco bootstrap`` and ``peer`` start theirs, and a
    squatter's node that checks nothing."""
    nodes = [start_dht(DHTConfig(host_maddrs=LOOPBACK), record_validators=validators())]
    squatter = None
    try:
        initial = visible_maddrs(nodes[0])
        for _ in range(2):
            nodes.append(start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=initial),
                                   record_validators=validators()))
        squatter = hivemind.DHT(start=True, initial_peers=initial, host_maddrs=LOOPBACK)
        yield nodes, squatter
    finally:
        for node in nodes + ([squatter] if squatter is not None else []):
            node.shutdown()


async def _local_value(_dht, node, key: str):
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return None if found is None else type(found.value).__name__


def held(node, key: str):
    """The type of what ``node`` keeps under ``key`` in its own storage (None: nothing)."""
    return node.run_coroutine(partial(_local_value, key=key))


def test_a_plain_value_under_the_round_key_lands_nowhere_and_a_group_still_forms(swarm):
    nodes, squatter = swarm
    group_key = f"{group_prefix(RUN, 0, 1)}.0b{round_bits(0)}"
    squatted = [group_key, f"{RUN}_progress", f"{RUN}_config", f"{FRAGMENT_RUN}_f1of2_progress",
                f"{FRAGMENT_RUN}_f0of2.0b{round_bits(7)}"]
    forever = get_dht_time() + 10**6
    for key in squatted:
        squatter.store(key, b"squatted", expiration_time=forever)
        assert held(squatter, key) == "bytes"  # the squatter keeps it and hands it to whoever asks
        assert [held(node, key) for node in nodes] == [None] * len(nodes), key
    # the shape hivemind's matchmaking writes, but expiring far ahead: refused too
    squatter.store(group_key, subkey=squatter.peer_id.to_bytes(), value=True, expiration_time=forever)
    assert [held(node, group_key) for node in nodes] == [None] * len(nodes)
    averagers = []
    try:
        for node in nodes[1:]:
            averagers.append(PseudoGradientAverager(TEMPLATES, node, run_id=RUN, stage_index=0, num_stages=1,
                                                    cfg=CFG))
        contributions = [[torch.full_like(t, float(k + 1)) for t in TEMPLATES] for k in range(len(averagers))]
        for averager, contribution in zip(averagers, contributions):
            averager.set_expected_group_size(len(averagers))
            averager.start_round(contribution, 0, weight=1.0)
        results = [averager.finish_round() for averager in averagers]
    finally:
        for averager in averagers:
            averager.shutdown()
    assert [(r.averaged, r.group_size) for r in results] == [(True, 2), (True, 2)], \
        [r.fallback_reason for r in results]
    assert all(torch.equal(t, torch.full_like(t, 1.5)) for r in results for t in r.average)
    # hivemind's own declarations went under the key: a dictionary on the nodes that check, never the plain value
    assert {held(node, group_key) for node in nodes} <= {None, "DictionaryDHTValue"}
