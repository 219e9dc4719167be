"""The round end in each overlap mode: one small rule per mode, chosen once when a stage is made.

The round on one stage (docs/design.md §2.4), after the H inner steps: 2. the pseudo-gradient ``delta = phi0 -
phi``; 3. error feedback ``c = delta + e``; 4. start averaging ``c`` (weight: tokens trained); 5. collect an average
(a failed round's is this peer's own ``c``); 6. the outer step ``theta = outer_step(theta, avg)`` and the next
round's starting point. The modes differ in which round step 5 collects and when step 6 runs:

- ``none`` (blocking DiLoCo, arXiv 2311.08105): 3-4-5-6 on this round; the peer waits for the network.
- ``delayed`` (one-step delay, DiLoCoX): 3-4 now; this round's average is collected and applied a few steps
  into the next round (:meth:`Delayed.merge`), the working params rebased on the new anchor.
- ``eager`` (arXiv 2502.12996): 5-6 on the previous round's average, then 3 and this peer's eager outer step
  with its fresh contribution standing in for its stale one, then 4.

A rule is given the stage's outer state, the round's pseudo-gradient (step 2), the stage's averaging and what the
round end tells it, orders steps 3-6 on them and returns the round's report; it holds no state of its own. Called by
:meth:`p2p_diloco.round.stage.Stage.end_round`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from p2p_diloco.round.exchange import Exchange, RoundEnd
from p2p_diloco.round.outcome import PendingRound, RoundReport
from p2p_diloco.round.outer_state import OuterState


class Rule(ABC):
    """The round end of one ``diloco.mode``."""

    name: str
    overlaps: bool = False
    """Whether a round's averaging runs on while the next round trains (then its budget is that round's compute)."""
    keeps_eager_state: bool = False
    """Whether the peer keeps its own eager copy of the outer state besides the shared anchor."""

    @abstractmethod
    def end(self, state: OuterState, delta: list[torch.Tensor], exchange: Exchange, round_end: RoundEnd) -> RoundReport:
        """Steps 3-6 of the round ``round_end.round_index`` on ``state``, given its pseudo-gradient ``delta`` (step 2;
        step 3 writes into it)."""

    def merge_due(self, exchange: Exchange, deadline_reached: bool) -> bool:
        """Whether the pending round's average is applied now, in the middle of a round (``delayed`` only)."""
        return False


def _report(round_end: RoundEnd, delta: list[torch.Tensor]) -> RoundReport:
    """The report of a round end, with the norm of the round's progress (before step 3 adds to ``delta``)."""
    return RoundReport(round_end.round_index, tokens=int(round_end.tokens),
                       delta_norm=float(torch.sqrt(sum(d.pow(2).sum() for d in delta))))


class Blocking(Rule):
    """``none``: the round's own average is applied at its end."""

    name = "none"

    def end(self, state: OuterState, delta: list[torch.Tensor], exchange: Exchange, round_end: RoundEnd) -> RoundReport:
        report = _report(round_end, delta)
        contribution = state.with_feedback(delta, exchange.averager)  # 3.
        exchange.start(round_end, contribution)  # 4.
        average = exchange.collect(report, state)  # 5. this round's
        state.outer_optimizer.step(average, exchange.applied_group_size)  # 6. theta = outer_step(theta, avg) ...
        state.set_params(state.anchor)  # ... phi0 = phi = theta
        return report


class Delayed(Rule):
    """``delayed``: the round's average is applied ``merge_step`` steps into the next round (or when it arrives)."""

    name = "delayed"
    overlaps = True

    def end(self, state: OuterState, delta: list[torch.Tensor], exchange: Exchange, round_end: RoundEnd) -> RoundReport:
        report = _report(round_end, delta)
        if exchange.pending is not None:  # 5-6 of the previous round, not merged yet (merge_step = H, or a resume)
            self.merge(state, exchange, report)
            delta = state.pseudo_gradient()  # 2. again: phi and phi0 were rebased on the new anchor
        else:  # merged earlier in this round: this round end reports it
            merged, exchange.merged = exchange.merged, None
            if merged is not None:
                report.applied_round, report.outcome, report.waited_s, report.outer_lr = \
                    merged.applied_round, merged.outcome, merged.waited_s, merged.outer_lr
        contribution = state.with_feedback(delta, exchange.averager)  # 3.
        exchange.start(round_end, contribution)  # 4. in the background; this round's progress stays in phi until its
        state.restart_from_params()  # average lands (the merge)
        return report

    def merge_due(self, exchange: Exchange, deadline_reached: bool) -> bool:
        """The previous round's average is pending, and has arrived or this round has reached ``overlap_steps``
        (``deadline_reached``: the merge then waits for it). The anchor does not depend on when."""
        return exchange.pending is not None and (deadline_reached or exchange.average_arrived())

    @staticmethod
    @torch.no_grad()
    def merge(state: OuterState, exchange: Exchange, report: RoundReport) -> None:
        """Steps 5-6 of a delayed round: theta = outer_step(theta, avg_prev); phi = theta - progress since the
        round started; the round now starts from theta."""
        exchange.merged = None
        applied = exchange.collect(report, state)
        if applied is None:
            return
        state.own_round_start()
        state.outer_optimizer.step(applied, exchange.applied_group_size)
        state.rebase(restart_from=state.anchor)


class Eager(Rule):
    """``eager``: the previous round's average is applied at this round's end, this round's own contribution
    stands in for its part of it in the peer's eager outer state."""

    name = "eager"
    overlaps = True
    keeps_eager_state = True

    def end(self, state: OuterState, delta: list[torch.Tensor], exchange: Exchange, round_end: RoundEnd) -> RoundReport:
        report = _report(round_end, delta)
        previous = exchange.pending
        applied = exchange.collect(report, state)  # 5. the previous round's (bounded wait), its residual into e
        contribution = state.with_feedback(delta, exchange.averager)  # 3.
        if applied is not None:
            state.outer_optimizer.step(applied, exchange.applied_group_size)  # 6. theta = outer_step(theta, avg_prev)
        share = self.eager_step(state, previous, applied, contribution, exchange.applied_group_size)  # 6'. eager's
        exchange.start(round_end, contribution, share)  # 4.
        state.set_params(state.eager_anchor)
        state.restart_from_params()
        return report

    @staticmethod
    def eager_step(state: OuterState, previous: PendingRound | None, applied: list[torch.Tensor] | None,
                   fresh: list[torch.Tensor], group_size: int) -> float:
        """Step this peer's eager outer state (arXiv 2502.12996) and return the share of ``fresh`` it took.

        The eager outer gradient is the previous round's applied average with this peer's stale contribution
        replaced by its fresh one: ``avg(r-1) - s(r-1) c(r-1) + s(r) c(r)``. The share taken out is the one put
        in a round earlier, so every contribution counts exactly once (with outer momentum 0 the eager params
        are ``theta0 - lr (sum of the applied averages + s(r) c(r))``). ``s(r)`` is this peer's share in its
        last group (its tokens over the group's), 1 before its first group, after a failed round, and alone:
        then eager is blocking DiLoCo exactly. A failed round's own contribution is applied whole (``applied``
        is that contribution), so nothing of it is dropped. ``group_size``: the group of ``applied`` (its step
        grows with it as the shared anchor's does).
        """
        done = previous.outcome if previous is not None else None
        previous_ok = done is not None and done.averaged and done.group_tokens > 0
        share = min(1.0, previous.weight / done.group_tokens) if previous_ok else 1.0
        gradient = [share * c for c in fresh]
        if previous is not None:
            gradient = [g + a - previous.share * old for g, a, old in zip(gradient, applied, previous.contribution)]
        state.eager_optimizer.step(gradient, group_size)
        return share


RULES: dict[str, Rule] = {rule.name: rule for rule in (Blocking(), Delayed(), Eager())}
