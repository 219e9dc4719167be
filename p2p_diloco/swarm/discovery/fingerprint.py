"""The run's config fingerprint in the DHT: what every peer of a swarm must share to average together.

Model shape, the digest of the weights a run started from (``model.init_from``), pipeline stages and split (or, in a
run that averages by fragment, the fragment count), vocabulary and data format. Each stage process publishes its
fingerprint under ``<run_id>_config`` (subkey: its public key; signed and schema-checked, see
:mod:`p2p_diloco.swarm.discovery.records`) and, before training, compares it with the live ones: a peer whose stages
would not line up with the swarm's is refused with a message naming each key that differs. (The averager's
group key and tensor schema keep mismatched peers apart anyway; this turns a silent "never finds a group" into
a clear error.) Called by :func:`p2p_diloco.stage_process.run_stage`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from p2p_diloco.swarm.discovery.records import (
    FingerprintValue,
    bound_to_writer,
    is_owner_subkey,
    peer_id_of_owner,
    record_owner,
)
from p2p_diloco.swarm.errors import SwarmError

logger = logging.getLogger(__name__)
FINGERPRINT_VERSION = 3
"""2: model.rope_theta, model.norm_eps, model.init_from. 3: ``adaptive`` is a ladder (whole int8, int4, low rank) and
CenteredClip judges a part from the segment to the center: from the same gathered metadata a version-2 peer plans
other codecs for a round, and groupmates whose plans differ send parts of other shapes (``malformed``, an offence).
Peers of two versions are kept apart by this key."""


def config_key(run_id: str) -> str:
    return f"{run_id}_config"


def config_fingerprint(model_args, stage_layers: list[int], data_meta: dict[str, Any], fragments: int = 0,
                       init_digest: Optional[str] = None) -> dict[str, Any]:
    """What peers of one run must agree on, keyed by the config key a user would change. A run that averages by
    fragment (``fragments`` F >= 1) fixes F, not the pipeline split: peers of any split average together. A run
    started from a model folder fixes its weights (``init_digest``, :func:`~p2p_diloco.model.init_from.init_digest`)
    and the rotary and norm constants its config.json gives."""
    # every key always present (None where it does not apply): hivemind's schema validator refuses a record that
    # parsing would change, and a default filled in for a missing key is such a change (no config record was stored)
    by_fragment = {"pipeline.stages": None, "pipeline.stage_layers": None}
    return ({
        "version": FINGERPRINT_VERSION,
        "model.dim": model_args.dim, "model.n_layers": model_args.n_layers, "model.n_heads": model_args.n_heads,
        "model.n_kv_heads": model_args.n_kv_heads, "model.ffn_dim": model_args.ffn_dim,
        "model.vocab_size": model_args.vocab_size, "model.max_seq_len": model_args.max_seq_len,
        "model.tie_embeddings": model_args.tie_embeddings, "model.init_seed": model_args.init_seed,
        "model.rope_theta": float(model_args.rope_theta), "model.norm_eps": float(model_args.norm_eps),
        "model.init_from": init_digest,
        "pipeline.stages": len(stage_layers), "pipeline.stage_layers": list(stage_layers),
        "data.vocab_size": data_meta.get("vocab_size"), "data.dtype": data_meta.get("dtype"),
        "data.tokenizer": data_meta.get("tokenizer"), "diloco.fragments": fragments or None,
    }) | (by_fragment if fragments else {})


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Human-readable differences, e.g. ``pipeline.stage_layers is [2, 2] here but [3, 1] in the swarm``."""
    keys = sorted(set(mine) | set(theirs))
    return [_difference(key, mine.get(key), theirs.get(key)) for key in keys if mine.get(key) != theirs.get(key)]


def _difference(key: str, mine: Any, theirs: Any) -> str:
    if key == "version":  # the releases differ, not a setting the user chose
        return (f"version is {mine!r} here but {theirs!r} in the swarm: its peers run a p2p-diloco release that "
                "plans or combines rounds differently; run the swarm's release")
    if key == "model.init_from":  # a digest says little by itself: say what it stands for
        return f"model.init_from weights differ: {_weights(mine)} here, {_weights(theirs)} in the swarm"
    return f"{key} is {mine!r} here but {theirs!r} in the swarm"


def _weights(digest: Optional[str]) -> str:
    return f"sha256 {digest[:12]}…" if digest else "none (random init from model.init_seed)"


def check_fingerprint(dht, run_id: str, fingerprint: dict[str, Any], timeout_s: float = 15.0,
                      allowlist: frozenset[str] = frozenset()) -> None:
    """Refuse to join if most live peers of ``run_id`` published another fingerprint than this peer's.

    A majority, not a veto: each record is signed by its writer's libp2p identity and expires within minutes (see
    ``swarm.discovery.records``), but anyone can start a node, and one record of another config used to block every
    newcomer. Peers whose fingerprint differs from the majority's are refused; a tie lets the newcomer in (the
    averager's group key and tensor schema keep mismatched peers apart anyway). With an ``allowlist`` (a private
    swarm: peer ids), only its members' records count: an outsider's identities cannot outvote them.

    Raises:
        SwarmError: naming every key that differs from the swarm's.
    """
    me = record_owner(dht, run_id)  # a node that checks signatures, and now the run's schemas too
    try:
        found = dht.get(config_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:  # an unreadable DHT is not a reason to refuse; averaging keeps peers apart anyway
        logger.warning(f"Could not read the swarm's config fingerprint ({e!r}); not checked")
        return
    if found is None or not isinstance(found.value, dict):
        return
    same, others = 0, []
    for subkey, entry in found.value.items():
        if subkey == me or not is_owner_subkey(subkey) or not _well_formed(entry.value) \
                or not bound_to_writer(subkey, None, float(entry.expiration_time)) \
                or (allowlist and peer_id_of_owner(subkey) not in allowlist):
            continue
        if differences(fingerprint, entry.value):
            others.append(entry.value)
        else:
            same += 1
    if not others:
        return
    counts = [sum(1 for o in others if not differences(theirs, o)) for theirs in others]
    majority = max(range(len(others)), key=counts.__getitem__)
    if counts[majority] > same:
        diff = differences(fingerprint, others[majority])
        raise SwarmError(f"this peer's config does not fit the swarm of run {run_id!r}: " + "; ".join(diff)
                         + f" ({counts[majority]} of {same + len(others)} live peers). Use the swarm's settings, "
                         "or another --run-id")
    logger.warning(f"{len(others)} of {same + len(others)} live peers of run {run_id!r} published another config "
                   f"fingerprint ({'; '.join(differences(fingerprint, others[majority]))}); going on with the majority")


def _well_formed(value) -> bool:
    try:
        FingerprintValue.parse_obj(value)
    except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError; a list of pairs with keys
        # that are not strings makes it raise TypeError
        return False
    return True


def publish_fingerprint(dht, run_id: str, fingerprint: dict[str, Any], ttl_s: float) -> None:
    from p2p_diloco.hivemind_adapter.dht import get_dht_time

    dht.store(config_key(run_id), subkey=record_owner(dht, run_id), value=fingerprint,
              expiration_time=get_dht_time() + ttl_s, return_future=True)


def run_fragments(dht, run_id: str, timeout_s: float = 10.0) -> int:
    """The fragment count of run ``run_id`` as most of its live config records say (``diloco.fragments``), 0 when it
    averages by stage or no record is found (``p2p-diloco status``: a run averaged by fragment keeps its progress
    records per fragment)."""
    record_owner(dht, run_id)
    try:
        found = dht.get(config_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:  # unreadable: as if no record
        logger.debug(f"Could not read the config records of {run_id}: {e!r}")
        return 0
    if found is None or not isinstance(found.value, dict):
        return 0
    counts: dict[int, int] = {}
    for subkey, entry in found.value.items():
        if is_owner_subkey(subkey) and _well_formed(entry.value) and \
                bound_to_writer(subkey, None, float(entry.expiration_time)):
            fragments = entry.value.get("diloco.fragments") or 0
            counts[fragments] = counts.get(fragments, 0) + 1
    return max(counts, key=lambda f: (counts[f], -f)) if counts else 0
