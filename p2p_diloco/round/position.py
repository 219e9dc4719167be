"""Where a stage stands in the run: the round it trains, its inner step, the last round it applied, and where its
rounds start and end.

:class:`Clock` is the stage's own, changed by its inner steps, round ends, resumes and reloads; :class:`Position` is
the snapshot of it that its progress record tells the swarm. Called by :class:`p2p_diloco.round.stage.Stage` and the
state sharing and checkpoints of its state.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Position:
    """Where a stage process stands in the run: what its progress record tells the swarm."""

    round: int
    inner_step: int
    applied_round: int


@dataclass
class Clock:
    """Where one stage stands in its rounds, and where each of its rounds starts and ends (docs/design.md 2.11:
    streaming sync ends a fragment's rounds a few steps early)."""

    inner_steps: int
    """H: the inner steps of a round."""
    round_index: int = 0
    """The round the stage trains."""
    inner_step: int = 0
    """Inner steps taken in the run (the global step the inner lr schedule is indexed by)."""
    round_first_step: int | None = None
    """Set when this round's work began mid-round (after a reload): its tokens are counted from there."""
    round_shift: int = 0
    """Streaming sync: this stage's rounds end this many steps before every H-th step."""
    last_round: int | None = None
    """The run's last round when rounds are shifted: it ends on the run's last step (longer by the shift), so that
    no step is left out of a round."""
    seconds_per_step: float = 0.0
    """Recent inner step time (set by the trainer; served to newcomers)."""

    def round_start_step(self, round_index: int) -> int:
        """The inner step after which round ``round_index`` begins: ``r H`` less the shift (0 for round 0)."""
        return max(0, round_index * self.inner_steps - self.round_shift)

    def round_end_step(self, round_index: int) -> int:
        """The inner step after which round ``round_index`` ends: ``(r + 1) H`` less the shift; the run's last round
        ends on the run's last step."""
        H = self.inner_steps
        if self.last_round is not None and round_index >= self.last_round:
            return (round_index + 1) * H
        return (round_index + 1) * H - self.round_shift

    def round_at(self, inner_step: int) -> int:
        """The round the step after ``inner_step`` belongs to."""
        r = (inner_step + self.round_shift) // self.inner_steps
        return min(r, self.last_round) if self.last_round is not None else r

    def steps_into_round(self) -> int:
        """Inner steps taken since the regular start of the round it trains (``r H``), the shift counted in."""
        return self.inner_step - self.round_index * self.inner_steps + self.round_shift
