"""Bounds on the memory a peer can make this process spend: one message's size, and the state streams it serves.

- **Messages.** hivemind's ``P2P.receive_raw_data`` reads an 8-byte length header and then buffers as many bytes as
  it declares, before any handler (and any allowlist check) of ours sees the message: one peer could make this
  process buffer up to 2**64 bytes per stream. :func:`install_message_cap` replaces it, for the whole process, with a
  copy that refuses a declared length above :data:`MAX_MESSAGE_BYTES` before reading it
  (:func:`~p2p_diloco.hivemind_adapter.p2p.cap_received_messages`); hivemind closes a stream whose read raises, and
  goes on serving the others. The cap does not depend on the model: hivemind cuts what an
  honest peer sends into messages of bounded size (all-reduce parts of ``part_size_bytes``, 512 KiB after
  compression, plus our codecs' scales; state tensors in chunks of 64 KiB; metadata of a few KiB), so 64 MiB is two
  orders of magnitude above the largest honest message, whatever the model. It is installed on import: every process
  that runs averaging code imports this module through :mod:`~p2p_diloco.swarm.averaging.guard`, and the averager's
  and the DHT's background processes are forked from one that did. (The DHT's own requests are unary calls, which
  the p2p daemon bounds itself: 4 MiB.)
- **State streams.** Every state request makes the training process copy the stage's anchor and momentum, and the
  stream holds that copy until its reader has read it all. :class:`StateGate` serves at most
  ``averaging.state_streams`` streams at once, one per peer, refusing the others before any copy is made (a refused
  stream ends with no data: the downloader moves on to its next donor). A stream must keep moving: its reader takes
  every message within ``averaging.state_stall_s`` and, after that head start, at least ``averaging.state_min_mbit``
  on average, so a state of S bytes is served within ``state_stall_s + S / state_min_mbit`` at most. A stream that
  falls behind is ended at once (its handler task cancelled: its socket closes and its copy is dropped) and its peer
  refused state for ``averaging.state_cooldown_s``. When every slot is taken, a new request takes the slot of the
  slowest stream served for at least :data:`PREEMPT_AFTER_S` (its reader moves on to its next donor; for
  ``state_cooldown_s`` it may take a free slot, not another's, so that a few identities cannot keep every slot young
  by preempting each other in turns). Readers that hold a slot without reading cannot keep out a newcomer that
  reads faster than they do: to keep it out they must take the state faster than it (their own bandwidth) or bring
  a fresh identity for every slot they take from another. Called by
  :meth:`~p2p_diloco.swarm.averaging.server.AveragingServer.rpc_download_state`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Optional, TypeVar

from p2p_diloco.hivemind_adapter.p2p import MessageTooLargeError, cap_received_messages, message_cap_bytes

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 2**20  # see the module docstring: > 100x the largest message an honest peer sends
# a stream's rate is not known in its first seconds (p2p's buffers take the first MBs at once): it is not preempted
# in them. Short, so that holding every slot with fresh streams takes fresh identities and MBs of download each 2 s
PREEMPT_AFTER_S = 2.0
MAX_COOLED_PEERS = 4096  # peers remembered as cooling down (the oldest are forgotten first): a few hundred KB at most

T = TypeVar("T")

__all__ = [
    "MAX_MESSAGE_BYTES", "MessageTooLargeError", "StateGate", "install_message_cap", "message_cap_bytes",
]


def install_message_cap(max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Refuse every message above ``max_bytes`` that this process's hivemind ``P2P`` receives (idempotent; a later
    call only changes the cap)."""
    cap_received_messages(max_bytes)


@dataclass(eq=False)
class _Stream:
    """One state stream being served."""

    peer: str
    task: asyncio.Task  # the handler task writing it: cancelled to end the stream at once (its socket closes)
    messages: AsyncIterator  # its generator: its frame holds the copy of the state
    first_at: Optional[float] = None  # when its first message was ready (the copy is made before, at our pace)
    bytes_taken: int = 0  # what its reader has taken (written to p2p's buffers) so far

    def rate(self, now: float) -> float:
        """Bytes per second its reader has taken since its first message."""
        return self.bytes_taken / max(now - self.first_at, 1e-9)


class StateGate:
    """The state streams an averager serves (in its background process): how many, to whom, how fast, how long.

    Args:
        max_streams: streams served at once, one per peer.
        min_bytes_per_s: the rate a stream must keep on average once its head start (``stall_timeout_s``) is over.
        stall_timeout_s: a stream whose reader takes no message for this long is ended.
        cooldown_s: a peer whose stream was ended for stalling or falling behind is refused this long; one whose
            stream was preempted takes no other's slot for this long (it may still take a free one).
    """

    def __init__(self, max_streams: int, min_bytes_per_s: float, stall_timeout_s: float, cooldown_s: float):
        self.max_streams, self.min_bytes_per_s = max_streams, min_bytes_per_s
        self.stall_timeout_s, self.cooldown_s = stall_timeout_s, cooldown_s
        self.streams: dict[str, _Stream] = {}  # peer -> the stream served to it
        self.cooled: OrderedDict[str, float] = OrderedDict()  # peer -> refused until (time.monotonic())
        self.preempted: OrderedDict[str, float] = OrderedDict()  # peer -> takes no other's slot until
        self._closing: set[asyncio.Task] = set()

    @classmethod
    def of(cls, averager) -> StateGate:
        """The gate of an averager (made on first use, in its background process), with its config's bounds."""
        gate = vars(averager).get("_state_gate")
        if gate is None:
            cfg = averager.cfg
            gate = averager._state_gate = cls(cfg.state_streams, cfg.state_min_mbit * 1e6 / 8, cfg.state_stall_s,
                                              cfg.state_cooldown_s)
        return gate

    def admit(self, peer: str, now: float) -> Optional[str]:
        """Why a new stream to ``peer`` is not served now, or None (a slot is free, or was freed for it)."""
        until = self.cooled.get(peer)
        if until is not None and until > now:
            return f"its last stream stalled or fell behind; refused for {until - now:.0f} s more"
        self.cooled.pop(peer, None)
        if peer in self.streams:
            return "a state stream to it already"
        if len(self.streams) < self.max_streams:
            return None
        if self.preempted.get(peer, 0.0) > now:  # else a few identities would keep every slot young by turns
            return f"{self.max_streams} state streams served already, and it lost a slot to another recently"
        # the slowest stream, if it has run PREEMPT_AFTER_S: a younger one would let a few identities keep every
        # slot young by turns, and the slowest *old* one instead can be, with the others re-admitted squatters, the
        # one honest reader, cut off near the end of its download
        started = [s for s in self.streams.values() if s.first_at is not None]
        slowest = min(started, key=lambda s: s.rate(now), default=None)
        if slowest is None or now - slowest.first_at < PREEMPT_AFTER_S:
            return (f"{self.max_streams} state streams served already, the slowest of them started in the last "
                    f"{PREEMPT_AFTER_S:g} s")
        self._end(slowest, f"its slot went to {peer}: the slowest of {len(self.streams)} streams "
                           f"({slowest.rate(now) * 8e-6:.3g} Mbit/s)", cool=False)
        return None

    async def serve(self, peer_id, open_stream: Callable[[], AsyncIterator[T]],
                    size_of: Callable[[T], int]) -> AsyncIterator[T]:
        """The messages of ``open_stream()`` (called only if the stream is admitted), while the gate allows.

        Iterated by the task that writes the stream (hivemind's handler task): ending a stream cancels it."""
        peer = str(peer_id)
        reason = self.admit(peer, time.monotonic())
        if reason is not None:
            logger.info(f"Refused to serve state to {peer}: {reason}")
            return
        stream = self.streams[peer] = _Stream(peer, asyncio.current_task(), open_stream())
        loop = asyncio.get_running_loop()
        try:
            async for message in stream.messages:
                if stream.first_at is None:
                    stream.first_at = time.monotonic()
                patience_s, why = self._patience(stream)
                watchdog = loop.call_later(patience_s, self._end, stream, why)
                try:
                    yield message
                finally:
                    watchdog.cancel()
                if self.streams.get(peer) is not stream:
                    break  # ended while its reader held the message (its task, cancelled, never comes back here)
                stream.bytes_taken += size_of(message)
        finally:
            if self.streams.get(peer) is stream:
                del self.streams[peer]
            await _close(stream.messages)

    def _patience(self, stream: _Stream) -> tuple[float, str]:
        """How long the reader may take to take the next message, and why it is ended if it does not."""
        now = time.monotonic()
        behind_in = stream.first_at + self.stall_timeout_s + stream.bytes_taken / self.min_bytes_per_s - now
        if behind_in >= self.stall_timeout_s:
            return self.stall_timeout_s, f"it took nothing for {self.stall_timeout_s:g} s"
        return max(0.0, behind_in), (f"it fell below {self.min_bytes_per_s * 8e-6:.3g} Mbit/s "
                                     f"({stream.bytes_taken} bytes in {now - stream.first_at:.0f} s)")

    def _end(self, stream: _Stream, why: str, cool: bool = True) -> None:
        """End a stream now: free its slot, cancel the task that writes it, drop its copy; cool its peer down."""
        if self.streams.get(stream.peer) is not stream:
            return  # over already
        del self.streams[stream.peer]
        logger.warning(f"Stopped serving state to {stream.peer}: {why}")
        _remember(self.cooled if cool else self.preempted, stream.peer, time.monotonic() + self.cooldown_s)
        stream.task.cancel()
        task = asyncio.ensure_future(_close(stream.messages))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)


def _remember(table: OrderedDict[str, float], peer: str, until: float) -> None:
    """Note ``peer`` in a table of peers refused something until a time, forgetting the oldest beyond the bound."""
    table[peer] = until
    table.move_to_end(peer)
    while len(table) > MAX_COOLED_PEERS:
        table.popitem(last=False)


async def _close(messages: AsyncIterator) -> None:
    """Close a state stream's generator (its frame holds the state), unless it is closing already."""
    with contextlib.suppress(RuntimeError):  # aclose() of a generator another task is closing
        await messages.aclose()


install_message_cap()
