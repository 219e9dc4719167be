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

from p2p_diloco.round.outcome import PendingRound, RoundOutcome, RoundReport


class StageCheckpoint:
    """What a checkpoint holds of a :class:`~p2p_diloco.round.stage.Stage`, written and restored by the stage's own
    methods (a mixin of the Stage: it owns the state it changes)."""

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, metadata) of everything a resume needs; the metadata is JSON."""
        return self._state_tensors(), self._state_meta()

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a resume needs."""
        tensors = {}
        for i, (name, p) in enumerate(zip(self.param_names, self.params)):
            tensors[f"param/{name}"] = p.detach()
            tensors[f"anchor/{name}"] = self.anchor[i]
            tensors[f"outer_momentum/{name}"] = self.outer_optimizer.momentum_buffers[i]
            if self.rule.overlaps:
                tensors[f"round_start/{name}"] = self.round_start[i]
            if self.feedback is not None:
                tensors[f"feedback/{name}"] = self.feedback[i]
            if self.eager_anchor is not None:
                tensors[f"eager_anchor/{name}"] = self.eager_anchor[i]
                tensors[f"eager_momentum/{name}"] = self.eager_optimizer.momentum_buffers[i]
            outcome = self.pending.outcome if self.pending is not None else None
            if self.pending is not None:
                tensors[f"pending/{name}"] = self.pending.contribution[i]
            if outcome is not None and outcome.average is not None:
                tensors[f"pending_average/{name}"] = outcome.average[i]
                if outcome.residual is not None:
                    tensors[f"pending_residual/{name}"] = outcome.residual[i]
            for key, value in self.inner_optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[f"adam_{key}/{name}"] = value
        return tensors


    def _state_meta(self) -> dict:
        adam_steps = [float(self.inner_optimizer.state.get(p, {}).get("step", 0)) for p in self.params]
        pending = self.pending
        return {"inner_step": self.inner_step, "round": self.round_index,
                "outer_steps": self.outer_optimizer.num_steps, "adam_step": adam_steps[0] if adam_steps else 0.0,
                "stage": self.stage_index, "num_stages": self.num_stages, **self.unit, "mode": self.mode,
                "applied_round": self.applied_round,
                "eager_outer_steps": None if self.eager_optimizer is None else self.eager_optimizer.num_steps,
                "merged": None if self._merged is None else self._merged.record(),
                "pending": None if pending is None else {
                    "round": pending.round_index, "weight": pending.weight, "share": pending.share,
                    "outcome": None if pending.outcome is None else pending.outcome.facts()}}


    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore the stage from :meth:`state_dict`'s tensors and metadata; ValueError naming the first mismatch."""
        unit = self.unit
        if {key: meta.get(key) for key in unit} != unit:
            raise ValueError(f"checkpoint is of {_unit_name(meta, unit)}, this is {_unit_name(unit, unit)}")
        if meta.get("mode", "none") != self.mode and (meta.get("mode") == "none" or self.mode == "none"):
            raise ValueError(f"checkpoint was written in diloco.mode {meta.get('mode')!r}, "
                             f"this peer runs {self.mode!r}")
        info = meta.get("pending")
        pending = [] if info is not None else None
        outcome = None if info is None else _pending_outcome(info)
        average = [] if outcome is not None and outcome.averaged else None
        residual = [] if average is not None and f"pending_residual/{self.param_names[0]}" in tensors else None
        for i, (name, p) in enumerate(zip(self.param_names, self.params)):
            for prefix, target in (("param", p), ("anchor", self.anchor[i]),
                                   ("outer_momentum", self.outer_optimizer.momentum_buffers[i])):
                _copy_checked(tensors, f"{prefix}/{name}", target)
            if self.rule.overlaps:
                _copy_checked(tensors, f"round_start/{name}", self.round_start[i])
            if pending is not None:
                pending.append(torch.zeros_like(self.anchor[i]))
                _copy_checked(tensors, f"pending/{name}", pending[-1])
            if average is not None:
                average.append(torch.zeros_like(self.anchor[i]))
                _copy_checked(tensors, f"pending_average/{name}", average[-1])
            if residual is not None:
                residual.append(torch.zeros_like(self.anchor[i]))
                _copy_checked(tensors, f"pending_residual/{name}", residual[-1])
            if self.feedback is not None and f"feedback/{name}" in tensors:
                _copy_checked(tensors, f"feedback/{name}", self.feedback[i])
            if self.eager_anchor is not None:
                if f"eager_anchor/{name}" in tensors:
                    _copy_checked(tensors, f"eager_anchor/{name}", self.eager_anchor[i])
                    _copy_checked(tensors, f"eager_momentum/{name}", self.eager_optimizer.momentum_buffers[i])
                else:  # written before eager kept its own state, or in delayed mode: start it from the shared one
                    self.eager_anchor[i].copy_(self.anchor[i])
                    self.eager_optimizer.momentum_buffers[i].copy_(self.outer_optimizer.momentum_buffers[i])
            if f"adam_exp_avg/{name}" in tensors:
                state = self.inner_optimizer.state[p]
                state["step"] = torch.tensor(float(meta["adam_step"]))
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = torch.zeros_like(p)
                    _copy_checked(tensors, f"adam_{key}/{name}", state[key])
        self.inner_step, self.round_index = int(meta["inner_step"]), int(meta["round"])
        self.applied_round = int(meta.get("applied_round", self.round_index - 1))
        self.outer_optimizer.num_steps = int(meta["outer_steps"])
        self._merged = RoundReport.from_record(meta["merged"]) if meta.get("merged") else None
        if self.eager_optimizer is not None:
            self.eager_optimizer.num_steps = int(meta.get("eager_outer_steps") or meta["outer_steps"])
        if outcome is not None:
            outcome = dataclasses.replace(outcome, average=average, residual=residual)
        self.pending = None if pending is None else PendingRound(
            int(info["round"]), pending, float(info["weight"]), outcome=outcome, share=float(info.get("share", 1.0)))


def _unit_name(meta: dict, unit: dict) -> str:
    if "fragment" in unit:
        return f"fragment {meta.get('fragment')} of {meta.get('num_fragments')}"
    return f"stage {meta.get('stage')} of {meta.get('num_stages')}"


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
