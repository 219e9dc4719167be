"""A stranger floods a node with entries, with real hivemind DHTs on 127.0.0.1: the node's memory for others'
entries stays within ``dht.storage_limit_mb``, by class of key, and the run's records and averagers' declarations
still land on it after a flood of other keys (``swarm/discovery/storage_budget.py``)."""

from __future__ import annotations

import os
from functools import partial

import hivemind
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import get_dht_time

from p2p_diloco.config import DHTConfig
from p2p_diloco.swarm import fetch_progress, publish_progress, start_dht, visible_maddrs
from p2p_diloco.swarm.averaging.averager import group_prefix, round_bits
from p2p_diloco.swarm.discovery.progress import ProgressRecord, progress_key
from p2p_diloco.swarm.discovery.records import swarm_validators
from p2p_diloco.swarm.discovery.storage_budget import SHARES, entry_cost, storage_totals

pytestmark = pytest.mark.timeout(180)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN = "flood"
LIMIT_MB = 0.5  # the victim's limit: the flood below sends four times as much
GROUP_KEY = f"{group_prefix(RUN, 0, 1)}.0b{round_bits(3)}"


async def _flood(_dht, node, victim, count: int, in_cache: bool, kind: str):
    """Runs in the flooder's DHT process: ``count`` entries sent straight to ``victim`` in requests of 50, far
    ahead of expiry; returns how many it took."""
    expires, taken = get_dht_time() + 500, 0
    for start in range(0, count, 50):
        n = min(50, count - start)
        if kind == "other":  # fresh keys, values near the 16 KiB a record may have
            keys = [DHTID.generate(source=f"junk-{in_cache}-{start + i}") for i in range(n)]
            values, subkeys = [os.urandom(15_000) for _ in range(n)], None
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
        taken = flooder.run_coroutine(partial(flood, count=4 * int(limit) // 15_000, in_cache=in_cache, kind="other"))
        assert 0 < taken < 4 * int(limit) // 15_000 // 4
    totals = storage_totals(victim)
    for store in ("storage", "cache"):
        assert 0 < totals[store]["held"]["other"] <= totals[store]["limit_bytes"] * SHARES["other"]
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
    # made-up averagers fill their own class only, and never past it
    count = int(limit * SHARES["averagers"]) // entry_cost(b"\xc3", b"\x12\x20" + bytes(32)) * 2
    taken = flooder.run_coroutine(partial(flood, count=count, in_cache=False, kind="averagers"))
    assert 0 < taken < count
    totals = storage_totals(victim)
    assert totals["storage"]["held"]["averagers"] <= totals["storage"]["limit_bytes"] * SHARES["averagers"]
    assert totals["storage"]["refused"]["averagers"] > 0 and totals["storage"]["held"]["records"] > 0
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
