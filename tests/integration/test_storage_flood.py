"""Strangers flood nodes with entries, with real hivemind DHTs on 127.0.0.1: the node's memory for others' entries
stays within ``dht.storage_limit_mb``, by class of key, and the run's records and averagers' declarations still land
on it after a flood of other keys; declarations naming made-up averagers land nowhere; and a flood of declarations
from a dozen identities, which fills the averagers' share of every node of a swarm and is kept there, still leaves
two honest averagers to form their group (``swarm/discovery/storage_budget.py``)."""

from __future__ import annotations

import asyncio
import os
from functools import partial

import hivemind
import pytest
import torch
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2P
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from p2p_diloco.config import AveragingConfig, DHTConfig
from p2p_diloco.hivemind_adapter.dht import STORE_HANDLER
from p2p_diloco.swarm import PseudoGradientAverager, fetch_progress, publish_progress, start_dht, visible_maddrs
from p2p_diloco.swarm.averaging.averager import group_prefix, round_bits
from p2p_diloco.swarm.discovery.progress import ProgressRecord, progress_key
from p2p_diloco.swarm.discovery.records import swarm_validators
from p2p_diloco.swarm.discovery.storage_budget import (
    SENDER_SHARE,
    SHARES,
    entry_cost,
    storage_totals,
)

pytestmark = pytest.mark.timeout(180)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN = "flood"
LIMIT_MB = 0.5  # the victim's limit: the flood below sends four times as much
JUNK_BYTES = 1_500  # the flood's values under other keys (at most 16 KiB each)
GROUP_KEY = f"{group_prefix(RUN, 0, 1)}.0b{round_bits(3)}"


async def _flood(_dht, node, victim, count: int, in_cache: bool, kind: str):
    """Runs in the flooder's DHT process: ``count`` entries sent straight to ``victim`` in requests of 50, far
    ahead of expiry; returns how many it took."""
    expires, taken = get_dht_time() + 500, 0
    for start in range(0, count, 50):
        n = min(50, count - start)
        if kind == "other":  # fresh keys
            keys = [DHTID.generate(source=f"junk-{in_cache}-{start + i}") for i in range(n)]
            values, subkeys = [os.urandom(JUNK_BYTES) for _ in range(n)], None
        else:  # declarations of made-up averagers under one of the run's group keys
            keys = [DHTID.generate(source=GROUP_KEY)] * n
            subkeys = [b"\x12\x20" + os.urandom(32) for _ in range(n)]
            values = [node.protocol.serializer.dumps(True)] * n
        answer = await node.protocol.call_store(victim, keys, values, expires, subkeys=subkeys, in_cache=in_cache)
        taken += sum(answer or [])
    return taken


async def _held(_dht, node) -> dict:
    """What the node's two stores hold, in the ledger's bytes, counted from the stores themselves."""
    def total(store) -> int:
        return sum(sum(entry_cost(sub.value, subkey) for subkey, sub in item.value.items())
                   if isinstance(item.value, DictionaryDHTValue) else entry_cost(item.value)
                   for _, item in store.items())
    return {"storage": total(node.protocol.storage), "cache": total(node.protocol.cache)}


async def _holds_subkey(_dht, node, key: str, subkey) -> bool:
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return found is not None and isinstance(found.value, DictionaryDHTValue) and subkey in found.value.data


@pytest.fixture
def swarm():
    """The victim (a node as ``p2p-diloco bootstrap`` starts it, with a small limit), an honest peer's node, and a
    flooder's node that checks nothing."""
    nodes = [start_dht(DHTConfig(host_maddrs=LOOPBACK, storage_limit_mb=LIMIT_MB),
                       record_validators=swarm_validators(RUN))]
    flooder = None
    try:
        initial = visible_maddrs(nodes[0])
        nodes.append(start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=initial),
                               record_validators=swarm_validators(RUN)))
        flooder = hivemind.DHT(start=True, initial_peers=initial, host_maddrs=LOOPBACK)
        yield nodes[0], nodes[1], flooder
    finally:
        for node in nodes + ([flooder] if flooder is not None else []):
            node.shutdown()


def test_a_flood_stays_within_the_limit_and_the_runs_entries_still_land(swarm):
    victim, honest, flooder = swarm
    limit = LIMIT_MB * 2**20
    flood = partial(_flood, victim=victim.peer_id)
    # four times the limit in other keys, to the storage and to the cache; then declarations to a group key
    for in_cache in (False, True):
        taken = flooder.run_coroutine(partial(flood, count=4 * int(limit) // JUNK_BYTES, in_cache=in_cache,
                                              kind="other"))
        assert 0 < taken < 4 * int(limit) // JUNK_BYTES // 4
    totals = storage_totals(victim)
    for store in ("storage", "cache"):  # one sender: an eighth of the class at most
        assert 0 < totals[store]["held"]["other"] <= totals[store]["limit_bytes"] * SHARES["other"] * SENDER_SHARE
        assert totals[store]["refused"]["other"] > 0
    assert totals["storage"]["limit_bytes"] + totals["cache"]["limit_bytes"] == limit
    # a flood of other keys leaves the run's classes their room: an honest declaration and a signed record land
    declaration = honest.peer_id.to_bytes()
    assert honest.store(GROUP_KEY, subkey=declaration, value=True, expiration_time=get_dht_time() + 30)
    assert victim.run_coroutine(partial(_holds_subkey, key=GROUP_KEY, subkey=declaration))
    record = ProgressRecord(peer="honest", stage=0, num_stages=1, round=4, inner_step=80, tokens_per_s=10.0, loss=2.0,
                            time=get_dht_time())
    publish_progress(honest, RUN, record, ttl_s=60)
    assert _eventually(lambda: victim.run_coroutine(partial(_holds_progress, key=progress_key(RUN))))
    assert [r.round for r in fetch_progress(victim, RUN)] == [4]
    # declarations of made-up averagers (each naming a peer id other than its sender's) land nowhere
    count = int(limit * SHARES["averagers"]) // entry_cost(b"\xc3", b"\x12\x20" + bytes(32)) * 2
    assert flooder.run_coroutine(partial(flood, count=count, in_cache=False, kind="averagers")) == 0
    totals = storage_totals(victim)
    assert totals["storage"]["refused"]["averagers"] == count and totals["storage"]["held"]["records"] > 0
    # what the stores hold, counted from them, is within the limit (the ledger never undercounts)
    held = victim.run_coroutine(_held)
    assert held["storage"] <= sum(totals["storage"]["held"].values()) <= limit
    assert held["cache"] <= sum(totals["cache"]["held"].values())


async def _holds_progress(_dht, node, key: str) -> bool:
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return found is not None and isinstance(found.value, DictionaryDHTValue) and len(found.value.data) == 1


def _eventually(predicate, timeout_s: float = 20.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.3)
    return value


SMALL_MB = 0.25  # every node's limit below: its averagers' share of the storage holds 168 declarations
NUM_FLOODERS = 12  # each may hold an eighth of a class: together they fill it
CFG = AveragingConfig(matchmaking_time_s=3, request_timeout_s=1, round_timeout_s=12, allreduce_timeout_s=15,
                      next_chunk_timeout_s=5, compression="none")
TEMPLATES = [torch.zeros(40, 7), torch.zeros(13)]


async def _declare_from_identities(initial: list[str], nodes: list, num_identities: int, keys: list[str],
                                   expiration: float) -> int:
    """``num_identities`` strangers, each its own libp2p identity (a p2p daemon of this process), declare themselves
    (their own peer id, as an averager's subkey) under every key of ``keys`` on each of ``nodes``, straight, by
    hivemind's store request; returns how many entries the nodes took."""
    identities = await asyncio.gather(*[P2P.create(initial_peers=initial, host_maddrs=LOOPBACK)
                                        for _ in range(num_identities)])
    try:
        taken = 0
        for p2p in identities:
            request = dht_pb2.StoreRequest(
                keys=[DHTID.generate(source=key).to_bytes() for key in keys],
                subkeys=[DHTProtocol.serializer.dumps(p2p.peer_id.to_bytes())] * len(keys),
                values=[DHTProtocol.serializer.dumps(True)] * len(keys),
                expiration_time=[expiration] * len(keys), in_cache=[False] * len(keys))
            for node in nodes:
                answer = await asyncio.wait_for(
                    p2p.call_protobuf_handler(node, STORE_HANDLER, request, dht_pb2.StoreResponse), timeout=10)
                taken += sum(answer.store_ok)
        return taken
    finally:
        await asyncio.gather(*[p2p.shutdown() for p2p in identities])


@pytest.fixture
def small_swarm():
    """A bootstrap node and two peers' nodes, as ``p2p-diloco bootstrap`` and ``peer`` start them, with a small
    ``dht.storage_limit_mb`` each."""
    nodes = [start_dht(DHTConfig(host_maddrs=LOOPBACK, storage_limit_mb=SMALL_MB),
                       record_validators=swarm_validators(RUN))]
    try:
        initial = visible_maddrs(nodes[0])
        for _ in range(2):
            nodes.append(start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=initial, storage_limit_mb=SMALL_MB),
                                   record_validators=swarm_validators(RUN)))
        yield nodes
    finally:
        for node in nodes:
            node.shutdown()


def test_a_flood_of_declarations_from_a_dozen_identities_fills_every_node_and_a_group_still_forms(small_swarm):
    nodes = small_swarm
    share = SMALL_MB * 2**20 * 0.75 * SHARES["averagers"]
    per_entry = entry_cost(b"\xc3", bytes(38))  # a declaration under the longest peer id (ed25519: 38 bytes)
    # each identity declares itself under 30 rounds' group keys (not round 0's), far ahead of expiry, on every node
    keys = [f"{group_prefix(RUN, 0, 1)}.0b{round_bits(r)}" for r in range(1, 31)]
    addresses = [a for node in nodes for a in visible_maddrs(node)]
    taken = asyncio.run(_declare_from_identities(addresses, [node.peer_id for node in nodes], NUM_FLOODERS, keys,
                                                 get_dht_time() + 500))
    assert taken >= 3 * int(share // per_entry)  # each node's averagers' share is full:
    for node in nodes:
        totals = storage_totals(node)["storage"]
        assert totals["held"]["averagers"] > share - per_entry and totals["senders"]["averagers"] == NUM_FLOODERS
        assert totals["refused"]["averagers"] > 0
    # two honest averagers of the two peers' nodes look for their group under round 0's key, while the flood stays
    averagers = []
    try:
        for node in nodes[1:]:
            averagers.append(PseudoGradientAverager(TEMPLATES, node, run_id=RUN, stage_index=0, num_stages=1,
                                                    cfg=CFG))
        for k, averager in enumerate(averagers):
            averager.set_expected_group_size(len(averagers))
            averager.start_round([torch.full_like(t, float(k + 1)) for t in TEMPLATES], 0, weight=1.0)
        results = [averager.finish_round() for averager in averagers]
    finally:
        for averager in averagers:
            averager.shutdown()
    assert [(r.averaged, r.group_size) for r in results] == [(True, 2), (True, 2)], \
        [r.fallback_reason for r in results]
    assert all(torch.equal(t, torch.full_like(t, 1.5)) for r in results for t in r.average)
    # the honest declarations made room on every node: the oldest entries of the biggest flooders went
    for node in nodes:
        totals = storage_totals(node)["storage"]
        assert totals["evicted"]["averagers"] > 0 and totals["held"]["averagers"] <= share
