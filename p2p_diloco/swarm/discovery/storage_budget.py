"""A bound on the bytes a DHT node keeps for others, by class of key: no stranger grows a node's memory without end,
and no flood of other keys crowds out the run's records.

hivemind's DHT node keeps, until it expires, every entry its validators let through: in its storage (entries whose
key it is among the nearest nodes of) and in its cache (entries it found, or was asked to cache). ``RecordBounds``
caps each entry at 16 KiB and 600 s, but not their number: a stranger could store 4 MiB per request under fresh
keys or subkeys, request after request, on every node, bootstrap nodes included, and each node's memory grew at the
stranger's upload rate for as long as it sent. Now each of the two stores of a node has a :class:`Ledger`, and an
entry that would take its class of key over its share of ``dht.storage_limit_mb`` is refused (hivemind answers the
writer ``store_ok = False``; the writer's other replicas are unaffected). The storage has three quarters of the
limit and the cache one (:data:`CACHE_SHARE`); within each, the classes:

- ``records``: the run's signed records (progress and config, of the run and of its fragments: the keys of
  :class:`~p2p_diloco.swarm.discovery.records.IdentityBinding`). Each entry of a writer needs an RSA identity of
  its own, and honest peers write one each: half the limit.
- ``averagers``: the keys the run's averagers write unsigned (group keys and ``all_averagers``,
  :class:`~p2p_diloco.swarm.discovery.averager_keys.AveragerKeys`): a quarter.
- ``other``: any other key (another run's, or none): a quarter.

An entry costs its value's and subkey's bytes plus :data:`ENTRY_OVERHEAD` (the Python objects that hold it) and
leaves the ledger at its expiration time (at most 600 s ahead: ``RecordBounds``) or when its writer replaces it. An
entry hivemind drops early (a plain value replacing a dictionary) stays charged until it expires: the ledger
overcounts, never undercounts. A subkey must also be of a sort Python can order beside the subkeys its key's
dictionary holds (:meth:`BoundedStorage._fits_dictionary`). Installed by :func:`bound_storage` in the node's own
process; pure logic but for that.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue

ENTRY_OVERHEAD = 256
"""Bytes charged per entry beyond its value and subkey: the dictionary slot, the value-with-expiration tuple and the
heap entry hivemind keeps for it, and the ledger's own."""
SHARES = {"records": 0.5, "averagers": 0.25, "other": 0.25}
"""Each class's share of a store's limit."""
CACHE_SHARE = 0.25
"""The cache's part of ``dht.storage_limit_mb`` (the storage has the rest): a node caches what it looked up."""


def entry_cost(value, subkey=None) -> int:
    """Bytes an entry is charged: its value's and subkey's lengths (a dictionary value: the sum of its entries')
    plus :data:`ENTRY_OVERHEAD`."""
    if isinstance(value, DictionaryDHTValue):
        return sum(entry_cost(item.value, sub) for sub, item in value.data.items()) + ENTRY_OVERHEAD
    return _length(value) + (0 if subkey is None else _length(subkey)) + ENTRY_OVERHEAD


def _length(raw) -> int:
    return len(raw) if isinstance(raw, (bytes, bytearray, str)) else 16


@dataclass
class Ledger:
    """The bytes each class of key holds in one store, and when each entry leaves it.

    Args:
        limit_bytes: the store's limit, shared among the classes by :data:`SHARES`.
        classify: the class of a key (its DHT hash, 20 bytes).
        clock: the DHT's time (``hivemind.utils.get_dht_time``).
    """

    limit_bytes: float
    classify: Callable[[bytes], str]
    clock: Callable[[], float]
    held: dict = field(default_factory=lambda: dict.fromkeys(SHARES, 0))
    refused: dict = field(default_factory=lambda: dict.fromkeys(SHARES, 0))
    _entries: dict = field(default_factory=dict)  # (key, subkey) -> (cost, expiration, class)
    _heap: list = field(default_factory=list)  # (expiration, sequence, key, subkey); stale items are skipped
    _sequence: itertools.count = field(default_factory=itertools.count)

    def share(self, kind: str) -> float:
        return self.limit_bytes * SHARES[kind]

    def admits(self, kind: str, key, subkey, cost: int) -> bool:
        """Whether an entry of ``cost`` bytes under (``key``, ``subkey``; None for a plain value), of class ``kind``,
        fits that class's share, counting the one it would replace. A refusal is counted in :attr:`refused`."""
        self._expire()
        old = self._entries.get((key, subkey))
        if self.held[kind] - (old[0] if old else 0) + cost <= self.share(kind):
            return True
        self.refused[kind] += 1
        return False

    def add(self, kind: str, key, subkey, cost: int, expiration: float) -> None:
        """Charge an entry of class ``kind`` the store has taken (it replaces the one under the same key and
        subkey)."""
        old = self._entries.pop((key, subkey), None)
        if old is not None:
            self.held[old[2]] -= old[0]
        self._entries[(key, subkey)] = (cost, expiration, kind)
        self.held[kind] += cost
        heapq.heappush(self._heap, (expiration, next(self._sequence), key, subkey))

    def kind(self, key) -> str:
        """The class of ``key`` (a DHTID or its bytes); ``other`` where the classifier cannot read it."""
        try:
            return self.classify(key.to_bytes() if isinstance(key, DHTID) else key)
        except Exception:  # noqa: BLE001 (a key the classifier cannot read is nobody's record)
            return "other"

    def _expire(self) -> None:
        now = self.clock()
        while self._heap and self._heap[0][0] < now:
            expiration, _, key, subkey = heapq.heappop(self._heap)
            entry = self._entries.get((key, subkey))
            if entry is not None and entry[1] == expiration:
                del self._entries[(key, subkey)]
                self.held[entry[2]] -= entry[0]

    def totals(self) -> dict:
        """What each class holds and has been refused, and the limit (for tests and the node's metrics)."""
        self._expire()
        return {"held": dict(self.held), "refused": dict(self.refused), "limit_bytes": self.limit_bytes,
                "entries": len(self._entries)}


class BoundedStorage(DHTLocalStorage):
    """hivemind's store of a node, whose entries go through a :class:`Ledger` (set as ``ledger``) first.

    Only the two entry points others' entries come through are wrapped: ``store`` and ``store_subkey`` (hivemind's
    own calls between them go to ``TimedStorage``'s and are charged by the call that made them)."""

    ledger: Ledger

    def store(self, key, value, expiration_time, subkey=None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        return self._charged(key, None, entry_cost(value), expiration_time,
                             lambda: super(BoundedStorage, self).store(key, value, expiration_time))

    def store_subkey(self, key, subkey, value, expiration_time) -> bool:
        if not self._fits_dictionary(key, subkey):
            self.ledger.refused[self.ledger.kind(key)] += 1
            return False
        return self._charged(key, subkey, entry_cost(value, subkey), expiration_time,
                             lambda: super(BoundedStorage, self).store_subkey(key, subkey, value, expiration_time))

    def _charged(self, key, subkey, cost: int, expiration_time, store: Callable[[], bool]) -> bool:
        """``store()`` if the entry fits its class's share, and charge it if hivemind took it."""
        kind = self.ledger.kind(key)
        if not self.ledger.admits(kind, key, subkey, cost):
            return False
        stored = store()
        if stored:
            self.ledger.add(kind, key, subkey, cost, expiration_time)
        return stored

    def _fits_dictionary(self, key, subkey) -> bool:
        """Whether ``subkey`` can join the dictionary under ``key``: hivemind keeps a dictionary's subkeys in a heap
        ordered by (expiration, subkey), so two subkeys that Python cannot order (bytes and str, or None and None)
        raised ``TypeError`` in the middle of a store and left that heap broken. A subkey must be bytes, text or
        a number, of the same sort as those the dictionary holds."""
        sort = _sort_of(subkey)
        if sort is None:
            return False
        held = self.data.get(key)
        if held is not None and isinstance(held.value, DictionaryDHTValue) and held.value.data:
            return _sort_of(next(iter(held.value.data))) == sort
        return True


def _sort_of(subkey) -> Optional[str]:
    """The subkeys that order among themselves: ``bytes``, ``text``, ``number`` (None: none, e.g. None or a list)."""
    if isinstance(subkey, bytes):
        return "bytes"
    if isinstance(subkey, str):
        return "text"
    if isinstance(subkey, (int, float)):
        return "number"
    return None


def key_classifier(record_validator) -> Callable[[bytes], str]:
    """The class of a key (its 20-byte hash) for a node checking with ``record_validator`` (hivemind's composite of
    the node's validators): ``records`` under a key of one of its ``IdentityBinding`` s, ``averagers`` under a key of
    one of its ``AveragerKeys``, else ``other``. The validators are read at each call: a node's may grow later."""
    from p2p_diloco.swarm.discovery.averager_keys import AveragerKeys
    from p2p_diloco.swarm.discovery.records import IdentityBinding

    def classify(key: bytes) -> str:
        validators = getattr(record_validator, "_validators", [record_validator])
        if any(isinstance(v, IdentityBinding) and v.holds(key) for v in validators):
            return "records"
        if any(isinstance(v, AveragerKeys) and v.holds(key) for v in validators):
            return "averagers"
        return "other"

    return classify


def _bound(store: DHTLocalStorage, limit_bytes: float, classify, clock) -> Ledger:
    """Turns ``store`` into a :class:`BoundedStorage` in place, charging what it already holds."""
    ledger = Ledger(limit_bytes, classify, clock)
    for key, item in list(store.items()):
        kind = ledger.kind(key)
        if isinstance(item.value, DictionaryDHTValue):
            for subkey, sub in list(item.value.items()):
                ledger.add(kind, key, subkey, entry_cost(sub.value, subkey), sub.expiration_time)
        else:
            ledger.add(kind, key, None, entry_cost(item.value), item.expiration_time)
    store.__class__ = BoundedStorage
    store.ledger = ledger
    return ledger


async def _install(_dht, node, limit_bytes: float) -> None:
    from hivemind.utils import get_dht_time

    classify = key_classifier(node.protocol.record_validator)
    _bound(node.protocol.storage, limit_bytes * (1 - CACHE_SHARE), classify, get_dht_time)
    _bound(node.protocol.cache, limit_bytes * CACHE_SHARE, classify, get_dht_time)


def node_totals(node) -> tuple:
    """(bytes kept, entries refused) over the bounded stores of a DHT node (in its process); (None, None) unbounded."""
    stores = (node.protocol.storage, node.protocol.cache)
    if not all(isinstance(s, BoundedStorage) for s in stores):
        return None, None
    totals = [s.ledger.totals() for s in stores]
    return sum(sum(t["held"].values()) for t in totals), sum(sum(t["refused"].values()) for t in totals)


async def _totals(_dht, node) -> Optional[dict]:
    stores = {"storage": node.protocol.storage, "cache": node.protocol.cache}
    if not all(isinstance(s, BoundedStorage) for s in stores.values()):
        return None
    return {name: s.ledger.totals() for name, s in stores.items()}


def bound_storage(dht, limit_mb: float, timeout_s: float = 10.0) -> None:
    """Bound the storage and cache of ``dht`` (a running ``hivemind.DHT``) to ``limit_mb`` MiB together, from now
    on (see the module's docstring)."""
    from functools import partial

    dht.run_coroutine(partial(_install, limit_bytes=limit_mb * 2**20), return_future=True).result(timeout_s)


def storage_totals(dht, timeout_s: float = 10.0) -> Optional[dict]:
    """What the bounded stores of ``dht`` hold and have refused, by class (None: not bounded)."""
    return dht.run_coroutine(_totals, return_future=True).result(timeout_s)
