"""The state a stage shares with the swarm, and how a stage takes it over: newcomers, peers that fell behind,
and peers whose anchor diverged after a failed round.

A donor serves its anchor and outer momentum with its round, the last round its anchor took, its inner step
and its identity (run, stage, shapes). In an overlap mode the donor's last round is usually still averaging
in the background; once that average has arrived, the donor serves the state *after* it (computed on copies,
its own state is not touched), so that a newcomer holds, from its first round on, the anchor the others reach
at the end of it. Taking a state over has two strengths:

- ``reload``: become the donor where it stands: anchor, momentum, round, and the inner step it has reached in
  that round; local progress and the pending round are dropped (a newcomer, or a peer more than a round
  behind). The newcomer trains the rest of the round from the anchor and contributes its shorter pseudo-
  gradient weighted by the tokens it trained, so it reaches the round's end with the others: starting at the
  round's first step instead would make it late for every matchmaking from then on;
- ``resync``: replace the anchor and momentum, keep the local progress and the round in flight (a peer on the
  swarm's round whose anchor diverged); the working params move by the same amount as the anchor (in eager
  mode the peer's eager state too). The donor may be a little further on (its average of the round this peer
  still has in flight already applied): the round in flight is then settled and dropped. If this peer's
  contribution was averaged, the anchor taken over holds it, and the error feedback becomes that round's
  residual; if it was not, the whole contribution is carried into the next round (as error feedback when
  pseudo-gradients are compressed, else as progress in the working params), so nothing is counted twice or
  lost.

Called by :class:`p2p_diloco.training.sync.SwarmSync` (taking over) and by the averager's state-sharing thread
(serving), both through the stage's state lock.
"""

from __future__ import annotations

import torch

from p2p_diloco.training.stage import Stage

STATE_FORMAT = 1


class StateError(ValueError):
    """A downloaded state does not fit this stage."""


def shareable_state(stage: Stage, run_id: str, finished_average: list[torch.Tensor] | None = None,
                    ) -> tuple[dict, list[torch.Tensor]]:
    """What this stage serves to others: metadata and [anchor..., momentum...] (fp32 copies).

    Args:
        stage: the donor.
        run_id: the donor's run.
        finished_average: the average of the round still pending, if it has already arrived.
    """
    with stage.state_lock:
        anchor = [t.clone() for t in stage.anchor]
        momentum = [m.clone() for m in stage.outer_optimizer.momentum_buffers]
        applied, outer_steps = stage.applied_round, stage.outer_optimizer.num_steps
        pending = stage.pending
        arrived = pending.outcome if pending is not None else None
        average = arrived.average if arrived is not None and arrived.averaged else finished_average
        if pending is not None and average is not None:
            anchor = stage.outer_optimizer.peek(average)
            mu = stage.outer_optimizer.momentum
            momentum = [m * mu + a for m, a in zip(momentum, average)] if mu else momentum
            applied, outer_steps = pending.round_index, outer_steps + 1
        meta = {"format": STATE_FORMAT, "run_id": run_id, "stage": stage.stage_index,
                "num_stages": stage.num_stages, "round": stage.round_index, "applied_round": applied,
                "outer_steps": outer_steps, "round_start_step": stage.round_index * stage.diloco_cfg.inner_steps,
                "inner_step": stage.inner_step, "seconds_per_step": float(stage.seconds_per_step),
                "shapes": [list(t.shape) for t in stage.anchor]}
    return meta, anchor + momentum


def check_state(stage: Stage, run_id: str, meta: dict, tensors: list[torch.Tensor]) -> None:
    """Raise StateError unless ``meta`` and ``tensors`` are a state of this run, stage and shape, all finite."""
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise StateError("the donor sent no state of a known format")
    expected = (run_id, stage.stage_index, stage.num_stages)
    got = (meta.get("run_id"), meta.get("stage"), meta.get("num_stages"))
    if got != expected:
        raise StateError(f"the donor's state is of run/stage/stages {got}, not {expected}")
    shapes = [list(t.shape) for t in stage.anchor]
    if meta.get("shapes") != shapes or len(tensors) != 2 * len(shapes):
        raise StateError("the donor's tensors do not have this stage's shapes")
    for tensor, shape in zip(tensors, shapes + shapes):
        if list(tensor.shape) != shape or not torch.is_floating_point(tensor) or not torch.isfinite(tensor).all():
            raise StateError("the donor's tensors have the wrong shape or non-finite values")
    for key in ("round", "applied_round", "outer_steps", "round_start_step", "inner_step"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < -1:
            raise StateError(f"the donor's {key} is not a count: {value!r}")
    H, start = stage.diloco_cfg.inner_steps, meta["round_start_step"]
    if start != meta["round"] * H or not start <= meta["inner_step"] <= start + H:
        raise StateError(f"the donor's steps do not fit its round {meta['round']} with H={H}: round start "
                         f"{start}, inner step {meta['inner_step']}")


@torch.no_grad()
def adopt_state(stage: Stage, meta: dict, tensors: list[torch.Tensor], how: str, inner_step: int | None = None,
                ) -> None:
    """Take a checked state over, as a ``reload`` or a ``resync`` (see the module docstring).

    ``inner_step``: where a reload starts in the donor's round (default: where the donor was; the stages of a
    pipelined peer agree on one).
    """
    assert how in ("reload", "resync"), how
    count = len(stage.anchor)
    anchor, momentum = tensors[:count], tensors[count:]
    with stage.state_lock:
        old_momentum = [m.clone() for m in stage.outer_optimizer.momentum_buffers]
        shift = [new.float() - old for new, old in zip(anchor, stage.anchor)]
        for theta, value in zip(stage.anchor, anchor):
            theta.copy_(value)
        for buf, value in zip(stage.outer_optimizer.momentum_buffers, momentum):
            buf.copy_(value)
        stage.outer_optimizer.num_steps = int(meta["outer_steps"])
        stage.applied_round = int(meta["applied_round"])
        if how == "reload":
            if stage.pending is not None and stage.pending.in_flight and stage.averager is not None:
                stage.averager.abandon_round()  # its average is never applied: the donor's state replaces it
            stage.pending = None
            H = stage.diloco_cfg.inner_steps
            step = int(meta["inner_step"] if inner_step is None else inner_step)
            stage.round_index = int(meta["round"])
            stage.inner_step = min(step, (stage.round_index + 1) * H - 1)  # at least one step of its own
            stage.round_first_step = stage.inner_step
            stage.set_params(stage.anchor)
            if stage.feedback is not None:
                stage.feedback = [torch.zeros_like(e) for e in stage.feedback]
            _set_eager(stage, shift=None)
            if stage.rule.overlaps:
                stage.round_start = [t.clone() for t in stage.anchor]
            return
        progress = [s - p.detach().to("cpu", torch.float32) for s, p in zip(stage.round_start, stage.params)]
        pending = stage.pending
        if not stage.rule.overlaps or pending is None or pending.round_index > stage.applied_round:
            stage.set_params([p.detach().to("cpu", torch.float32) + d for p, d in zip(stage.params, shift)])
            if stage.rule.overlaps:
                stage.round_start = [s + d for s, d in zip(stage.round_start, shift)]
            _set_eager(stage, shift=(shift, [m - old for m, old in zip(momentum, old_momentum)]))
            return
        # the donor's anchor already holds the round in flight: settle it, then drop it (applying it again would
        # count it twice)
        stage._settle(pending)
        stage.pending = None
        carried = [torch.zeros_like(t) for t in stage.anchor]
        if pending.outcome.averaged:
            if stage.feedback is not None and pending.outcome.residual is not None:
                stage.feedback = pending.outcome.residual
        elif stage.feedback is not None:
            stage.feedback = pending.contribution  # not in anyone's average: it goes out with the next round
        else:
            carried = pending.contribution  # not in anyone's average: it stays in this peer's progress
        _set_eager(stage, shift=None)
        start = stage.eager_anchor if stage.eager_anchor is not None else stage.anchor
        stage.round_start = [t.clone() for t in start]
        # the next pseudo-gradient (round start - params) includes what is carried
        stage.set_params([t - c - d for t, c, d in zip(start, carried, progress)])


def _set_eager(stage: Stage, shift) -> None:
    """Eager mode: this peer's eager state becomes the shared one (``shift`` None), or moves by (anchor shift,
    momentum shift)."""
    if stage.eager_anchor is None:
        return
    if shift is None:
        for theta_e, theta in zip(stage.eager_anchor, stage.anchor):
            theta_e.copy_(theta)
        stage.eager_optimizer.load_state_tensors(stage.outer_optimizer.momentum_buffers,
                                                 stage.outer_optimizer.num_steps)
        return
    for theta_e, m_e, d_theta, d_m in zip(stage.eager_anchor, stage.eager_optimizer.momentum_buffers, *shift):
        theta_e.add_(d_theta)
        m_e.add_(d_m)
