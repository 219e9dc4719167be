"""What a stage process reports: the console reporter protocol and the end-of-training summary.

Called by the trainer (which fills them) and the CLI (which reads them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Protocol

from p2p_diloco.round.outcome import RoundReport
from p2p_diloco.round.swarm_state import anchor_digest  # noqa: F401 (the metrics rows' digest)


class Reporter(Protocol):
    """Where the loop reports progress (the CLI's console, or nothing)."""

    def on_start(self, total_steps: int, done_steps: int) -> None: ...
    def on_step(self, step: int, loss: float, tokens_per_s: float) -> None: ...
    def on_round(self, report: RoundReport) -> None: ...
    def on_eval(self, round_index: int, loss: float) -> None: ...
    def close(self) -> None: ...


class NullReporter:
    def on_start(self, total_steps: int, done_steps: int) -> None: ...
    def on_step(self, step: int, loss: float, tokens_per_s: float) -> None: ...
    def on_round(self, report: RoundReport) -> None: ...
    def on_eval(self, round_index: int, loss: float) -> None: ...
    def close(self) -> None: ...


@dataclass
class TrainSummary:
    """What one stage process did, written to ``summary-stage<j>.json`` at the end."""

    peer: str
    run_id: str
    stage: int
    num_stages: int
    num_params: int
    mode: str = "none"
    rounds_completed: int = 0
    inner_steps: int = 0
    """Where this stage is on the inner-step schedule (a round ended by the swarm skips the rest of its steps)."""
    tokens: int = 0
    """Tokens this peer trained on (not those of a state it downloaded)."""
    averaged_rounds: int = 0
    """Rounds whose pseudo-gradients were averaged with other peers and applied."""
    fallback_rounds: int = 0
    """Rounds applied with this peer's own pseudo-gradient (nobody to average with, or averaging failed)."""
    reloads: int = 0
    """Times this stage took a peer's state over to catch up (joining late, or behind the swarm)."""
    resyncs: int = 0
    """Times this stage replaced a diverged anchor with the swarm's."""
    joins: int = 0
    """Groupmates that appeared in an averaged round since the previous averaged round."""
    leaves: int = 0
    """Groupmates of the previous averaged round missing from the next one."""
    last_group: Optional[list[str]] = None
    """Peer ids of the last averaged round's group."""
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    eval_loss_start: Optional[float] = None
    eval_round_start: int = 0
    """The rounds the anchor held at ``eval_loss_start``: more than 0 for a peer that joined late (the state it
    downloaded)."""
    eval_loss_final: Optional[float] = None
    bytes_sent: int = 0
    bytes_received: int = 0
    allreduce_bytes_equivalent: int = 0
    """Bytes a per-step fp32 ring AllReduce of this stage would have sent over the same inner steps."""
    network_wait_s: float = 0.0
    """Time the training loop spent waiting for averaging at round ends."""
    train_s: float = 0.0
    """Time spent in inner steps and round ends (not start-up, evaluation or checkpoints)."""
    anchor_sha256: str = ""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes held for parameters, inner optimizer state and outer state (anchor + momentum) by this stage."""
    max_rss_mb: float = 0.0
    """Peak resident memory of this stage process."""
    wall_s: float = 0.0
    stopped_early: bool = False
    group_sizes: list[int] = field(default_factory=list)

    def account(self, report: RoundReport, inner_steps_per_round: int) -> None:
        """Add one applied round (or the first round end of an overlap mode, which applies nothing); in a run averaged
        by fragment, the :func:`combined_report` of every fragment's round end."""
        outcome = report.outcome
        self.bytes_sent += outcome.bytes_sent
        self.bytes_received += outcome.bytes_received
        self.network_wait_s += report.waited_s
        if report.applied_round is None:
            return
        self.group_sizes.append(outcome.group_size)
        if outcome.averaged:
            self.averaged_rounds += 1
            group = set(outcome.group_peers)
            if self.last_group is not None:  # groupmates that appeared / disappeared since the last averaged round
                self.joins += len(group - set(self.last_group))
                self.leaves += len(set(self.last_group) - group)
            self.last_group = sorted(group)
            g = outcome.group_size
            self.allreduce_bytes_equivalent += int(inner_steps_per_round * 2 * (g - 1) / g * 4 * self.num_params)
        else:
            self.fallback_rounds += 1


def combined_report(reports: list[RoundReport]) -> RoundReport:
    """One round end of several fragments as one report (the summary and the console): bytes and waits added up,
    averaged only if every fragment averaged, the smallest group, the peers of all groups, the first reason."""
    if len(reports) == 1:
        return reports[0]
    outcomes = [r.outcome for r in reports]
    failed = [o for o in outcomes if not o.averaged]
    outcome = dataclasses.replace(
        outcomes[0], averaged=not failed, group_size=min(o.group_size for o in outcomes),
        group_peers=tuple(sorted({p for o in outcomes for p in o.group_peers})),
        bytes_sent=sum(o.bytes_sent for o in outcomes), bytes_received=sum(o.bytes_received for o in outcomes),
        fallback_reason=failed[0].fallback_reason if failed else outcomes[0].fallback_reason,
        average=None, residual=None)
    first = reports[0]
    return dataclasses.replace(first, outcome=outcome, waited_s=sum(r.waited_s for r in reports),
                               round_end_s=sum(r.round_end_s for r in reports),
                               delta_norm=sum(r.delta_norm ** 2 for r in reports) ** 0.5)


RESUMED_FIELDS = ("rounds_completed", "tokens", "averaged_rounds", "fallback_rounds", "reloads", "resyncs", "joins",
                  "leaves", "last_group", "bytes_sent", "bytes_received",
                  "allreduce_bytes_equivalent", "first_loss", "eval_loss_start", "eval_round_start", "group_sizes",
                  "network_wait_s", "train_s")
