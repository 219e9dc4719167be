"""Progress records in the DHT: who is training in a run, on which stage and round, how fast.

Every stage process publishes one record under ``<run_id>_progress`` that expires unless refreshed; its subkey
is the writer's public key and the record is signed and schema-checked (:mod:`p2p_diloco.swarm.discovery.records`), so
nobody can write or overwrite another's record, and a malformed one is never read. Peers read them to know how
many groupmates to expect in a round (so a group is assembled as soon as everyone is in, and a peer alone skips
the network); ``p2p-diloco swarm`` and ``status`` read them to show the swarm. Called by the trainer and the CLI.

Whose word counts for round timing (identities are free in a public swarm): a peer's influence over when this stage
ends a round, how many groupmates it waits for and when it stops waiting is earned by averaging with this stage (the
peers of its recent groups) or by ``averaging.allowlist``. A record of an identity never met (a stranger) can delay a
round by a bounded time (a peer still averaging must be waited for), never end or shorten one; a stage that has met
nobody yet uses every record for timing until its first group (:meth:`SwarmLink.believed`).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Optional

from p2p_diloco.swarm.discovery.records import (
    MAX_BANS_SHOWN,
    MAX_EVALS_SHOWN,
    MAX_GROUP_MEMBERS_SHOWN,
    MAX_GROUPS_SHOWN,
    MAX_REASON_CHARS,
    MAX_TRAIN_LOSSES_SHOWN,
    NODE_ID_PATTERN,
    PEER_NAME_PATTERN,
    ProgressValue,
    bound_to_writer,
    is_owner_subkey,
    record_owner,
)
from p2p_diloco.unit import Unit

logger = logging.getLogger(__name__)

def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


def records_run(run_id: str, fragment: Optional[tuple[int, int]] = None) -> str:
    """Whose records: the run's (``<run_id>_progress``), or in a run averaged by fragment, fragment f of F's
    (``<run_id>_f<f>of<F>_progress``, read by every peer that holds that fragment, whatever its split):
    :meth:`~p2p_diloco.unit.Unit.records_run`."""
    return Unit.of(0, 1, fragment).records_run(run_id)


@dataclass
class ProgressRecord:
    """One stage process's latest progress."""

    peer: str
    """The peer this stage belongs to (peer id of its stage 0)."""
    stage: int
    num_stages: int
    round: int
    inner_step: int
    tokens_per_s: float
    loss: float
    """NaN while there is none yet."""
    time: float
    """Wall-clock time (DHT time) of the record."""
    applied_round: int = -1
    """The last round whose average this stage's anchor took."""
    anchor: str = ""
    """Fingerprint of the anchor after that round (see ``anchor_fingerprint``)."""
    prior_anchor: str = ""
    """Fingerprint of the anchor after round ``applied_round - 1``, "" if this stage does not know it (it reloaded
    or resynced since). With it, a peer that ends its round a little after the others, when they have already
    applied the next round's average (delayed mode applies it a few steps into the round), can still compare."""
    node: str = ""
    """DHT peer id of the stage process that wrote it (part of its signed record; one record per writer's key)."""
    eval_losses: tuple[tuple[int, float], ...] = ()
    """(rounds done, eval loss of the anchor then) of this stage process's last evaluations, oldest first (empty except
    on a peer's last stage). This field and the six below are shown by ``status``; nothing else reads them."""
    bytes_sent: int = 0
    """Bytes this stage process's averagers have sent since its run began."""
    rounds_averaged: int = 0
    """Rounds whose average of a group this stage process applied."""
    bans: tuple[tuple[str, str], ...] = ()
    """(peer id, why) of the last peers this stage process banned, oldest first."""
    groups: tuple[tuple[int, tuple[str, ...]], ...] = ()
    """(round, DHT peer ids of its group, sorted) of the last rounds whose group's average this record's unit applied,
    oldest first: who averaged with whom."""
    train_losses: tuple[tuple[int, float], ...] = ()
    """(round, mean train loss of its inner steps) of this stage process's last rounds, oldest first (empty except on
    a peer's last stage); the round in progress is the last, its mean so far."""
    finished: bool = False
    """This stage process has applied the run's last round (``train.num_rounds``)."""
    expiration: float = 0.0


def publish_progress(dht, run_id: str, record: ProgressRecord, ttl_s: float) -> None:
    """Store (or refresh) this node's record, signed, without waiting for the DHT."""
    from p2p_diloco.hivemind_adapter.dht import get_dht_time

    value = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "expiration"}
    node = dht.peer_id.to_base58()
    value.update(node=node, loss=float(record.loss) if math.isfinite(record.loss) else None,
                 tokens_per_s=max(0.0, float(record.tokens_per_s)) if math.isfinite(record.tokens_per_s) else 0.0,
                 **shown_facts(record, node))
    dht.store(progress_key(run_id), subkey=record_owner(dht, run_id), value=value,
              expiration_time=get_dht_time() + ttl_s, return_future=True)


_MAX_COUNT = 2**62
_PEER_NAME = re.compile(PEER_NAME_PATTERN)  # the schema's own patterns: what passes here, the schema accepts
_NODE_ID = re.compile(NODE_ID_PATTERN)


def shown_facts(record: ProgressRecord, node: str = "") -> dict:
    """The fields only ``status`` shows, made to pass the schema whatever the trainer noted (a record the schema
    refuses is not stored, and a peer without one is invisible to the round's timing): the last finite eval
    losses, counts within bounds, the last bans with their reasons cut to printable ASCII, the last groups (each
    its members that are peer ids, sorted; of a larger group, the writer ``node`` and the first others) and train
    losses, whether it finished."""
    bans = [(peer, re.sub(r"[^\x20-\x7e]", "?", str(why))[:MAX_REASON_CHARS]) for peer, why in record.bans
            if isinstance(peer, str) and _PEER_NAME.match(peer)]
    groups = [(int(r), nodes) for r, members in record.groups if 0 <= r <= _MAX_COUNT
              for nodes in [_group_shown(members, node)] if nodes]
    return {"eval_losses": _finite_points(record.eval_losses)[-MAX_EVALS_SHOWN:], "bans": bans[-MAX_BANS_SHOWN:],
            "bytes_sent": min(max(0, int(record.bytes_sent)), _MAX_COUNT),
            "rounds_averaged": min(max(0, int(record.rounds_averaged)), _MAX_COUNT),
            "groups": groups[-MAX_GROUPS_SHOWN:],
            "train_losses": _finite_points(record.train_losses)[-MAX_TRAIN_LOSSES_SHOWN:],
            "finished": bool(record.finished)}


def _group_shown(members, node: str) -> list[str]:
    """A group's members that are peer ids, sorted, at most MAX_GROUP_MEMBERS_SHOWN: ``node`` (the writer: a reader
    shows only the groups a record's writer is in) and the first others."""
    ids = {m for m in members if isinstance(m, str) and _NODE_ID.match(m)}
    mine = ids & {node}
    return sorted(mine | set(sorted(ids - mine)[:MAX_GROUP_MEMBERS_SHOWN - len(mine)]))


def _finite_points(points) -> list[tuple[int, float]]:
    """The (round, loss) pairs with a round the schema takes and a finite loss."""
    return [(int(r), float(loss)) for r, loss in points if 0 <= r <= _MAX_COUNT and math.isfinite(loss)]


def fetch_progress(dht, run_id: str, timeout_s: float = 10.0) -> list[ProgressRecord]:
    """All unexpired records of a run. The DHT node's validators have dropped unsigned and malformed ones; what
    is not a signed entry of the schema (a node without them) is skipped too, with a debug log."""
    record_owner(dht, run_id)  # a node that checks signatures, and now the run's schemas too (else SwarmError)
    try:
        found = request_progress(dht, run_id).result(timeout=timeout_s)
    except Exception as e:  # a slow or broken DHT must not stop training: no records means "alone"
        logger.debug(f"Could not read progress records: {e!r}")
        return []
    return parse_progress(found)


def request_progress(dht, run_id: str):
    """Start reading a run's records; a future of the DHT's answer, for :func:`parse_progress`. The caller has
    checked that ``dht`` checks signatures (``record_owner``), as :func:`fetch_progress` and ``SwarmLink`` do."""
    return dht.get(progress_key(run_id), latest=True, return_future=True)


def parse_progress(found) -> list[ProgressRecord]:
    """The well-formed signed records of a DHT answer (see :func:`fetch_progress`)."""
    if found is None or not isinstance(found.value, dict):
        return []
    records = []
    for subkey, entry in found.value.items():
        try:
            if not is_owner_subkey(subkey):
                raise ValueError("the subkey is not a public key")
            value = ProgressValue.parse_obj(entry.value).dict()
            if not bound_to_writer(subkey, value, float(entry.expiration_time)):
                raise ValueError("its node is not its signer's peer id, or it expires too far ahead")
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError; an entry given as a
            # list of pairs with keys that are not strings makes it raise TypeError
            logger.debug(f"Skipping a malformed progress record under {subkey!r}: {e!r}")
            continue
        value.update(loss=float("nan") if value["loss"] is None else value["loss"],
                     eval_losses=tuple(value.get("eval_losses", ())), bans=tuple(value.get("bans", ())),
                     groups=tuple((r, tuple(nodes)) for r, nodes in value.get("groups", ())),
                     train_losses=tuple(value.get("train_losses", ())))
        records.append(ProgressRecord(**value, expiration=float(entry.expiration_time)))
    return records


def moved_past(others: list[ProgressRecord], round_index: int) -> bool:
    """Whether none of ``others`` (records of the same stage) can still average ``round_index``: none is on that
    round, or on the next with that round not yet applied (averaging it in the background). False when there
    are no others. A record more than two rounds ahead is no evidence either way: a peer that far ahead of a live
    round is more likely a false record than a swarm that ran off (one such record failed every round of a peer
    at once; a peer really that far behind is reloaded by the sync anyway)."""
    others = [r for r in others if r.round <= round_index + 2]
    return bool(others) and not could_join(others, round_index)


def could_join(records: list[ProgressRecord], round_index: int) -> bool:
    """Whether one of ``records`` can still average ``round_index`` (see :func:`moved_past`): it has not applied that
    round and names that round, the next, or the one after. The last is a peer of an overlapping mode that has just
    ended the next round: it announces the round after (``SwarmLink.announce``) before it collects this round's
    average, so its record names ``round_index + 2`` while it still waits in this round's group. Read as moved past, it
    makes a slower groupmate give up the round while the others are already in its all-reduce, and all of them fall
    back on it (eager mode). No peer names a later round before it has
    applied this one."""
    return any(round_index <= r.round <= round_index + 2 and r.applied_round < round_index for r in records)


def live_group_size(records: list[ProgressRecord], stage: int, num_stages: int, my_node: str,
                    max_round_lag: Optional[int] = None, my_round: int = 0) -> int:
    """How many stage processes (this one included) can join this stage's next averaging round."""
    others = {
        r.node for r in records
        if r.stage == stage and r.num_stages == num_stages and r.node != my_node
        and (max_round_lag is None or abs(r.round - my_round) <= max_round_lag)
    }
    return 1 + len(others)


def record_as_dict(record: ProgressRecord) -> dict:
    return asdict(record)
