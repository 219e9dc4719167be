"""What a checkpoint holds of one stage, and how a stage is restored from it.

Tensors: working params phi, anchor theta, outer momentum, inner AdamW moments, the error-feedback residuals
of compression, and with overlap
(delayed/eager) the round's starting point phi0, the contribution whose average is not applied yet and,
when it arrived before the checkpoint (a shutdown waits for it), that average; in eager mode the peer's own
eager outer state (params and momentum). Metadata: inner step,
round, optimizer step counts, the pending round's outcome. A stage resumed from a checkpoint written
while its round was in flight restarts that averaging (:meth:`Stage.restart_pending`): the rest of the
swarm may have finished the round meanwhile, and then it falls back like any failed round.
Called by the trainer when it saves and resumes.
"""

from __future__ import annotations

import dataclasses

import torch

from p2p_diloco.swarm.averaging.averager import RoundOutcome
from p2p_diloco.training.stage import PendingRound, RoundReport, Stage


def state_tensors(stage: Stage) -> dict[str, torch.Tensor]:
    """Every tensor a resume needs."""
    tensors = {}
    for i, (name, p) in enumerate(zip(stage.param_names, stage.params)):
        tensors[f"param/{name}"] = p.detach()
        tensors[f"anchor/{name}"] = stage.anchor[i]
        tensors[f"outer_momentum/{name}"] = stage.outer_optimizer.momentum_buffers[i]
        if stage.rule.overlaps:
            tensors[f"round_start/{name}"] = stage.round_start[i]
        if stage.feedback is not None:
            tensors[f"feedback/{name}"] = stage.feedback[i]
        if stage.eager_anchor is not None:
            tensors[f"eager_anchor/{name}"] = stage.eager_anchor[i]
            tensors[f"eager_momentum/{name}"] = stage.eager_optimizer.momentum_buffers[i]
        outcome = stage.pending.outcome if stage.pending is not None else None
        if stage.pending is not None:
            tensors[f"pending/{name}"] = stage.pending.contribution[i]
        if outcome is not None and outcome.average is not None:
            tensors[f"pending_average/{name}"] = outcome.average[i]
            if outcome.residual is not None:
                tensors[f"pending_residual/{name}"] = outcome.residual[i]
        for key, value in stage.inner_optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"adam_{key}/{name}"] = value
    return tensors


def state_meta(stage: Stage) -> dict:
    adam_steps = [float(stage.inner_optimizer.state.get(p, {}).get("step", 0)) for p in stage.params]
    pending = stage.pending
    return {"inner_step": stage.inner_step, "round": stage.round_index,
            "outer_steps": stage.outer_optimizer.num_steps, "adam_step": adam_steps[0] if adam_steps else 0.0,
            "stage": stage.stage_index, "num_stages": stage.num_stages, "mode": stage.mode,
            "applied_round": stage.applied_round,
            "eager_outer_steps": None if stage.eager_optimizer is None else stage.eager_optimizer.num_steps,
            "merged": None if stage._merged is None else stage._merged.record(),
            "pending": None if pending is None else {
                "round": pending.round_index, "weight": pending.weight, "share": pending.share,
                "outcome": None if pending.outcome is None else pending.outcome.facts()}}


@torch.no_grad()
def load_state(stage: Stage, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore ``stage`` from :func:`state_tensors` / :func:`state_meta`; ValueError naming the first mismatch."""
    if (meta.get("stage"), meta.get("num_stages")) != (stage.stage_index, stage.num_stages):
        raise ValueError(f"checkpoint is of stage {meta.get('stage')} of {meta.get('num_stages')}, "
                         f"this is stage {stage.stage_index} of {stage.num_stages}")
    if meta.get("mode", "none") != stage.mode and (meta.get("mode") == "none" or stage.mode == "none"):
        raise ValueError(f"checkpoint was written in diloco.mode {meta.get('mode')!r}, this peer runs {stage.mode!r}")
    info = meta.get("pending")
    pending = [] if info is not None else None
    outcome = None if info is None else _pending_outcome(info)
    average = [] if outcome is not None and outcome.averaged else None
    residual = [] if average is not None and f"pending_residual/{stage.param_names[0]}" in tensors else None
    for i, (name, p) in enumerate(zip(stage.param_names, stage.params)):
        for prefix, target in (("param", p), ("anchor", stage.anchor[i]),
                               ("outer_momentum", stage.outer_optimizer.momentum_buffers[i])):
            _copy_checked(tensors, f"{prefix}/{name}", target)
        if stage.rule.overlaps:
            _copy_checked(tensors, f"round_start/{name}", stage.round_start[i])
        if pending is not None:
            pending.append(torch.zeros_like(stage.anchor[i]))
            _copy_checked(tensors, f"pending/{name}", pending[-1])
        if average is not None:
            average.append(torch.zeros_like(stage.anchor[i]))
            _copy_checked(tensors, f"pending_average/{name}", average[-1])
        if residual is not None:
            residual.append(torch.zeros_like(stage.anchor[i]))
            _copy_checked(tensors, f"pending_residual/{name}", residual[-1])
        if stage.feedback is not None and f"feedback/{name}" in tensors:
            _copy_checked(tensors, f"feedback/{name}", stage.feedback[i])
        if stage.eager_anchor is not None:
            if f"eager_anchor/{name}" in tensors:
                _copy_checked(tensors, f"eager_anchor/{name}", stage.eager_anchor[i])
                _copy_checked(tensors, f"eager_momentum/{name}", stage.eager_optimizer.momentum_buffers[i])
            else:  # written before eager kept its own state, or in delayed mode: start it from the shared one
                stage.eager_anchor[i].copy_(stage.anchor[i])
                stage.eager_optimizer.momentum_buffers[i].copy_(stage.outer_optimizer.momentum_buffers[i])
        if f"adam_exp_avg/{name}" in tensors:
            state = stage.inner_optimizer.state[p]
            state["step"] = torch.tensor(float(meta["adam_step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(p)
                _copy_checked(tensors, f"adam_{key}/{name}", state[key])
    stage.inner_step, stage.round_index = int(meta["inner_step"]), int(meta["round"])
    stage.applied_round = int(meta.get("applied_round", stage.round_index - 1))
    stage.outer_optimizer.num_steps = int(meta["outer_steps"])
    stage._merged = RoundReport.from_record(meta["merged"]) if meta.get("merged") else None
    if stage.eager_optimizer is not None:
        stage.eager_optimizer.num_steps = int(meta.get("eager_outer_steps") or meta["outer_steps"])
    if outcome is not None:
        outcome = dataclasses.replace(outcome, average=average, residual=residual)
    stage.pending = None if pending is None else PendingRound(
        int(info["round"]), pending, float(info["weight"]), outcome=outcome, share=float(info.get("share", 1.0)))


def _pending_outcome(info: dict) -> RoundOutcome | None:
    """The outcome of a checkpoint's round in flight, if it was known; checkpoints of format 1 kept some of its
    fields beside the round's."""
    if "outcome" in info:
        return None if info["outcome"] is None else RoundOutcome.from_facts(info["outcome"])
    if not info.get("settled"):
        return None
    return RoundOutcome(averaged=bool(info["averaged"]), group_size=int(info["group_size"]),
                        group_tokens=float(info["group_tokens"]), fallback_reason=str(info["reason"]))


def _copy_checked(tensors: dict[str, torch.Tensor], key: str, target: torch.Tensor) -> None:
    if key not in tensors:
        raise ValueError(f"checkpoint has no tensor {key!r}")
    value = tensors[key]
    if value.shape != target.shape:
        raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
    target.copy_(value)
