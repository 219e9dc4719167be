"""Issue 30 item 5 without a network: a groupmate's gathered record is bounded in size before it is decoded, and its
decoding in items and depth; a join request or a relayed group with an oversized record is refused before hivemind
keeps it. The attack against real averagers is in ``tests/integration/test_byzantine.py``."""

from __future__ import annotations

import time
import tracemalloc

import msgpack
import pytest
from hivemind.averaging.allreduce import AveragingMode
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer

from p2p_diloco.swarm.averaging.gathered import (
    MAX_GATHERED_BYTES,
    MAX_GROUP_SIZE,
    GatheredError,
    decode_record,
    join_refusal,
    relayed_group_refusal,
)
from p2p_diloco.swarm.averaging.guard import METADATA, PeerGuard, read_group
from tests.unit.test_robust import PEERS, group, record


def empty_maps(num_bytes: int) -> bytes:
    """A record whose metadata carries ``num_bytes`` empty msgpack maps (one Python dict each when decoded)."""
    info = MSGPackSerializer.loads(MSGPackSerializer.loads(record())[2])
    user_bytes = msgpack.packb(dict(info, padding=[{}] * num_bytes), use_bin_type=True)
    return MSGPackSerializer.dumps([None, AveragingMode.NODE.value, user_bytes])


def test_an_honest_record_decodes_and_is_far_below_the_cap():
    mode, info = decode_record(record(last_error=0.25))
    assert mode == AveragingMode.NODE and info["tokens"] == 1024.0 and info["last_error"] == 0.25
    assert len(record(last_error=0.25)) < MAX_GATHERED_BYTES / 16


def test_an_oversized_record_is_excluded_before_it_is_decoded():
    """2 MiB of empty maps in a groupmate's record: refused on its length, in microseconds and without allocating
    (decoded, it cost over 100 MiB and a second of the event loop)."""
    fat = empty_maps(2 * 2**20)
    guard = PeerGuard(ban_after=3)
    tracemalloc.start()
    started = time.monotonic()
    try:
        view = read_group(group(record(), fat, record()), MSGPackSerializer, PEERS[0], guard, 2.0)
        elapsed = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert PEERS[1] not in view.infos and view.modes[1] == AveragingMode.AUX
    assert guard.report(5).suspects == {str(PEERS[1]): [METADATA]}
    assert peak < 2**20 and elapsed < 0.5, (peak, elapsed)


@pytest.mark.parametrize("raw", [
    b"\x91" * 3000 + b"\xc0",  # 3000 nested arrays: deeper than msgpack's stack
    msgpack.packb([None, 0, msgpack.packb({"padding": [{}] * 1000})]),  # within the cap, but 1000 items
    msgpack.packb([None, 0, msgpack.packb(msgpack.ExtType(64, b"\x90"))]),  # an extension type (hivemind's tuple)
    msgpack.packb([None, 0, b"\xc1"]),  # a byte msgpack never writes
    msgpack.packb([None, 0, msgpack.packb({"round": 1}), b"extra"]),
    msgpack.packb([None, 0, msgpack.packb({"round": 1})]) + b"trailing",
    msgpack.packb([None, True, msgpack.packb({})]),
    msgpack.packb({1: 2}),
])
def test_decoding_is_bounded_and_only_the_refusal_error_escapes(raw):
    assert len(raw) <= MAX_GATHERED_BYTES
    with pytest.raises(GatheredError):
        decode_record(raw)


def test_a_join_request_with_an_oversized_record_is_refused_and_a_full_group_too():
    honest = averaging_pb2.JoinRequest(gather=record())
    assert join_refusal(honest, num_followers=3) is None
    assert "bytes" in join_refusal(averaging_pb2.JoinRequest(gather=b"\x80" * (MAX_GATHERED_BYTES + 1)), 3)
    assert "members already" in join_refusal(honest, num_followers=MAX_GROUP_SIZE - 1)


def test_a_relayed_group_is_refused_on_sizes_and_counts_before_anything_is_decoded():
    def begin(peer_ids, gathered):
        return averaging_pb2.MessageFromLeader(code=averaging_pb2.BEGIN_ALLREDUCE, group_id=b"g",
                                               ordered_peer_ids=peer_ids, gathered=gathered)

    ids = [p.to_bytes() for p in PEERS[:3]]
    assert relayed_group_refusal(begin(ids, [record()] * 3)) is None
    assert "records for" in relayed_group_refusal(begin(ids, [record()] * 2))
    assert "bytes" in relayed_group_refusal(begin(ids, [record(), empty_maps(MAX_GATHERED_BYTES), record()]))
    assert "peer id" in relayed_group_refusal(begin(ids[:2] + [b"\x00" * 4096], [record()] * 3))
    many = [bytes([0x12, 0x20]) + i.to_bytes(32, "big") for i in range(MAX_GROUP_SIZE + 1)]
    assert "members" in relayed_group_refusal(begin(many, [b""] * len(many)))
