"""One pipeline stage's DiLoCo state and its round, as in DESIGN.md ("One round on one stage").

A :class:`Stage` owns a slice of the model (the whole model when P = 1) and everything DiLoCo keeps
for it: the working parameters phi (on the device), the anchor theta (fp32, CPU, identical on every
peer that saw the same averages), the outer momentum, the inner AdamW, the round's starting point phi0
and the averager that talks to the same stage of other peers. The trainer drives the inner steps and
calls :meth:`Stage.end_round` every H steps. Called by :class:`p2p_diloco.training.trainer.Trainer`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from p2p_diloco.config import DiLoCoConfig, InnerConfig
from p2p_diloco.training.outer import OuterOptimizer
from p2p_diloco.training.schedule import inner_lr

logger = logging.getLogger(__name__)


@dataclass
class RoundReport:
    """What happened in one round on one stage, for metrics and the console."""

    round_index: int
    averaged: bool
    group_size: int
    bytes_sent: int
    bytes_received: int
    averaging_s: float
    delta_norm: float
    fallback_reason: str = ""


class Stage:
    """DiLoCo state of one pipeline stage.

    Args:
        module: this stage's slice of the model, already on its device.
        stage_index: index of the stage in the peer's pipeline.
        num_stages: P.
        inner_cfg: the ``[inner]`` section.
        diloco_cfg: the ``[diloco]`` section.
        total_steps: length of the inner lr schedule.
        averager: a :class:`PseudoGradientAverager`, or None to train alone (benchmarks, tests).
    """

    def __init__(self, module: nn.Module, *, stage_index: int, num_stages: int, inner_cfg: InnerConfig,
                 diloco_cfg: DiLoCoConfig, total_steps: int, averager=None):
        self.module = module
        self.stage_index, self.num_stages = stage_index, num_stages
        self.inner_cfg, self.diloco_cfg, self.total_steps = inner_cfg, diloco_cfg, total_steps
        self.averager = averager
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.anchor = [p.detach().to(device="cpu", dtype=torch.float32, copy=True) for p in self.params]
        self.round_start = self.anchor  # phi0; in blocking mode every round starts from the anchor
        self.inner_optimizer = _make_adamw(named, inner_cfg)
        self.outer_optimizer = OuterOptimizer(
            self.anchor, lr=diloco_cfg.outer_lr, momentum=diloco_cfg.outer_momentum, nesterov=diloco_cfg.nesterov
        )
        self.inner_step = 0
        self.round_index = 0

    # ---- inner steps --------------------------------------------------------------------------------
    def grad_norms(self) -> torch.Tensor:
        """Per-tensor gradient norms of this stage, in parameter order (fp32, as ``clip_grad_norm_`` computes them).

        The peer's total norm is the norm of all stages' per-tensor norms concatenated in stage order, so it
        is bit-identical whatever P is.
        """
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros(0, dtype=torch.float32, device=self.params[0].device)
        return torch.stack(torch._foreach_norm(grads, 2)).float()

    def inner_update(self, total_grad_norm: torch.Tensor) -> float:
        """Clip by the peer's total gradient norm, take one AdamW step and return the learning rate used.

        A non-finite norm (overflow, a bad batch) skips the step rather than writing NaN into the weights.
        """
        lr = inner_lr(self.inner_step, self.inner_cfg, self.total_steps)
        for group in self.inner_optimizer.param_groups:
            group["lr"] = lr
        if torch.isfinite(total_grad_norm):
            if self.inner_cfg.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.params, self.inner_cfg.grad_clip,
                                                     total_grad_norm.to(self.params[0].device))
            self.inner_optimizer.step()
        else:
            logger.warning(f"Stage {self.stage_index} step {self.inner_step}: non-finite gradient norm, "
                           "step skipped")
        self.inner_optimizer.zero_grad(set_to_none=True)
        self.inner_step += 1
        return lr

    # ---- the round ----------------------------------------------------------------------------------
    @torch.no_grad()
    def end_round(self, tokens: int, expected_group_size: int) -> RoundReport:
        """Steps 2-6 of DESIGN.md's round: pseudo-gradient, averaging, outer step, new starting point.

        Args:
            tokens: tokens this peer trained on in the round (the averaging weight).
            expected_group_size: live peers of this stage in the swarm, this one included; 1 skips the network.
        """
        delta = [start - p.detach().to(device="cpu", dtype=torch.float32)
                 for start, p in zip(self.round_start, self.params)]  # 2. this round's local progress
        contribution = delta  # 3. compression plugs in here (identity: fp32 or the wire codec)
        averaged, report = self._average(contribution, tokens, expected_group_size)  # 4. + 5.
        self.outer_optimizer.step(averaged)  # 6. theta = outer_step(theta, avg)
        for p, theta in zip(self.params, self.anchor):  # blocking mode: phi = theta
            p.copy_(theta)
        self.round_index += 1
        report.delta_norm = float(torch.sqrt(sum(d.pow(2).sum() for d in delta)))
        return report

    def _average(self, contribution: list[torch.Tensor], tokens: int, expected_group_size: int):
        report = RoundReport(self.round_index, False, 1, 0, 0, 0.0, 0.0)
        if self.averager is None:
            return contribution, report
        if expected_group_size <= 1:
            report.fallback_reason = "no other live peer of this stage in the swarm"
            return contribution, report
        self.averager.set_expected_group_size(expected_group_size)
        self.averager.start_round(contribution, self.round_index, weight=float(tokens))
        result = self.averager.finish_round()
        report.bytes_sent, report.bytes_received = result.bytes_sent, result.bytes_received
        report.averaging_s, report.group_size = result.duration_s, result.group_size
        if result.averaged is None:
            report.fallback_reason = result.error or "averaging failed"
            logger.warning(f"Stage {self.stage_index} round {self.round_index}: averaging failed "
                           f"({report.fallback_reason}); applying this peer's own pseudo-gradient")
            return contribution, report
        report.averaged = True
        return result.averaged, report

    # ---- checkpoint state ---------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a resume needs: working params, anchor, outer momentum, inner AdamW moments."""
        tensors = {}
        for name, p, theta, m in zip(self.param_names, self.params, self.anchor,
                                     self.outer_optimizer.momentum_buffers):
            tensors[f"param/{name}"] = p.detach()
            tensors[f"anchor/{name}"] = theta
            tensors[f"outer_momentum/{name}"] = m
            for key, value in self.inner_optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"adam_{key}/{name}"] = value
        return tensors

    def state_meta(self) -> dict:
        adam_steps = [float(self.inner_optimizer.state.get(p, {}).get("step", 0)) for p in self.params]
        return {"inner_step": self.inner_step, "round": self.round_index, "outer_steps": self.outer_optimizer.num_steps,
                "adam_step": adam_steps[0] if adam_steps else 0.0, "stage": self.stage_index,
                "num_stages": self.num_stages}

    @torch.no_grad()
    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore from :meth:`state_tensors` / :meth:`state_meta`; ValueError naming the first mismatch."""
        if (meta.get("stage"), meta.get("num_stages")) != (self.stage_index, self.num_stages):
            raise ValueError(f"checkpoint is of stage {meta.get('stage')} of {meta.get('num_stages')}, "
                             f"this is stage {self.stage_index} of {self.num_stages}")
        for name, p, theta, m in zip(self.param_names, self.params, self.anchor,
                                     self.outer_optimizer.momentum_buffers):
            for prefix, target in (("param", p), ("anchor", theta), ("outer_momentum", m)):
                _copy_checked(tensors, f"{prefix}/{name}", target)
            if f"adam_exp_avg/{name}" in tensors:
                state = self.inner_optimizer.state[p]
                state["step"] = torch.tensor(float(meta["adam_step"]))
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = torch.zeros_like(p)
                    _copy_checked(tensors, f"adam_{key}/{name}", state[key])
        self.inner_step, self.round_index = int(meta["inner_step"]), int(meta["round"])
        self.outer_optimizer.num_steps = int(meta["outer_steps"])

    # ---- helpers ------------------------------------------------------------------------------------
    @contextmanager
    def anchor_weights(self) -> Iterator[None]:
        """Temporarily load the anchor into the working parameters (to evaluate the agreed model)."""
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            for p, theta in zip(self.params, self.anchor):
                p.copy_(theta)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(self.params, saved):
                    p.copy_(value)

    def num_state_bytes(self) -> dict[str, int]:
        """Bytes held for parameters, inner optimizer state and DiLoCo state (anchor, momentum)."""
        params = sum(p.numel() * p.element_size() for p in self.params)
        inner = sum(t.numel() * t.element_size() for state in self.inner_optimizer.state.values()
                    for t in state.values() if torch.is_tensor(t))
        outer = sum(t.numel() * t.element_size() for t in self.anchor + self.outer_optimizer.momentum_buffers)
        return {"params": params, "inner_optimizer": inner, "outer_state": outer}

    def shutdown(self) -> None:
        if self.averager is not None:
            self.averager.cancel_round()
            self.averager.shutdown()
            self.averager = None


def _make_adamw(named_params: list[tuple[str, nn.Parameter]], cfg: InnerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and other vectors are not decayed)."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps)


def _copy_checked(tensors: dict[str, torch.Tensor], key: str, target: torch.Tensor) -> None:
    if key not in tensors:
        raise ValueError(f"checkpoint has no tensor {key!r}")
    value = tensors[key]
    if value.shape != target.shape:
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
    target.copy_(value)
