"""The unsigned DHT keys hivemind's averagers of a run write, held to the shape hivemind gives them.

The averagers of one stage (or fragment) share a prefix, ``<run_id>_s<j>of<P>`` or ``<run_id>_f<f>of<F>``
(:meth:`~p2p_diloco.unit.Unit.group_prefix`), and write two kinds of entries
that nobody signs (hivemind's design):

- matchmaking, under the round's group key ``<prefix>.0b<16 round bits>`` (``GroupKeyManager.declare_averager``):
  subkey the averager's peer id (its bytes), value True while it looks for a group and False when it stops, expiring
  one matchmaking time ahead;
- state sharing, under ``<prefix>.all_averagers``: subkey its peer id, value its priority (a number) or None,
  expiring ``declare_state_period`` ahead.

Anyone may add such an entry, and a fake declaration costs a group at most a join request's timeout. What
:class:`AveragerKeys` refuses, on every node that holds it (peers, their averagers, which share the peer's DHT node,
bootstrap nodes), is anything else under those keys: above all a plain value (no subkey), which replaces the
dictionary of declarations on a node until it expires, so that honest declarations fail there and readers get bytes
where hivemind expects a dictionary (no group formed under the key); also a subkey that is not a peer id, a value of
another type, an expiration more than :data:`MAX_DECLARATION_TTL_S` ahead. Other keys pass.

A DHT node sees keys only as hashes: the validator holds the hash of every group key of its prefixes (2^16 per
prefix: 1.3 MB and about 0.1 s each, once at the node's start). Called by
:func:`p2p_diloco.swarm.discovery.records.swarm_validators`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np

from p2p_diloco.hivemind_adapter.dht import DHTProtocol, DHTRecord, RecordValidatorBase
from p2p_diloco.unit import run_units

ROUND_BITS = 16
"""The group key's round bits (``p2p_diloco.swarm.averaging.averager.ROUND_BITS``; a unit test keeps them equal)."""
MAX_DECLARATION_TTL_S = 600.0
"""No node keeps an averager's declaration that expires further ahead than this (hivemind's declare one matchmaking
time, 5 s by default, or ``declare_state_period``, 10 s, ahead): one stored with a far-future expiration would
outlive its writer."""
_MAX_SUBKEY_BYTES = 66  # a peer id: a multihash of at most 64 bytes, serialized (msgpack adds 2)
_MAX_VALUE_BYTES = 9  # True, False, None or a number, serialized (a float64 takes 9)
_KEY_BYTES = 20  # a DHT key's hash (sha1)


def averager_prefixes(run_id: str, num_stages: int = 1, fragments: int = 0) -> list[str]:
    """The prefixes of a run's averagers: each of its ``fragments`` F (when F >= 1) or of its ``num_stages`` stages.
    A fragment's prefix is also the run id of its progress records (:meth:`~p2p_diloco.unit.Unit.records_run`)."""
    return [unit.group_prefix(run_id) for unit in run_units(num_stages, fragments)]


def key_id(key: str) -> bytes:
    """The DHT's hash of ``key`` (``hivemind.dht.routing.DHTID.generate(source=key).to_bytes()``)."""
    return hashlib.sha1(DHTProtocol.serializer.dumps(key)).digest()


def is_peer_id(raw) -> bool:
    """Whether ``raw`` is a libp2p peer id's bytes: a multihash, sha2-256 (0x12) or identity (0x00), of its length."""
    return isinstance(raw, bytes) and 3 <= len(raw) <= 64 and raw[0] in (0x00, 0x12) and raw[1] == len(raw) - 2


def _is_looking(value) -> bool:
    return type(value) is bool


def _is_priority(value) -> bool:
    return value is None or (type(value) in (int, float) and math.isfinite(value))


class AveragerKeys(RecordValidatorBase):
    """Refuses, under the averager keys of ``prefixes``, anything hivemind's averagers do not write themselves.

    Args:
        prefixes: the averagers' prefixes (:func:`averager_prefixes`).
    """

    def __init__(self, prefixes: Sequence[str]):
        self.prefixes = tuple(prefixes)
        ids = [key_id(f"{prefix}.0b{bits:0{ROUND_BITS}b}") for prefix in self.prefixes
               for bits in range(1 << ROUND_BITS)]
        rows = np.frombuffer(b"".join(ids), dtype=np.uint8).reshape(-1, _KEY_BYTES)
        heads = rows[:, :8].copy().view(">u8").ravel()  # the first 8 bytes, to search; the rows, to compare
        order = np.argsort(heads, kind="stable")
        self._heads, self._rows = heads[order], rows[order]
        self._state_keys = frozenset(key_id(f"{prefix}.all_averagers") for prefix in self.prefixes)

    def validate(self, record: DHTRecord) -> bool:
        if record.key in self._state_keys:
            return _is_declaration(record, _is_priority)
        if self.is_group_key(record.key):
            return _is_declaration(record, _is_looking)
        return True

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` (a DHT key's hash) is one of the keys this validator checks (a group key or a state key)."""
        return key in self._state_keys or self.is_group_key(key)

    def is_group_key(self, key: bytes) -> bool:
        """Whether ``key`` (a DHT key's hash) is one of the group keys of this validator's prefixes."""
        if len(key) != _KEY_BYTES:
            return False
        head = np.frombuffer(key[:8], dtype=">u8")[0]
        first = int(np.searchsorted(self._heads, head, side="left"))
        last = int(np.searchsorted(self._heads, head, side="right"))
        return any(self._rows[i].tobytes() == key for i in range(first, last))

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, AveragerKeys) and other.prefixes == self.prefixes


def _is_declaration(record: DHTRecord, value_ok: Callable[[object], bool]) -> bool:
    """Whether ``record`` is an entry as an averager declares it: a peer id's subkey, a short value that
    ``value_ok``, an expiration at most :data:`MAX_DECLARATION_TTL_S` ahead."""
    from p2p_diloco.hivemind_adapter.dht import get_dht_time

    if not record.expiration_time <= get_dht_time() + MAX_DECLARATION_TTL_S:  # NaN too
        return False
    if record.subkey in DHTProtocol.RESERVED_SUBKEYS or len(record.subkey) > _MAX_SUBKEY_BYTES \
            or len(record.value) > _MAX_VALUE_BYTES:
        return False  # a plain value, or bytes no averager writes (checked before they are decoded)
    try:
        subkey, value = DHTProtocol.serializer.loads(record.subkey), DHTProtocol.serializer.loads(record.value)
    except Exception:  # anything a writer sends may be malformed
        return False
    return is_peer_id(subkey) and value_ok(value)
