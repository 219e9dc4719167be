"""A peer of D data-parallel replicas of its P-stage pipeline (a cluster's devices): replica 0 leads, the others follow.

Each stage's D replicas compute their gradients on their own batches and average them at every inner step through
torch's ``DistributedDataParallel`` (wrapped around the stage's module by the executors, over the stage's replica
group of :class:`~p2p_diloco.pipeline.context.PipelineContext`). With equal weights and equal averaged gradients,
their AdamW steps are equal, so the replicas stay one model without any exchange of weights.

Everything else is replica 0's: the swarm (DHT node, averagers, records), the outer step, state sharing,
evaluation, checkpoints and the metrics. A stage averages with the swarm once per round, not once per replica, and a
round's weight is the tokens of all D replicas. What replica 0 does to its weights outside the inner step (a merge,
a round end in mode ``none`` or ``eager``, a reload, a resume) the others learn from it: before each inner step,
replica 0 sends a :class:`Control` to its stage's replicas, followed by its weights when they changed outside the
inner step since the last one and by its AdamW state at the start and at each round's first step. A follower holds
what the inner loop needs and nothing of the outer state (docs/design.md, "What a peer holds").

Who calls this: the peer's stage process (``p2p_diloco.cli.peer``: :func:`run_follower` for replicas 1..D-1) and
the trainer (:class:`ReplicaLeader`, through ``executor.replicas``).
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import Optional

import torch

from p2p_diloco.data import WindowSampler
from p2p_diloco.model import build_stage_model, model_args_from_config
from p2p_diloco.model.fragments import fragment_parts
from p2p_diloco.round.inner import inner_lr, make_inner_optimizer
from p2p_diloco.stage_setup import load_data, make_executor, max_seq_len, resolve_init, resolve_split, stage_units

logger = logging.getLogger(__name__)


class ReplicaBatches:
    """Replica ``index``'s share of the peer's batches: every replica draws the same D x B windows from one seeded
    stream (a :class:`~p2p_diloco.data.WindowSampler` of batch D x B) and trains on its slice of B. So the D replicas
    train on exactly the batches that one replica of batch D x B would, and DDP's average of their mean losses is
    that replica's mean loss: the same learning at equal tokens, up to the order of float sums."""

    def __init__(self, sampler, replicas: int, index: int):
        self.sampler, self.replicas, self.index = sampler, replicas, index
        self.seq_len = sampler.seq_len
        self.batch_size = sampler.batch_size // replicas

    def next_batch(self):
        inputs, targets = self.sampler.next_batch()
        share = slice(self.index * self.batch_size, (self.index + 1) * self.batch_size)
        return inputs[share], targets[share]

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


@dataclass(frozen=True)
class Control:
    """What replica 0 tells its stage's other replicas before an inner step."""

    stop: bool
    inner_step: int
    weights: bool = False
    """Replica 0's weights follow (they changed outside the inner step)."""
    optimizer: Optional[list[float]] = None
    """AdamW's step count per parameter, followed by its two moments; None: nothing of AdamW follows."""
    sampler: Optional[dict] = None
    """Replica 0's sampler position (at each round's first step: its resume and the others' stay one stream)."""


def optimizer_tensors(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], create: bool) -> list:
    """AdamW's moments of ``params`` in order (exp_avg of each, then exp_avg_sq of each); ``create``: make zeros
    where there are none yet (a follower before its first step)."""
    moments = []
    for key in ("exp_avg", "exp_avg_sq"):
        for p in params:
            state = optimizer.state[p]
            if key not in state and create:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            moments.append(state[key])
    return moments


def optimizer_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Optional[list[float]]:
    """AdamW's step count of each of ``params``; None before its first step."""
    steps = [optimizer.state[p].get("step") for p in params]
    if any(step is None for step in steps):
        return None
    return [float(step) for step in steps]


class ReplicaLeader:
    """Replica 0's side: tells its stage's followers what to do before each inner step of the trainer.

    Args:
        context: this stage process's place in the peer.
        units: (params, inner optimizer) of each unit this stage process holds, in model order.
        sampler: replica 0's :class:`ReplicaBatches` (the followers draw from the same stream).
    """

    def __init__(self, context, units: list[tuple[list[torch.Tensor], torch.optim.Optimizer]], sampler):
        self.context, self.units, self.sampler = context, units, sampler
        self.params = [p for params, _ in units for p in params]
        self._sent_first = False

    def before_step(self, inner_step: int, weights: bool, optimizer: bool) -> None:
        """Before inner step ``inner_step``: send the followers what they need to take it as this replica will."""
        first = not self._sent_first
        self._sent_first = True
        steps = None
        if optimizer or first:
            per_unit = [optimizer_steps(opt, params) for params, opt in self.units]
            if all(s is not None for s in per_unit):
                steps = [s for unit_steps in per_unit for s in unit_steps]
        control = Control(False, inner_step, weights or first, steps,
                          self.sampler.state_dict() if optimizer or first else None)
        self.context.to_replicas(control)
        logger.debug(f"replica 0 of stage {self.context.stage_index}: step {inner_step}, weights {control.weights}, "
                     f"AdamW {control.optimizer is not None}, {len(self.params)} tensors")
        self._send(control)

    def _send(self, control: Control) -> None:
        if control.weights:
            self.context.tensors_to_replicas(self.params)
        if control.optimizer is not None:
            moments = [t for params, opt in self.units for t in optimizer_tensors(opt, params, create=False)]
            self.context.tensors_to_replicas(moments)

    def stop(self) -> None:
        """The run is over for this peer (or it stops): the followers exit."""
        self.context.to_replicas(Control(True, -1))


def run_follower(cfg, context) -> None:
    """Replica ``context.replica_index`` > 0 of stage ``context.stage_index``: inner steps on its own batches, in step
    with replica 0, until replica 0 says stop."""
    # Ctrl-C and SIGTERM are replica 0's to handle (it stops at a step's end and saves its checkpoint, then tells
    # this replica to stop): the launcher sends them to every process of the peer
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    folder, init_args = resolve_init(cfg) if cfg.model.init_from is not None else (None, None)
    data = load_data(cfg, max_seq_len=init_args.max_seq_len if init_args else max_seq_len(cfg))
    model_args = init_args or model_args_from_config(cfg.model, data.train.vocab_size)
    parts = fragment_parts(model_args, cfg.diloco.fragments) if cfg.diloco.fragments else None
    split = resolve_split(cfg, model_args, parts)
    # weights come from replica 0 (DDP's start, then the first control): no need to read them from a folder
    model = build_stage_model(model_args, split, context.stage_index, initialize=False).to(context.device)
    units = [[p for _, p in params] for _, _, params in stage_units(model, parts)]  # as replica 0's units, in order
    named = [(name, p) for _, _, params in stage_units(model, parts) for name, p in params]
    params = [p for _, p in named]
    optimizer = make_inner_optimizer(named, cfg.inner)
    executor = make_executor(cfg, context, model, context.device)  # DDP: joins replica 0's gradient averaging
    total_steps = cfg.inner.total_steps or cfg.train.num_rounds * cfg.diloco.inner_steps
    sampler, steps, replicas = None, 0, context.num_replicas
    label = f"stage {context.stage_index} replica {context.replica_index}"
    while True:
        control: Control = context.to_replicas(None)
        if control.stop:
            break
        if control.sampler is not None:
            if sampler is None:
                sampler = ReplicaBatches(WindowSampler(data.train, data.seq_len, cfg.data.batch_size * replicas, 0),
                                         replicas, context.replica_index)
            sampler.load_state_dict(control.sampler)
        logger.debug(f"{label}: step {control.inner_step}, weights {control.weights}, AdamW "
                     f"{control.optimizer is not None}, {len(params)} tensors")
        if control.weights:
            context.tensors_to_replicas(params)
        if control.optimizer is not None:
            context.tensors_to_replicas([t for unit in units for t in optimizer_tensors(optimizer, unit, create=True)])
            for p, step in zip(params, control.optimizer):
                optimizer.state[p]["step"] = torch.tensor(step, dtype=torch.float32)
        inputs, targets = sampler.next_batch()
        executor.forward_backward(inputs, targets)
        grads = [p.grad for p in params if p.grad is not None]
        # as Stage.grad_norms computes them: the same total norm, to the bit, as replica 0's
        norms = torch.stack(torch._foreach_norm(grads, 2)).float() if grads else \
            torch.zeros(0, dtype=torch.float32, device=context.device)
        total_norm = torch.linalg.vector_norm(executor.gather_across_stages(norms), 2)
        lr = inner_lr(control.inner_step, cfg.inner, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if torch.isfinite(total_norm):
            if cfg.inner.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(params, cfg.inner.grad_clip, total_norm.to(params[0].device))
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        steps += 1
    logger.info(f"{label}: {steps} inner steps, stopped by replica 0")
