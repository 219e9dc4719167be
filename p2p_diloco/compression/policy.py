"""How each tensor of a stage's pseudo-gradient crosses the wire in a round, decided the same on every peer.

``averaging.compression`` picks the scheme: ``none`` (fp32), ``fp16``, ``int8`` (blockwise, or 4-bit with
``averaging.quant_bits = 4``), ``lowrank`` (2-D tensors of at least ``lowrank_min_size`` values through PowerSGD
two-phase averaging at a fixed rank, factors quantized; the rest quantized), ``adaptive`` (the least lossy rung of a
ladder that fits the link: every tensor whole at ``int8``, else whole at ``int4``, else low rank whose rank and bits
change every round; blockwise codes with error feedback cost no measurable loss at 4-8x fewer bytes, low rank does,
BENCHMARKS "What the default sends, and what it costs") and ``sparseloco`` (every tensor as the top-k of each chunk
at 2 bits, :mod:`p2p_diloco.compression.sparse`; k is ``averaging.sparse_topk``, halved until the round fits the
bandwidth budget of the group's slowest link, as ``adaptive`` cuts its rank). Every peer proposes (rank, bits, the
round of the warm Q it holds), its last compression error, link rate and round of compute in the round's gathered
metadata; :meth:`CompressionPolicy.agree` turns them into one :class:`RoundPlan` (for ``adaptive``: the first rung
whose contribution fits the bandwidth budget of the slowest link; in low rank, the group's median rank and bits,
more rank while the group's error is high, cut to that budget; warm start only if everyone holds the same Q of a
low-rank round), and :meth:`CompressionPolicy.next_proposal` derives the next proposal from what the group shares
after the round (the spectrum of the averaged Qs). So all peers of a group pick the same plan with no extra message.
Pure logic; called in the averager process.

Proposals come from groupmates, some of whom may be hostile, so no single one decides the plan: rank, bits and
round of compute are the group's lower median (with an honest majority, no lower than some honest member's), the
error that raises the rank is the upper median (a member reporting no error cannot hold the rank down), and a link
claimed slower than :data:`LINK_SPREAD` times below the median link counts as that much slower (one claim cuts the
budget by that factor at most, while an honest slow link within it is respected). A group of 2 has no majority: its
lower median is either member's own value, so there the rank and k are at least the larger proposal over
LINK_SPREAD, and the budget at least the larger member's own over LINK_SPREAD (within that spread, the smaller
proposal and the slower link still win; beyond it, the member that asks for more lifts the plan, up to
``averaging.max_rank``: bytes, never precision, are what one member of a pair can cost the other).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from p2p_diloco.compression.codecs import codec_for
from p2p_diloco.compression.lowrank import desired_rank, lowrank_size
from p2p_diloco.compression.sparse import CHUNK, TopK2Bit
from p2p_diloco.config import AveragingConfig
from p2p_diloco.medians import lower_median, upper_median

LINK_SPREAD = 4.0  # a member's link counts as at most this many times slower than the group's median link
# (in a pair: its rank, k, and link times compute, than the other member's)


@dataclass(frozen=True)
class RoundPlan:
    """One round's compression, identical on every groupmate."""

    codecs: tuple[str, ...]
    """Codec of each tensor sent whole (fp32, fp16, int8, int4, topk2:<k>), as the registry names it
    (:func:`~p2p_diloco.compression.codecs.codec_for`); for low-rank tensors, of their factors."""
    lowrank: tuple[int, ...]
    """Indices of the tensors averaged in low rank."""
    rank: int
    warm_round: int | None
    """Round whose averaged Q every groupmate starts from; None: a Q seeded from the round index."""


class CompressionPolicy:
    """Per-stage compression rules.

    Args:
        shapes: the shapes of the stage's tensors, in averaging order.
        cfg: the ``[averaging]`` section.
    """

    def __init__(self, shapes: list[tuple[int, ...]], cfg: AveragingConfig):
        self.shapes, self.cfg = [tuple(s) for s in shapes], cfg
        self.scheme = cfg.compression
        self.eligible = tuple(i for i, s in enumerate(self.shapes) if self.scheme in ("lowrank", "adaptive")
                              and len(s) == 2 and math.prod(s) >= cfg.lowrank_min_size and min(s) > cfg.min_rank)

    @property
    def feedback_decay(self) -> float:
        """What the error feedback is multiplied by before a round's pseudo-gradient is added: SparseLoCo's beta,
        1 for the other schemes (nothing owed is forgotten)."""
        return self.cfg.sparse_feedback_decay if self.scheme == "sparseloco" else 1.0

    def initial_proposal(self) -> dict:
        return self._with_topk({"rank": self.cfg.rank, "bits": self.cfg.quant_bits, "q_round": -1})

    def _with_topk(self, proposal: dict) -> dict:
        """'sparseloco' proposals carry the k this peer is configured with (the group takes their lower median)."""
        return dict(proposal, topk=self.cfg.sparse_topk) if self.scheme == "sparseloco" else proposal

    def agree(self, members: list[dict]) -> RoundPlan:
        """The group's plan from every member's gathered metadata (order does not matter).

        Each member brings ``compression`` (its proposal: rank, bits, round of its warm Q), ``last_error`` (the
        relative compression error of its last averaged round), ``bandwidth_mbit`` and ``compute_s``. The rank and
        bits are the proposals' lower median (the rank within ``averaging.max_rank``, in a pair at least the larger
        proposal over :data:`LINK_SPREAD`); ``adaptive`` sends every tensor whole at those bits, else at 4 bits,
        if that fits what the group's slowest link can send within the budget; else in low rank, where the rank
        doubles while the upper median of the last errors is above ``averaging.target_error`` and is then cut (or
        the bits halved) to the budget (see the module docstring for what one member's claims can move).
        """
        proposals = [m["compression"] for m in members]
        rank = min(_floored_median([int(p["rank"]) for p in proposals]), self.cfg.max_rank)
        bits = lower_median([int(p["bits"]) for p in proposals])
        q_rounds = {int(p["q_round"]) for p in proposals}
        warm = q_rounds.pop() if len(q_rounds) == 1 and -1 not in q_rounds else None
        whole = self._whole_that_fits(rank, bits, members) if self.scheme == "adaptive" else None
        if whole is not None:
            return whole
        if self.scheme == "adaptive" and self.eligible:
            errors = [float(m["last_error"]) for m in members if m.get("last_error") is not None]
            if errors and upper_median(errors) > self.cfg.target_error:
                rank = min(2 * rank, self.cfg.max_rank)
            rank, bits = self._fit_budget(rank, bits, members)
        if self.scheme == "sparseloco":
            return self._sparse_plan(self._fit_topk(members))
        return self._plan_at(rank, bits, warm)

    def _fit_topk(self, members: list[dict]) -> int:
        """'sparseloco': the lower median of the members' proposed k (``averaging.sparse_topk`` of each; a member
        that proposes none counts with this peer's; in a pair at least the larger over :data:`LINK_SPREAD`), halved
        until the round fits the bandwidth budget (1 at least).

        The budget counts both directions of the all-reduce: a member sends its top-k parts out and its part's
        average back, and that average (``sparse8``) holds up to group-size times k values per chunk at 3 bytes
        each, more than a ``topk2`` contribution; :meth:`transfer_bytes` is what the budget is compared with.
        """
        proposed = [int(m["compression"].get("topk", self.cfg.sparse_topk)) for m in members]
        k = max(1, min(_floored_median(proposed), CHUNK))
        budget = self._budget(members)
        while budget is not None and k > 1 and self.transfer_bytes(self._sparse_plan(k), len(members)) > budget:
            k //= 2
        return k

    def transfer_bytes(self, plan: RoundPlan, group_size: int) -> float:
        """Half the bytes one member moves per peer it exchanges with under ``plan``: its contribution plus the
        average it sends back, over 2 (so that for codecs whose average is sent as the contribution was, this is
        :meth:`payload_bytes`, which :meth:`_budget` is in units of)."""
        returned = sum(codec_for(plan.codecs[i]).average_size(values, group_size)
                       for i, values in enumerate(self._num_values(plan)))
        return (self.payload_bytes(plan) + returned) / 2

    def _budget(self, members: list[dict]) -> float | None:
        """Bytes one contribution may take so that the round's transfer fits ``averaging.bandwidth_budget`` of a
        round of compute on the group's slowest link (see the module docstring for what one member's claims can
        move); None before a round of compute was measured."""
        group_size = len(members)
        links = [float(m["bandwidth_mbit"]) for m in members]
        computes = [float(m["compute_s"]) for m in members]
        bandwidth = max(min(links), lower_median(links) / LINK_SPREAD)
        compute_s = lower_median(computes)
        if compute_s <= 0:
            return None
        butterfly = max(1.0, 2 * (group_size - 1) / group_size)  # the all-reduce sends this many contributions
        budget = self.cfg.bandwidth_budget * compute_s * bandwidth * 1e6 / 8 / butterfly
        if group_size == 2:  # both lower medians are either member's own claim: bound them by the other's
            own = max(c * link for c, link in zip(computes, links))  # Mbit a member's link carries in its round
            budget = max(budget, self.cfg.bandwidth_budget * own * 1e6 / 8 / butterfly / LINK_SPREAD)
        return budget

    def _sparse_plan(self, k: int) -> RoundPlan:
        return RoundPlan(codecs=(TopK2Bit(k).name,) * len(self.shapes), lowrank=(), rank=0, warm_round=None)

    def _whole_that_fits(self, rank: int, bits: int, members: list[dict]) -> RoundPlan | None:
        """'adaptive', the first rungs of its ladder: every tensor sent whole, blockwise at ``bits`` (the group's
        lower median), else at 4 bits, whichever first fits the budget; None where neither does (low rank then) or
        no round of compute was measured yet. A model without matrices for low rank is sent whole at 4 bits where
        nothing fits. The plan keeps ``rank``, the rank low rank would start from if the link narrows."""
        budget = self._budget(members)
        if budget is None:
            return None
        for candidate_bits in sorted({bits, 4}, reverse=True):
            plan = self._whole_plan(rank, candidate_bits)
            if self.payload_bytes(plan) <= budget:
                return plan
        return None if self.eligible else self._whole_plan(rank, 4)

    def _whole_plan(self, rank: int, bits: int) -> RoundPlan:
        return RoundPlan(codecs=("int4" if bits <= 4 else "int8",) * len(self.shapes), lowrank=(), rank=rank,
                         warm_round=None)

    def _fit_budget(self, rank: int, bits: int, members: list[dict]) -> tuple[int, int]:
        """The largest rank up to ``rank`` (at ``bits``, else at 4 bits) whose round fits the bandwidth budget."""
        budget = self._budget(members)
        if budget is None:
            return rank, bits  # no round of compute measured yet: nothing to budget against
        for candidate_bits in sorted({bits, 4}, reverse=True):
            for candidate_rank in range(rank, self.cfg.min_rank - 1, -1):
                if self.payload_bytes(self._plan_at(candidate_rank, candidate_bits, None)) <= budget:
                    return candidate_rank, candidate_bits
        return self.cfg.min_rank, 4

    def payload_bytes(self, plan: RoundPlan) -> int:
        """Bytes one contribution takes on the wire under ``plan`` (before the all-reduce's 2(N-1)/N)."""
        return sum(codec_for(plan.codecs[i]).encoded_size(values) for i, values in enumerate(self._num_values(plan)))

    def _num_values(self, plan: RoundPlan) -> list[int]:
        """Values each tensor sends under ``plan``: its own, or for a low-rank one its factors'."""
        return [lowrank_size(shape, plan.rank) if i in plan.lowrank else math.prod(shape)
                for i, shape in enumerate(self.shapes)]

    def next_proposal(self, plan: RoundPlan, q_avgs: dict[int, torch.Tensor], round_index: int) -> dict:
        """This peer's proposal for the next round, from what the group shares after this one (every groupmate
        computes the same): the spectrum of the averaged Qs (adaptive), and the round they come from.

        Args:
            plan: the round's plan.
            q_avgs: the group's averaged Q of each low-rank tensor.
            round_index: the round just averaged (its Qs become the warm start).
        """
        rank = plan.rank
        if self.scheme == "adaptive" and q_avgs:
            rank = max(desired_rank(q, plan.rank, self.cfg.min_rank, self.cfg.max_rank) for q in q_avgs.values())
        # a round that sent every tensor whole left no averaged Q to start the next from
        return self._with_topk({"rank": max(rank, self.cfg.min_rank), "bits": self.cfg.quant_bits,
                                "q_round": round_index if plan.lowrank else -1})

    def _plan_at(self, rank: int, bits: int, warm_round: int | None) -> RoundPlan:
        if self.scheme == "sparseloco":  # every tensor: top-k of each chunk, 2 bits each
            return self._sparse_plan(self.cfg.sparse_topk)
        quantized = "int4" if bits <= 4 else "int8"
        whole = {"none": "fp32", "fp16": "fp16"}.get(self.scheme, quantized)
        # low rank only where it sends at most half the values of the whole tensor; else the tensor goes whole
        lowrank = tuple(i for i in self.eligible if 2 * lowrank_size(self.shapes[i], rank) <= math.prod(self.shapes[i]))
        return RoundPlan(codecs=tuple(quantized if i in lowrank else whole for i in range(len(self.shapes))),
                         lowrank=lowrank, rank=rank, warm_round=warm_round)


def _floored_median(values: list[int]) -> int:
    """The members' lower median, in a pair at least the larger value over :data:`LINK_SPREAD` (rounded up).

    With 3 or more members an honest majority bounds the lower median; a pair has none, and its lower median is
    either member's own value: without the floor, one member alone would decide how far the group's rank or k goes
    down."""
    low = lower_median(values)
    return max(low, math.ceil(max(values) / LINK_SPREAD)) if len(values) == 2 else low
