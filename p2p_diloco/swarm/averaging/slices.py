"""The two halves of a reducer's slice in one all-reduce: combining what the senders sent, and keeping the averages
it sent back for a groupmate whose stream of them broke.

- :class:`RobustPartReducer`: hivemind's ``TensorPartReducer``, but every sender's part is kept until all are in and
  then combined robustly (:func:`~p2p_diloco.swarm.averaging.robust.combine`) in sender order, each sender weighted
  by the group's capped record of its tokens (not the weight it writes in its messages).
- :class:`ServedAverages`: the exact bytes every groupmate got, served again by the averager's
  ``rpc_fetch_averages`` (:class:`~p2p_diloco.swarm.averaging.server.AveragingServer`) to that all-reduce's senders
  only.

Used by :class:`p2p_diloco.swarm.averaging.allreduce.ExactAllReduceRunner`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Optional

import torch

from p2p_diloco.hivemind_adapter.averaging import AllreduceException, BannedException, TensorPartReducer
from p2p_diloco.swarm.averaging.robust import RobustRule, combine


class RobustPartReducer(TensorPartReducer):
    """hivemind's reducer of one slice, but every sender's part is kept until all are in and then combined with
    :func:`p2p_diloco.swarm.averaging.robust.combine` in sender order (so the result does not depend on arrival order).

    Args:
        part_shapes: shapes of the parts of this peer's slice.
        weights: each sender's weight, in sender order (the weight a sender writes in its messages is ignored).
        rule: the combination's thresholds.
        on_flag: called with (sender index, reason) for every part left out or clipped.
        claims: each sender's claimed tokens, in sender order (see ``robust.combine``); default: the weights.
    """

    def __init__(self, part_shapes, weights: list[float], rule: RobustRule, on_flag, claims=None):
        self.weights, self.rule, self.on_flag, self.claims = weights, rule, on_flag, claims
        self.received: list = []
        self._combining = None  # the task combining the current part, while it runs
        super().__init__(part_shapes, len(weights))

    def reset_accumulators(self):
        self.received = [None] * self.num_senders
        super().reset_accumulators()

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: Optional[torch.Tensor],
                              weight: float = 1.0) -> torch.Tensor:
        """Keep a sender's part (None: a malformed one, left out), wait until every sender's part is in, then return
        the combined part."""
        assert 0 <= sender_index < self.num_senders and 0 <= part_index < self.num_parts
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # wait for the previous parts to be combined
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait({self.current_part_future, finished}, return_when=asyncio.FIRST_COMPLETED)
            finished.cancel()
            if self.finished.is_set():
                raise AllreduceException(f"part {part_index} arrived after the reducer finished")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        self.received[sender_index] = tensor_part
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self):
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders and self._combining is None:
            self._combining = asyncio.create_task(self._combine_current_part())

    async def _combine_current_part(self) -> None:
        """Combine the current part in a thread (it takes a while on large parts; the event loop keeps serving the
        other streams meanwhile), then release the senders waiting for it and move on to the next part."""
        combined = await asyncio.get_event_loop().run_in_executor(
            None, combine, list(self.received), self.weights, self.rule, self.part_shapes[self.current_part_index],
            self.claims)
        self._combining = None
        if self.finished.is_set():
            return
        for sender, reason in combined.flags.items():
            self.on_flag(sender, reason)
        if combined.average is None:  # every part was left out: this slice has no average to return
            self.current_part_future.set_exception(
                AllreduceException(f"no usable contribution to part {self.current_part_index}"))
            self.finalize()
            return
        self.current_part_future.set_result(combined.average)
        self.reset_accumulators()


class ServedAverages:
    """The averages a peer computed as the reducer of its slice in one all-reduce, as the bytes it sent, kept after
    the all-reduce for the groupmates whose stream of them broke (the averager serves them to its senders only).

    Args:
        senders: the peers the all-reduce averaged (those that may ask).
        num_parts: how many parts the slice has.
    """

    def __init__(self, senders, num_parts: int):
        self.senders = frozenset(senders)
        self.parts: list = [None] * num_parts  # CompressedTensor of each averaged part, once computed
        self.done = False  # no more parts will come (all computed, or the reduction failed)
        self._changed: Optional[asyncio.Condition] = None

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:  # made in the averager's event loop, on first use
            self._changed = asyncio.Condition()
        return self._changed

    async def add(self, part_index: int, serialized) -> None:
        async with self.changed:
            self.parts[part_index] = serialized
            self.changed.notify_all()

    async def finish(self) -> None:
        async with self.changed:
            self.done = True
            self.changed.notify_all()

    async def iterate(self, timeout_s: float) -> AsyncIterator:
        """The parts in order, each as soon as it is computed; ends at the first part not computed within
        ``timeout_s`` of the start, or never computed."""
        deadline = asyncio.get_event_loop().time() + timeout_s
        for part_index in range(len(self.parts)):
            async with self.changed:
                try:
                    await asyncio.wait_for(
                        self.changed.wait_for(lambda i=part_index: self.parts[i] is not None or self.done),
                        timeout=max(0.0, deadline - asyncio.get_event_loop().time()))
                except TimeoutError:
                    return
            if self.parts[part_index] is None:
                return
            yield self.parts[part_index]
