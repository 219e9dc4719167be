"""Property-based tests (hypothesis) of every decoder and validator that reads another peer's bytes.

Each takes arbitrary values of every field a stranger controls and must either accept them or refuse them with the
project's own refusal (a ``False`` from a validator, a skipped record, ``ValueError``/``StateError``), never another
exception, and must stay under 1 s and 64 MiB of Python-visible allocations per input (tracemalloc: numpy's buffers
are counted; what it misses is bounded by the checks these tests drive). ``max_examples`` is fixed so that the
suite's time stays known. The inputs and their checks are listed in docs/threat-model.md.
"""

from __future__ import annotations

import time
import tracemalloc
from contextlib import contextmanager

import torch
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.proto import runtime_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from p2p_diloco.compression.codecs import REGISTERED, decode_tensor
from p2p_diloco.round.swarm_state import StateError
from p2p_diloco.swarm.discovery.progress import parse_progress
from p2p_diloco.swarm.discovery.records import swarm_validators, with_signer
from tests.unit.test_swarm_state import make_stage

PROPERTIES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_SECONDS = 1.0
MAX_BYTES = 64 * 2**20
RUN = "prop-run"

serialize = DHTProtocol.serializer.dumps
scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**64 - 1),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=64))
trees = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                     st.dictionaries(st.text(max_size=20), inner, max_size=4), max_leaves=12)


@contextmanager
def bounded(what: str):
    """The block stays under MAX_SECONDS and MAX_BYTES of traced allocations."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert took < MAX_SECONDS, f"{what} took {took:.2f} s"
    assert peak < MAX_BYTES, f"{what} allocated {peak / 2**20:.0f} MiB"


# ---- DHT records: every validator a node of the swarm installs -------------------------------------------------

def _validators():
    import tempfile

    from p2p_diloco.swarm.discovery.identity import ensure_identity, load_signing_key
    folder = tempfile.mkdtemp(prefix="p2p-diloco-prop-")
    ensure_identity(f"{folder}/id.key")
    validators = with_signer(swarm_validators(RUN, num_stages=2), load_signing_key(f"{folder}/id.key"))
    return CompositeValidator(list(validators))


VALIDATOR = None
RUN_KEYS = [f"{RUN}_progress", f"{RUN}_config", f"{RUN}_s0of2.0b" + "0" * 16, f"{RUN}_s1of2.all_averagers",
            "other-run_progress"]


@PROPERTIES
@given(key=st.sampled_from(RUN_KEYS) | st.text(max_size=30), subkey=st.one_of(trees, st.just(b"[owner:junk]")),
       value=trees, raw_value=st.binary(max_size=256) | st.none(), expires_in=st.floats(allow_nan=True),
       plain=st.booleans())
@example(key=RUN_KEYS[0], subkey=b"[owner:junk]", value=None, raw_value=None, expires_in=0.0, plain=False)
@example(key=RUN_KEYS[0], subkey=None, value=None, plain=False, expires_in=0.0,
         raw_value=serialize({b"[owner:junk]": [[None, None]]}))
def test_any_dht_record_is_accepted_or_refused_never_raises(key, subkey, value, raw_value, expires_in, plain):
    global VALIDATOR
    if VALIDATOR is None:
        VALIDATOR = _validators()
    record = DHTRecord(key=DHTID.generate(source=key).to_bytes(),
                       subkey=DHTProtocol.IS_REGULAR_VALUE if plain else serialize(subkey),
                       value=raw_value if raw_value is not None else serialize(value),
                       expiration_time=get_dht_time() + expires_in)
    with bounded("a DHT record's validation"):
        accepted = VALIDATOR.validate(record)
    assert isinstance(accepted, bool)
    if key in RUN_KEYS[:2]:  # a run's records: only signed ones (none here: no valid signature) are stored
        assert not accepted


@PROPERTIES
@given(entries=st.dictionaries(st.binary(max_size=40) | st.text(max_size=20) | st.just(b"[owner:junk]"), trees,
                               max_size=6), expires_in=st.floats(allow_nan=False), whole=trees)
def test_any_progress_answer_parses_to_well_formed_records_or_none(entries, expires_in, whole):
    answer = ValueWithExpiration({k: ValueWithExpiration(v, get_dht_time() + expires_in)
                                  for k, v in entries.items()}, get_dht_time() + 10)
    with bounded("parsing a progress answer"):
        assert parse_progress(ValueWithExpiration(whole, get_dht_time())) == []  # not a dictionary of entries
    with bounded("parsing a progress answer"):
        records = parse_progress(answer)
    assert records == []  # nothing here is signed by a key its subkey names


# ---- tensors on the wire: parts, averages, state tensors -------------------------------------------------------

@PROPERTIES
@given(compression=st.integers(min_value=0, max_value=12), dtype=st.sampled_from(
       sorted({codec.wire_dtype for codec in REGISTERED}) + ["float16", "V40000", "object", "<f8", ""])
       | st.text(max_size=12),
       size=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=10), buffer=st.binary(max_size=4096),
       max_values=st.one_of(st.none(), st.integers(min_value=0, max_value=2**20)))
def test_any_wire_tensor_decodes_or_is_refused_before_allocating(compression, dtype, size, buffer, max_values):
    message = runtime_pb2.Tensor(compression=compression, dtype=dtype, size=size, buffer=buffer)
    with bounded("decoding a wire tensor"):
        try:
            tensor = decode_tensor(message, max_values=max_values)
        except ValueError:
            return
    assert tensor.dtype == torch.float32 and list(tensor.shape) == list(size)
    assert max_values is None or tensor.numel() <= max_values


# ---- a served state's metadata --------------------------------------------------------------------------------

STAGE = None
META_KEYS = ["format", "run_id", "stage", "num_stages", "round", "applied_round", "outer_steps", "round_start_step",
             "inner_step", "seconds_per_step", "shapes", "fingerprint", "fragment", "num_fragments"]


@PROPERTIES
@given(meta=st.dictionaries(st.sampled_from(META_KEYS) | st.text(max_size=10), trees, max_size=12),
       honest=st.booleans(), scale=st.sampled_from([1.0, 0.0, float("nan"), 1e38]))
@example(meta={"seconds_per_step": 5e-320}, honest=True, scale=1.0)
def test_any_state_metadata_is_checked_or_refused(meta, honest, scale):
    global STAGE
    if STAGE is None:
        stage = make_stage()
        STAGE = stage, *stage.shareable_state("run")
    stage, honest_meta, tensors = STAGE
    if honest:  # the honest document with the drawn fields replaced: each field's own check is reached
        meta = {**honest_meta, **meta}
    tensors = [t * scale for t in tensors]
    with bounded("checking a served state"):
        try:
            stage.check_state("run", meta, tensors)
        except StateError:
            return
    # accepted: a document of this run, stage and shapes, with finite tensors (what they hold is for the vote)
    assert meta.get("format") == honest_meta["format"] and meta.get("run_id") == "run"
    assert all(torch.isfinite(t).all() for t in tensors)
    step_s = meta.get("seconds_per_step")  # the clock a downloader divides by (5e-320 once crashed it)
    assert type(step_s) is float and (step_s == 0.0 or 1e-6 <= step_s <= 86400), step_s
    assert -1 <= meta["applied_round"] <= meta["round"] <= 2**40


def test_every_node_bounds_the_size_and_lifetime_of_any_record():
    """Under any key, another run's or one nobody uses, a node keeps no value above 16 KiB and no expiration more
    than 600 s ahead: a stranger could otherwise store a value of up to the message cap on every node per request."""
    from p2p_diloco.swarm.discovery.records import MAX_RECORD_VALUE_BYTES, RecordBounds

    bounds = RecordBounds()
    assert any(isinstance(v, RecordBounds) for v in with_signer([]))  # every node started by start_dht has it

    def record(value: bytes, expires_in: float = 60.0, subkey: bytes = DHTProtocol.IS_REGULAR_VALUE):
        return DHTRecord(key=DHTID.generate(source="anything").to_bytes(), subkey=subkey, value=value,
                         expiration_time=get_dht_time() + expires_in)

    assert bounds.validate(record(b"x" * MAX_RECORD_VALUE_BYTES))
    assert not bounds.validate(record(b"x" * (MAX_RECORD_VALUE_BYTES + 1)))
    assert not bounds.validate(record(b"x", expires_in=10 * 3600))
    assert not bounds.validate(record(b"x", expires_in=float("inf")))
    assert not bounds.validate(record(b"x", subkey=b"s" * 2000))


# ---- the group: gathered records, and the digests members compare ----------------------------------------------

@PROPERTIES
@given(record=trees, wrap=st.booleans(), mode=st.integers(min_value=-3, max_value=5), raw=st.binary(max_size=512))
@example(record=None, wrap=False, mode=0, raw=b"\x91" * 400)  # 400 nested arrays
@example(record=None, wrap=False, mode=0, raw=b"\xdd\xff\xff\xff\xff")  # an array declaring 2^32 - 1 items
def test_any_gathered_record_decodes_or_is_refused(record, wrap, mode, raw):
    from p2p_diloco.swarm.averaging.gathered import GatheredError, decode_record

    if wrap:  # the shape hivemind gathers, [bandwidth, mode, metadata bytes], around an arbitrary metadata
        raw = serialize([1.0, mode, serialize(record)])
    with bounded("decoding a gathered record"):
        try:
            decode_record(raw)
        except GatheredError:
            pass


@PROPERTIES
@given(entries=st.dictionaries(st.binary(max_size=40) | st.just(b"[owner:junk]") | st.text(max_size=10), trees,
                               max_size=6),
       members=st.lists(st.sampled_from(["QmA", "QmB", "QmC"]), max_size=3, unique=True))
def test_any_digest_claim_is_parsed_or_dropped(entries, members):
    from p2p_diloco.swarm.averaging.digests import parse_claim, read_claims

    found = ValueWithExpiration({k: ValueWithExpiration(v, get_dht_time() + 5) for k, v in entries.items()},
                                get_dht_time() + 5)
    with bounded("reading a group's digests"):
        claims = read_claims(found, {m: None for m in members}, me="QmA")
        for value in entries.values():
            parse_claim(value, {m: None for m in members})
    assert claims == {}  # nothing here is signed by a member's key


OWNER_KEYS = [b"ssh-foo " + __import__("base64").b64encode(b"\x00\x00\x00\x07ssh-foo" + b"\x00" * 8),
              b"ecdsa-sha2-nistp999 AAAA", b"ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQ==", b"\xff\xfe"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.one_of(st.sampled_from(OWNER_KEYS), st.binary(max_size=300)))
@example(key=OWNER_KEYS[0])  # a key type cryptography does not know: it raised its own UnsupportedAlgorithm
def test_any_owner_subkey_names_a_peer_id_or_is_refused_with_a_value_error(key):
    """Every reader of a record's writer (the digests' exchange, the config check, the record validator) refuses a
    subkey on ValueError: any other exception from a peer's bytes would end that reader, not the record."""
    from p2p_diloco.swarm.discovery.records import peer_id_of_owner

    try:
        peer_id_of_owner(b"[owner:" + key + b"]")
    except ValueError:
        pass
