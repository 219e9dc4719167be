"""The outer optimizer: SGD with (Nesterov) momentum on the anchor, driven by averaged pseudo-gradients.

Pure tensor maths on fp32 CPU tensors, deterministic, so that every peer that applies the same average
to the same anchor gets a bit-identical result. Follows ``torch.optim.SGD`` (dampening 0):
``m = mu * m + g``; ``theta -= lr * (g + mu * m)`` with Nesterov, ``theta -= lr * m`` without.

The step of an average of g contributions may grow with g (``diloco.outer_lr_group_exponent``, docs/design.md
2.3): the mean of more peers' pseudo-gradients is less noisy, and the DiLoCo scaling-law study (arXiv 2503.09799)
finds the best outer learning rate growing with the number of replicas. :func:`group_lr` is that rule; every member
of a group sees the same group size, so their anchors stay identical.
Called by :class:`p2p_diloco.round.stage.Stage` and by the reference simulation in the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

REFERENCE_GROUP = 2
"""The group size ``diloco.outer_lr`` is the step of: the smallest group that averages."""


def group_lr(lr: float, exponent: float, group_size: int, largest: int) -> float:
    """The outer learning rate for an average of ``group_size`` contributions: ``lr * (g / 2) ** exponent`` with ``g``
    the group size clamped to [2, ``largest``]; a round that fell back (g = 1: the peer's own pseudo-gradient) takes
    ``lr``. Groups larger than ``largest`` take its step: the rule does not extrapolate beyond where it was measured
    (BENCHMARKS.md, "The outer step against the group size"), and a crowd of identities joining one group cannot
    raise the step further."""
    if exponent == 0 or group_size <= REFERENCE_GROUP:
        return lr
    return lr * (min(group_size, largest) / REFERENCE_GROUP) ** exponent


class OuterOptimizer:
    """Nesterov SGD over a list of anchor tensors.

    Args:
        anchor: the tensors updated in place (fp32).
        lr: outer learning rate of a group of 2 (DiLoCo: 0.7).
        momentum: outer momentum (DiLoCo: 0.9).
        nesterov: use Nesterov momentum.
        group_exponent: how the step grows with the group size (:func:`group_lr`); 0: the same step for any group.
        largest_group: the largest group whose size still raises the step.
    """

    def __init__(self, anchor: Sequence[torch.Tensor], lr: float, momentum: float, nesterov: bool = True,
                 group_exponent: float = 0.0, largest_group: int = REFERENCE_GROUP):
        self.anchor = list(anchor)
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.group_exponent, self.largest_group = group_exponent, largest_group
        self.last_lr = lr  # the learning rate of the last step (the run's end measures steps by it)
        self.momentum_buffers = [torch.zeros_like(t) for t in self.anchor]
        self.num_steps = 0
        # the L2 norm of the pseudo-gradient of the last step: the scale of one outer step of this peer's, by which
        # the run's end bounds how far a final state it takes may be from its own (training.run_end)
        self.last_grad_norm = 0.0

    def lr_for(self, group_size: int) -> float:
        """The learning rate of a step on an average of ``group_size`` contributions."""
        return group_lr(self.lr, self.group_exponent, group_size, self.largest_group)

    @torch.no_grad()
    def step(self, pseudo_gradient: Sequence[torch.Tensor], group_size: int = 1) -> None:
        """Apply one outer step with the (averaged) pseudo-gradient ``phi0 - phi`` of a group of ``group_size``."""
        assert len(pseudo_gradient) == len(self.anchor), "one pseudo-gradient tensor per anchor tensor"
        lr = self.last_lr = self.lr_for(group_size)
        squares = 0.0
        for theta, buf, grad in zip(self.anchor, self.momentum_buffers, pseudo_gradient):
            grad = grad.to(dtype=theta.dtype, device=theta.device)
            squares += float(grad.double().pow(2).sum())
            if self.momentum == 0:
                theta.sub_(grad, alpha=lr)
                continue
            buf.mul_(self.momentum).add_(grad)
            update = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
            theta.sub_(update, alpha=lr)
        self.num_steps += 1
        self.last_grad_norm = squares ** 0.5

    @torch.no_grad()
    def peek(self, pseudo_gradient: Sequence[torch.Tensor], group_size: int = 1) -> list[torch.Tensor]:
        """The anchor that :meth:`step` would give for ``pseudo_gradient``, changing nothing (state serving)."""
        lr = self.lr_for(group_size)
        result = []
        for theta, buf, grad in zip(self.anchor, self.momentum_buffers, pseudo_gradient):
            grad = grad.to(dtype=theta.dtype, device=theta.device)
            if self.momentum == 0:
                result.append(theta.sub(grad, alpha=lr))
                continue
            new_buf = buf * self.momentum + grad
            update = grad.add(new_buf, alpha=self.momentum) if self.nesterov else new_buf
            result.append(theta.sub(update, alpha=lr))
        return result

    @torch.no_grad()
    def peek_into(self, pseudo_gradient: Sequence[torch.Tensor], group_size: int, anchor_out: Sequence[torch.Tensor],
                  momentum_out: Sequence[torch.Tensor]) -> None:
        """:meth:`peek`'s anchor, and the momentum :meth:`step` would leave, written into ``anchor_out`` and
        ``momentum_out`` (the same bits as :meth:`peek`; no temporary larger than one tensor), changing nothing."""
        lr = self.lr_for(group_size)
        for theta, buf, grad, theta_out, buf_out in zip(self.anchor, self.momentum_buffers, pseudo_gradient,
                                                        anchor_out, momentum_out):
            grad = grad.to(dtype=theta.dtype, device=theta.device)
            if self.momentum == 0:
                torch.sub(theta, grad, alpha=lr, out=theta_out)
                buf_out.copy_(buf)
                continue
            torch.mul(buf, self.momentum, out=buf_out)
            buf_out.add_(grad)
            update = grad.add(buf_out, alpha=self.momentum) if self.nesterov else buf_out
            torch.sub(theta, update, alpha=lr, out=theta_out)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.momentum_buffers

    def load_state_tensors(self, buffers: Sequence[torch.Tensor], num_steps: int) -> None:
        for buf, value in zip(self.momentum_buffers, buffers):
            buf.copy_(value)
        self.num_steps = num_steps
