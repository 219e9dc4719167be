"""Issue 16 §4 without a network: what a peer's message may declare before this process allocates for it.

:func:`~p2p_diloco.compression.codecs.decode_tensor` reads only the compression/dtype pairs this version sends and
checks a message's shape and length before allocating anything; the message cap refuses a length header before the
bytes are read; the state gate bounds the streams served, ends those whose reader stalls or falls below the
minimum rate (and cools their peers down), and gives the slowest stream's slot to a new reader. The attacks against
real hivemind peers are in ``tests/integration/test_wire_limits.py``."""

from __future__ import annotations

import asyncio
import math
import time
import tracemalloc

import pytest
import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from p2p_diloco.compression import CODECS, decode_tensor
from p2p_diloco.config import AveragingConfig, ConfigError
from p2p_diloco.hivemind_adapter.p2p import P2P
from p2p_diloco.swarm.averaging import limits
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
    # a zero dimension holds no values, but huge others overflowed torch's strides (a RuntimeError, found by
    # test_hostile_properties): refused with the shapes too large to be a model's
    for size in ([2**20, 2**20], [2**32 - 1] * 2, [2**32 - 1] * 8, [2**32 - 1], [0, 281675, 4032797, 8119608]):
        attack = altered(good, size=size)
        with pytest.raises(ValueError, match="does not fit shape|multiply past"):
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


CHUNK = b"x" * 1000  # one message of a state stream


class _State:
    """A state stream's messages; notes whether it was opened and whether its generator was closed."""

    def __init__(self, num_messages: int = 100):
        self.num_messages, self.opened, self.closed = num_messages, 0, asyncio.Event()

    async def stream(self):
        self.opened += 1
        try:
            for _ in range(self.num_messages):
                yield CHUNK
        finally:
            self.closed.set()


def make_gate(max_streams: int = 2, min_bytes_per_s: float = 1.0, stall_timeout_s: float = 60.0,
              cooldown_s: float = 60.0) -> StateGate:
    return StateGate(max_streams, min_bytes_per_s, stall_timeout_s, cooldown_s)


def serve(gate: StateGate, peer: str, state: _State):
    return gate.serve(peer, state.stream, len)


async def read(gate: StateGate, peer: str, state: _State, every_s: float = 0.0, received: list = None) -> list:
    """A reader in a task of its own (as hivemind's handler task is: the gate cancels it to end its stream)."""
    received = [] if received is None else received
    async for message in serve(gate, peer, state):
        received.append(message)
        await asyncio.sleep(every_s)
    return received


def test_the_gate_serves_one_stream_per_peer_and_a_bounded_number_in_all_opening_no_other():
    async def main():
        gate = make_gate()
        a1, a2, b, c = _State(), _State(), _State(), _State()
        held_a, held_b = serve(gate, "a", a1), serve(gate, "b", b)
        assert await anext(held_a) == CHUNK and await anext(held_b) == CHUNK  # two readers in their state
        assert [m async for m in serve(gate, "a", a2)] == []  # a second stream to a
        assert [m async for m in serve(gate, "c", c)] == []  # a third, while both are too young to be preempted
        assert (a2.opened, c.opened) == (0, 0)  # nothing was copied for the refused requests
        assert set(gate.streams) == {"a", "b"}
        assert len([m async for m in held_a]) == 99 and a1.closed.is_set()
        assert set(gate.streams) == {"b"}
        assert len([m async for m in serve(gate, "c", c)]) == 100  # a slot is free again
        await held_b.aclose()  # the reader went away: no offence
        assert b.closed.is_set() and gate.streams == {} and not gate.cooled

    asyncio.run(main())


def test_a_stream_whose_reader_stalls_is_ended_its_state_dropped_and_its_peer_cooled_down():
    async def main():
        gate = make_gate(stall_timeout_s=0.2, cooldown_s=1.0)
        state, received = _State(), []
        stalled = asyncio.ensure_future(read(gate, "a", state, every_s=60, received=received))
        await asyncio.wait_for(state.closed.wait(), timeout=5)  # the state's generator (holding its copy) is closed
        with pytest.raises(asyncio.CancelledError):  # and the task writing it cancelled: its socket closes
            await asyncio.wait_for(stalled, timeout=5)
        assert len(received) == 1 and gate.streams == {} and "a" in gate.cooled
        again = _State()
        assert await read(gate, "a", again) == [] and again.opened == 0  # cooled down: refused, nothing copied
        assert len(await read(gate, "b", _State())) == 100  # the slot is free for the others
        await asyncio.sleep(1.0)
        assert len(await read(gate, "a", again)) == 100  # the cooldown is over

    asyncio.run(main())


@pytest.mark.parametrize("every_s, served_in_full", [(0.02, True), (0.2, False)])
def test_a_stream_must_keep_the_minimum_rate_after_its_head_start(every_s, served_in_full):
    """10 KB/s at least after a head start of 0.3 s: a reader of a 1 KB message every 0.02 s (50 KB/s) is served to
    the end; one every 0.2 s (5 KB/s, never stalling for 0.3 s) falls behind once 10 KB/s x (t - 0.3 s) exceeds what
    it took: at 0.4 s, as it had taken one message."""
    async def main():
        gate = make_gate(min_bytes_per_s=10_000, stall_timeout_s=0.3)
        state, received = _State(num_messages=40), []
        started = time.monotonic()
        try:
            await asyncio.wait_for(read(gate, "a", state, every_s=every_s, received=received), timeout=10)
        except asyncio.CancelledError:
            assert not served_in_full
        took = time.monotonic() - started
        assert state.closed.is_set() and gate.streams == {}
        if served_in_full:
            assert len(received) == 40 and not gate.cooled
        else:
            assert 0.3 < took < 1.5 and len(received) <= 6 and "a" in gate.cooled, (took, len(received))

    asyncio.run(main())


def test_a_full_gate_gives_the_slowest_old_streams_slot_to_a_new_reader(monkeypatch):
    monkeypatch.setattr(limits, "PREEMPT_AFTER_S", 0.2)

    async def main():
        gate = make_gate()
        squatted, fast = _State(), _State(num_messages=10**6)
        squatter = asyncio.ensure_future(read(gate, "squatter", squatted, every_s=30))  # one message, then waits
        reader = asyncio.ensure_future(read(gate, "fast", fast, every_s=0.005))
        await asyncio.sleep(0.4)
        newcomer = _State()
        assert len(await read(gate, "newcomer", newcomer)) == 100  # it took the squatter's slot
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(squatter, timeout=5)
        assert squatted.closed.is_set() and "squatter" not in gate.cooled  # preempted, not punished
        assert set(gate.streams) == {"fast"} and not reader.done()
        slow = asyncio.ensure_future(read(gate, "slow", _State(), every_s=30))
        await asyncio.sleep(0.4)
        again = _State()
        assert await read(gate, "squatter", again) == [] and again.opened == 0  # it takes no other's slot now
        assert len(await read(gate, "other", _State())) == 100  # another does: the slowest's
        assert slow.cancelled() and set(gate.streams) == {"fast"}
        reader.cancel()

    asyncio.run(main())


def test_an_old_fast_stream_keeps_its_slot_when_the_slower_ones_are_young(monkeypatch):
    """The slowest stream is preempted only once it has run PREEMPT_AFTER_S. Before, the slowest of the *old* streams
    was: squatters whose streams had just been admitted again left the one honest reader as the only old stream,
    and the next squatter to knock took its slot 98% into its download (a fresh-clone run of the test below's
    network twin)."""
    monkeypatch.setattr(limits, "PREEMPT_AFTER_S", 0.3)

    async def main():
        gate = make_gate(max_streams=3)
        honest = _State(num_messages=10**6)
        reader = asyncio.ensure_future(read(gate, "honest", honest, every_s=0.005))
        await asyncio.sleep(0.4)  # old, and fast
        squatters = [asyncio.ensure_future(read(gate, f"squatter{i}", _State(), every_s=30)) for i in range(2)]
        await asyncio.sleep(0.05)  # young, and slow
        knocking = _State()
        assert await read(gate, "squatter2", knocking) == [] and knocking.opened == 0
        assert set(gate.streams) == {"honest", "squatter0", "squatter1"} and not reader.done()
        await asyncio.sleep(0.4)  # now the slow ones are old: the slowest of them goes
        assert len(await read(gate, "newcomer", _State())) == 100
        assert "honest" in gate.streams and not reader.done()
        assert sum(task.cancelled() for task in squatters) == 1
        for task in [reader, *squatters]:
            task.cancel()
        await asyncio.gather(reader, *squatters, return_exceptions=True)

    asyncio.run(main())


def test_squatters_that_reconnect_do_not_keep_out_a_reader_faster_than_them(monkeypatch):
    """Issue 30 item 6 without a network: three identities hold both slots, each taking a message every 0.4 s (under
    the stall timeout) and reconnecting as soon as they lose their stream. A newcomer that reads faster than they do
    gets its whole state, and keeps its slot until it is done."""
    monkeypatch.setattr(limits, "PREEMPT_AFTER_S", 0.2)

    async def squat(gate: StateGate, peer: str) -> None:
        while True:  # a stream the gate ends (its task cancelled) is followed by the next at once
            await asyncio.wait({asyncio.ensure_future(read(gate, peer, _State(num_messages=10**6), every_s=0.4))})
            await asyncio.sleep(0.01)

    async def main():
        gate = make_gate(min_bytes_per_s=1000, stall_timeout_s=0.5)
        squatters = [asyncio.ensure_future(squat(gate, f"squatter{i}")) for i in range(3)]
        try:
            await asyncio.sleep(0.5)
            assert len(gate.streams) == 2
            started, received = time.monotonic(), []
            while not received and time.monotonic() - started < 5:
                # refused while both streams are younger than PREEMPT_AFTER_S, it asks again, as a downloader
                # does after its other donors (a loaded machine can make every ask land in a squatter's first 0.2 s)
                received = await asyncio.wait_for(read(gate, "honest", _State(num_messages=200), every_s=0.005),
                                                  timeout=10)
                await asyncio.sleep(0 if received else 0.05)
            assert len(received) == 200 and time.monotonic() - started < 5
        finally:
            for task in squatters:
                task.cancel()
            await asyncio.gather(*squatters, return_exceptions=True)

    asyncio.run(main())


def test_the_peers_cooling_down_are_bounded(monkeypatch):
    monkeypatch.setattr(limits, "MAX_COOLED_PEERS", 3)

    async def main():
        gate = make_gate(max_streams=8, stall_timeout_s=0.05)
        readers = [asyncio.ensure_future(read(gate, f"p{i}", _State(), every_s=60)) for i in range(5)]
        await asyncio.gather(*readers, return_exceptions=True)
        assert list(gate.cooled) == ["p2", "p3", "p4"]  # the oldest forgotten first

    asyncio.run(main())


def test_the_gate_of_an_averager_uses_its_averaging_config():
    class Averager:
        cfg = AveragingConfig(state_streams=7, state_min_mbit=8.0, state_stall_s=5.0, state_cooldown_s=9.0)

    averager = Averager()
    gate = StateGate.of(averager)
    assert StateGate.of(averager) is gate and gate.max_streams == 7
    assert (gate.min_bytes_per_s, gate.stall_timeout_s, gate.cooldown_s) == (1e6, 5.0, 9.0)


@pytest.mark.parametrize("field, value", [("state_streams", 0), ("state_streams", 1.5), ("state_min_mbit", 0.0),
                                          ("state_min_mbit", math.inf), ("state_stall_s", -1.0),
                                          ("state_cooldown_s", math.nan)])
def test_state_serving_bounds_are_checked(field, value):
    with pytest.raises(ConfigError, match=f"averaging.{field}"):
        AveragingConfig(**{field: value}).validate()
    AveragingConfig().validate()
