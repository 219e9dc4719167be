"""The outer optimizer: SGD with (Nesterov) momentum on the anchor, driven by averaged pseudo-gradients.

Pure tensor maths on fp32 CPU tensors, deterministic, so that every peer that applies the same average
to the same anchor gets a bit-identical result. Follows ``torch.optim.SGD`` (dampening 0):
``m = mu * m + g``; ``theta -= lr * (g + mu * m)`` with Nesterov, ``theta -= lr * m`` without.
Called by :class:`p2p_diloco.round.stage.Stage` and by the reference simulation in the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class OuterOptimizer:
    """Nesterov SGD over a list of anchor tensors.

    Args:
        anchor: the tensors updated in place (fp32).
        lr: outer learning rate (DiLoCo: 0.7).
        momentum: outer momentum (DiLoCo: 0.9).
        nesterov: use Nesterov momentum.
    """

    def __init__(self, anchor: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool = True):
        self.anchor = list(anchor)
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.momentum_buffers = [torch.zeros_like(t) for t in self.anchor]
        self.num_steps = 0
        # the L2 norm of the pseudo-gradient of the last step: the scale of one outer step of this peer's, by which
        # the run's end bounds how far a final state it takes may be from its own (training.run_end)
        self.last_grad_norm = 0.0

    @torch.no_grad()
    def step(self, pseudo_gradient: Sequence[torch.Tensor]) -> None:
        """Apply one outer step with the (averaged) pseudo-gradient ``phi0 - phi``."""
        assert len(pseudo_gradient) == len(self.anchor), "one pseudo-gradient tensor per anchor tensor"
        squares = 0.0
        for theta, buf, grad in zip(self.anchor, self.momentum_buffers, pseudo_gradient):
            grad = grad.to(dtype=theta.dtype, device=theta.device)
            squares += float(grad.double().pow(2).sum())
            if self.momentum == 0:
                theta.sub_(grad, alpha=self.lr)
                continue
            buf.mul_(self.momentum).add_(grad)
            update = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
            theta.sub_(update, alpha=self.lr)
        self.num_steps += 1
        self.last_grad_norm = squares ** 0.5

    @torch.no_grad()
    def peek(self, pseudo_gradient: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The anchor that :meth:`step` would give for ``pseudo_gradient``, changing nothing (eager mode)."""
        result = []
        for theta, buf, grad in zip(self.anchor, self.momentum_buffers, pseudo_gradient):
            grad = grad.to(dtype=theta.dtype, device=theta.device)
            if self.momentum == 0:
                result.append(theta.sub(grad, alpha=self.lr))
                continue
            new_buf = buf * self.momentum + grad
            update = grad.add(new_buf, alpha=self.momentum) if self.nesterov else new_buf
            result.append(theta.sub(update, alpha=self.lr))
        return result

    def state_tensors(self) -> list[torch.Tensor]:
        return self.momentum_buffers

    def load_state_tensors(self, buffers: Sequence[torch.Tensor], num_steps: int) -> None:
        for buf, value in zip(self.momentum_buffers, buffers):
            buf.copy_(value)
        self.num_steps = num_steps
