"""Downloading a stage's state from donors the caller chose, every message checked before it is used.

What a donor sends is bounded as it arrives: one metadata message of at most :data:`MAX_STATE_METADATA_BYTES`, at
most one tensor per template twice over (anchor and momentum), each fp32 of exactly its template's shape; a donor
that sends more, another layout, or too slowly for what is left of the bound, is dropped for the next one. The
caller chooses the donors (from the swarm's signed records: ``training.fetch``), not the priority each averager
declares for itself in hivemind's unsigned ``all_averagers`` key.

Runs in the averager's background process (:meth:`p2p_diloco.swarm.averaging.server.AveragingServer.download_from`);
what a donor serves is :class:`~p2p_diloco.swarm.averaging.server.AveragingServer`'s ``rpc_download_state``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Optional

import torch

from p2p_diloco.hivemind_adapter.averaging import PeerID, averaging_pb2, p2p_of

logger = logging.getLogger(__name__)

MAX_STATE_METADATA_BYTES = 1 << 16  # an honest donor's metadata is a few hundred bytes
NEXT_DONOR_SHARE = 0.6  # of the time left, what one donor gets when others are still to be asked


def check_state_header(header, shape: tuple) -> None:
    """The first chunk of a tensor of a downloaded state must name it fp32, uncompressed (what hivemind's state
    sharing sends by default), of exactly ``shape``; anything else is a ValueError, raised before any allocation."""
    if header.compression != 0 or header.dtype != "float32" or tuple(header.size) != tuple(shape):
        raise ValueError(f"a state tensor is not fp32 of shape {list(shape)} (compression {header.compression}, "
                         f"dtype {header.dtype[:32]!r}, size {list(header.size)[:8]})")


class _Receiving:
    """One tensor of a downloaded state as its chunks arrive: written straight into a tensor of the expected shape in
    shared memory (the training process then gets a handle to it, not a copy; joining the chunks and decoding them
    made two more copies of each tensor, and the pipe's pickler a third)."""

    def __init__(self, shape: tuple):
        self.tensor = torch.empty(shape, dtype=torch.float32).share_memory_()
        self.target = memoryview(self.tensor.numpy()).cast("B")
        self.size = 0

    def write(self, chunk: bytes, index: int) -> None:
        end = self.size + len(chunk)
        if end > self.target.nbytes:
            raise ValueError(f"the donor's tensor {index} is larger than its shape {list(self.tensor.shape)}")
        self.target[self.size:end] = chunk
        self.size = end

    def finish(self, index: int) -> torch.Tensor:
        if self.size != self.target.nbytes:  # the donor left (or stopped) inside a tensor
            raise ValueError(f"the donor's stream ended inside tensor {index} ({self.size} of {self.target.nbytes} "
                             "bytes)")
        self.target.release()
        return self.tensor


async def download_from(server, donors: Sequence[str], timeout_s: float) -> Optional[tuple[dict, list]]:
    """(metadata, tensors) from the first of ``donors`` (base58 peer ids, in the order to ask them) that serves a
    well-formed state, or None; never longer than ``timeout_s`` in all. ``server`` is the asking averager: its own
    id, banned peers and outsiders are skipped."""
    deadline = time.monotonic() + timeout_s
    for index, donor in enumerate(donors):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        peer_id = PeerID.from_base58(donor)
        if peer_id == server.peer_id or server.guard.refuses(peer_id) is not None:
            continue
        # a donor that trickles its bytes gets a share of the bound, not all of it (the next donors are left the
        # rest); hivemind's per-message timeout alone let one slow donor hold a download forever
        share = remaining if index == len(donors) - 1 else remaining * NEXT_DONOR_SHARE
        try:
            state = await asyncio.wait_for(download_one(server, peer_id), timeout=share)
        except Exception as e:
            logger.warning(f"State download from {donor} failed: {type(e).__name__}: {e}")
            continue
        if state is not None:
            logger.info(f"Downloaded this stage's state from {donor}")
            return state
    return None


async def download_one(server, peer_id) -> Optional[tuple[dict, list]]:
    """One donor's state, checked for size and layout as it arrives (see the module's docstring)."""
    shapes = [tuple(t.shape) for t in server.residuals] * 2  # anchor, then momentum
    stub = server.get_stub(p2p_of(server), peer_id, namespace=server.prefix)
    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
    metadata, tensors, receiving = None, [], None
    async for message in stream:
        if message.metadata:
            if metadata is not None or len(message.metadata) > MAX_STATE_METADATA_BYTES:
                raise ValueError("the donor sent more than one metadata message, or one too large")
            metadata = server.serializer.loads(message.metadata)
        part = message.tensor_part
        if part.dtype:  # the first chunk of a tensor names its dtype (hivemind's split_for_streaming)
            if receiving is not None:
                tensors.append(receiving.finish(len(tensors)))
            if len(tensors) >= len(shapes):
                raise ValueError(f"the donor sent more than the {len(shapes)} tensors of this stage's state")
            check_state_header(part, shapes[len(tensors)])
            receiving = _Receiving(shapes[len(tensors)])
        elif receiving is None and part.buffer:
            raise ValueError("the donor sent tensor bytes before naming a tensor")
        if part.buffer:
            receiving.write(part.buffer, len(tensors))
    if receiving is not None:
        tensors.append(receiving.finish(len(tensors)))
    if not isinstance(metadata, dict):
        logger.debug(f"Peer {peer_id} did not send its state")
        return None
    return metadata, tensors
