"""Hostile peers to the swarm's sync: what their progress records claim (the link's ``_progress_told``) and the state
they serve to newcomers (the server's ``get_current_state``, in the training process).

- ``false-state:K`` (:class:`FalseStateLink`, :class:`ShiftedState`): its records claim K rounds more than it has
  trained and applied (every peer that believed them would think it was behind and reload), and the state it serves
  has every anchor value shifted by 1 (default 1000);
- ``poison-momentum:K`` (:class:`PoisonedMomentum`): serves its true anchor with outer momentum K times that anchor:
  with the default K = 1 / (outer_lr * outer_momentum**2) of the default outer optimizer, the taker's next Nesterov
  step sends its anchor to about zero; its records are honest, so a benchmark casts the votes for the served state
  from other identities;
- ``tiny-clock`` (:class:`TinyClock`): the state it serves claims ``seconds_per_step`` = :data:`TINY_CLOCK_S`, whose
  ``elapsed / it`` overflows a downloader's ``int()``;
- colluding, honest until their round R (the value, default 3: trust earned by averaging honestly), then all
  together (:class:`CollusionLink`, :class:`CollusionState`): ``collude-wipe:R`` (their records claim round
  R + :data:`COLLUDE_AHEAD`, its previous round applied, with the fingerprint of an all-zero state, and that is the
  state they serve: every colluder's records vouch for the same forged state, so a victim that met them sees it
  confirmed) and ``collude-end:R`` (the same, claiming the run is over: its last round applied, the zero state its
  final one).
"""

from __future__ import annotations

import torch

from p2p_diloco.round.position import Position
from p2p_diloco.round.swarm_state import anchor_digest, state_fingerprint
from tests.hostile.base import HostileLink, HostileServer, Hostility

COLLUDE_AHEAD = 3  # collude-wipe: how many rounds ahead the colluders' records claim to be
TINY_CLOCK_S = 5e-320  # a subnormal float: positive and finite, and elapsed / it overflows


class FalseStateLink(HostileLink):
    def _progress_told(self, position: Position) -> tuple[int, int, str, str]:
        told_round, applied_round, anchor, prior_anchor = super()._progress_told(position)
        ahead = int(self.hostility.value)
        return told_round + ahead, applied_round + ahead, anchor, prior_anchor


class LyingState(HostileServer):
    """Serves :meth:`_served` of its state (metadata, anchor tensors then momentum) instead of it."""

    def get_current_state(self):
        meta, tensors, info = super().get_current_state()
        return (*self._served(meta, tensors), info) if meta else (meta, tensors, info)

    def _served(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        raise NotImplementedError


class ShiftedState(LyingState):
    def _served(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        half = len(tensors) // 2
        return meta, [t + 1.0 for t in tensors[:half]] + list(tensors[half:])


class PoisonedMomentum(LyingState):
    def _served(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        anchor = list(tensors[:len(tensors) // 2])
        return meta, anchor + [t * self.hostility.value for t in anchor]


class TinyClock(LyingState):
    def _served(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        return dict(meta, seconds_per_step=TINY_CLOCK_S), tensors


def striking(hostility: Hostility, round_index: int) -> bool:
    """Whether the colluders lie from ``round_index`` on (their strike: round R)."""
    return round_index >= hostility.value


def told(hostility: Hostility) -> tuple[int, int]:
    """The (round, applied round) every colluder claims from its strike on: the same on all of them, so that they
    vouch for one state."""
    if hostility.kind == "collude-end":
        return hostility.num_rounds, hostility.num_rounds - 1
    strike = int(hostility.value) + COLLUDE_AHEAD
    return strike, strike - 1


def forged(hostility: Hostility, applied_round: int) -> tuple[list[torch.Tensor], str]:
    """The all-zero state every colluder serves after ``applied_round`` (outer steps: applied + 1), and its
    fingerprint (the same on every colluder)."""
    zeros = [torch.zeros(shape) for shape in hostility.shapes]
    return zeros, state_fingerprint(anchor_digest(zeros), zeros, applied_round, applied_round + 1)


class CollusionLink(HostileLink):
    def _progress_told(self, position: Position) -> tuple[int, int, str, str]:
        if not striking(self.hostility, position.round):
            return super()._progress_told(position)
        told_round, applied_round = told(self.hostility)
        return told_round, applied_round, forged(self.hostility, applied_round)[1], ""


class CollusionState(LyingState):
    def _served(self, meta: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
        if not striking(self.hostility, int(meta["round"])):
            return meta, tensors
        told_round, applied_round = told(self.hostility)
        zeros, _ = forged(self.hostility, applied_round)
        start = told_round * self.hostility.inner_steps  # where a peer on that round would be (the end: its last step)
        return dict(meta, round=told_round, applied_round=applied_round, outer_steps=applied_round + 1,
                    round_start_step=start, inner_step=start), zeros + [torch.zeros_like(z) for z in zeros]
