"""AveragerKeys, the validator of the averagers' unsigned DHT keys: it knows the keys hivemind's averagers of a run
write (a contract with the averager's naming and hivemind's hashing), accepts their declarations as hivemind writes
them and refuses everything else under those keys, whatever the bytes."""

from __future__ import annotations

import time

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p_diloco.swarm.averaging import averager
from p2p_diloco.swarm.discovery import averager_keys
from p2p_diloco.swarm.discovery.averager_keys import MAX_DECLARATION_TTL_S, AveragerKeys, averager_prefixes, key_id
from p2p_diloco.swarm.discovery.progress import records_run

PEER = PeerID.from_base58("QmXLCxMWnS2VaMWnbPmr5vxWWwmC3dnfCeuR5Xe5NZr7XQ")
dumps = DHTProtocol.serializer.dumps


@pytest.fixture(scope="module")
def keys() -> AveragerKeys:
    return AveragerKeys(averager_prefixes("run", num_stages=2))


def declaration(key: str, subkey=PEER.to_bytes(), value=True, ahead_s: float = 5.0) -> DHTRecord:
    """An entry under ``key`` as hivemind's DHT node hands it to a validator (``subkey=None``: a plain value)."""
    return DHTRecord(key_id(key), dumps(subkey), dumps(value), get_dht_time() + ahead_s)


def test_the_keys_are_the_averagers_and_hashed_as_hivemind_does():
    assert averager_prefixes("run", num_stages=3) == [averager.group_prefix("run", j, 3) for j in range(3)]
    assert averager_prefixes("run", fragments=4) == [f"run_f{f}of4" for f in range(4)]
    assert averager_prefixes("run", fragments=4) == [records_run("run", (f, 4)) for f in range(4)]
    assert averager_keys.ROUND_BITS == averager.ROUND_BITS
    key = f"{averager.group_prefix('run', 1, 2)}.0b{averager.round_bits(54321)}"
    assert key_id(key) == DHTID.generate(source=key).to_bytes()


def test_hivemind_declarations_pass_and_everything_else_under_the_keys_is_refused(keys):
    group_key = f"{averager.group_prefix('run', 1, 2)}.0b{averager.round_bits(54321)}"
    state_key = f"{averager.group_prefix('run', 0, 2)}.all_averagers"
    assert keys.validate(declaration(group_key))  # looking for a group
    assert keys.validate(declaration(group_key, value=False))  # leaving it
    assert keys.validate(declaration(state_key, value=1.5)) and keys.validate(declaration(state_key, value=None))
    refused = [declaration(group_key, subkey=None, value=b"squatted"),  # a plain value
               declaration(group_key, ahead_s=10 * MAX_DECLARATION_TTL_S),  # far-future expiration
               declaration(group_key, subkey=b"not a peer id"), declaration(group_key, subkey="QmText"),
               declaration(group_key, value=1), declaration(group_key, value={"x": True}),
               declaration(group_key, value=b"\x00" * 100), declaration(state_key, value=True),
               declaration(state_key, value=float("inf")), declaration(state_key, subkey=None, value=1.0),
               DHTRecord(key_id(group_key), b"\xc1", dumps(True), get_dht_time() + 5)]  # undecodable subkey
    assert [keys.validate(record) for record in refused] == [False] * len(refused)
    for other in ("run_progress", "interop-key", f"{averager.group_prefix('run', 2, 3)}.0b{averager.round_bits(0)}",
                  f"{averager.group_prefix('run', 0, 2)}.0b{averager.round_bits(0)}x"):
        assert keys.validate(declaration(other, subkey=None, value=b"anything", ahead_s=1e9))  # not ours: passes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(subkey=st.binary(max_size=200), value=st.binary(max_size=200),
       expiration=st.floats(allow_nan=True, allow_infinity=True), round_index=st.integers(0, 2**16 - 1))
def test_arbitrary_bytes_under_a_group_key_are_refused_quickly_never_raise(keys, subkey, value, expiration,
                                                                          round_index):
    record = DHTRecord(key_id(f"run_s0of2.0b{averager.round_bits(round_index)}"), subkey, value, expiration)
    started = time.monotonic()
    accepted = keys.validate(record)
    assert time.monotonic() - started < 1.0
    if accepted:  # only an averager's declaration, as hivemind writes it
        assert type(DHTProtocol.serializer.loads(value)) is bool
        assert expiration <= get_dht_time() + MAX_DECLARATION_TTL_S
