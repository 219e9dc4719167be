"""What a stage asks of the network for its rounds: the averager interface and the records interface.

The real averager (:class:`p2p_diloco.swarm.averaging.averager.PseudoGradientAverager`, a client of hivemind's
averager in a background process) and the in-process simulator (:class:`p2p_diloco.training.simulate.ExactAverager`)
both implement :class:`RoundAverager`; the swarm's signed progress records
(:class:`p2p_diloco.swarm.discovery.link.SwarmLink`) implement :class:`RoundRecords`. The stage and the round rules
see only these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional, Protocol, runtime_checkable

import torch

from p2p_diloco.round.outcome import RoundOutcome


@runtime_checkable
class RoundAverager(Protocol):
    """Averages one round's contribution at a time with the same stage of other peers, in the background."""

    @property
    def compresses(self) -> bool:
        """Whether what is sent differs from the contribution (then the stage keeps error feedback)."""

    @property
    def feedback_decay(self) -> float:
        """What the stage multiplies its error feedback by before adding a round's pseudo-gradient (1: none)."""

    @property
    def round_settled(self) -> bool:
        """No round in flight, or its averaging is over (its outcome not collected yet)."""

    def set_expected_group_size(self, size: Optional[int]) -> None:
        """The live peers of this stage (this one included) the next group waits for; None: unknown."""

    def start_round(self, contribution: Sequence[torch.Tensor], round_index: int, weight: float,
                    compute_s: float = 0.0, budget_s: float = 0.0) -> None:
        """Start averaging ``contribution`` (weight: tokens trained) in the background; the previous round is
        finished."""

    def finish_round(self, timeout: Optional[float] = None,
                     hopeless: Optional[Callable[[int], bool]] = None,
                     feedback: Optional[list[torch.Tensor]] = None) -> RoundOutcome:
        """Wait for the round in flight (bounded) and return what it gave; a failure is an outcome, never raised.
        An implementation may write an averaged round's residual into ``feedback`` (the stage's error feedback) and
        return that list as the outcome's residual, and may return its own buffers as the average, valid until the
        next :meth:`start_round`: the round end uses both before then, and neither is copied."""

    def abandon_round(self) -> None:
        """Stop caring about the round in flight: it finishes with its group, its result is never read."""

    def cancel_round(self) -> None:
        """Cancel the round in flight, if any."""

    def shutdown(self) -> None:
        """Stop the averager."""


@runtime_checkable
class RoundRecords(Protocol):
    """What a stage reads of the swarm's progress records for its rounds."""

    def moved_past(self, round_index: int) -> bool:
        """Whether no group can form for ``round_index`` any more (every other live peer of the unit has applied it
        already): a round still matching then fails at once instead of waiting out its timeout. Never raises."""
