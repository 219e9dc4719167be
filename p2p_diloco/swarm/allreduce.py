"""A hivemind all-reduce whose result is bit-identical on every groupmate, with traffic counters.

hivemind's ``AllReduceRunner`` sends each sender ``average - sender's part`` and the sender adds it to
its own part, so groupmates end up a few ulps apart. DiLoCo needs every peer that saw the same average
to hold the *same* anchor, so here each reducer sends the average itself (encoded with the reducer's own
codec) and uses the decoded copy of the same bytes locally. The byte counters (payload bytes of the
protobuf messages, both directions) feed the per-round metrics.

Built on hivemind 1.1.12 internals (``AllReduceRunner``, ``TensorPartContainer``); the version is pinned.
Called only by :class:`p2p_diloco.swarm.averager.PseudoGradientAverager`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import BannedException
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

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
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        loop = asyncio.get_event_loop()
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged_part = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, tensor_part, weight=self.weight
            )
            local_copy = await loop.run_in_executor(
                None, lambda i=part_index, avg=averaged_part: deserialize_torch_tensor(self._encode_result(avg, i))
            )
            self.tensor_part_container.register_processed_part(peer_index, part_index, local_copy)

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
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight),
                _count_received(stream, self._traffic),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
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
