"""One round's averaging of a stage's contribution under a compression plan, in the averager process.

Tensors sent whole go through one exact all-reduce with their codec. Low-rank tensors go through PowerSGD's
two phases: ``P = M Q`` (averaged with the whole tensors, then orthogonalized) and ``Q = M^T P`` (averaged),
the group's matrix being ``P Q^T``. Besides the average, the round yields this peer's error-feedback
residual (its contribution minus what the wire carried of it: the codec's rounding, and for low rank what
lies outside the shared basis), the group's averaged Qs (the next round's warm start and spectrum), and
statistics (bytes, rank, bits, relative compression error). Called by
:class:`p2p_diloco.swarm.averaging.averager.PseudoGradientAverager`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from p2p_diloco.compression.codecs import roundtrip
from p2p_diloco.compression.lowrank import fit_q, orthonormalize, reconstruct
from p2p_diloco.compression.policy import CompressionPolicy, RoundPlan

AllReduce = Callable[[list[torch.Tensor], list[str], bytes], Awaitable[list[torch.Tensor]]]
"""(tensors, codec per tensor, phase tag) -> the group's exact averages of those tensors."""


@dataclass
class ReduceOutcome:
    parts: list
    """Per tensor, the group's average, or for a low-rank one its factors (P, averaged Q, shape): the averager
    writes each into its buffer in turn (:meth:`average_of`), so a whole average is never held besides them."""
    residuals: list[torch.Tensor]
    q_avgs: dict[int, torch.Tensor]
    stats: dict = field(default_factory=dict)

    def average_of(self, index: int) -> torch.Tensor:
        part = self.parts[index]
        if isinstance(part, tuple):
            p, q_avg, shape = part
            return reconstruct(p, q_avg).reshape(shape)
        return part

    @property
    def averaged(self) -> list[torch.Tensor]:
        """Every tensor's average, made at once."""
        return [self.average_of(i) for i in range(len(self.parts))]


class RoundReducer:
    """Averages contributions under plans, keeping the warm-start Qs of the last two rounds.

    Args:
        policy: the stage's compression policy.
        seed: a string shared by the group (run id and stage), for seeded Qs.
    """

    def __init__(self, policy: CompressionPolicy, seed: str):
        self.policy, self.seed = policy, seed
        self.warm_qs: dict[int, dict[int, torch.Tensor]] = {}

    async def reduce(self, contributions: list[torch.Tensor], plan: RoundPlan, round_index: int,
                     allreduce: AllReduce, residuals_out: list[torch.Tensor] | None = None) -> ReduceOutcome:
        """Average ``contributions`` (read, never written: the averager passes its shared buffers) under ``plan``.
        The residuals are written into ``residuals_out`` when given (the averager's shared residual buffers:
        read by the training process only after a round that succeeded), else into new tensors."""
        started = time.monotonic()
        whole = [i for i in range(len(contributions)) if i not in plan.lowrank]
        sent = {}
        for i in whole:  # what the wire carries; never the contribution itself, which the all-reduce must not touch
            sent[i] = roundtrip(plan.codecs[i], contributions[i])
            if sent[i].data_ptr() == contributions[i].data_ptr():
                sent[i] = sent[i].clone()
        averaged: list = [None] * len(contributions)
        residuals: list = [None] * len(contributions)

        def residual(i: int, value: torch.Tensor) -> None:
            if residuals_out is None:
                residuals[i] = value
            else:
                residuals[i] = residuals_out[i]
                residuals[i].copy_(value)

        for i in whole:
            residual(i, contributions[i] - sent[i])
        q_avgs: dict[int, torch.Tensor] = {}
        if plan.lowrank:
            matrices = {i: contributions[i].reshape(contributions[i].shape[0], -1) for i in plan.lowrank}
            qs = {i: self._starting_q(plan, i, m.shape[1], round_index) for i, m in matrices.items()}
            ps = [matrices[i] @ qs[i] for i in plan.lowrank]  # (m, r) each
            phase_one = await allreduce(ps + [sent[i] for i in whole],
                                        [plan.codecs[i] for i in plan.lowrank] + [plan.codecs[i] for i in whole], b".P")
            ps_avg = {i: orthonormalize(p) for i, p in zip(plan.lowrank, phase_one[: len(ps)])}
            for i, avg in zip(whole, phase_one[len(ps):]):
                averaged[i] = avg
            local_qs = {i: matrices[i].t() @ ps_avg[i] for i in plan.lowrank}  # (n, r) each
            sent_qs = {i: roundtrip(plan.codecs[i], q) for i, q in local_qs.items()}
            phase_two = await allreduce([sent_qs[i] for i in plan.lowrank], [plan.codecs[i] for i in plan.lowrank],
                                        b".Q")
            for i, q_avg in zip(plan.lowrank, phase_two):
                q_avgs[i] = q_avg
                averaged[i] = (ps_avg[i], q_avg, contributions[i].shape)  # made when written (average_of)
                residual(i, contributions[i] - reconstruct(ps_avg[i], sent_qs[i]).reshape(contributions[i].shape))
        else:
            for i, avg in zip(whole, await allreduce([sent[i] for i in whole], [plan.codecs[i] for i in whole], b"")):
                averaged[i] = avg
        self.warm_qs = {round_index: q_avgs, **{r: q for r, q in self.warm_qs.items() if r == round_index - 1}}
        return ReduceOutcome(averaged, residuals, q_avgs, self._stats(contributions, residuals, plan, started))

    def _starting_q(self, plan: RoundPlan, index: int, num_columns: int, round_index: int) -> torch.Tensor:
        warm = None
        if plan.warm_round is not None:
            held = self.warm_qs.get(plan.warm_round)
            if held is None or index not in held:
                raise RuntimeError(f"the group starts from the Qs of round {plan.warm_round}, which this peer lost")
            warm = held[index]
        return fit_q(warm, num_columns, plan.rank, f"{self.seed}:{round_index}:{index}")

    def _stats(self, contributions, residuals, plan: RoundPlan, started: float) -> dict:
        total = torch.sqrt(sum(c.double().pow(2).sum() for c in contributions))
        error = torch.sqrt(sum(r.double().pow(2).sum() for r in residuals))
        return {"rank": plan.rank if plan.lowrank else 0, "codecs": sorted(set(plan.codecs)),
                "lowrank_tensors": len(plan.lowrank), "warm": plan.warm_round is not None,
                "payload_bytes": self.policy.payload_bytes(plan),
                "compression_error": float(error / total) if total > 0 else 0.0,
                "reduce_s": time.monotonic() - started}
