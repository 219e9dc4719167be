"""Hostile peers on the wire: what they send in the all-reduce (every phase: whole tensors, low-rank P and Q), what
they return as reducers, and a groupmate that stalls the all-reduce.

- ``scale:K`` (:class:`ScaledParts`, contribution times K, default 1000), ``noise:K`` (:class:`NoisyParts`, Gaussian
  noise of K times the contribution's norm, default 100), ``nan`` and ``inf`` (:class:`NonFiniteParts`): through the
  server's ``_allreduce_phase``, right before the all-reduce sends the tensors;
- ``shape`` (:class:`OversizedShapes`): every part it sends declares one value more than it holds;
- as a reducer: ``reply-nan`` (:class:`NaNReplies`), ``reply-scale:K`` (:class:`ScaledReplies`: the averages it returns
  are K times too large) and ``equivocate:K`` (:class:`Equivocating`: K times too large to the first other sender in
  group order, the true one to the rest, default 1.5), through the runner's ``_reply``;
- ``stall:S`` (:class:`Stalling`): joins groups, then neither sends its parts nor answers for S seconds before it
  leaves the group and looks for the next one (default 30).
"""

from __future__ import annotations

import asyncio
import math

import torch

from p2p_diloco.hivemind_adapter.averaging import MatchmakingException
from tests.hostile.base import HostileRunner, HostileServer


class LyingParts(HostileServer):
    """Sends :meth:`_lie` of its tensors in every all-reduce phase instead of them."""

    async def _allreduce_phase(self, tensors, *args, **kwargs):
        return await super()._allreduce_phase(self._lie(tensors), *args, **kwargs)

    def _lie(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError


class ScaledParts(LyingParts):
    def _lie(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t * self.hostility.value for t in tensors]


class NoisyParts(LyingParts):
    def _lie(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        norm = torch.sqrt(sum(t.double().pow(2).sum() for t in tensors))
        noise = [torch.randn_like(t) for t in tensors]
        scale = float(self.hostility.value * norm / torch.sqrt(sum(n.double().pow(2).sum() for n in noise)))
        return [n * scale for n in noise]


class NonFiniteParts(LyingParts):
    def _lie(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        fill = math.nan if self.hostility.kind == "nan" else math.inf
        return [torch.full_like(t, fill) for t in tensors]


def oversized(serialized_part):
    """A serialized part (a hivemind ``runtime_pb2.Tensor``) that declares one value more than it holds."""
    serialized_part.size[0] += 1
    return serialized_part


class OversizedShapes(HostileRunner):
    async def _generate_input_for_peer(self, peer_index: int):
        async for message in super()._generate_input_for_peer(peer_index):
            oversized(message.tensor_part)
            yield message


class NaNReplies(HostileRunner):
    def _reply(self, averaged_part: torch.Tensor, sender_index: int) -> torch.Tensor:
        return torch.full_like(averaged_part, math.nan)


class ScaledReplies(HostileRunner):
    def _reply(self, averaged_part: torch.Tensor, sender_index: int) -> torch.Tensor:
        return averaged_part * self.hostility.value


class Equivocating(HostileRunner):
    def _reply(self, averaged_part: torch.Tensor, sender_index: int) -> torch.Tensor:
        first_other = 1 if self.sender_peer_ids.index(self.peer_id) == 0 else 0
        return averaged_part * self.hostility.value if sender_index == first_other else averaged_part


class Stalling(HostileServer):
    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        try:
            await asyncio.sleep(self.hostility.value)
            raise MatchmakingException(f"stalled the group for {self.hostility.value:g} s (a test hook)")
        finally:
            self._leave_group(group_info.group_id)
