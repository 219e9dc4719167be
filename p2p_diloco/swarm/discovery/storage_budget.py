"""A bound on the bytes a DHT node keeps for others, by class of key and by sender: no stranger grows a node's
memory without end, no flood of other keys crowds out the run's records, and no few identities crowd out the others
within a class.

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

Within a class, each entry is charged to its sender: the peer id of the node whose store request brought it (the
libp2p connection authenticates it: hivemind's node sends its own stores to the nearest nodes itself), or this node
itself for what its own processes store and what it caches from its own lookups. A sender other than the node
itself holds at most :data:`SENDER_SHARE` of a class, so a flood from fewer identities leaves the class room. Once a
class is full, a sender still under its fair part (the class's share over the number of senders holding entries in
it, itself counted) still gets its entry in: the oldest entries of the sender that holds the most are dropped to
make room. So an honest peer's few declarations land however many entries a flood keeps fresh, unless the flood
comes from so many identities that the class's share over their number is below what that peer stores. And an
averager's declaration names its writer (its subkey is the averager's peer id, which is its DHT node's): a node
takes one from another node only under that node's own peer id, so nobody declares, or withdraws, for another.
(hivemind's node also hands the entries it holds to a node it meets that is nearer their keys: the declarations of
others among them are refused there; averagers declare again every few seconds.)

An entry costs its value's and subkey's bytes plus :data:`ENTRY_OVERHEAD` (the Python objects that hold it) and
leaves the ledger at its expiration time (at most 600 s ahead: ``RecordBounds``), when its writer replaces it or
when it is dropped for a fairer sender. An entry hivemind drops early (a dictionary replaced by a plain value)
stays charged until it expires: the ledger overcounts, never undercounts. A subkey must also be of a sort Python can
order beside the subkeys its key's dictionary holds (:meth:`BoundedStorage._fits_dictionary`). Installed by
:func:`bound_storage` in the node's own process: hivemind's store objects change class in place
(:func:`~p2p_diloco.hivemind_adapter.dht.swap_store_class`), and the node's handler of store requests is wrapped to
name their sender (:func:`~p2p_diloco.hivemind_adapter.dht.name_store_senders`), both patches of the hivemind
adapter, checked by ``tests/unit/test_hivemind_contract.py``; pure logic but for that.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from p2p_diloco.hivemind_adapter.dht import (
    DHTID,
    DHTLocalStorage,
    DictionaryDHTValue,
    get_dht_time,
    name_store_senders,
    swap_store_class,
    validators_of,
)

ENTRY_OVERHEAD = 256
"""Bytes charged per entry beyond its value and subkey: the dictionary slot, the value-with-expiration tuple and the
heap entry hivemind keeps for it, and the ledger's own."""
SHARES = {"records": 0.5, "averagers": 0.25, "other": 0.25}
"""Each class's share of a store's limit."""
CACHE_SHARE = 0.25
"""The cache's part of ``dht.storage_limit_mb`` (the storage has the rest): a node caches what it looked up."""
SENDER_SHARE = 1 / 8
"""The most of a class's share one sender holds (the node itself excepted): an honest peer stores a few entries per
key, and a flood from fewer than 8 identities leaves a class room without dropping anything."""

_SENDER: ContextVar[Optional[bytes]] = ContextVar("dht_store_sender", default=None)
"""The peer id (bytes) of the node whose store request this node is handling; None: this node's own store."""


def entry_cost(value, subkey=None) -> int:
    """Bytes an entry is charged: its value's and subkey's lengths (a dictionary value: the sum of its entries')
    plus :data:`ENTRY_OVERHEAD`."""
    if isinstance(value, DictionaryDHTValue):
        return sum(entry_cost(item.value, sub) for sub, item in value.data.items()) + ENTRY_OVERHEAD
    return _length(value) + (0 if subkey is None else _length(subkey)) + ENTRY_OVERHEAD


def _length(raw) -> int:
    return len(raw) if isinstance(raw, (bytes, bytearray, str)) else 16


class _Entry(NamedTuple):
    cost: int
    expiration: float
    kind: str
    sender: Optional[bytes]


@dataclass
class Senders:
    """Who holds what in one class of one store: each sender's bytes, its entries oldest first, and who holds the
    most (a heap of (-bytes, sequence, sender) whose stale items are skipped, rebuilt when it has grown twice the
    senders' number). A sender is a peer id's bytes, or None for the node itself."""

    bytes_of: dict = field(default_factory=dict)  # sender -> bytes held
    entries_of: dict = field(default_factory=dict)  # sender -> {(key, subkey): None}, oldest first
    _ranking: list = field(default_factory=list)
    _sequence: itertools.count = field(default_factory=itertools.count)

    def charge(self, sender, entry, cost: int) -> None:
        self.bytes_of[sender] = self.bytes_of.get(sender, 0) + cost
        self.entries_of.setdefault(sender, {})[entry] = None
        self._rank(sender)

    def release(self, sender, entry, cost: int) -> None:
        self.bytes_of[sender] -= cost
        del self.entries_of[sender][entry]
        if not self.entries_of[sender]:
            del self.bytes_of[sender], self.entries_of[sender]
        else:
            self._rank(sender)

    def biggest(self, besides) -> tuple:
        """(the sender other than ``besides`` that holds the most, its oldest entry), or (None, None)."""
        skipped, found = [], None
        while self._ranking:
            negative, _, sender = self._ranking[0]
            if self.bytes_of.get(sender) != -negative:
                heapq.heappop(self._ranking)  # stale
            elif sender == besides:
                skipped.append(heapq.heappop(self._ranking))
            else:
                found = sender
                break
        for item in skipped:
            heapq.heappush(self._ranking, item)
        return (None, None) if found is None else (found, next(iter(self.entries_of[found])))

    def _rank(self, sender) -> None:
        heapq.heappush(self._ranking, (-self.bytes_of[sender], next(self._sequence), sender))
        if len(self._ranking) > 2 * len(self.bytes_of) + 16:
            self._ranking = [(-held, next(self._sequence), who) for who, held in self.bytes_of.items()]
            heapq.heapify(self._ranking)


def _keep(key, subkey) -> None:
    """What a ledger without a store does with an entry it drops: nothing."""


@dataclass
class Ledger:
    """The bytes each class of key, and each sender within it, holds in one store, and when each entry leaves it.

    Args:
        limit_bytes: the store's limit, shared among the classes by :data:`SHARES`.
        classify: the class of a key (its DHT hash, 20 bytes).
        clock: the DHT's time (``hivemind.utils.get_dht_time``).
        evict: drops an entry (key, subkey) from the store, when the ledger makes room for a fairer sender.
    """

    limit_bytes: float
    classify: Callable[[bytes], str]
    clock: Callable[[], float]
    evict: Callable[[object, object], None] = _keep
    held: dict = field(default_factory=lambda: dict.fromkeys(SHARES, 0))
    refused: dict = field(default_factory=lambda: dict.fromkeys(SHARES, 0))
    evicted: dict = field(default_factory=lambda: dict.fromkeys(SHARES, 0))
    senders: dict = field(default_factory=lambda: {kind: Senders() for kind in SHARES})
    _entries: dict = field(default_factory=dict)  # (key, subkey) -> _Entry
    _heap: list = field(default_factory=list)  # (expiration, sequence, key, subkey); stale items are skipped
    _sequence: itertools.count = field(default_factory=itertools.count)

    def share(self, kind: str) -> float:
        return self.limit_bytes * SHARES[kind]

    def admits(self, kind: str, key, subkey, cost: int, sender: Optional[bytes] = None) -> bool:
        """Whether an entry of ``cost`` bytes under (``key``, ``subkey``; None for a plain value), of class ``kind``,
        from ``sender`` (None: this node) may be stored, counting the one it would replace: within the sender's
        :data:`SENDER_SHARE` of the class, and within the class's share, or, the class being full, within the
        sender's fair part of it (:meth:`add` then drops the biggest sender's oldest entries to make room). A
        refusal is counted in :attr:`refused`."""
        self._expire()
        old = self._entries.get((key, subkey))
        freed = old.cost if old else 0
        senders = self.senders[kind]
        mine = senders.bytes_of.get(sender, 0) - (freed if old and old.sender == sender else 0) + cost
        share = self.share(kind)
        if sender is None or mine <= share * SENDER_SHARE:
            if self.held[kind] - freed + cost <= share:
                return True
            if mine <= share / (len(senders.bytes_of) + (sender not in senders.bytes_of)):
                return True
        self.refused[kind] += 1
        return False

    def add(self, kind: str, key, subkey, cost: int, expiration: float, sender: Optional[bytes] = None) -> None:
        """Charge an entry of class ``kind`` from ``sender`` that the store has taken (it replaces the one under the
        same key and subkey), then drop the oldest entries of the biggest other sender until the class fits its
        share (after :meth:`admits`, they hold at least the excess)."""
        self.release(key, subkey)
        self._entries[(key, subkey)] = _Entry(cost, expiration, kind, sender)
        self.held[kind] += cost
        self.senders[kind].charge(sender, (key, subkey), cost)
        heapq.heappush(self._heap, (expiration, next(self._sequence), key, subkey))
        while self.held[kind] > self.share(kind):
            victim, entry = self.senders[kind].biggest(besides=sender)
            if victim is None:
                break
            self.release(*entry)
            self.evicted[kind] += 1
            self.evict(*entry)

    def release(self, key, subkey) -> None:
        """The entry under (``key``, ``subkey``) has left the store (if the ledger charges one)."""
        entry = self._entries.pop((key, subkey), None)
        if entry is not None:
            self.held[entry.kind] -= entry.cost
            self.senders[entry.kind].release(entry.sender, (key, subkey), entry.cost)

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
            if entry is not None and entry.expiration == expiration:
                self.release(key, subkey)

    def totals(self) -> dict:
        """What each class holds, has been refused and has had dropped for a fairer sender, how many senders hold
        entries in it, and the limit (for tests and the node's metrics)."""
        self._expire()
        return {"held": dict(self.held), "refused": dict(self.refused), "evicted": dict(self.evicted),
                "senders": {kind: len(s.bytes_of) for kind, s in self.senders.items()},
                "limit_bytes": self.limit_bytes, "entries": len(self._entries)}


class BoundedStorage(DHTLocalStorage):
    """hivemind's store of a node, whose entries go through a :class:`Ledger` (set as ``ledger``) first, charged to
    the sender of the store request being handled (:data:`_SENDER`).

    Only the two entry points others' entries come through are wrapped: ``store`` and ``store_subkey`` (hivemind's
    own calls between them go to ``TimedStorage``'s and are charged by the call that made them)."""

    ledger: Ledger

    def store(self, key, value, expiration_time, subkey=None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        return self._charged(key, None, entry_cost(value), expiration_time,
                             lambda: super(BoundedStorage, self).store(key, value, expiration_time))

    def store_subkey(self, key, subkey, value, expiration_time) -> bool:
        kind, sender = self.ledger.kind(key), _SENDER.get()
        if not self._fits_dictionary(key, subkey) or not _declares_itself(kind, subkey, sender):
            self.ledger.refused[kind] += 1
            return False
        previous = self.data.get(key)  # a plain value there is replaced by a new dictionary if the entry is taken
        plain = previous is not None and not isinstance(previous.value, DictionaryDHTValue)
        return self._charged(key, subkey, entry_cost(value, subkey), expiration_time,
                             lambda: super(BoundedStorage, self).store_subkey(key, subkey, value, expiration_time),
                             replaces=((key, None),) if plain else ())

    def _charged(self, key, subkey, cost: int, expiration_time, store: Callable[[], bool], replaces=()) -> bool:
        """``store()`` if the ledger admits the entry, and charge it to its sender if hivemind took it (releasing
        the entries ``replaces`` names, which hivemind then dropped)."""
        kind, sender = self.ledger.kind(key), _SENDER.get()
        if not self.ledger.admits(kind, key, subkey, cost, sender):
            return False
        stored = store()
        if stored:
            for entry in replaces:
                self.ledger.release(*entry)
            self.ledger.add(kind, key, subkey, cost, expiration_time, sender)
        return stored

    def _drop(self, key, subkey) -> None:
        """Drops the entry the ledger charged under (``key``, ``subkey``): a plain value (or a dictionary cached
        whole), or one subkey of a dictionary (the key with it, if it was the last). Nothing if it is gone."""
        held = self.data.get(key)
        if held is None:
            return
        if subkey is None:
            del self[key]
        elif isinstance(held.value, DictionaryDHTValue) and subkey in held.value.data:
            del held.value[subkey]
            if not held.value.data:
                del self[key]

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


def _declares_itself(kind: str, subkey, sender: Optional[bytes]) -> bool:
    """Whether an entry of class ``kind`` under ``subkey`` from ``sender`` names its writer as an averager's does: an
    averager's declaration's subkey is its peer id, its DHT node's, and the node sends it to the others itself. What
    this node stores itself passes (its own processes', and what it caches from its lookups)."""
    return kind != "averagers" or sender is None or subkey == sender


def key_classifier(record_validator) -> Callable[[bytes], str]:
    """The class of a key (its 20-byte hash) for a node checking with ``record_validator`` (hivemind's composite of
    the node's validators): ``records`` under a key of one of its ``IdentityBinding`` s, ``averagers`` under a key of
    one of its ``AveragerKeys``, else ``other``. The validators are read at each call: a node's may grow later."""
    from p2p_diloco.swarm.discovery.averager_keys import AveragerKeys
    from p2p_diloco.swarm.discovery.records import IdentityBinding

    def classify(key: bytes) -> str:
        validators = validators_of(record_validator)
        if any(isinstance(v, IdentityBinding) and v.holds(key) for v in validators):
            return "records"
        if any(isinstance(v, AveragerKeys) and v.holds(key) for v in validators):
            return "averagers"
        return "other"

    return classify


def _bound(store: DHTLocalStorage, limit_bytes: float, classify, clock) -> Ledger:
    """Turns ``store`` into a :class:`BoundedStorage` in place, charging what it already holds to the node itself."""
    ledger = Ledger(limit_bytes, classify, clock)
    for key, item in list(store.items()):
        kind = ledger.kind(key)
        if isinstance(item.value, DictionaryDHTValue):
            for subkey, sub in list(item.value.items()):
                ledger.add(kind, key, subkey, entry_cost(sub.value, subkey), sub.expiration_time)
        else:
            ledger.add(kind, key, None, entry_cost(item.value), item.expiration_time)
    swap_store_class(store, BoundedStorage)
    store.ledger = ledger
    ledger.evict = store._drop
    return ledger


async def _install(_dht, node, limit_bytes: float) -> None:
    classify = key_classifier(node.protocol.record_validator)
    _bound(node.protocol.storage, limit_bytes * (1 - CACHE_SHARE), classify, get_dht_time)
    _bound(node.protocol.cache, limit_bytes * CACHE_SHARE, classify, get_dht_time)
    name_store_senders(node.protocol.p2p, _SENDER)  # a store is charged to the sender of its request


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
