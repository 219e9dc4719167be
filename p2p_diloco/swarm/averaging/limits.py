"""Bounds on the memory a peer can make this process spend: one message's size, and the state streams it serves.

- **Messages.** hivemind's ``P2P.receive_raw_data`` reads an 8-byte length header and then buffers as many bytes as
  it declares, before any handler (and any allowlist check) of ours sees the message: one peer could make this
  process buffer up to 2**64 bytes per stream. :func:`install_message_cap` replaces it, for the whole process, with a
  copy that refuses a declared length above :data:`MAX_MESSAGE_BYTES` before reading it; hivemind closes a stream
  whose read raises, and goes on serving the others. The cap does not depend on the model: hivemind cuts what an
  honest peer sends into messages of bounded size (all-reduce parts of ``part_size_bytes``, 512 KiB after
  compression, plus our codecs' scales; state tensors in chunks of 64 KiB; metadata of a few KiB), so 64 MiB is two
  orders of magnitude above the largest honest message, whatever the model. It is installed on import: every process
  that runs averaging code imports this module through :mod:`~p2p_diloco.swarm.averaging.guard`, and the averager's
  and the DHT's background processes are forked from one that did. (The DHT's own requests are unary calls, which
  the p2p daemon bounds itself: 4 MiB.) Upstream fix to suggest: a ``max_msg_size`` of ``P2P`` checked in
  ``receive_raw_data``, as the daemon's ``persistent_conn_max_msg_size`` is for unary calls.
- **State streams.** Every state request makes the training process copy the stage's anchor and momentum, and the
  stream holds that copy until its reader has read it all. :class:`StateGate` serves at most
  :data:`MAX_STATE_STREAMS` streams at once, one per peer, refusing the others before any copy is made (a refused
  stream ends with no data: the downloader moves on to its next donor); a stream whose reader reads nothing for
  :data:`STATE_STALL_TIMEOUT_S` or is not done after :data:`STATE_SERVE_TIMEOUT_S` is ended and its copy dropped.
  Called by :meth:`~p2p_diloco.swarm.averaging.guard.GuardedAverager.rpc_download_state`.

The hivemind internal replaced here is imported through :mod:`~p2p_diloco.swarm.averaging.hivemind_api`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Optional, TypeVar

from p2p_diloco.swarm.averaging.hivemind_api import P2P

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 2**20  # see the module docstring: > 100x the largest message an honest peer sends
MAX_STATE_STREAMS = 4  # state streams served at once; each holds a copy of anchor and momentum
MAX_STATE_STREAMS_PER_PEER = 1
STATE_STALL_TIMEOUT_S = 30.0  # an honest reader takes a 64 KiB chunk in well under a second
STATE_SERVE_TIMEOUT_S = 600.0  # a whole state; honest downloaders give up sooner (train.state_timeout_s)

T = TypeVar("T")


class MessageTooLargeError(ValueError):
    """A peer declared a message larger than this process accepts."""


_cap = {"bytes": MAX_MESSAGE_BYTES}


def install_message_cap(max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Refuse every message above ``max_bytes`` that this process's hivemind ``P2P`` receives (idempotent; a later
    call only changes the cap)."""
    if max_bytes < 1:
        raise ValueError(f"a message cap must be at least 1 byte, got {max_bytes}")
    _cap["bytes"] = max_bytes
    if getattr(P2P.receive_raw_data, "message_cap", False):
        return

    @functools.wraps(P2P.receive_raw_data)
    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > _cap["bytes"]:
            raise MessageTooLargeError(f"a peer declared a message of {length} bytes, more than this process accepts "
                                       f"({_cap['bytes']}): stream closed")
        return await reader.readexactly(length)

    receive_raw_data.message_cap = True
    P2P.receive_raw_data = staticmethod(receive_raw_data)


def message_cap_bytes() -> int:
    """The largest message this process accepts."""
    return _cap["bytes"]


class StateGate:
    """The state streams an averager serves (in its background process): how many, to whom, for how long.

    Args:
        max_streams: streams served at once, to all peers.
        max_per_peer: streams served at once to one peer.
        stall_timeout_s: a stream whose reader takes no message for this long is ended.
        serve_timeout_s: a stream not done after this long is ended.
    """

    def __init__(self, max_streams: int, max_per_peer: int, stall_timeout_s: float, serve_timeout_s: float):
        self.max_streams, self.max_per_peer = max_streams, max_per_peer
        self.stall_timeout_s, self.serve_timeout_s = stall_timeout_s, serve_timeout_s
        self.streams: Counter[str] = Counter()  # peer -> streams being served to it
        self._closing: set[asyncio.Task] = set()

    @classmethod
    def of(cls, averager) -> StateGate:
        """The gate of an averager (made on first use, in its background process), with this module's bounds."""
        gate = vars(averager).get("_state_gate")
        if gate is None:
            gate = averager._state_gate = cls(MAX_STATE_STREAMS, MAX_STATE_STREAMS_PER_PEER, STATE_STALL_TIMEOUT_S,
                                              STATE_SERVE_TIMEOUT_S)
        return gate

    def refuses(self, peer: str) -> Optional[str]:
        """Why a new stream to ``peer`` is not served now, or None."""
        if self.streams[peer] >= self.max_per_peer:
            return f"{self.streams[peer]} state stream(s) to it already"
        if sum(self.streams.values()) >= self.max_streams:
            return f"{self.max_streams} state streams served already"
        return None

    async def serve(self, peer_id, open_stream: Callable[[], AsyncIterator[T]]) -> AsyncIterator[T]:
        """The messages of ``open_stream()`` (called only if the stream is admitted), while the gate allows."""
        peer = str(peer_id)
        reason = self.refuses(peer)
        if reason is not None:
            logger.info(f"Refused to serve state to {peer}: {reason}")
            return
        self.streams[peer] += 1
        released, closing = [], []

        def release() -> None:
            if not released:
                released.append(True)
                self.streams[peer] -= 1
                if not self.streams[peer]:
                    del self.streams[peer]

        def end(why: str) -> None:
            """Runs while the reader holds this stream (it is not taking messages): end it and drop its state."""
            logger.warning(f"Stopped serving state to {peer}: {why}")
            release()
            task = asyncio.ensure_future(_close(messages))
            closing.append(task)
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

        messages = open_stream()
        deadline = time.monotonic() + self.serve_timeout_s
        loop = asyncio.get_running_loop()
        try:
            async for message in messages:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning(f"Stopped serving state to {peer}: not done after {self.serve_timeout_s:g} s")
                    break
                stalled = remaining > self.stall_timeout_s
                watchdog = loop.call_later(min(self.stall_timeout_s, remaining), end,
                                           f"it read nothing for {self.stall_timeout_s:g} s" if stalled
                                           else f"not done after {self.serve_timeout_s:g} s")
                try:
                    yield message
                finally:
                    watchdog.cancel()
                if closing:
                    break
        finally:
            release()
            await (closing[0] if closing else _close(messages))


async def _close(messages: AsyncIterator) -> None:
    """Close a state stream's generator (its frame holds the state), unless it is closing already."""
    with contextlib.suppress(RuntimeError):  # aclose() of a generator another task is closing
        await messages.aclose()


install_message_cap()
