"""Signed, schema-checked DHT records of a run, with hivemind's own validators.

A run keeps two kinds of records in the DHT, both a dictionary with one entry per writing stage process:
``<run_id>_progress`` (:mod:`p2p_diloco.swarm.discovery.progress`) and ``<run_id>_config`` (the config fingerprint,
:mod:`p2p_diloco.swarm.discovery.fingerprint`). Each entry's subkey is its writer's public key (``[owner:<RSA key>]``)
and its value is signed with the matching private key (hivemind's ``RSASignatureValidator``), so nobody can write or
overwrite another process's entry; ``SchemaValidator`` checks every entry against the pydantic schemas below
(strict types, no NaN, no negative round, no missing or unknown field). Every DHT node that holds the validators
refuses a bad record when asked to store it and when another node returns it, so a reader never sees one.

Each DHT node signs with the private key of its libp2p identity (:func:`with_signer`, used by
:func:`p2p_diloco.swarm.discovery.dht.start_dht`, so that the node checks signatures from its first record on), and
:class:`IdentityBinding` makes every node refuse a run's record whose ``node`` (the writer's DHT peer id) is not the
peer id of the key that signed it, or whose expiration is further than :data:`MAX_RECORD_TTL_S` ahead. A record's
writer is therefore a libp2p identity, the one its averager and its DHT node speak as: ``averaging.allowlist``
applies to records too, and one machine writes one record per identity it runs, which expires within minutes of
its last refresh. :func:`record_owner` gives the subkey a node's records go under. Readers also parse every entry
with the schemas, so a node that got its run's schemas late (``p2p-diloco status``) reads no malformed one either.
Called by the DHT start, the progress and fingerprint records, and the commands that start DHT nodes (their run's
schemas, and the shape of its averagers' unsigned keys: :func:`swarm_validators`).
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from pydantic.v1 import BaseModel, Extra, Field, StrictBool, confloat, conint, conlist, constr, root_validator

from p2p_diloco.hivemind_adapter.crypto import RSAPrivateKey
from p2p_diloco.hivemind_adapter.dht import (
    DHTID,
    BytesWithPublicKey,
    DHTProtocol,
    DHTRecord,
    RecordValidatorBase,
    RSASignatureValidator,
    SchemaValidator,
)
from p2p_diloco.swarm.discovery.averager_keys import AveragerKeys, averager_prefixes
from p2p_diloco.swarm.errors import SwarmError

# the base58 peer ids this project writes, or any other short printable name
PEER_NAME_PATTERN = r"^[A-Za-z0-9._-]{1,128}$"  # a peer id as records name it (bans)
_NAME = constr(strict=True, min_length=1, max_length=128, regex=PEER_NAME_PATTERN)
_COUNT = conint(strict=True, ge=0, le=2**62)
_FINITE = confloat(strict=True, allow_inf_nan=False)
MAX_STAGES = 1024
ADD_VALIDATORS_TIMEOUT_S = 10.0  # a node that takes longer to add a schema is stuck (see _add_validators)
MAX_EVALS_SHOWN = 32  # the eval losses a progress record carries (its last ones)
MAX_BANS_SHOWN = 16  # the bans a progress record names (its last ones)
MAX_REASON_CHARS = 160  # a ban's reason, printable ASCII
MAX_GROUPS_SHOWN = 3  # the groups a progress record names (of its last rounds averaged)
MAX_GROUP_MEMBERS_SHOWN = 32  # the members of a group a progress record names (its first, sorted)
MAX_TRAIN_LOSSES_SHOWN = 32  # the rounds' mean train losses a progress record carries (its last ones)
# a group member's DHT peer id: base58, 46 characters for the RSA identities this project writes (52 for Ed25519);
# tighter than _NAME so that full groups stay well inside MAX_RECORD_VALUE_BYTES
NODE_ID_PATTERN = r"^[A-Za-z0-9]{1,56}$"
_NODE_ID = constr(strict=True, min_length=1, max_length=56, regex=NODE_ID_PATTERN)
_REASON = constr(strict=True, max_length=MAX_REASON_CHARS, regex=r"^[\x20-\x7e]*$")
MAX_RECORD_TTL_S = 600.0
"""No node stores or returns a run's record that expires further ahead than this (peers refresh their records with a
lifetime of ``SwarmLink.ttl_s``, 120 s): a record published once with a far-future expiration would otherwise
outlive its writer forever."""
_OWNER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


class ProgressValue(BaseModel):
    """One stage process's progress record (see :class:`p2p_diloco.swarm.discovery.progress.ProgressRecord`)."""

    peer: _NAME
    node: _NAME
    stage: conint(strict=True, ge=0, lt=MAX_STAGES)
    num_stages: conint(strict=True, ge=1, le=MAX_STAGES)
    round: _COUNT
    inner_step: _COUNT
    tokens_per_s: confloat(strict=True, ge=0, allow_inf_nan=False)
    loss: Optional[_FINITE] = Field(...)  # None: no loss yet
    time: confloat(strict=True, ge=0, allow_inf_nan=False)
    applied_round: conint(strict=True, ge=-1, le=2**62)
    anchor: constr(strict=True, max_length=128, regex=r"^[0-9a-f]*$")
    prior_anchor: constr(strict=True, max_length=128, regex=r"^[0-9a-f]*$") = ""
    # shown by `status` (optional: an older peer's record, without them, still parses)
    eval_losses: conlist(tuple[_COUNT, _FINITE], max_items=MAX_EVALS_SHOWN) = []
    bytes_sent: _COUNT = 0
    rounds_averaged: _COUNT = 0
    bans: conlist(tuple[_NAME, _REASON], max_items=MAX_BANS_SHOWN) = []
    groups: conlist(tuple[_COUNT, conlist(_NODE_ID, min_items=1, max_items=MAX_GROUP_MEMBERS_SHOWN)],
                    max_items=MAX_GROUPS_SHOWN) = []
    train_losses: conlist(tuple[_COUNT, _FINITE], max_items=MAX_TRAIN_LOSSES_SHOWN) = []
    finished: StrictBool = False

    class Config:
        extra = Extra.forbid

    def dict(self, **kwargs) -> dict:
        """The fields the writer gave, no default added: hivemind's ``SchemaValidator`` refuses a record whose parsed
        value differs from the one stored, so a record without the optional fields (an older peer's) would be
        refused if they came back as defaults."""
        return super().dict(**dict(kwargs, exclude_unset=True))

    @root_validator(skip_on_failure=True)
    def _stage_of_its_peer(cls, values: dict) -> dict:
        if values["stage"] >= values["num_stages"]:
            raise ValueError(f"stage {values['stage']} is not a stage of {values['num_stages']}")
        return values


class FingerprintValue(BaseModel):
    """One stage process's config fingerprint (see :func:`~p2p_diloco.swarm.discovery.fingerprint.config_fingerprint`).
    """

    version: conint(strict=True, ge=1)
    model_dim: conint(strict=True, ge=1) = Field(..., alias="model.dim")
    model_n_layers: conint(strict=True, ge=1) = Field(..., alias="model.n_layers")
    model_n_heads: conint(strict=True, ge=1) = Field(..., alias="model.n_heads")
    model_n_kv_heads: conint(strict=True, ge=1) = Field(..., alias="model.n_kv_heads")
    model_ffn_dim: conint(strict=True, ge=1) = Field(..., alias="model.ffn_dim")
    model_vocab_size: conint(strict=True, ge=1) = Field(..., alias="model.vocab_size")
    model_max_seq_len: conint(strict=True, ge=1) = Field(..., alias="model.max_seq_len")
    model_tie_embeddings: StrictBool = Field(..., alias="model.tie_embeddings")
    model_init_seed: conint(strict=True) = Field(..., alias="model.init_seed")
    model_rope_theta: confloat(strict=True, gt=0, allow_inf_nan=False) = Field(..., alias="model.rope_theta")
    model_norm_eps: confloat(strict=True, gt=0, allow_inf_nan=False) = Field(..., alias="model.norm_eps")
    # the sha256 of the weights a run started from (model.init_from); None: random init from model.init_seed
    model_init_from: Optional[constr(strict=True, regex=r"^[0-9a-f]{64}$")] = Field(..., alias="model.init_from")
    # None when the run averages by fragment (diloco.fragments): then peers of any split train together
    pipeline_stages: Optional[conint(strict=True, ge=1, le=MAX_STAGES)] = Field(..., alias="pipeline.stages")
    pipeline_stage_layers: Optional[conlist(conint(strict=True, ge=1), min_items=1, max_items=MAX_STAGES)] = \
        Field(..., alias="pipeline.stage_layers")
    diloco_fragments: Optional[conint(strict=True, ge=1, le=MAX_STAGES)] = Field(..., alias="diloco.fragments")
    data_vocab_size: Optional[conint(strict=True, ge=1)] = Field(..., alias="data.vocab_size")
    data_dtype: Optional[constr(strict=True, max_length=32)] = Field(..., alias="data.dtype")
    data_tokenizer: Optional[constr(strict=True, max_length=256)] = Field(..., alias="data.tokenizer")

    class Config:
        extra = Extra.forbid


class ProgressSchema(BaseModel):
    progress: dict[BytesWithPublicKey, ProgressValue]


class FingerprintSchema(BaseModel):
    config: dict[BytesWithPublicKey, FingerprintValue]


class RunSchemaValidator(SchemaValidator):
    """hivemind's SchemaValidator for the keys of one run, which remembers the run."""

    def __init__(self, schema: type[BaseModel], run_id: str):
        super().__init__(schema, allow_extra_keys=True, prefix=run_id)
        self.run_id = run_id

    def validate(self, record: DHTRecord) -> bool:
        """hivemind's check, refusing what it would raise on: pydantic raises ``TypeError`` for an entry given as a
        list of pairs with keys that are not strings, and an exception fails the whole request it came in."""
        try:
            return super().validate(record)
        except Exception:  # anything a writer sends may be malformed
            return False


def peer_id_of_owner(owner: bytes) -> str:
    """The libp2p peer id (base58) of the RSA key an owner subkey (``[owner:<key>]``) names; ValueError if it names
    none. The libp2p rule: the multihash (sha2-256) of the key's protobuf (type RSA, DER SubjectPublicKeyInfo)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from p2p_diloco.hivemind_adapter.crypto import crypto_pb2
    from p2p_diloco.hivemind_adapter.p2p import PeerID

    found = _OWNER.search(owner) if isinstance(owner, bytes) else None
    if found is None:
        raise ValueError("the subkey names no public key")
    try:  # what hivemind's RSAPublicKey.from_bytes reads; a key type cryptography does not know raises its own error
        key = serialization.load_ssh_public_key(found.group(1))
    except Exception as e:  # noqa: BLE001 (any failure on a peer's bytes is a refusal, the documented ValueError)
        raise ValueError(f"the subkey names no readable key ({type(e).__name__})") from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("the subkey names a key that is not RSA")
    der = key.public_bytes(encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest()).to_base58()  # multihash: sha2-256, 32 bytes


class IdentityBinding(RecordValidatorBase):
    """Refuses a run's record whose writer is not the identity that signed it, or that expires too far ahead.

    For the keys of run ``run_id``: the subkey must name a public key (the signature validator, which runs first,
    has checked the signature against it); a progress record's ``node`` must be that key's libp2p peer id; the
    expiration must be at most :data:`MAX_RECORD_TTL_S` ahead. Other keys pass."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._progress = DHTID.generate(source=f"{run_id}_progress").to_bytes()
        self._config = DHTID.generate(source=f"{run_id}_config").to_bytes()

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` (a DHT key's hash) is one of the run's signed records (progress, config)."""
        return key in (self._progress, self._config)

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in (self._progress, self._config):
            return True
        try:
            owner = DHTProtocol.serializer.loads(record.subkey)
            value = DHTProtocol.serializer.loads(record.value) if record.key == self._progress else None
        except Exception:  # anything a writer sends may be malformed
            return False
        return bound_to_writer(owner, value, record.expiration_time)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, IdentityBinding) and other.run_id == self.run_id


def bound_to_writer(owner, value: Optional[dict], expiration_time: float) -> bool:
    """Whether an entry under subkey ``owner`` is its writer's: ``owner`` names a key, the entry expires at most
    :data:`MAX_RECORD_TTL_S` ahead, and a progress record's ``value`` names that key's peer id as its ``node`` (pass
    None for a config entry). :class:`IdentityBinding` checks it in the DHT; readers check it again, as a node
    that got the run's validators late (``p2p-diloco status``) may have taken an entry before."""
    from p2p_diloco.hivemind_adapter.dht import get_dht_time

    if expiration_time > get_dht_time() + MAX_RECORD_TTL_S:
        return False
    try:
        peer_id = peer_id_of_owner(owner)
    except Exception:  # not a key, or a garbled one
        return False
    return value is None or (isinstance(value, dict) and value.get("node") == peer_id)

def run_record_validators(run_id: str) -> list[RecordValidatorBase]:
    """Schemas of the records of run ``run_id`` (keys ``<run_id>_progress`` and ``<run_id>_config``) and the binding
    of each record to its signer's identity; other keys (the averagers' matchmaking, other runs) pass. Give them to
    :func:`~p2p_diloco.swarm.discovery.dht.start_dht`."""
    return [RunSchemaValidator(ProgressSchema, run_id), RunSchemaValidator(FingerprintSchema, run_id),
            IdentityBinding(run_id)]


def swarm_validators(run_id: str, num_stages: int = 1, fragments: int = 0) -> list[RecordValidatorBase]:
    """What every node of run ``run_id`` checks from its start (peers and their averagers, bootstrap nodes): the run's
    records (:func:`run_record_validators`), in a run averaged by ``fragments`` F each fragment's progress records
    too (a bootstrap node never reads them, and without their schemas it kept a plain value under their key), and
    the unsigned keys of the averagers of its ``num_stages`` stages or F fragments
    (:class:`~p2p_diloco.swarm.discovery.averager_keys.AveragerKeys`). Give them to
    :func:`~p2p_diloco.swarm.discovery.dht.start_dht`."""
    prefixes = averager_prefixes(run_id, num_stages, fragments)
    runs = [run_id] + (prefixes if fragments else [])  # a fragment's prefix is its records' run id
    return [v for run in runs for v in run_record_validators(run)] + [AveragerKeys(prefixes)]


def with_signer(validators: Iterable[RecordValidatorBase],
                private_key: Optional[RSAPrivateKey] = None) -> list[RecordValidatorBase]:
    """``validators`` plus an ``RSASignatureValidator`` with ``private_key`` (the node's libp2p identity key; a fresh
    key if None), unless they hold one (hivemind keeps only the first one a DHT node is given). A key per node, not
    hivemind's process-wide one: several nodes of one process (tests, a local swarm) must not share, and overwrite,
    one another's entries."""
    validators = list(validators)
    if not any(isinstance(v, RSASignatureValidator) for v in validators):
        validators.append(SignatureValidator(private_key if private_key is not None else RSAPrivateKey()))
    if not any(isinstance(v, RecordBounds) for v in validators):
        validators.append(RecordBounds())
    return validators


MAX_RECORD_VALUE_BYTES = 16 * 1024
"""The largest value (signature included) any node of the swarm stores or reads under any key: the largest honest
record, a config fingerprint, takes about 1.5 KiB signed. Without it, a stranger could store a value of up to the
p2p daemon's 4 MiB request cap on every node per request, bootstrap nodes included."""
MAX_SUBKEY_BYTES = 1024  # an owner subkey (an RSA public key) takes about 400 bytes; a peer id under 70


class RecordBounds(RecordValidatorBase):
    """Refuses, under every key (other runs' too: keys are hashes, a node cannot tell whose they are), a value above
    :data:`MAX_RECORD_VALUE_BYTES`, a subkey above :data:`MAX_SUBKEY_BYTES`, and an expiration more than
    :data:`MAX_RECORD_TTL_S` ahead (or not a finite number). Every node of the swarm holds it (:func:`with_signer`).
    What it does not bound is the number of keys and subkeys a stranger stores (docs/threat-model.md)."""

    def validate(self, record: DHTRecord) -> bool:
        from p2p_diloco.hivemind_adapter.dht import get_dht_time

        try:
            expiration = float(record.expiration_time)
            return len(record.value) <= MAX_RECORD_VALUE_BYTES and len(record.subkey) <= MAX_SUBKEY_BYTES and \
                math.isfinite(expiration) and expiration <= get_dht_time() + MAX_RECORD_TTL_S
        except Exception:  # anything a writer sends may be malformed
            return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RecordBounds)


class SignatureValidator(RSASignatureValidator):
    """hivemind's signature validator, which refuses a malformed key or signature instead of raising: it raised
    ``ValueError`` on a subkey such as ``[owner:junk]`` (a stranger's bytes), and an exception in a validator fails
    the whole store or find request it came in, honest records of the same request included."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            return super().validate(record)
        except Exception:  # anything a writer sends may be malformed
            return False


@dataclass
class _Signing:
    signer: RSASignatureValidator
    runs: set = field(default_factory=set)


_signing: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DHT -> its _Signing
_lock = threading.Lock()


def bind_signer(dht, validators: Iterable[RecordValidatorBase]) -> None:
    """Remember that ``dht`` was started with ``validators`` (from :func:`with_signer`)."""
    validators = list(validators)
    signer = next(v for v in validators if isinstance(v, RSASignatureValidator))
    runs = {v.run_id for v in validators if isinstance(v, RunSchemaValidator)}
    with _lock:
        _signing[dht] = _Signing(signer, runs)


def record_owner(dht, run_id: Optional[str] = None) -> bytes:
    """The subkey under which ``dht`` writes its entries: ``[owner:<its public key>]``.

    With ``run_id``, a node started without that run's schemas (``p2p-diloco status``) gets them now (hivemind's
    ``DHT.add_validators``); its signature checks were in from the start, and readers parse every entry anyway.

    Raises:
        SwarmError: ``dht`` was not started by :func:`~p2p_diloco.swarm.discovery.dht.start_dht`: without a signature
            validator from its start, entries other nodes handed it could not be told from forged ones.
    """
    with _lock:
        signing = _signing.get(dht)
        if signing is None:
            raise SwarmError("this DHT node was not started by p2p_diloco.swarm.start_dht, so it does not check "
                             "record signatures; start it with start_dht to read or write a run's records")
        if run_id is not None and run_id not in signing.runs:
            _add_validators(dht, run_record_validators(run_id))
            signing.runs.add(run_id)
        return signing.signer.local_public_key


def _add_validators(dht, validators, timeout_s: float = ADD_VALIDATORS_TIMEOUT_S) -> None:
    """hivemind's ``DHT.add_validators`` waits for the node's process without a bound; a node stuck on a busy
    machine must not stop its caller (``status`` has a deadline to keep), so the call runs in a thread and is given
    up after ``timeout_s``."""
    worker = threading.Thread(target=dht.add_validators, args=(validators,), daemon=True,
                              name="p2p-diloco-add-validators")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise SwarmError(f"the DHT node did not take the run's record schemas within {timeout_s:.0f} s")


def is_owner_subkey(subkey) -> bool:
    """Whether a subkey names a public key (a signed entry); readers skip any other."""
    return isinstance(subkey, bytes) and _OWNER.search(subkey) is not None
