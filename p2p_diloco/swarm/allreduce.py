"""A hivemind all-reduce whose result is bit-identical on every groupmate, with traffic counters.

hivemind's ``AllReduceRunner`` sends each sender ``average - sender's part`` and the sender adds it to
its own part, so groupmates end up a few ulps apart. DiLoCo needs every peer that saw the same average
to hold the *same* anchor, so here each reducer sends the average itself (encoded with the reducer's own
codec) and uses the decoded copy of the same bytes locally; its own contribution to the parts it reduces is
what its codec would have sent, as everyone else's. Decoding goes through our codec registry (which also
knows hivemind's) and checks every part's shape. The byte counters (payload bytes of the
protobuf messages, both directions) feed the per-round metrics.

Built on hivemind 1.1.12 internals (``AllReduceRunner``, ``TensorPartContainer``); the version is pinned.
Called only by :class:`p2p_diloco.swarm.averager.PseudoGradientAverager`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from p2p_diloco.compression.codecs import decode_tensor

logger = get_logger(__name__)

# indices into the shared int64 traffic counter tensor
BYTES_SENT, BYTES_RECEIVED = 0, 1


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce that returns the group average itself (not a difference), identical on all peers.

    Args:
        traffic: a shared int64 tensor of two counters (bytes sent, bytes received), updated in place.
        kwargs: everything ``AllReduceRunner`` takes.
    """

    def __init__(self, *, traffic: torch.Tensor, **kwargs):
        super().__init__(**kwargs)
        self._traffic = traffic
        container = self.tensor_part_container
        container.return_deltas = False  # a failed reducer's parts fall back to our own values, not zeros
        my_index = self.ordered_peer_ids.index(self.peer_id)
        self._my_part_infos = [info for _part, info in container._input_parts_by_peer[my_index]]

    def _encode_result(self, averaged_part: torch.Tensor, part_index: int):
        """The reducer encodes each averaged part once; every groupmate decodes the same bytes."""
        return self.tensor_part_container.compression.compress(
            averaged_part, self._my_part_infos[part_index], allow_inplace=False
        )

    async def _communicate_with_peer(self, peer_id: PeerID):
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            return await self._reduce_own_parts(peer_index)
        try:
            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            parts = self.tensor_part_container._input_parts_by_peer[peer_index]
            expected_shapes = [part.shape for part, _info in parts]

            def decode(message):
                if message.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
                return decode_tensor(message.tensor_part)

            part_index = 0
            async for averaged_part in amap_in_executor(decode, aiter_with_timeout(stream, self.reducer_timeout),
                                                        max_prefetch=self.tensor_part_container.prefetch):
                if part_index >= len(expected_shapes) or averaged_part.shape != expected_shapes[part_index]:
                    raise AllreduceException(f"{peer_id} sent an averaged part of the wrong shape")
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged_part)
                part_index += 1
            if part_index != len(expected_shapes):
                raise AllreduceException(f"{peer_id} sent {part_index} parts, {len(expected_shapes)} expected")
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"Caught {e!r} when communicating with {peer_id}", exc_info=True)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _reduce_own_parts(self, peer_index: int) -> None:
        """Reduce the parts this peer is responsible for; its own contribution is what the codec would send."""
        sender_index = self.sender_peer_ids.index(self.peer_id)
        loop = asyncio.get_event_loop()
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            sent = await loop.run_in_executor(None, lambda i=part_index, p=tensor_part: self._roundtrip(p, i))
            averaged_part = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, sent,
                                                                           weight=self.weight)
            local_copy = await loop.run_in_executor(
                None, lambda i=part_index, avg=averaged_part: decode_tensor(self._encode_result(avg, i))
            )
            self.tensor_part_container.register_processed_part(peer_index, part_index, local_copy)

    def _roundtrip(self, part: torch.Tensor, part_index: int) -> torch.Tensor:
        return decode_tensor(self.tensor_part_container.compression.compress(part, self._my_part_infos[part_index]))

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self._traffic[BYTES_SENT] += message.ByteSize()
            yield message

    def _get_peer_stub(self, peer: PeerID):
        return _CountingStub(super()._get_peer_stub(peer), self._traffic)

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        """As in hivemind, but the reply is the encoded average rather than ``average - sender's part``."""
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight in amap_in_executor(
                lambda msg: (decode_tensor(msg.tensor_part), msg.weight),
                _count_received(stream, self._traffic),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if part_index >= self.tensor_part_reducer.num_parts or \
                        tensor_part.shape != self.tensor_part_reducer.part_shapes[part_index]:
                    raise AllreduceException(f"sender {sender_index} sent a part of the wrong shape")
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                except BannedException:
                    break  # the sender was banned in the meantime: it gets nothing more
                serialized = await loop.run_in_executor(
                    None, lambda i=part_index, avg=averaged_part: self._encode_result(avg, i)
                )
                part_index += 1
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self._traffic[BYTES_SENT] += reply.ByteSize()
                yield reply
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class _CountingStub:
    """Wraps a groupmate's stub so that the averaged parts it returns are counted as received bytes."""

    def __init__(self, stub, traffic: torch.Tensor):
        self._stub, self._traffic = stub, traffic

    async def rpc_aggregate_part(self, inputs):
        return _count_received(await self._stub.rpc_aggregate_part(inputs), self._traffic)


async def _count_received(stream: AsyncIterator, traffic: torch.Tensor) -> AsyncIterator:
    async for message in stream:
        traffic[BYTES_RECEIVED] += message.ByteSize()
        yield message
