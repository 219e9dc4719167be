"""What crosses between a unit's two averaging processes: the training process's client
(:class:`~p2p_diloco.swarm.averaging.averager.PseudoGradientAverager`) and the averager's background process
(:class:`~p2p_diloco.swarm.averaging.server.AveragingServer`), which owns the compression policy, the link's
measured bandwidth and the peer guard.

The client tells the server only what the training process knows of a round (:class:`RoundClaim`); the server
completes it into the record its groupmates gather (:class:`OwnRecord`), and returns a group's result
(:class:`GroupResult`) and a round's flags (:class:`Flags`). Each crosses the process boundary pickled, as
hivemind's step control and pipe carry it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class RoundClaim:
    """What this peer claims of a round: its index, the tokens it trained (its weight) and its compute time."""

    round: int
    tokens: float
    compute_s: float

    def to_gather(self) -> dict:
        """As hivemind's ``step(gather=...)`` takes it (msgpack in the client): a plain dict."""
        return asdict(self)

    @classmethod
    def from_gather(cls, gathered: dict) -> RoundClaim:
        return cls(int(gathered["round"]), float(gathered["tokens"]), float(gathered["compute_s"]))


@dataclass
class OwnRecord:
    """What the averaging process adds to a round's claim in the record its groupmates gather, and keeps from one
    round to the next: its compression proposal, the last round's compression error and the link's bandwidth (an
    average of the recent samples, with little lag)."""

    proposal: dict
    bandwidth_mbit: float
    last_error: Optional[float] = None

    def record(self, claim: RoundClaim) -> dict:
        """The round's record, its fields in the wire's order (``gathered.check_gathered`` reads it)."""
        return dict(round=claim.round, tokens=float(claim.tokens), compute_s=float(claim.compute_s),
                    bandwidth_mbit=float(self.bandwidth_mbit), compression=self.proposal, last_error=self.last_error)

    def averaged(self, stats: dict, next_proposal: dict) -> None:
        """After an averaged round: the policy's next proposal, the round's error, a bandwidth sample if measured."""
        self.proposal = next_proposal
        self.last_error = stats.get("compression_error")
        if stats.get("bandwidth_mbit"):
            self.bandwidth_mbit = 0.5 * self.bandwidth_mbit + 0.5 * float(stats["bandwidth_mbit"])


@dataclass
class GroupResult:
    """A group's all-reduce, as the server returns it to the client: every member's record (peer id -> its
    metadata), the group's tokens (claims capped as in the average) and the round's compression statistics."""

    gathered: dict
    tokens: float
    stats: dict = field(default_factory=dict)


@dataclass
class Flags:
    """The groupmates flagged in a round (peer -> sorted reasons), every peer banned so far, and why the last of them
    were banned."""

    suspects: dict = field(default_factory=dict)
    banned: list = field(default_factory=list)
    ban_reasons: dict = field(default_factory=dict)
