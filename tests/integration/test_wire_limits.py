"""Issue 16 §4 against real hivemind peers on 127.0.0.1: a length header declaring 2**40 bytes is refused before they
are buffered (the stream is closed, and the peer goes on serving others), in both directions; a donor serves a
bounded number of state streams, one per peer, and copies no state for the requests it refuses; a reader that stalls
loses its stream and is cooled down; and (issue 30 item 6) identities that squat every slot, reading slowly, keep
neither a 10 Mbit/s newcomer nor the project's downloader from the state."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import typing

import pytest
import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import as_aiter

from p2p_diloco.swarm import PseudoGradientAverager
from p2p_diloco.swarm.averaging.limits import MessageTooLargeError
from p2p_diloco.swarm.averaging.server import AveragingServer
from tests.integration.test_byzantine import CFG, TEMPLATES, network  # noqa: F401 (network: a fixture)

pytestmark = pytest.mark.timeout(120)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
ECHO, OVERSIZED = "test.echo", "test.oversized"
HUGE = 2**40


def header(length: int) -> bytes:
    return P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)


async def echo(requests: typing.AsyncIterator[averaging_pb2.AveragingData],
               context: P2PContext) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
    async for request in requests:
        yield request


async def oversized(_info: StreamInfo, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A hostile server: its reply declares 2**40 bytes."""
    writer.write(header(HUGE) + b"\x00" * 2**16)
    await writer.drain()
    await asyncio.sleep(30)


async def pair() -> tuple[P2P, P2P]:
    server = await P2P.create(host_maddrs=LOOPBACK)
    client = await P2P.create(host_maddrs=LOOPBACK, initial_peers=await server.get_visible_maddrs())
    await server.add_protobuf_handler(ECHO, echo, averaging_pb2.AveragingData, stream_input=True, stream_output=True)
    await server.add_binary_stream_handler(OVERSIZED, oversized)
    return server, client


async def ask_echo(client: P2P, server: P2P, payload: bytes) -> bytes:
    request = averaging_pb2.AveragingData(group_id=payload)
    replies = await client.iterate_protobuf_handler(server.peer_id, ECHO, as_aiter(request),
                                                    averaging_pb2.AveragingData)
    return b"".join([reply.group_id async for reply in replies])


async def attack(client: P2P, server: P2P, wait_s: float) -> bytes:
    """Open a stream to the echo handler, send a header declaring 2**40 bytes and 64 KiB of them, and read what comes
    back within ``wait_s`` (b"" once the server closed the stream)."""
    _info, reader, writer = await client.call_binary_stream_handler(server.peer_id, ECHO)
    try:
        writer.write(header(HUGE) + b"\x00" * 2**16)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=wait_s)
    finally:
        writer.close()


def test_a_header_declaring_2_40_bytes_is_refused_and_the_stream_closed_both_ways():
    async def main():
        server, client = await pair()
        try:
            assert await ask_echo(client, server, b"before") == b"before"
            started = time.monotonic()
            assert await attack(client, server, wait_s=15) == b""  # closed at once, nothing buffered, no reply
            assert time.monotonic() - started < 10
            assert await ask_echo(client, server, b"after") == b"after"  # the server goes on serving
            assert await ask_echo(client, server, b"x" * 2**20) == b"x" * 2**20  # honest sizes pass
            replies = await client.iterate_protobuf_handler(server.peer_id, OVERSIZED, as_aiter(), averaging_pb2.
                                                            AveragingData)
            with pytest.raises(MessageTooLargeError, match=f"declared a message of {HUGE} bytes"):
                await asyncio.wait_for(anext(replies), timeout=15)  # a reply that large is refused too
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())


def test_hivemind_alone_waits_to_buffer_what_the_header_declares(monkeypatch):
    """The hook's reason: with hivemind's own receive_raw_data, the same stream stays open, waiting for 2**40 bytes."""
    monkeypatch.setattr(P2P, "receive_raw_data", staticmethod(P2P.receive_raw_data.__wrapped__))

    async def main():
        server, client = await pair()
        try:
            with pytest.raises(asyncio.TimeoutError):
                await attack(client, server, wait_s=3)
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(main())


class _Provider:
    """A donor's state provider (runs in a thread of this process, one call at a time): its first call waits until
    the test lets it go; it counts the calls it started and the copies it made."""

    def __init__(self):
        self.started, self.copies, self.lock, self.go = 0, 0, threading.Lock(), threading.Event()

    def __call__(self):
        with self.lock:
            self.started += 1
        assert self.go.wait(timeout=60)
        with self.lock:
            self.copies += 1
        return {"served": True}, [torch.full(t.shape, 0.5) for t in TEMPLATES * 2]


async def download(client: P2P, donor: PseudoGradientAverager) -> tuple[int, float]:
    """(messages received, seconds taken) of one state request to ``donor``."""
    started = time.monotonic()
    stub = AveragingServer.get_stub(client, donor.peer_id, namespace=donor.prefix)
    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    count = 0
    async for _message in stream:
        count += 1
    return count, time.monotonic() - started


def test_a_donor_serves_one_stream_per_peer_and_a_bounded_number_in_all(network):  # noqa: F811
    donor = network.averager(cfg=dataclasses.replace(CFG, state_streams=2))
    provider = donor.state_provider = _Provider()
    maddrs = [str(m) for m in donor.dht.get_visible_maddrs()]

    async def until(condition: typing.Callable[[], bool], what: str) -> None:
        for _ in range(600):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"not within 30 s: {what}")

    async def main():
        clients = [await P2P.create(host_maddrs=LOOPBACK, initial_peers=maddrs) for _ in range(3)]
        try:
            a, b, c = clients
            # Step by step, whatever order a busy machine delivers concurrent requests in. a asks twice at once: one
            # stream is admitted (its copy starts and is held until `go`), the other refused with a slot still free
            # (one per peer). Then b and c ask at once: one takes the last slot, the other is refused (two in all).
            # The refused ones end at once, and nothing is copied for them.
            async def refused_one_of(tasks: list[asyncio.Future], what: str) -> None:
                await until(lambda: any(task.done() for task in tasks), f"one of {what} refused")
                done = [task.result() for task in tasks if task.done()]
                assert [count for count, _ in done] == [0], done

            from_a = [asyncio.ensure_future(download(a, donor)) for _ in range(2)]
            await refused_one_of(from_a, "a's two streams")
            await until(lambda: provider.started == 1, "a's other stream admitted")
            from_b_c = [asyncio.ensure_future(download(peer, donor)) for peer in (b, c)]
            await refused_one_of(from_b_c, "b's and c's streams")
            assert provider.copies == 0
            provider.go.set()
            results = [await task for task in from_a + from_b_c]
            served = [count > 0 for count, _ in results]
            assert served[:2].count(True) == 1 and served[2:].count(True) == 1, results
            assert provider.started == provider.copies == 2, results  # none made for a refused request
            count, _ = await download(c, donor)  # the streams are over: their slots are free again
            assert count > 0 and provider.copies == 3
        finally:
            for client in clients:
                await client.shutdown()

    asyncio.run(main())


def test_a_reader_that_stalls_loses_its_stream_and_is_cooled_down(network):  # noqa: F811
    """A reader takes the first chunk of an 8 MB state and no more (the donor's writes block: more than p2p's buffers
    hold). After the stall timeout its stream is ended (the donor closes it: the reader gets what p2p had buffered,
    then the end), its copy dropped and its slot free for another peer; the staller itself is refused for a while."""
    donor = network.averager(cfg=dataclasses.replace(CFG, state_streams=1, state_stall_s=2.0))
    donor.state_provider = lambda: ({"served": True}, [torch.zeros(2 * 2**20)])
    maddrs = [str(m) for m in donor.dht.get_visible_maddrs()]

    async def main():
        staller, other = [await P2P.create(host_maddrs=LOOPBACK, initial_peers=maddrs) for _ in range(2)]
        try:
            stub = AveragingServer.get_stub(staller, donor.peer_id, namespace=donor.prefix)
            stalled = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            await anext(stalled)
            await asyncio.sleep(4)
            rest = [message async for message in stalled]
            assert 1 + len(rest) < 2**23 // 2**16, len(rest)  # ended before its end (64 KiB chunks)
            assert (await download(staller, donor))[0] == 0  # cooled down
            assert (await download(other, donor))[0] == 2**23 // 2**16  # the slot is free
        finally:
            for client in (staller, other):
                await client.shutdown()

    asyncio.run(main())


CHUNK_BYTES = 2**16  # hivemind streams a state in chunks of 64 KiB
BIG = [torch.zeros(2**21)]  # a stage of 8 MiB: its state (16 MiB) is more than p2p's buffers hold


async def squat(client: P2P, donor: PseudoGradientAverager, holding: set, stop: asyncio.Event) -> None:
    """One identity of issue 30 item 6: it holds a state stream, taking one chunk every 5 s (under every stall
    timeout), and asks for a fresh stream every second, to take a slot back as soon as it lost one."""
    stub = AveragingServer.get_stub(client, donor.peer_id, namespace=donor.prefix)
    stream, read_at = None, 0.0
    while not stop.is_set():
        try:
            fresh = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
            await asyncio.wait_for(anext(fresh), timeout=10)
            stream, read_at = fresh, time.monotonic()  # admitted
            holding.add(str(client.peer_id))
        except (StopAsyncIteration, Exception):
            pass  # refused
        if stream is not None and time.monotonic() - read_at >= 5:
            with contextlib.suppress(StopAsyncIteration, Exception):
                await asyncio.wait_for(anext(stream), timeout=1)
            read_at = time.monotonic()
        await asyncio.sleep(1)


async def read_slowly(client: P2P, donor: PseudoGradientAverager, mbit: float) -> int:
    """Bytes of state that a downloader on a link of ``mbit`` Mbit/s gets from ``donor``."""
    stub = AveragingServer.get_stub(client, donor.peer_id, namespace=donor.prefix)
    received = 0
    async for message in await stub.rpc_download_state(averaging_pb2.DownloadRequest()):
        received += len(message.tensor_part.buffer)
        await asyncio.sleep(CHUNK_BYTES * 8 / (mbit * 1e6))
    return received


def test_slot_squatters_do_not_keep_honest_newcomers_from_the_state(network):  # noqa: F811
    """Issue 30 item 6: four identities each hold one of a donor's four state streams, reading a chunk every 5 s and
    asking again every second. An honest newcomer on a 10 Mbit/s link still gets the whole state, and so does the
    project's own downloader after it (before, both were refused for as long as the squatters kept at it)."""
    donor = PseudoGradientAverager(BIG, network.dht(), run_id="run", stage_index=0, num_stages=1, cfg=CFG)
    newcomer = PseudoGradientAverager(BIG, network.dht(), run_id="run", stage_index=0, num_stages=1, cfg=CFG)
    network.averagers += [donor, newcomer]
    assert CFG.state_streams == 4 and CFG.state_min_mbit <= 2  # the defaults
    donor.state_provider = lambda: ({"served": True}, [torch.full(t.shape, 0.5) for t in BIG * 2])
    maddrs = [str(m) for m in donor.dht.get_visible_maddrs()]

    async def main():
        clients = [await P2P.create(host_maddrs=LOOPBACK, initial_peers=maddrs) for _ in range(5)]
        holding, stop = set(), asyncio.Event()
        squatters = [asyncio.ensure_future(squat(client, donor, holding, stop)) for client in clients[:4]]
        try:
            for _ in range(600):
                if len(holding) == 4:
                    break
                await asyncio.sleep(0.05)
            assert len(holding) == 4, holding  # every slot taken
            await asyncio.sleep(3)
            started = time.monotonic()
            assert await asyncio.wait_for(read_slowly(clients[4], donor, mbit=10), timeout=60) == 2 * 4 * 2**21
            assert time.monotonic() - started < 30  # 13.4 s of transfer at 10 Mbit/s
            downloaded = await asyncio.to_thread(newcomer.download_state, [str(donor.peer_id)], 20)
            assert downloaded is not None and downloaded[0] == {"served": True}
            assert all(torch.equal(t, torch.full(t.shape, 0.5)) for t in downloaded[1])
        finally:
            stop.set()
            await asyncio.gather(*squatters, return_exceptions=True)
            for client in clients:
                await client.shutdown()

    asyncio.run(main())
