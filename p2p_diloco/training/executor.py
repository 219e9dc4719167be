"""How one inner step's forward and backward run: :class:`LocalExecutor` runs the whole model in this
process (P = 1); the pipeline executor (``p2p_diloco.pipeline``) runs one stage of P.

Both split the batch into microbatches and leave the gradients of the mean loss in the parameters, so
the same data gives the same update whatever P is. On CUDA the forward runs under bf16 autocast.
Called by :class:`p2p_diloco.training.trainer.Trainer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from p2p_diloco.model import loss_fn


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; nothing on CPU (fp32 is faster there and exact)."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def data_parallel(module: nn.Module, device: torch.device, replica_group) -> nn.Module:
    """``module`` under torch's DistributedDataParallel over ``replica_group`` (this stage's replicas): gradients
    averaged at each backward (its start also gives every replica replica 0's weights). Its forward broadcasts
    nothing, so replica 0 alone can evaluate through it."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # (torch 2.13 renamed broadcast_buffers; the model's only buffers are its RoPE tables, equal on every replica)
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in \
        inspect.signature(DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False}
    return DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None,
                                   process_group=replica_group, **no_sync)


class LocalExecutor:
    """Runs the whole model in this process.

    Args:
        model: the full model, on ``device``.
        device: where the model lives.
        microbatches: gradient-accumulation steps per inner step (must divide the batch size).
    """

    is_last_stage = True
    is_first_stage = True

    replicas = None  # p2p_diloco.pipeline.replicas.ReplicaLeader of a peer of several replicas (replica 0)

    def __init__(self, model: nn.Module, device: torch.device, microbatches: int = 1, replica_group=None):
        self.model, self.device, self.microbatches = model, device, microbatches
        # a peer of D replicas: DDP averages the gradients over this stage's replicas at the last microbatch
        self.trained = self.model if replica_group is None else data_parallel(model, device, replica_group)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Accumulate gradients of the mean loss over the batch; returns that loss."""
        self.model.train()
        total = 0.0
        pairs = list(zip(inputs.chunk(self.microbatches), targets.chunk(self.microbatches)))
        for i, (x, y) in enumerate(pairs):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            last = i == len(pairs) - 1
            with contextlib.nullcontext() if last or self.trained is self.model else self.trained.no_sync():
                with autocast_for(self.device):
                    logits = self.trained(x)  # (B, T, V)
                loss = loss_fn(logits, y) / self.microbatches
                loss.backward()
            total += loss.item()
        return total

    def any_stage(self, flag: bool) -> bool:
        """Whether any stage of the peer raised ``flag``: there is only this one."""
        return flag

    def any_stages(self, *flags: bool) -> tuple[bool, ...]:
        """For each flag, whether any stage raised it: there is only this one."""
        return flags

    def gather_across_stages(self, values: torch.Tensor) -> torch.Tensor:
        """Concatenate a 1-D tensor over the peer's stages in stage order: there is only this one."""
        return values

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` with the current weights."""
        if not batches:
            return float("nan")
        self.model.eval()
        losses = []
        for x, y in batches:
            with autocast_for(self.device):
                logits = self.model(x.to(self.device))
            losses.append(loss_fn(logits, y.to(self.device)).item())
        self.model.train()
        return sum(losses) / len(losses)

    def barrier(self) -> None:
        """Wait for the peer's other stages: there are none."""

    def common_value(self, value):
        """Every stage's ``value``, in stage order: here, only this one's."""
        return [value]
