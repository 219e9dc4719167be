"""Steps 4 and 5 of a stage's rounds (docs/design.md §2.4): averaging a round's contribution with the same unit of
other peers, and collecting what it gave.

An :class:`Exchange` holds the stage's averager (the swarm's or the simulator's, behind
:class:`~p2p_diloco.round.averager.RoundAverager`), the swarm's records of its peers, and the round whose average is
not applied yet (:class:`~p2p_diloco.round.outcome.PendingRound`). A failed round is an outcome, never an error: the
peer then applies its own contribution (a fallback, logged with its reason). Collecting a round sets what the
outer state keeps of it: the round the anchor takes and the error feedback. Owned by
:class:`~p2p_diloco.round.stage.Stage`; the rules (:mod:`.rules`) and state sharing use it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from p2p_diloco.round.averager import RoundAverager, RoundRecords
from p2p_diloco.round.outcome import PendingRound, RoundOutcome, RoundReport
from p2p_diloco.round.outer_state import OuterState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundEnd:
    """What a round end tells the averaging of the round that ended (step 4)."""

    round_index: int
    tokens: float
    """Tokens this peer trained on in the round (the averaging weight)."""
    expected_group_size: int | None
    """Live peers of this unit in the swarm, this one included; 1 skips the network, None (unknown) tries it."""
    compute_s: float = 0.0
    """How long the round's inner steps took (for the compression's bandwidth budget, and with overlap the retry
    budget of a failed all-reduce)."""


class Exchange:
    """A stage's averaging of its rounds: the averager, the swarm's records, the round in flight.

    Args:
        averager: what averages this unit's rounds, or None to train alone.
        records: the swarm's records of this unit's peers, read while a round waits for its group; None: a round
            waits out its own bounds.
        overlaps: a round's averaging runs on while the next round trains (``delayed``, ``eager``).
        label: the stage's name in logs.
    """

    def __init__(self, averager: RoundAverager | None, records: RoundRecords | None, *, overlaps: bool, label: str):
        self.averager, self.records = averager, records
        self.overlaps, self.label = overlaps, label
        self.pending: PendingRound | None = None
        self.applied_group_size = 1  # the group of the average step 5 last collected (1: a fallback, or none)
        self.merged: RoundReport | None = None  # delayed mode: a merge done mid-round, reported with the round end

    def start(self, end: RoundEnd, contribution: list[torch.Tensor], share: float = 1.0) -> None:
        """Step 4: start averaging a round's contribution (or note why the network is skipped); it is then pending.
        ``share``: eager mode's share of it already in the peer's eager parameters."""
        pending = PendingRound(end.round_index, contribution, float(end.tokens), share=share)
        if self.averager is None:
            pending.outcome = RoundOutcome(fallback_reason="training without a swarm")
        elif end.expected_group_size is not None and end.expected_group_size <= 1:
            pending.outcome = RoundOutcome(fallback_reason="no other live peer of this stage in the swarm")
        else:
            self.averager.set_expected_group_size(end.expected_group_size)
            # a failed all-reduce (a groupmate gone) is retried by the rest of the group within the round's budget:
            # with overlap, the next round's compute (docs/design.md §2.6); blocking, the matchmaking bound
            budget = end.compute_s if self.overlaps else 0.0
            self.averager.start_round(contribution, end.round_index, weight=float(end.tokens),
                                      compute_s=end.compute_s, budget_s=budget)
            pending.in_flight = True
        self.pending = pending

    def settle(self, feedback: list[torch.Tensor] | None) -> float:
        """Wait for the pending round's averaging (at most what is left of its own timeouts) and keep its outcome;
        returns the wait. ``feedback``: the stage's error feedback, which the averager may write the round's
        residual into."""
        pending = self.pending
        if pending is None or not pending.in_flight:
            return 0.0
        started = time.monotonic()
        outcome = self.averager.finish_round(hopeless=None if self.records is None else self.records.moved_past,
                                             feedback=feedback)
        waited = time.monotonic() - started
        pending.in_flight, pending.outcome = False, outcome
        if outcome.suspects:
            logger.warning(f"{self.label} round {pending.round_index}: flagged groupmates "
                           f"{outcome.suspects}")
        if not outcome.averaged:
            logger.warning(f"{self.label} round {pending.round_index}: averaging failed "
                           f"({outcome.fallback_reason}); applying this peer's own pseudo-gradient")
        return waited

    def collect(self, report: RoundReport, state: OuterState) -> list[torch.Tensor] | None:
        """Step 5: the pending round's average, or its own contribution if that round failed; None if nothing
        is pending. ``applied_group_size`` is then the size of the group that averaged it (1: a fallback); the
        state's ``applied_round`` is that round and its error feedback what the round leaves owed."""
        pending = self.pending
        self.applied_group_size = 1
        if pending is None:
            return None
        report.waited_s = self.settle(state.feedback)
        self.pending = None
        report.applied_round = state.applied_round = pending.round_index
        outcome = pending.outcome
        # the report keeps the facts, not the tensors: the average is the caller's until its outer step, the
        # residual becomes e (the report is kept until the next round end: a copy of the average there would be a
        # whole copy of the weights)
        report.outcome = dataclasses.replace(outcome, average=None, residual=None)
        if outcome.averaged:  # the outer step of an average grows with its group (round/outer.py, group_lr)
            self.applied_group_size = outcome.group_size
        report.outer_lr = state.outer_optimizer.lr_for(self.applied_group_size)
        if not outcome.averaged:  # the whole own contribution, feedback included, is applied: nothing is owed
            if state.feedback is not None:
                state.feedback = [torch.zeros_like(e) for e in state.feedback]
            return pending.contribution
        if state.feedback is not None and outcome.residual is not None:
            state.feedback = outcome.residual
        return outcome.average

    def average_arrived(self) -> bool:
        """The pending round's average is here, or its averaging is over (its outcome not collected yet)."""
        pending = self.pending
        if pending.settled:
            return True
        return pending.in_flight and self.averager is not None and self.averager.round_settled

    def drop(self) -> None:
        """Forget the pending round: its average is never applied (a reload replaces the state it would step)."""
        if self.pending is not None and self.pending.in_flight and self.averager is not None:
            self.averager.abandon_round()
        self.pending = None

    def shutdown(self) -> None:
        """Cancel the round in flight, if any, and stop the averager."""
        if self.averager is not None:
            self.averager.cancel_round()
            self.averager.shutdown()
            self.averager = None
