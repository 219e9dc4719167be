"""The outer state of one stage: everything DiLoCo keeps beside the working parameters phi, and the operations of the
round (docs/design.md §2.4) that move it and phi.

- the anchor theta (fp32, CPU, identical on every peer that saw the same averages) and its outer optimizer (the
  outer momentum), with the last round whose average the anchor took;
- phi0, the round's starting point (in mode ``none`` the anchor itself until a flush makes it its own);
- the error feedback e while pseudo-gradients are compressed (docs/design.md 2.8);
- in ``eager`` mode the peer's own copy of the anchor and its outer optimizer (2.7): the shared anchor stays the agreed
  one (state sharing, fingerprints, evaluation) and this copy is where the peer trains from.

These are the copies ``p2p_diloco.memory`` counts as the training process's outer state (with the round's
contribution, held by :class:`~p2p_diloco.round.exchange.Exchange`). The lock is held while a round end changes
them and while state serving reads them. Owned by :class:`~p2p_diloco.round.stage.Stage`; the rules
(:mod:`.rules`), state sharing (:mod:`.swarm_state`) and checkpoints (:mod:`.stage_state`) work on it.
"""

from __future__ import annotations

import threading

import torch

from p2p_diloco.config import DiLoCoConfig
from p2p_diloco.round.outer import OuterOptimizer


class OuterState:
    """theta, the outer momentum, phi0, e and eager's copy of the outer state, for the working params ``params``.

    Args:
        names: the parameters' names (what a checkpoint calls each tensor of the state).
        params: the stage's working parameters phi (the tensors of its module, moved in place).
        cfg: the ``[diloco]`` section.
        overlaps: the mode overlaps averaging with training (``delayed``, ``eager``): phi0 is a copy of its own.
        keeps_eager_state: ``eager``: keep the peer's own copy of the outer state.
        compressed: pseudo-gradients are compressed: keep error feedback.
    """

    def __init__(self, names: list[str], params: list[torch.nn.Parameter], cfg: DiLoCoConfig, *, overlaps: bool,
                 keeps_eager_state: bool, compressed: bool):
        self.names, self.params = names, params
        self.anchor = [p.detach().to(device="cpu", dtype=torch.float32, copy=True) for p in params]
        # phi0: in blocking mode every round starts from the anchor; with overlap, from the rebased params
        self.round_start = [t.clone() for t in self.anchor] if overlaps else self.anchor
        self.feedback = [torch.zeros_like(t) for t in self.anchor] if compressed else None
        self.outer_optimizer = _make_outer(self.anchor, cfg)
        self.eager_anchor = [t.clone() for t in self.anchor] if keeps_eager_state else None
        self.eager_optimizer = _make_outer(self.eager_anchor, cfg) if keeps_eager_state else None
        self.applied_round = -1  # the last round whose average the anchor took
        self.lock = threading.RLock()

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """phi0 - phi: the progress since the round's starting point (fp32, CPU)."""
        return [start - p.detach().to(device="cpu", dtype=torch.float32)
                for start, p in zip(self.round_start, self.params)]

    def with_feedback(self, delta: list[torch.Tensor], averager) -> list[torch.Tensor]:
        """delta + beta e, written into ``delta`` (the round end's own tensors, used for nothing else after): what
        the compressor left out of earlier rounds goes out with this one (beta: ``averager.feedback_decay``, below 1
        for SparseLoCo, whose decaying feedback plays the outer momentum; read only while there is feedback)."""
        if self.feedback is None:
            return delta
        decay = averager.feedback_decay
        for d, e in zip(delta, self.feedback):
            d.add_(e if decay == 1.0 else decay * e)
        return delta

    def set_params(self, values: list[torch.Tensor]) -> None:
        """phi = ``values``."""
        for p, value in zip(self.params, values):
            p.copy_(value)

    def restart_from_params(self) -> None:
        """The next round starts from the working params as they are (overlap modes), copied into phi0's own
        buffers: a round end allocates no new copy of the weights."""
        self.own_round_start()
        for start, p in zip(self.round_start, self.params):
            start.copy_(p.detach())

    def own_round_start(self) -> None:
        """phi0 in buffers of its own (in blocking mode it is the anchor itself), before it is written in place."""
        if self.round_start is self.anchor:
            self.round_start = [t.clone() for t in self.anchor]

    def rebase(self, restart_from: list[torch.Tensor] | None) -> None:
        """phi = theta - (phi0 - phi), the progress since the round started carried onto the new anchor, then phi0
        = ``restart_from`` (None: the rebased params). One tensor at a time, in place: one tensor's temporary,
        not three copies of the weights (the progress, the new params, the new phi0)."""
        for i, (p, start, theta) in enumerate(zip(self.params, self.round_start, self.anchor)):
            progress = start - p.detach().to(device="cpu", dtype=torch.float32)
            p.copy_(theta - progress)
            start.copy_(p.detach() if restart_from is None else restart_from[i])

    def reset_eager(self) -> None:
        """Eager mode: this peer's eager state becomes the shared one (nothing without it)."""
        if self.eager_anchor is None:
            return
        for theta_e, theta in zip(self.eager_anchor, self.anchor):
            theta_e.copy_(theta)
        self.eager_optimizer.load_state_tensors(self.outer_optimizer.momentum_buffers, self.outer_optimizer.num_steps)

    def shift_eager(self, anchor_shift: list[torch.Tensor], momentum_shift: list[torch.Tensor]) -> None:
        """Eager mode: this peer's eager state moves as the shared one did (nothing without it)."""
        if self.eager_anchor is None:
            return
        for theta_e, m_e, d_theta, d_m in zip(self.eager_anchor, self.eager_optimizer.momentum_buffers,
                                              anchor_shift, momentum_shift):
            theta_e.add_(d_theta)
            m_e.add_(d_m)

    def num_bytes(self) -> int:
        """Bytes of the anchor and outer momentum, and of eager's copy of them."""
        tensors = self.anchor + self.outer_optimizer.momentum_buffers
        if self.eager_anchor is not None:
            tensors += self.eager_anchor + self.eager_optimizer.momentum_buffers
        return sum(t.numel() * t.element_size() for t in tensors)


def _make_outer(anchor: list[torch.Tensor], cfg: DiLoCoConfig) -> OuterOptimizer:
    return OuterOptimizer(anchor, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov,
                          group_exponent=cfg.outer_lr_group_exponent, largest_group=cfg.outer_lr_largest_group)
