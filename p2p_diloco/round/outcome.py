"""What one round gave a stage: the averager's outcome, the round end's report, and a round still in flight.

Plain data, no network: the averager (``swarm.averaging``) and the simulator both return a :class:`RoundOutcome`;
the stage turns it into a :class:`RoundReport` for the metrics, the console, the checkpoint and the summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch


@dataclass(frozen=True)
class RoundOutcome:
    """What averaging one round's contribution gave this peer: the one record of it, from the averager to the round
    report, the metrics and the summary (same names everywhere). The default is a round that never reached the
    network (``averaged`` False)."""

    average: Optional[list[torch.Tensor]] = field(default=None, metadata={"tensors": True})
    """The group's average; None when the round fell back (this peer applies its own contribution)."""
    residual: Optional[list[torch.Tensor]] = field(default=None, metadata={"tensors": True})
    """This peer's error feedback: its contribution minus what the wire carried of it."""
    group_size: int = 1
    group_tokens: float = 0.0
    """The tokens of the whole group (claims capped as in the average): this peer's share is its weight over these."""
    group_peers: tuple[str, ...] = ()
    """DHT peer ids of the group (empty when it fell back)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    averaging_s: float = 0.0
    fallback_reason: str = ""
    compression: dict = field(default_factory=dict)
    """Rank, codecs, payload bytes, relative compression error, measured bandwidth."""
    suspects: dict = field(default_factory=dict)
    """Groupmates flagged in the round (peer id -> reasons: see :mod:`p2p_diloco.swarm.averaging.guard`)."""
    banned: tuple[str, ...] = ()
    """Peers this peer has banned: it does not group with them (until it restarts)."""
    ban_reasons: dict = field(default_factory=dict)
    """Why the last of them were banned (peer id -> reason; see ``guard.REPORTED_BANS``)."""
    averaged: bool = False
    """The group's average came back (``average`` holds it until the round is applied)."""

    def facts(self) -> dict:
        """Everything but the tensors (metrics, checkpoints); :meth:`from_facts` reads it back."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("tensors")} | \
            {"group_peers": list(self.group_peers), "banned": list(self.banned)}

    @classmethod
    def from_facts(cls, facts: dict) -> RoundOutcome:
        """The outcome (without tensors) of :meth:`facts`, or of any dict with these keys among others."""
        known = {f.name for f in fields(cls) if not f.metadata.get("tensors")}
        kept = {k: v for k, v in facts.items() if k in known}
        return cls(**kept | {k: tuple(kept[k]) for k in ("group_peers", "banned") if k in kept})


@dataclass
class RoundReport:
    """What one round end did on one stage, for metrics and the console.

    In ``none`` mode the round that ended is also the round applied; in ``delayed``/``eager`` the round
    applied is the previous one (``applied_round`` is None at the end of the first round: nothing to apply).
    """

    round_index: int
    tokens: int = 0
    """Tokens this peer trained on in the round that ended (its averaging weight)."""
    applied_round: int | None = None
    outcome: RoundOutcome = field(default_factory=RoundOutcome)
    """The applied round's averaging, as the averager gave it (the default: nothing applied)."""
    waited_s: float = 0.0
    """How long the training loop waited for the network at this round end."""
    round_end_s: float = 0.0
    """Time the round end took on the training thread, waiting included (overhead = this - waited_s)."""
    delta_norm: float = 0.0
    outer_lr: float | None = None
    """The learning rate of the outer step that applied ``applied_round`` (it grows with the group: round/outer.py)."""

    def record(self) -> dict:
        """The report as one flat row (metrics, checkpoints): its own fields and the outcome's, no tensors."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "outcome"}
        return own | self.outcome.facts()

    @classmethod
    def from_record(cls, row: dict) -> RoundReport:
        own = {f.name for f in fields(cls) if f.name != "outcome"}
        return cls(**{k: v for k, v in row.items() if k in own}, outcome=RoundOutcome.from_facts(row))


@dataclass
class PendingRound:
    """A round's contribution whose average has not been applied yet (delayed/eager modes)."""

    round_index: int
    contribution: list[torch.Tensor]
    weight: float
    in_flight: bool = False
    """Its averaging is running in the background."""
    outcome: RoundOutcome | None = None
    """Known once its averaging is over (or was never started: then with the reason)."""
    share: float = 1.0
    """eager mode: the share of this contribution already in the peer's eager parameters (taken back when the
    round's average is applied, so that the contribution counts exactly once)."""

    @property
    def settled(self) -> bool:
        return self.outcome is not None
