"""Issue 16 §4 without a network: what a peer's message may declare before this process allocates for it.

:func:`~p2p_diloco.compression.codecs.decode_tensor` reads only the compression/dtype pairs this version sends and
checks a message's shape and length before allocating anything; the message cap refuses a length header before the
bytes are read; the state gate bounds the streams served and ends those whose reader stalls. The attacks against
real hivemind peers are in ``tests/integration/test_wire_limits.py``."""

from __future__ import annotations

import asyncio
import math
import tracemalloc

import pytest
import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from p2p_diloco.compression import CODECS, decode_tensor
from p2p_diloco.swarm.averaging import limits
from p2p_diloco.swarm.averaging.hivemind_api import P2P
from p2p_diloco.swarm.averaging.limits import MessageTooLargeError, StateGate

SMALL_BYTES = 2**16  # more than any check should allocate; far less than what the attacks ask for


def message(name: str, tensor: torch.Tensor) -> runtime_pb2.Tensor:
    return CODECS[name].compress(tensor, CompressionInfo.from_tensor(tensor))


def altered(serialized: runtime_pb2.Tensor, **fields) -> runtime_pb2.Tensor:
    copy = runtime_pb2.Tensor()
    copy.CopyFrom(serialized)
    for name, value in fields.items():
        if name == "size":
            del copy.size[:]
            copy.size.extend(value)
        else:
            setattr(copy, name, value)
    return copy


def peak_bytes(function) -> int:
    """Peak bytes that Python and numpy allocated while ``function`` ran."""
    tracemalloc.start()
    try:
        function()
    except (ValueError, TypeError):
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


VOID = dict(dtype="V40000", size=[100], buffer=b"\x00" * 200)
VOID_KINDS = {"FLOAT16": runtime_pb2.FLOAT16, "MEANSTD_16BIT": runtime_pb2.MEANSTD_16BIT, "NONE": runtime_pb2.NONE}


@pytest.mark.parametrize("kind", VOID_KINDS)
def test_a_void_dtype_is_refused_before_numpy_allocates_for_it(kind):
    """A 200-byte part naming numpy's ``V40000`` made hivemind's FLOAT16 decoder allocate 40,000 bytes per value."""
    attack = runtime_pb2.Tensor(compression=VOID_KINDS[kind], **VOID)
    with pytest.raises(ValueError, match=f"compression {kind} and dtype 'V40000' is not one this version sends"):
        decode_tensor(attack)
    assert peak_bytes(lambda: decode_tensor(attack)) < SMALL_BYTES
    if kind == "FLOAT16":  # the reason: hivemind's decoder, handed the same bytes
        assert peak_bytes(lambda: deserialize_torch_tensor(attack)) >= 40_000 * 100


@pytest.mark.parametrize("compression, dtype", [
    (runtime_pb2.NONE, "float64"), (runtime_pb2.NONE, "int64"), (runtime_pb2.NONE, "bfloat16"),
    (runtime_pb2.NONE, "float16"), (runtime_pb2.FLOAT16, "float16"), (runtime_pb2.FLOAT16, "p2p_diloco:int8"),
    (runtime_pb2.MEANSTD_16BIT, "float32"), (runtime_pb2.QUANTILE_8BIT, "float32"),
    (runtime_pb2.UNIFORM_8BIT, "float32"), (runtime_pb2.BLOCKWISE_8BIT, "float32"), (99, "float32"),
    (runtime_pb2.NONE, "p2p_diloco:int2"), (runtime_pb2.NONE, "x" * 10_000),
])
def test_compression_and_dtype_pairs_this_version_never_sends_are_refused(compression, dtype):
    attack = runtime_pb2.Tensor(compression=compression, dtype=dtype, size=[4], buffer=b"\x00" * 16)
    with pytest.raises(ValueError, match="is not one this version sends") as refused:
        decode_tensor(attack)
    assert len(str(refused.value)) < 200  # a one-line error, whatever the message's dtype field holds


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int4"])
def test_what_this_version_sends_decodes_to_fp32_of_its_shape(name):
    x = torch.randn(37, 129, generator=torch.Generator().manual_seed(0))
    sent = altered(message(name, x), requires_grad=True)  # a claim the decoder ignores
    decoded = decode_tensor(sent, max_values=x.numel())
    assert decoded.dtype == torch.float32 and decoded.shape == x.shape and not decoded.requires_grad
    if name in ("fp32", "fp16"):
        assert torch.equal(decoded, x.half().float() if name == "fp16" else x)
    decoded += 1  # writable, not a view of the message's bytes


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int4"])
def test_a_shape_that_does_not_fit_the_payload_is_refused_before_allocating(name):
    good = message(name, torch.ones(600))
    # sizes are uint32 on the wire: 2**40 values (terabytes once decoded) take two dimensions or more
    for size in ([2**20, 2**20], [2**32 - 1] * 2, [2**32 - 1] * 8, [2**32 - 1]):
        attack = altered(good, size=size)
        with pytest.raises(ValueError, match="does not fit shape"):
            decode_tensor(attack)
        assert peak_bytes(lambda a=attack: decode_tensor(a)) < SMALL_BYTES
    with pytest.raises(ValueError, match="9 dimensions"):
        decode_tensor(altered(good, size=[1] * 9))
    for cut in (good.buffer[:-1], good.buffer + b"\x00"):
        with pytest.raises(ValueError, match="does not fit shape"):
            decode_tensor(altered(good, buffer=cut))


def test_max_values_bounds_the_declared_shape():
    sent = message("fp32", torch.ones(10, 10))
    assert decode_tensor(sent, max_values=100).shape == (10, 10)
    with pytest.raises(ValueError, match="holds 100 values, more than the 99 expected"):
        decode_tensor(sent, max_values=99)
    with pytest.raises(ValueError, match="more than the 99 expected"):
        decode_tensor(altered(sent, size=[2**20, 2**20]), max_values=99)


def _receive(data: bytes, eof: bool = True):
    async def receive():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        return await asyncio.wait_for(P2P.receive_raw_data(reader), timeout=5)
    return asyncio.run(receive())


def test_the_message_cap_refuses_a_length_header_before_reading_the_message():
    cap = limits.message_cap_bytes()
    assert cap == limits.MAX_MESSAGE_BYTES and getattr(P2P.receive_raw_data, "message_cap", False)
    with pytest.raises(MessageTooLargeError, match=f"a peer declared a message of {2**40} bytes"):
        _receive((2**40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER), eof=False)  # refused without waiting for them
    with pytest.raises(MessageTooLargeError):
        _receive((cap + 1).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER), eof=False)
    assert _receive((5).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"hello") == b"hello"
    with pytest.raises(asyncio.IncompleteReadError):  # a stream cut short is still hivemind's "closed"
        _receive((5).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"hel")


def test_the_message_cap_installs_once_and_a_later_call_moves_the_cap():
    installed = P2P.receive_raw_data
    try:
        limits.install_message_cap(1024)
        assert P2P.receive_raw_data is installed and limits.message_cap_bytes() == 1024
        with pytest.raises(MessageTooLargeError):
            _receive((1025).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER), eof=False)
    finally:
        limits.install_message_cap()
    assert limits.message_cap_bytes() == limits.MAX_MESSAGE_BYTES
    with pytest.raises(ValueError, match="at least 1 byte"):
        limits.install_message_cap(0)


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int4"])
def test_the_cap_is_far_above_every_message_an_honest_peer_sends(name):
    """hivemind cuts parts at part_size_bytes after compression and state tensors into 64 KiB chunks: the cap does
    not depend on the model."""
    bytes_per_value = 4 * CODECS[name].estimate_compression_ratio(CompressionInfo.from_tensor(torch.ones(1)))
    part = torch.randn(int(DEFAULT_PART_SIZE_BYTES / bytes_per_value))  # the largest part hivemind cuts
    sent = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g" * 64,
                                       tensor_part=message(name, part), weight=1.0)
    assert sent.ByteSize() * 64 < limits.MAX_MESSAGE_BYTES
    chunks = split_for_streaming(message("fp32", torch.randn(2**20)))
    assert max(averaging_pb2.DownloadData(tensor_part=c, metadata=b"m" * 2**16).ByteSize() for c in chunks) * 64 \
        < limits.MAX_MESSAGE_BYTES


class _State:
    """A state stream's messages; notes whether it was opened and whether its generator was closed."""

    def __init__(self, num_messages: int = 100):
        self.num_messages, self.opened, self.closed = num_messages, 0, asyncio.Event()

    async def stream(self):
        self.opened += 1
        try:
            for index in range(self.num_messages):
                yield index
        finally:
            self.closed.set()


def test_the_gate_serves_one_stream_per_peer_and_a_bounded_number_in_all_opening_no_other():
    async def main():
        gate = StateGate(max_streams=2, max_per_peer=1, stall_timeout_s=60, serve_timeout_s=60)
        a1, a2, b, c = _State(), _State(), _State(), _State()
        held_a, held_b = gate.serve("a", a1.stream), gate.serve("b", b.stream)
        assert await anext(held_a) == 0 and await anext(held_b) == 0  # two readers in the middle of their state
        assert [m async for m in gate.serve("a", a2.stream)] == []  # a second stream to a
        assert [m async for m in gate.serve("c", c.stream)] == []  # a third stream in all
        assert (a2.opened, c.opened) == (0, 0)  # nothing was copied for the refused requests
        assert gate.streams == {"a": 1, "b": 1}
        assert [m async for m in held_a] == list(range(1, 100)) and a1.closed.is_set()
        assert gate.streams == {"b": 1}
        assert len([m async for m in gate.serve("c", c.stream)]) == 100  # a slot is free again
        await held_b.aclose()  # the reader went away
        assert b.closed.is_set() and gate.streams == {}

    asyncio.run(main())


def test_a_stream_whose_reader_stalls_is_ended_and_its_state_dropped():
    async def main():
        gate = StateGate(max_streams=2, max_per_peer=1, stall_timeout_s=0.2, serve_timeout_s=60)
        state = _State()
        stalled = gate.serve("a", state.stream)
        assert await anext(stalled) == 0  # then the reader takes nothing more
        await asyncio.wait_for(state.closed.wait(), timeout=5)  # the state's generator (holding its copy) is closed
        assert gate.streams == {}  # and the slot free, although the reader still holds the stream
        assert [m async for m in stalled] == []  # a reader that wakes up gets nothing more

    asyncio.run(main())


def test_a_stream_that_is_not_done_in_time_is_ended():
    async def main():
        gate = StateGate(max_streams=2, max_per_peer=1, stall_timeout_s=60, serve_timeout_s=0.5)
        state, received = _State(), []
        async for index in gate.serve("a", state.stream):
            received.append(index)
            await asyncio.sleep(0.1)  # a reader that takes a message every 0.1 s
        assert 2 <= len(received) <= 6 and state.closed.is_set() and gate.streams == {}

    asyncio.run(main())


def test_the_gate_of_an_averager_uses_the_module_bounds(monkeypatch):
    class Averager:
        pass

    monkeypatch.setattr(limits, "MAX_STATE_STREAMS", 7)
    averager = Averager()
    gate = StateGate.of(averager)
    assert StateGate.of(averager) is gate and gate.max_streams == 7 and gate.max_per_peer == 1
    assert math.isclose(gate.stall_timeout_s, limits.STATE_STALL_TIMEOUT_S)
