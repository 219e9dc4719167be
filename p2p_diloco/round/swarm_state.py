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

What is served is the state every peer of a group holds bit for bit after the same averages (the outer optimizer's
maths is deterministic, and the donor's peek computes the momentum as its step does): anchor, momentum, the round the
anchor took last and its outer step count. Its :func:`fingerprint` is what progress records publish and peers vote
on, so a downloaded state is taken only if *every* tensor of it is what the believed peers hold: a donor serving the
agreed anchor with momentum of its own making (which steers the taker's next outer step anywhere) is refused. A
peer's own state (error feedback, the eager anchor and momentum) is never served.

Every metadata field a donor sends is range-checked in :func:`check_state` before any arithmetic uses it: a count
or a step time out of range would otherwise reach the downloader's and the taker's arithmetic (an ``int()`` of a
subnormal float overflows).

Functions of a stage's parts: its outer state (:class:`~p2p_diloco.round.outer_state.OuterState`), its averaging
(:class:`~p2p_diloco.round.exchange.Exchange`) and its clock (:class:`~p2p_diloco.round.position.Clock`). Called
through the :class:`~p2p_diloco.round.stage.Stage`'s methods of the same names by
:class:`p2p_diloco.training.sync.SwarmSync` (taking over) and by the averager's state-sharing thread (serving), both
under the outer state's lock.
"""

from __future__ import annotations

import hashlib

import torch

from p2p_diloco.round.exchange import Exchange
from p2p_diloco.round.outer_state import OuterState
from p2p_diloco.round.position import Clock
from p2p_diloco.unit import Unit

STATE_FORMAT = 1
MAX_ROUND = 1 << 40  # far past any run, far below where round arithmetic costs anything
MAX_SECONDS_PER_STEP = 86400.0
MIN_SECONDS_PER_STEP = 1e-6  # (0.0: not measured yet, served before a donor's first step)


def anchor_digest(anchor: list[torch.Tensor]) -> str:
    """sha256 of the anchor's exact bytes: equal digests mean bit-identical anchors."""
    digest = hashlib.sha256()
    for tensor in anchor:
        digest.update(tensor.detach().cpu().contiguous().numpy().data)  # no copy of a CPU tensor's bytes
    return digest.hexdigest()


def state_fingerprint(anchor_sha256: str, momentum: list[torch.Tensor], applied_round: int, outer_steps: int) -> str:
    """The fingerprint of a stage's shared outer state in progress records (their ``anchor`` and ``prior_anchor``):
    a sha256 over the anchor's full sha256 (:func:`anchor_digest`), the outer momentum's, the round the anchor took
    last and the outer step count, everything a donor serves and a taker adopts into the state it shares. Peers vote
    on it and a downloaded state is checked against it, so it covers every value: with the anchor alone a donor could
    serve the agreed anchor with momentum that steers the taker's next outer step to any model, and with a sample of
    the values it could change every value the sample skips. The anchor's own digest is an input, so the metrics
    rows' ``anchor_sha256`` costs no second pass over it."""
    header = f"p2p-diloco outer state 1 applied_round={int(applied_round)} outer_steps={int(outer_steps)} " \
             f"anchor={anchor_sha256} momentum="
    return hashlib.sha256(header.encode() + anchor_digest(momentum).encode()).hexdigest()


class StateError(ValueError):
    """A downloaded state does not fit this stage."""


def fingerprint(state: OuterState) -> tuple[str, str]:
    """(fingerprint of the state a stage would serve now, sha256 of its anchor): see :func:`state_fingerprint`.
    Called by the training thread, which alone changes the state."""
    anchor = anchor_digest(state.anchor)
    outer = state.outer_optimizer
    return state_fingerprint(anchor, outer.momentum_buffers, state.applied_round, outer.num_steps), anchor


def served_fingerprint(state: OuterState, meta: dict, tensors: list[torch.Tensor]) -> str:
    """The fingerprint of a served state that passed :func:`check_state`: every tensor and count it holds."""
    count = len(state.anchor)
    return state_fingerprint(anchor_digest(tensors[:count]), tensors[count:], meta["applied_round"],
                             meta["outer_steps"])


def shareable_state(state: OuterState, exchange: Exchange, clock: Clock, unit_names: dict, run_id: str,
                    finished_average: list[torch.Tensor] | None = None,
                    finished_group_size: int = 1) -> tuple[dict, list[torch.Tensor]]:
    """What a stage serves to others: metadata and [anchor..., momentum...] (fp32 copies).

    Args:
        state, exchange, clock: the stage's outer state, averaging and clock.
        unit_names: the stage's names in the state (:attr:`~p2p_diloco.unit.Unit.names`): its pipeline stage and,
            averaged by fragment, its fragment.
        run_id: the donor's run.
        finished_average: the average of the round still pending, if it has already arrived.
        finished_group_size: the size of the group that averaged it (its outer step depends on it).
    """
    with state.lock:
        # the copies are made in shared memory at once: handed to the averager's process, they travel as handles
        # (a private copy would be copied again by the pipe's pickler, and the peeked outer step's twice more)
        anchor = [torch.empty_like(t).share_memory_() for t in state.anchor]
        momentum = [torch.empty_like(m).share_memory_() for m in state.outer_optimizer.momentum_buffers]
        applied, outer_steps = state.applied_round, state.outer_optimizer.num_steps
        pending = exchange.pending
        arrived = pending.outcome if pending is not None else None
        average, group_size = (arrived.average, arrived.group_size) if arrived is not None and arrived.averaged \
            else (finished_average, finished_group_size)
        if pending is not None and average is not None:
            state.outer_optimizer.peek_into(average, group_size, anchor, momentum)
            applied, outer_steps = pending.round_index, outer_steps + 1
        else:
            for out, t in zip(anchor + momentum, state.anchor + state.outer_optimizer.momentum_buffers):
                out.copy_(t)
        meta = {"format": STATE_FORMAT, "run_id": run_id, **unit_names, "round": clock.round_index,
                "applied_round": applied, "outer_steps": outer_steps,
                "round_start_step": clock.round_start_step(clock.round_index), "inner_step": clock.inner_step,
                "seconds_per_step": float(clock.seconds_per_step), "shapes": [list(t.shape) for t in state.anchor]}
    return meta, anchor + momentum


def check_state(state: OuterState, clock: Clock, unit: Unit, run_id: str, meta: dict,
                tensors: list[torch.Tensor]) -> None:
    """Raise StateError unless ``meta`` and ``tensors`` are a state of this run, unit (``unit``: a stage of P, or a
    fragment of F) and shape, all finite, every count and time of it in range."""
    if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
        raise StateError("the donor sent no state of a known format")
    # a fragment's donor may hold it on any pipeline stage of any split: only the unit's own names must match
    expected = (run_id, *unit.meta.values())
    got = (meta.get("run_id"), *(meta.get(key) for key in unit.meta))
    if got != expected:
        raise StateError(f"the donor's state is of run/{'/'.join(unit.meta)} {got}, not {expected}")
    shapes = [list(t.shape) for t in state.anchor]
    if meta.get("shapes") != shapes or len(tensors) != 2 * len(shapes):
        raise StateError("the donor's tensors do not have this stage's shapes")
    for tensor, shape in zip(tensors, shapes + shapes):
        if list(tensor.shape) != shape or not torch.is_floating_point(tensor) or not torch.isfinite(tensor).all():
            raise StateError("the donor's tensors have the wrong shape or non-finite values")
    _check_counts(meta)
    H, start = clock.inner_steps, meta["round_start_step"]
    if start != clock.round_start_step(meta["round"]) or \
            not start <= meta["inner_step"] <= clock.round_end_step(meta["round"]):
        raise StateError(f"the donor's steps do not fit its round {meta['round']} with H={H}: round start "
                         f"{start}, inner step {meta['inner_step']}")
    step_s = meta.get("seconds_per_step")
    if not isinstance(step_s, float) or \
            not (step_s == 0.0 or MIN_SECONDS_PER_STEP <= step_s <= MAX_SECONDS_PER_STEP):
        raise StateError(f"the donor's seconds_per_step is not a step time: {step_s!r}")


def _check_counts(meta: dict) -> None:
    """Each count of a state's metadata is an int in its range before any arithmetic sees it: a round in
    [0, MAX_ROUND], the applied round in [-1, round], outer steps in [0, applied round + 1] (one per applied
    round), the steps >= 0 (their fit to the round, which bounds them, is checked after)."""
    for key in ("round", "applied_round", "outer_steps", "round_start_step", "inner_step"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise StateError(f"the donor's {key} is not a count: {value!r}")
    bounds = {"round": (0, MAX_ROUND), "applied_round": (-1, meta["round"]),
              "outer_steps": (0, meta["applied_round"] + 1), "round_start_step": (0, None),
              "inner_step": (0, None)}
    for key, (low, high) in bounds.items():
        if meta[key] < low or high is not None and meta[key] > high:
            raise StateError(f"the donor's {key} {meta[key]} is outside [{low}, {high}]")


@torch.no_grad()
def adopt(state: OuterState, exchange: Exchange, clock: Clock, meta: dict, tensors: list[torch.Tensor], how: str,
          inner_step: int | None = None) -> None:
    """Take a checked state over, as a ``reload`` or a ``resync`` (see the module docstring).

    ``inner_step``: where a reload starts in the donor's round (default: where the donor was; the stages of a
    pipelined peer agree on one).
    """
    assert how in ("reload", "resync"), how
    count = len(state.anchor)
    anchor, momentum = tensors[:count], tensors[count:]
    with state.lock:
        old_momentum = [m.clone() for m in state.outer_optimizer.momentum_buffers]
        shift = [new.float() - old for new, old in zip(anchor, state.anchor)]
        for theta, value in zip(state.anchor, anchor):
            theta.copy_(value)
        for buf, value in zip(state.outer_optimizer.momentum_buffers, momentum):
            buf.copy_(value)
        state.outer_optimizer.num_steps = int(meta["outer_steps"])
        state.applied_round = int(meta["applied_round"])
        if how == "reload":
            _reload(state, exchange, clock, meta, inner_step)
        else:
            _resync(state, exchange, shift, [m - old for m, old in zip(momentum, old_momentum)])


def _reload(state: OuterState, exchange: Exchange, clock: Clock, meta: dict, inner_step: int | None) -> None:
    """The rest of a reload, the anchor and momentum taken: the donor's round and step, the pending round dropped
    (the donor's state replaces the one its average would step), phi = phi0 = theta, nothing owed."""
    exchange.drop()
    step = int(meta["inner_step"] if inner_step is None else inner_step)
    clock.round_index = int(meta["round"])
    clock.inner_step = min(step, clock.round_end_step(clock.round_index) - 1)  # at least one step of its own
    clock.round_first_step = clock.inner_step
    state.set_params(state.anchor)
    if state.feedback is not None:
        state.feedback = [torch.zeros_like(e) for e in state.feedback]
    state.reset_eager()
    if exchange.overlaps:
        state.round_start = [t.clone() for t in state.anchor]


def _resync(state: OuterState, exchange: Exchange, shift: list[torch.Tensor],
            momentum_shift: list[torch.Tensor]) -> None:
    """The rest of a resync, the anchor and momentum taken (``shift``, ``momentum_shift``: how far they moved): the
    working params move as far, or, when the donor's anchor already holds the round in flight, that round is
    settled and dropped and its contribution carried or owed."""
    progress = [s - p.detach().to("cpu", torch.float32) for s, p in zip(state.round_start, state.params)]
    pending = exchange.pending
    if not exchange.overlaps or pending is None or pending.round_index > state.applied_round:
        state.set_params([p.detach().to("cpu", torch.float32) + d for p, d in zip(state.params, shift)])
        if exchange.overlaps:
            state.round_start = [s + d for s, d in zip(state.round_start, shift)]
        state.shift_eager(shift, momentum_shift)
        return
    # the donor's anchor already holds the round in flight: settle it, then drop it (applying it again would
    # count it twice)
    exchange.settle(state.feedback)
    exchange.pending = None
    carried = [torch.zeros_like(t) for t in state.anchor]
    if pending.outcome.averaged:
        if state.feedback is not None and pending.outcome.residual is not None:
            state.feedback = pending.outcome.residual
    elif state.feedback is not None:
        state.feedback = pending.contribution  # not in anyone's average: it goes out with the next round
    else:
        carried = pending.contribution  # not in anyone's average: it stays in this peer's progress
    state.reset_eager()
    start = state.eager_anchor if state.eager_anchor is not None else state.anchor
    state.round_start = [t.clone() for t in start]
    # the next pseudo-gradient (round start - params) includes what is carried
    state.set_params([t - c - d for t, c, d in zip(start, carried, progress)])
