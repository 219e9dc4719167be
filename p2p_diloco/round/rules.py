"""The round end in each overlap mode: one small rule per mode, chosen once when a stage is made.

The round on one stage (docs/design.md §2.4), after the H inner steps: 2. the pseudo-gradient ``delta = phi0 -
phi``; 3. error feedback ``c = delta + e``; 4. start averaging ``c`` (weight: tokens trained); 5. collect an average
(a failed round's is this peer's own ``c``); 6. the outer step ``theta = outer_step(theta, avg)`` and the next
round's starting point. The modes differ in which round step 5 collects and when step 6 runs:

- ``none`` (blocking DiLoCo, arXiv 2311.08105): 3-4-5-6 on this round; the peer waits for the network.
- ``delayed`` (one-step delay, DiLoCoX): 3-4 now; this round's average is collected and applied a few steps
  into the next round (:meth:`Stage.merge`), the working params rebased on the new anchor.
- ``eager`` (arXiv 2502.12996): 5-6 on the previous round's average, then 3 and this peer's eager outer step
  with its fresh contribution standing in for its stale one, then 4.

Stage owns the state; a rule only orders its steps. Called by :meth:`Stage.end_round`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from p2p_diloco.round.outcome import PendingRound, RoundReport

if TYPE_CHECKING:
    from p2p_diloco.round.stage import Stage


class Blocking:
    """``none``: the round's own average is applied at its end."""

    name = "none"
    overlaps = False
    """Whether a round's averaging runs on while the next round trains (then its budget is that round's compute)."""
    keeps_eager_state = False
    """Whether the peer keeps its own eager copy of the outer state besides the shared anchor."""

    def end(self, stage: Stage, delta: list[torch.Tensor], report: RoundReport, start) -> None:
        contribution = stage.with_feedback(delta)  # 3.
        start(contribution)  # 4.
        average = stage.collect(report)  # 5. this round's
        stage.outer_optimizer.step(average, stage.applied_group_size)  # 6. theta = outer_step(theta, avg) ...
        stage.set_params(stage.anchor)  # ... phi0 = phi = theta

    def merge_due(self, stage: Stage) -> bool:
        return False


class Delayed(Blocking):
    """``delayed``: the round's average is applied ``merge_step`` steps into the next round (or when it arrives)."""

    name = "delayed"
    overlaps = True

    def end(self, stage: Stage, delta: list[torch.Tensor], report: RoundReport, start) -> None:
        if stage.pending is not None:  # 5-6 of the previous round, not merged yet (merge_step = H, or a resume)
            stage.merge_now(report)
            delta = stage.pseudo_gradient()  # 2. again: phi and phi0 were rebased on the new anchor
        else:  # merged earlier in this round: this round end reports it
            stage.report_merge(report)
        contribution = stage.with_feedback(delta)  # 3.
        start(contribution)  # 4. in the background; this round's progress stays in phi until its average lands
        stage.restart_from_params()

    def merge_due(self, stage: Stage) -> bool:
        if stage.pending is None:
            return False
        steps_in = stage.inner_step - stage.round_index * stage.diloco_cfg.inner_steps + stage.round_shift
        return steps_in >= stage.overlap_steps or stage.average_arrived()


class Eager(Blocking):
    """``eager``: the previous round's average is applied at this round's end, this round's own contribution
    stands in for its part of it in the peer's eager outer state."""

    name = "eager"
    overlaps = True
    keeps_eager_state = True

    def end(self, stage: Stage, delta: list[torch.Tensor], report: RoundReport, start) -> None:
        previous = stage.pending
        applied = stage.collect(report)  # 5. the previous round's (bounded wait), its residual into e
        contribution = stage.with_feedback(delta)  # 3.
        if applied is not None:
            stage.outer_optimizer.step(applied, stage.applied_group_size)  # 6. theta = outer_step(theta, avg_prev)
        share = self.eager_step(stage, previous, applied, contribution)  # 6'. the eager state, this round included
        start(contribution, share)  # 4.
        stage.set_params(stage.eager_anchor)
        stage.restart_from_params()

    @staticmethod
    def eager_step(stage: Stage, previous: PendingRound | None, applied: list[torch.Tensor] | None,
                   fresh: list[torch.Tensor]) -> float:
        """Step this peer's eager outer state (arXiv 2502.12996) and return the share of ``fresh`` it took.

        The eager outer gradient is the previous round's applied average with this peer's stale contribution
        replaced by its fresh one: ``avg(r-1) - s(r-1) c(r-1) + s(r) c(r)``. The share taken out is the one put
        in a round earlier, so every contribution counts exactly once (with outer momentum 0 the eager params
        are ``theta0 - lr (sum of the applied averages + s(r) c(r))``). ``s(r)`` is this peer's share in its
        last group (its tokens over the group's), 1 before its first group, after a failed round, and alone:
        then eager is blocking DiLoCo exactly. A failed round's own contribution is applied whole (``applied``
        is that contribution), so nothing of it is dropped.
        """
        done = previous.outcome if previous is not None else None
        previous_ok = done is not None and done.averaged and done.group_tokens > 0
        share = min(1.0, previous.weight / done.group_tokens) if previous_ok else 1.0
        gradient = [share * c for c in fresh]
        if previous is not None:
            gradient = [g + a - previous.share * old for g, a, old in zip(gradient, applied, previous.contribution)]
        stage.eager_optimizer.step(gradient, stage.applied_group_size)
        return share


RULES = {rule.name: rule for rule in (Blocking(), Delayed(), Eager())}
