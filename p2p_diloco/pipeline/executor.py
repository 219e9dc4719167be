"""One stage's share of an inner step, through ``torch.distributed.pipelining`` (GPipe or 1F1B).

Same interface as :class:`p2p_diloco.training.executor.LocalExecutor`: stage 0 feeds the tokens, the last
stage the targets and gets the loss; the schedule splits the batch into microbatches and leaves the
gradients of the mean loss (``scale_grads``) in each stage's parameters, so P stages compute the update
that one process would. The peer's gradient norm is gathered from all stages' per-tensor norms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from p2p_diloco.config import PipelineConfig
from p2p_diloco.model import loss_fn
from p2p_diloco.pipeline.context import PipelineContext, PipelineError
from p2p_diloco.training.executor import autocast_for, data_parallel

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class _Autocast(nn.Module):
    """Runs the stage's module under the device's autocast (bf16 on CUDA), keeping its parameters as they are."""

    def __init__(self, module: nn.Module, device: torch.device):
        super().__init__()
        self.module, self.device = module, device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with autocast_for(self.device):
            out = self.module(x)
        return out.float() if out.is_floating_point() else out


def _first_backward(ddp: nn.Module, module: nn.Module, is_first: bool, device: torch.device) -> None:
    """One forward and backward of a dummy microbatch through ``ddp`` (every replica of the stage at once), its
    gradients dropped. DDP learns the order in which the gradients become ready from its first backward and rebuilds
    its buckets in that order at the next forward; a pipeline schedule's first step runs several microbatches'
    forwards before their backwards, which torch's reducer refuses ("rebuilt parameter indices size is not same as
    original model parameters size"). After this step there is nothing left to rebuild."""
    inputs = torch.zeros(1, 2, dtype=torch.long, device=device) if is_first else \
        torch.zeros(1, 2, module.args.dim, device=device)
    ddp(inputs).float().sum().backward()
    for p in module.parameters():
        p.grad = None


class PipelineExecutor:
    """Runs this stage of the peer's pipeline.

    Args:
        context: the peer's process group and this stage's place in it.
        module: this stage's slice of the model, on ``context.device``.
        cfg: the ``[pipeline]`` section (schedule, microbatches).
    """

    replicas = None  # p2p_diloco.pipeline.replicas.ReplicaLeader of a peer of several replicas (replica 0)

    def __init__(self, context: PipelineContext, module: nn.Module, cfg: PipelineConfig):
        self.context, self.device = context, context.device
        self.is_first_stage, self.is_last_stage = context.is_first, context.is_last
        wrapped = _Autocast(module, self.device)
        if context.num_replicas > 1:  # DDP over this stage's replicas; the schedule syncs at the last microbatch
            wrapped = data_parallel(wrapped, self.device, context.replica_group)
            _first_backward(wrapped, module, context.is_first, self.device)
        self.pipeline_stage = PipelineStage(wrapped, context.stage_index, context.num_stages, self.device,
                                            group=context.pipeline_group)
        self.schedule = SCHEDULES[cfg.schedule](self.pipeline_stage, n_microbatches=cfg.microbatches,
                                                loss_fn=loss_fn)
        # replica 0 evaluates alone: through the bare module (an evaluation through DDP can leave its next training
        # step waiting forever on the gradients' all-reduce, which the other replicas never join)
        self.eval_schedule = self.schedule if context.num_replicas == 1 else SCHEDULES[cfg.schedule](
            PipelineStage(_Autocast(module, self.device), context.stage_index, context.num_stages, self.device,
                          group=context.pipeline_group), n_microbatches=cfg.microbatches, loss_fn=loss_fn)
        num_tensors = sum(1 for p in module.parameters() if p.requires_grad)
        self.norm_sizes = [int(n) for n in context.all_gather_objects(num_tensors)]

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One inner step's forward and backward on this stage; the loss on the last stage, NaN elsewhere."""
        losses: list[torch.Tensor] = []
        try:
            self._run(self.schedule.step, inputs, targets, losses)
        except PipelineError:
            raise
        except Exception as e:  # a dead neighbour surfaces as one of several errors inside the schedule
            raise PipelineError(f"stage {self.context.stage_index}: the pipeline broke ({str(e)[:200]})") from None
        if not self.is_last_stage:
            return math.nan
        return float(torch.stack([loss.detach().float() for loss in losses]).mean())

    def _run(self, method, inputs: torch.Tensor, targets: torch.Tensor, losses: list) -> None:
        if self.is_first_stage and self.is_last_stage:
            method(inputs.to(self.device), target=targets.to(self.device), losses=losses)
        elif self.is_first_stage:
            method(inputs.to(self.device))
        elif self.is_last_stage:
            method(target=targets.to(self.device), losses=losses)
        else:
            method()

    def gather_across_stages(self, values: torch.Tensor) -> torch.Tensor:
        return self.context.gather_1d(values.to(self.device), self.norm_sizes)

    def any_stage(self, flag: bool) -> bool:
        return self.context.any_flag(flag)

    def any_stages(self, *flags: bool) -> tuple[bool, ...]:
        return self.context.any_flags(flags)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` (forward only, through the pipeline); NaN on other than the last stage."""
        losses: list[torch.Tensor] = []
        for x, y in batches:
            batch_losses: list[torch.Tensor] = []
            try:
                self._run(self.eval_schedule.eval, x, y, batch_losses)
            except PipelineError:
                raise
            except Exception as e:
                raise PipelineError(f"stage {self.context.stage_index}: the pipeline broke in evaluation "
                                    f"({str(e)[:200]})") from None
            losses.extend(batch_losses)
        if not self.is_last_stage or not losses:
            return math.nan
        return float(torch.stack([loss.float() for loss in losses]).mean())

    def barrier(self) -> None:
        self.context.barrier()

    def common_value(self, value):
        """The list of every stage's ``value`` (used to agree on a checkpoint to resume from)."""
        return self.context.all_gather_objects(value)
