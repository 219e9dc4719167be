"""What a checkpoint holds of one stage, and how a stage is restored from it.

Tensors: working params phi, anchor theta, outer momentum, inner AdamW moments, the error-feedback residuals
of compression, and with overlap (delayed/eager) the round's starting point phi0, the contribution whose average is
not applied yet and, when it arrived before the checkpoint (a shutdown waits for it), that average; in eager mode the
peer's own eager outer state (params and momentum). Metadata: inner step, round, optimizer step counts, the pending
round's outcome. A stage resumed from a checkpoint written while its round was in flight restarts that averaging
(:meth:`~p2p_diloco.round.stage.Stage.restart_pending`): the rest of the swarm may have finished the round meanwhile,
and then it falls back like any failed round.

Functions of a stage's parts: its outer state (:class:`~p2p_diloco.round.outer_state.OuterState`, with the working
params), its averaging (:class:`~p2p_diloco.round.exchange.Exchange`, the pending round), its clock
(:class:`~p2p_diloco.round.position.Clock`) and its inner optimizer. Called through
:meth:`~p2p_diloco.round.stage.Stage.state_dict` and :meth:`~p2p_diloco.round.stage.Stage.load_state_dict` by the
trainer when it saves and resumes.
"""

from __future__ import annotations

import dataclasses

import torch

from p2p_diloco.round.exchange import Exchange
from p2p_diloco.round.outcome import PendingRound, RoundOutcome, RoundReport
from p2p_diloco.round.outer_state import OuterState
from p2p_diloco.round.position import Clock
from p2p_diloco.unit import Unit


def state_dict(state: OuterState, exchange: Exchange, clock: Clock, inner_optimizer: torch.optim.Optimizer,
               header: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of everything a resume needs; the metadata is JSON. ``header``: the stage's names (its
    stage, and its fragment when averaged by fragment) and its mode, written into the metadata."""
    return _state_tensors(state, exchange, inner_optimizer), _state_meta(state, exchange, clock, inner_optimizer,
                                                                          header)


def _state_tensors(state: OuterState, exchange: Exchange,
                   inner_optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor a resume needs."""
    tensors = {}
    pending = exchange.pending
    outcome = pending.outcome if pending is not None else None
    for i, (name, p) in enumerate(zip(state.names, state.params)):
        tensors[f"param/{name}"] = p.detach()
        tensors[f"anchor/{name}"] = state.anchor[i]
        tensors[f"outer_momentum/{name}"] = state.outer_optimizer.momentum_buffers[i]
        if exchange.overlaps:
            tensors[f"round_start/{name}"] = state.round_start[i]
        if state.feedback is not None:
            tensors[f"feedback/{name}"] = state.feedback[i]
        if state.eager_anchor is not None:
            tensors[f"eager_anchor/{name}"] = state.eager_anchor[i]
            tensors[f"eager_momentum/{name}"] = state.eager_optimizer.momentum_buffers[i]
        if pending is not None:
            tensors[f"pending/{name}"] = pending.contribution[i]
        if outcome is not None and outcome.average is not None:
            tensors[f"pending_average/{name}"] = outcome.average[i]
            if outcome.residual is not None:
                tensors[f"pending_residual/{name}"] = outcome.residual[i]
        for key, value in inner_optimizer.state.get(p, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"adam_{key}/{name}"] = value
    return tensors


def _state_meta(state: OuterState, exchange: Exchange, clock: Clock, inner_optimizer: torch.optim.Optimizer,
                header: dict) -> dict:
    adam_steps = [float(inner_optimizer.state.get(p, {}).get("step", 0)) for p in state.params]
    pending, merged = exchange.pending, exchange.merged
    return {"inner_step": clock.inner_step, "round": clock.round_index,
            "outer_steps": state.outer_optimizer.num_steps, "adam_step": adam_steps[0] if adam_steps else 0.0,
            **header, "applied_round": state.applied_round,
            "eager_outer_steps": None if state.eager_optimizer is None else state.eager_optimizer.num_steps,
            "merged": None if merged is None else merged.record(),
            "pending": None if pending is None else {
                "round": pending.round_index, "weight": pending.weight, "share": pending.share,
                "outcome": None if pending.outcome is None else pending.outcome.facts()}}


def check_unit(meta: dict, unit: Unit, mode: str) -> None:
    """ValueError unless a checkpoint's metadata is of this ``unit`` (a stage of P, or a fragment of F) and of a mode
    whose state this stage can take (any overlap mode takes another's; ``none`` only its own)."""
    if not unit.matches(meta):
        raise ValueError(f"checkpoint is of {unit.describe(meta)}, this is {unit.describe(unit.meta)}")
    if meta.get("mode", "none") != mode and (meta.get("mode") == "none" or mode == "none"):
        raise ValueError(f"checkpoint was written in diloco.mode {meta.get('mode')!r}, "
                         f"this peer runs {mode!r}")


@torch.no_grad()
def load_state_dict(state: OuterState, exchange: Exchange, clock: Clock, inner_optimizer: torch.optim.Optimizer,
                    tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore a stage's parts from :func:`state_dict`'s tensors and metadata (checked by :func:`check_unit`);
    ValueError naming the first mismatch."""
    info = meta.get("pending")
    pending = [] if info is not None else None
    outcome = None if info is None else _pending_outcome(info)
    average = [] if outcome is not None and outcome.averaged else None
    residual = [] if average is not None and f"pending_residual/{state.names[0]}" in tensors else None
    for i, (name, p) in enumerate(zip(state.names, state.params)):
        for prefix, target in (("param", p), ("anchor", state.anchor[i]),
                               ("outer_momentum", state.outer_optimizer.momentum_buffers[i])):
            _copy_checked(tensors, f"{prefix}/{name}", target)
        if exchange.overlaps:
            _copy_checked(tensors, f"round_start/{name}", state.round_start[i])
        if pending is not None:
            pending.append(torch.zeros_like(state.anchor[i]))
            _copy_checked(tensors, f"pending/{name}", pending[-1])
        if average is not None:
            average.append(torch.zeros_like(state.anchor[i]))
            _copy_checked(tensors, f"pending_average/{name}", average[-1])
        if residual is not None:
            residual.append(torch.zeros_like(state.anchor[i]))
            _copy_checked(tensors, f"pending_residual/{name}", residual[-1])
        if state.feedback is not None and f"feedback/{name}" in tensors:
            _copy_checked(tensors, f"feedback/{name}", state.feedback[i])
        if state.eager_anchor is not None:
            if f"eager_anchor/{name}" in tensors:
                _copy_checked(tensors, f"eager_anchor/{name}", state.eager_anchor[i])
                _copy_checked(tensors, f"eager_momentum/{name}", state.eager_optimizer.momentum_buffers[i])
            else:  # a checkpoint without eager's own state (delayed mode's, say): start it from the shared one
                state.eager_anchor[i].copy_(state.anchor[i])
                state.eager_optimizer.momentum_buffers[i].copy_(state.outer_optimizer.momentum_buffers[i])
        if f"adam_exp_avg/{name}" in tensors:
            inner = inner_optimizer.state[p]
            inner["step"] = torch.tensor(float(meta["adam_step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                inner[key] = torch.zeros_like(p)
                _copy_checked(tensors, f"adam_{key}/{name}", inner[key])
    clock.inner_step, clock.round_index = int(meta["inner_step"]), int(meta["round"])
    state.applied_round = int(meta.get("applied_round", clock.round_index - 1))
    state.outer_optimizer.num_steps = int(meta["outer_steps"])
    exchange.merged = RoundReport.from_record(meta["merged"]) if meta.get("merged") else None
    if state.eager_optimizer is not None:
        state.eager_optimizer.num_steps = int(meta.get("eager_outer_steps") or meta["outer_steps"])
    if outcome is not None:
        outcome = dataclasses.replace(outcome, average=average, residual=residual)
    exchange.pending = None if pending is None else PendingRound(
        int(info["round"]), pending, float(info["weight"]), outcome=outcome, share=float(info.get("share", 1.0)))


def _pending_outcome(info: dict) -> RoundOutcome | None:
    """The outcome of a checkpoint's round in flight, if it was known: its ``outcome`` facts, or the fields of
    it that checkpoints of format 1 keep beside the round's."""
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
