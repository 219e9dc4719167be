"""The metadata each groupmate gathers into its group: bytes of another peer, bounded before they are decoded.

A follower sends its record (``[bandwidth, mode, msgpack(round, tokens, compute_s, bandwidth_mbit, compression,
last_error)]``, about 150 bytes) to its leader in its join request; the leader relays every member's record to every
follower in the group's BEGIN_ALLREDUCE message. Both are other peers' bytes, parsed in the averager's event loop:
msgpack builds a Python object per item, so before these limits 7.6 MiB of empty maps in one record cost half a GiB
and blocked the loop for 1.5 s. Here:

- a join request whose record is over :data:`MAX_GATHERED_BYTES` is refused before hivemind keeps it
  (:func:`join_refusal`), so a leader never relays it;
- a group relayed by a leader is refused before hivemind builds it when it has more than :data:`MAX_GROUP_SIZE`
  members, a peer id over :data:`MAX_PEER_ID_BYTES`, records not one per member, or a record over the cap
  (:func:`relayed_group_refusal`): the leader's offence, as an honest leader refuses such records at the join;
- a record is decoded with msgpack's own limits (at most :data:`MAX_ITEMS` items per array or map, strings and
  bytes no longer than the record, no extension types) and then checked field by field (:func:`check_gathered`).

So one record costs at most a few KiB and a few thousand Python objects, whoever sent it. Called by
:mod:`p2p_diloco.swarm.averaging.guard`.
"""

from __future__ import annotations

import math
from typing import Optional

import msgpack

from p2p_diloco.compression.sparse import CHUNK
from p2p_diloco.hivemind_adapter.averaging import AveragingMode

MAX_GATHERED_BYTES = 4096  # an honest record is about 150 bytes
MAX_GROUP_SIZE = 256  # members of one group (hivemind's butterfly opens a stream per member pair)
MAX_PEER_ID_BYTES = 128  # a libp2p peer id is a 34 to 39 byte multihash
MAX_ITEMS = 32  # items of one msgpack array or map in a record (an honest one has at most 6)


class GatheredError(ValueError):
    """A groupmate's gathered metadata is oversized or malformed."""


def decode_record(raw: bytes) -> tuple[AveragingMode, dict]:
    """(mode, metadata) of one member's gathered record, checked; GatheredError if it is anything else.

    The size is checked before any decoding; decoding is bounded by msgpack's limits (see the module docstring)."""
    if not isinstance(raw, bytes) or len(raw) > MAX_GATHERED_BYTES:
        raise GatheredError(f"a gathered record of {len(raw) if isinstance(raw, bytes) else type(raw).__name__} "
                            f"bytes (at most {MAX_GATHERED_BYTES})")
    outer = _unpack(raw)
    if not isinstance(outer, list) or len(outer) != 3:
        raise GatheredError("a gathered record is not [bandwidth, mode, metadata]")
    _bandwidth, mode_id, user_bytes = outer
    if not isinstance(mode_id, int) or isinstance(mode_id, bool) or not isinstance(user_bytes, bytes):
        raise GatheredError("a gathered record's mode or metadata has the wrong type")
    try:
        mode = AveragingMode(mode_id)
    except ValueError:
        raise GatheredError(f"unknown averaging mode {mode_id!r}") from None
    return mode, check_gathered(_unpack(user_bytes))


def _unpack(raw: bytes):
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True,
                               max_str_len=MAX_GATHERED_BYTES, max_bin_len=MAX_GATHERED_BYTES, max_array_len=MAX_ITEMS,
                               max_map_len=MAX_ITEMS, max_ext_len=0)
    except Exception as e:  # msgpack raises several types (ValueError, StackError, ExtraData, FormatError, ...)
        raise GatheredError(f"undecodable gathered record: {type(e).__name__}: {e}"[:200]) from None


def check_gathered(info) -> dict:
    """A groupmate's gathered metadata if every field has the type and range an honest peer sends; else raises."""
    if not isinstance(info, dict):
        raise GatheredError(f"gathered metadata is a {type(info).__name__}, not a mapping")
    try:
        _integer(info["round"], "round", minimum=0)
        _number(info["tokens"], "tokens", positive=True)
        _number(info["compute_s"], "compute_s")
        _number(info["bandwidth_mbit"], "bandwidth_mbit", positive=True)
        if info.get("last_error") is not None:
            _number(info["last_error"], "last_error")
        proposal = info["compression"]
        if not isinstance(proposal, dict):
            raise GatheredError("compression proposal is not a mapping")
        _integer(proposal["rank"], "compression.rank", minimum=1)
        _integer(proposal["q_round"], "compression.q_round", minimum=-1)
        if "topk" in proposal:  # sparseloco's k (peers before it sent none)
            _integer(proposal["topk"], "compression.topk", minimum=1, maximum=CHUNK)
    except KeyError as e:
        raise GatheredError(f"gathered metadata lacks {e}") from None
    if proposal["bits"] not in (4, 8) or isinstance(proposal["bits"], bool):
        raise GatheredError(f"compression.bits must be 4 or 8, got {proposal['bits']!r}")
    return info


def _integer(value, name: str, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum \
            or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise GatheredError(f"{name} must be an integer {bounds}, got {value!r}"[:200])


def _number(value, name: str, positive: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        raise GatheredError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


def join_refusal(request, num_followers: int) -> Optional[str]:
    """Why a leader refuses a join request before hivemind keeps it (a hivemind ``JoinRequest``), or None: its record
    is over the cap (the sender's offence), or the group is full."""
    if len(request.gather) > MAX_GATHERED_BYTES:
        return f"its gathered record has {len(request.gather)} bytes (at most {MAX_GATHERED_BYTES})"
    if num_followers + 1 >= MAX_GROUP_SIZE:
        return f"the group has {MAX_GROUP_SIZE} members already"
    return None


def relayed_group_refusal(message) -> Optional[str]:
    """Why a follower refuses the group its leader relays (a hivemind ``MessageFromLeader`` with BEGIN_ALLREDUCE)
    before hivemind builds it, or None. Only sizes and counts are read: nothing is decoded."""
    num_members = len(message.ordered_peer_ids)
    if num_members > MAX_GROUP_SIZE:
        return f"a group of {num_members} members (at most {MAX_GROUP_SIZE})"
    if len(message.gathered) != num_members:
        return f"{len(message.gathered)} records for {num_members} members"
    if any(len(peer_id) > MAX_PEER_ID_BYTES for peer_id in message.ordered_peer_ids):
        return f"a peer id over {MAX_PEER_ID_BYTES} bytes"
    largest = max((len(record) for record in message.gathered), default=0)
    if largest > MAX_GATHERED_BYTES:
        return f"a gathered record of {largest} bytes (at most {MAX_GATHERED_BYTES})"
    return None
