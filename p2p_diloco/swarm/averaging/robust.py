"""Robust combination of the senders' parts at a reducer: one broken or hostile groupmate cannot poison the average.

In the butterfly all-reduce every peer reduces a slice of the vector: it receives every groupmate's part of that
slice and sends back the combined part. :func:`combine` is that combination, run by the reducer alone (every
groupmate receives the reducer's bytes, so the result stays bit-identical across the group). In sender order:

1. a part of the wrong shape or with a non-finite value, or from a sender whose weight is 0 (banned, excluded),
   is left out;
2. with 3 or more parts left, a part whose norm per claimed token is more than ``outlier_ratio`` times the median
   is left out (with an honest majority the median is an honest norm; a claim counts for at most ``outlier_ratio``
   times the median claim); with 2 there is no majority to judge by, and a part is only scaled down to
   :func:`pair_ceiling` times the other: ``pair_ratio`` (at most ``outlier_ratio``) times the smaller at equal
   weights, more for the member with more tokens (``min(q ** 2, pair_claim_ratio)`` times more for q times the
   other's weight), since two honest peers of unequal speed that end a round together send parts that far apart;
3. the weighted mean of the parts left, ``sum_i w_i x_i / sum_i w_i``, computed as hivemind's reducer computes it;
4. CenteredClip (Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust Optimization", ICML 2021)
   with 3 or more parts: ``v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i`` from v = the mean, with
   ``tau = clip_ratio`` times the median distance of the parts to their coordinate-wise median (the honest
   majority's spread, which an outlier cannot inflate); a part is clipped only beyond tau from the segment from 0
   to v, so the part of a peer that trained fewer tokens (a fraction of the group's progress) is not. When no part
   lies beyond it (the usual honest case) the result is the plain weighted mean, bit for bit; otherwise an outlier
   moves the result by at most about tau times its weight share, and a part along the segment shrinks it by at most
   its weight share.

Leaving a part out (steps 1 and 2) is an offence of its sender; clipping it (steps 2 with 2 parts, and 4) is only
reported, never an offence: with 2 parts the clipped one may be the honest one (the other sent a tiny part), and with
3 or more honest parts are clipped too when peers trained on different numbers of steps. Weights are the tokens each
groupmate claims, capped by :func:`cap_weights`. Pure tensor logic, no network; called by
:class:`p2p_diloco.swarm.averaging.allreduce.RobustPartReducer` and the averager.

What one hostile sender can still do (docs/threat-model.md, section 6): with 3 or more parts and an honest majority,
move the result by about tau times its weight share (CenteredClip), its weight being at most ``max_weight_ratio`` times
the median claim; in a group of 2 there is no majority, and with a weight q times the honest member's (q at most
``max_weight_ratio ** 3``, 8) it keeps at most ``pair_ratio * min(q ** 2, pair_claim_ratio)`` times the honest part's
norm, so the result is at most ``(3 q min(q ** 2, 4) + 1) / (q + 1)`` times the honest part's norm, in any direction:
2 at equal weights, 25/3 at q = 2, 49/5 at q = 4, 97/9 (10.8) at most, at q = 8; and a tiny part shrinks the
honest one to :func:`pair_ceiling` times its own norm (the round is then wasted, not poisoned). The pair's bound is
looser than the 2.3 of a rule that ignores the weights because honest pairs need it: capped at 2 and scaled at 3
times the smaller part, a fast peer and one at a third of its speed are ``capped`` in every round, and may be
``clipped`` in the warmup (``benchmarks/honest_flags.py``). As the reducer of its slice it can return no more than
that: the honest member checks the other part each average implies (:func:`pair_excess`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from p2p_diloco.medians import lower_median

MALFORMED, NONFINITE, TOO_LARGE, CLIPPED = "malformed", "nonfinite", "norm", "clipped"
CLIP_ITERATIONS = 5  # CenteredClip converges in a few steps from the mean (the paper uses 1-3 from a momentum)
SPREAD_SAMPLE = 65536  # coordinates the clip radius is estimated on (a fixed stride: the same on every call)
CLIP_VALUES = 16  # parts with fewer non-zero values (the senders' lower median) are not clipped: see centered_clip


@dataclass(frozen=True)
class RobustRule:
    """How a reducer combines parts; 0 disables a step."""

    outlier_ratio: float = 10.0
    """Parts whose norm is above this multiple of the median norm are left out."""
    pair_ratio: float = 3.0
    """With only 2 parts of equal weights, the larger is scaled down to this multiple of the smaller (at most
    ``outlier_ratio``): an honest pair trained on the same tokens differs far less, and a hostile one then adds
    little to the honest part."""
    pair_claim_ratio: float = 4.0
    """With 2 parts of unequal weights, the part of the member with q times the other's weight may be
    ``pair_ratio * min(q ** 2, pair_claim_ratio)`` times the other's norm (:func:`pair_ceiling`): a pseudo-gradient
    grows with the steps and, in the warmup, with the learning rate that rises with them (a peer at a third of the
    speed, in its first round, sent a part 7 to 9 times smaller than its fast partner's). A pair's weights differ by
    at most ``max_weight_ratio ** 3`` (8, :func:`cap_weights`); from 2 on the ceiling is 12."""
    clip_ratio: float = 2.0
    """CenteredClip radius as a multiple of the median distance of the parts to their coordinate-wise median."""


@dataclass
class Combined:
    average: Optional[torch.Tensor]
    """The combined part; None when no part was usable."""
    flags: dict[int, str] = field(default_factory=dict)
    """Sender index -> why its part was left out or clipped."""


def cap_weights(claims: Sequence[float], ratio: float) -> list[float]:
    """Claimed weights capped at ``ratio`` times their lower median; of a pair, at ``ratio ** 3`` times the smaller
    claim (no cap when ``ratio`` is 0).

    With 3 or more claims and an honest majority the median is an honest claim, and an honest peer rarely trains
    twice the median's tokens. A pair has no majority: its lower median is the smaller claim, and two honest peers of
    unequal speed that end their rounds together (``diloco.round_end = swarm``) claim tokens in the ratio of their
    speeds, a third for a peer at a third of the speed: capped at twice the smaller claim, such a pair would be
    reported ``capped`` every round. So a pair's claims may differ by ``ratio ** 3`` (8): at 4 (``ratio ** 2``) a
    live pair of a peer and one at a third of its speed, on a busy machine, was capped in 6 of 20 rounds (the slow
    one, late to learn of round ends, trained a sixth of the other's tokens there).
    """
    if ratio <= 0 or not claims:
        return list(claims)
    cap = ratio ** 3 * min(claims) if len(claims) == 2 else ratio * lower_median(claims)
    return [min(claim, cap) for claim in claims]


def pair_ceiling(weight: float, other_weight: float, rule: RobustRule) -> float:
    """How many times the other part's norm :func:`combine` leaves a part of a pair: ``pair_ratio`` (at most
    ``outlier_ratio``) times ``min(q ** 2, pair_claim_ratio)``, with q this sender's weight over the other's (at
    least 1: the part of the member with fewer tokens may be ``pair_ratio`` times the other's, not less)."""
    ratio = min(rule.outlier_ratio, rule.pair_ratio or rule.outlier_ratio)
    share = weight / other_weight if other_weight > 0 else 1.0
    return ratio * max(1.0, min(share ** 2, rule.pair_claim_ratio))


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i w_i x_i / sum_i w_i`` in the given order, with hivemind's reducer's operations (fp32 accumulator)."""
    accumulator = torch.zeros_like(parts[0], dtype=torch.float32)
    for part, weight in zip(parts, weights):
        accumulator.add_(part, alpha=weight)
    return accumulator.div_(sum(weights))


def combine(parts: Sequence[Optional[torch.Tensor]], weights: Sequence[float], rule: RobustRule,
            shape: Optional[torch.Size] = None, claims: Optional[Sequence[float]] = None) -> Combined:
    """Combine one part of the vector from every sender (None: the sender sent nothing), in sender order.

    Args:
        parts: each sender's part, or None.
        weights: each sender's weight.
        rule: the thresholds.
        shape: the part's shape; parts of another shape are left out (default: the first part's).
        claims: the tokens each sender claims to have trained on (default: the weights). With 3 or more parts the
            outlier test compares norms per claimed token: an honest peer that trained on 5 times the tokens of the
            others (they joined the round late) has a part 5 to 20 times larger (more during the warmup's rising
            learning rate), so a test of plain norms would leave it out as an outlier, even in a calm swarm. A claim
            counts for at most ``outlier_ratio`` times the median claim.
    """
    flags: dict[int, str] = {}
    kept = []
    shape = shape if shape is not None else next((p.shape for p in parts if p is not None), None)
    for i, (part, weight) in enumerate(zip(parts, weights)):
        if part is None or weight <= 0:
            continue
        if part.shape != shape:
            flags[i] = MALFORMED
        elif not torch.isfinite(part).all():
            flags[i] = NONFINITE
        else:
            kept.append(i)
    values = {i: parts[i].float() for i in kept}
    if rule.outlier_ratio > 0 and len(kept) >= 2:
        norms = {i: float(torch.linalg.vector_norm(values[i])) for i in kept}
        if len(kept) >= 3:
            claimed = {i: float((claims if claims is not None else weights)[i]) for i in kept}
            typical = lower_median(list(claimed.values()))
            rates = {i: norms[i] * typical / max(min(claimed[i], rule.outlier_ratio * typical), 1e-12)
                     for i in kept}  # the norm the part would have at the median claim
            bound = rule.outlier_ratio * lower_median(list(rates.values()))
            flags.update({i: TOO_LARGE for i in kept if rates[i] > bound})
            kept = [i for i in kept if i not in flags]
        else:  # at most one part exceeds its ceiling: both ceilings are at least 1
            for i, j in (kept, kept[::-1]):
                bound = pair_ceiling(weights[i], weights[j], rule) * norms[j]
                if norms[i] > bound:
                    values[i], flags[i] = values[i] * (bound / norms[i]), CLIPPED
    if not kept:
        return Combined(None, flags)
    mean = weighted_mean([values[i] for i in kept], [weights[i] for i in kept])
    if rule.clip_ratio > 0 and len(kept) >= 3:
        mean, clipped = centered_clip([values[i] for i in kept], [weights[i] for i in kept], mean, rule.clip_ratio)
        flags.update({kept[j]: CLIPPED for j in clipped})
    return Combined(mean, flags)


def average_bound(weights: Sequence[float], claims: Sequence[float], me: int, rule: RobustRule,
                  max_claim_ratio: float = 8.0) -> float:
    """How many times the norm of its own part an honest reducer's average of a slice may be, as sender ``me`` can
    tell from the group's weights and claims alone (it sees no other part).

    With 2 parts this is :func:`combine`'s own rule: the other part is at most :func:`pair_ceiling` times this
    member's (``pair_ratio`` times the square of their weights' ratio, at most ``pair_ratio * pair_claim_ratio``),
    so the bound is exactly the largest average a hostile member of a pair obtains. With 3 or more, each sender's
    part is taken to be at most ``pair_ratio`` times the receiver's, times the square of their claims' ratio: the
    outlier test and CenteredClip keep an honest result within the span of the parts, and honest parts of one round
    differ in norm by less than that: by far less with equal claims; with unequal ones, a pseudo-gradient grows with
    the steps and, in the warmup, with the learning rate that rises with them (an honest peer on 5 times the tokens
    sent an 18 times larger part, and a peer at half speed in its first round, on a fifth of the tokens, got an
    honest average over 17 times its own part's norm). So the bound is the weighted mean

        B = sum_i w_i r_i / sum_i w_i,  r_me = 1,  r_i = pair_ratio * max(1, min(c_i / c_me, max_claim_ratio))^2,

    with c_i the claims capped at ``outlier_ratio`` times their median, as the outlier test caps them (in a pair
    r_i = ``pair_ceiling(w_i, w_me)``): 2 in a pair of equal weights, 97/9 at most in any pair (weights 8 times
    this member's), under 3 in any group of equal claims. Weights of 0 (banned, excluded) do not count; the codecs'
    rounding is the caller's margin.
    """
    members = [i for i, w in enumerate(weights) if w > 0]
    if me not in members:
        return 0.0
    if len(members) == 2:
        other = members[1 - members.index(me)]
        ceiling = pair_ceiling(weights[other], weights[me], rule) if rule.outlier_ratio > 0 else rule.pair_ratio
        return (weights[me] + weights[other] * ceiling) / (weights[me] + weights[other])
    typical = lower_median([claims[i] for i in members])
    capped = {i: min(claims[i], rule.outlier_ratio * typical) if rule.outlier_ratio > 0 else claims[i]
              for i in members}
    ratio = min(rule.outlier_ratio, rule.pair_ratio or rule.outlier_ratio) if rule.outlier_ratio > 0 else \
        rule.pair_ratio
    ceilings = {i: 1.0 if i == me else ratio * max(1.0, min(capped[i] / max(capped[me], 1e-12), max_claim_ratio)) ** 2
                for i in members}
    return sum(weights[i] * ceilings[i] for i in members) / sum(weights[i] for i in members)


def pair_excess(average: torch.Tensor, own: torch.Tensor, own_weight: float, other_weight: float, rule: RobustRule,
                rounding: float = 0.0) -> float:
    """In a group of 2, how far a reducer's ``average`` of a part is from every average :func:`combine` returns for
    this member's part ``own`` (as the reducer decoded it) and any part of the other member: the norm of the other
    part it implies, ``(W * average - w_own * own) / w_other`` with ``W = w_own + w_other``, less what the codec's
    ``rounding`` of the average (a norm) moves it, over the most that :func:`combine` leaves that part:
    ``max(r, w_own / w_other, 1)`` times the norm of ``own``, with r = ``pair_ceiling(w_other, w_own)`` (the pair
    ratio at equal weights).

    The bound: a part of a pair is scaled to at most :func:`pair_ceiling` times the other. Where ``own`` is not
    scaled, the other part enters with a norm of at most r times its own; where ``own`` is (the other part p is below
    1/r' of it, r' = ``pair_ceiling(w_own, w_other)`` >= 1), the implied part is
    ``p - (w_own / w_other) (1 - r' |p| / |own|) own``, of norm at most ``max(w_own / w_other, 1 / r')`` times
    ``|own|``. So every average :func:`combine` returns is within 1, up to float rounding. An average beyond
    it implies a part the reducer cannot have combined: at equal weights this member's part reversed at twice its
    norm (the implied part is 5 times ``own``), a random direction at twice its norm (4.1 times), or 19 times it
    reversed (39 times). The average of a zero part, or of a part reversed at r times ``own`` (0 and -1 times
    ``own`` at equal weights), is within it: the other member reaches those by sending such a part (the pair's
    limit, see the module docstring).

    Args:
        own: finite.
        rounding: the most the reducer's codec moved the average (``codecs.average_rounding``).

    Returns:
        The ratio; infinite for an implied part that is not finite, or not zero where ``own`` is; 0 where ``rule``
        scales no part of a pair.
    """
    if rule.outlier_ratio <= 0:
        return 0.0
    ratio = pair_ceiling(other_weight, own_weight, rule)
    total = own_weight + other_weight
    implied = (average.float() * total - own.float() * own_weight) / other_weight
    implied_norm = float(torch.linalg.vector_norm(implied))
    if not math.isfinite(implied_norm):
        return math.inf
    implied_norm = max(0.0, implied_norm - total / other_weight * rounding)
    bound = max(ratio, own_weight / other_weight, 1.0) * float(torch.linalg.vector_norm(own.float()))
    if bound <= 0:
        return math.inf if implied_norm > 0 else 0.0
    return implied_norm / bound


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], start: torch.Tensor,
                  clip_ratio: float) -> tuple[torch.Tensor, list[int]]:
    """CenteredClip from ``start`` (the weighted mean); returns the result and the indices of the parts still farther
    than tau from the segment from 0 to it (:func:`off_progress`; clipped in the last iteration).

    tau is ``clip_ratio`` times the median distance of the parts to their coordinate-wise median: the spread of
    the honest majority, which an outlier cannot inflate (as it would the distances to the mean); on large parts it
    is estimated on every k-th coordinate. A part farther than tau from the segment from 0 to the center is clipped
    as in the paper (its difference to the center scaled to tau); one within tau of the segment, a fraction of the
    group's progress, is not. ``start`` comes back unchanged (the same tensor) when no part is farther than tau
    from that segment.

    Parts with fewer than :data:`CLIP_VALUES` non-zero values (the lower median of the senders' counts, which a
    hostile minority cannot lower) are not clipped: a spread measured on so few values is noise. sparseloco keeps
    1 or 2 values of a small tensor's chunk (a norm weight, a bias), each sender at its own largest coordinates;
    when two senders keep the same coordinate and a third another, the two define the spread and the third, honest,
    is clipped (3 random senders, 1 value kept of 4: 27% of calls; of 27: 5%; a dense part of 4 values: 14%). Such
    parts keep the norm test of :func:`combine` and the senders' check of the average.
    """
    if lower_median([int(torch.count_nonzero(part)) for part in parts]) < CLIP_VALUES:
        return start, []
    numel = start.numel()
    stride = -(-numel // SPREAD_SAMPLE)
    sample = torch.stack([part.reshape(-1)[::stride] for part in parts])  # (num_parts, <= SPREAD_SAMPLE)
    center_of_majority = sample.median(dim=0).values
    spread = lower_median([float(torch.linalg.vector_norm(row - center_of_majority)) for row in sample])
    tau = clip_ratio * spread * math.sqrt(numel / sample.shape[1])
    center, total = start, sum(weights)
    off = [off_progress(part, center) for part in parts]
    for _ in range(CLIP_ITERATIONS):
        if not any(d > tau for d in off):
            break
        step = torch.zeros_like(center)
        for part, weight, d in zip(parts, weights, off):
            scale = 1.0
            if d > tau:  # then the distance to the center is above tau too (the center is on the segment)
                scale = tau / float(torch.linalg.vector_norm(part - center))
            step.add_(part - center, alpha=weight * scale / total)
        center = center + step
        off = [off_progress(part, center) for part in parts]
    return center, [j for j, d in enumerate(off) if d > tau]


def off_progress(part: torch.Tensor, center: torch.Tensor) -> float:
    """The distance of ``part`` to the segment from 0 to ``center``: how far it is from every fraction of the
    group's progress (:func:`centered_clip` clips a part only beyond tau from that segment).

    A peer that trained fewer tokens in the round (a slow peer, one that joined late) sends a part that is a
    fraction of the others' progress, in norm often far less than in proportion (the learning rate of its schedule,
    its warmup): a live triple of two peers and one at a third of their speed sent a part 10 times smaller than the
    others', almost along their direction. Its distance to the center is about the center's norm, over tau whenever
    the two others agree closely, and CenteredClip then clipped it in 5 of 30 groupmate-rounds. Its distance to the
    segment is its spread across the center's direction, as for any honest part. What a hostile part gains from
    this (docs/threat-model.md 6): sent as a fraction s of the center, unclipped, it shrinks the result by at most
    its weight share times (1 - s), never reverses or turns it beyond tau times its weight share."""
    squared = float(torch.linalg.vector_norm(center)) ** 2
    along = float(torch.dot(part.reshape(-1), center.reshape(-1)))  # reductions only: no copy of a large part
    if squared <= 0 or along <= 0:
        return float(torch.linalg.vector_norm(part))
    if along >= squared:
        return float(torch.linalg.vector_norm(part - center))
    return math.sqrt(max(0.0, float(torch.linalg.vector_norm(part)) ** 2 - along * along / squared))
