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
anchor took last and its outer step count. Its :meth:`StateSharing.state_fingerprint` is what progress records
publish and peers vote on, so a downloaded state is taken only if *every* tensor of it is what the believed peers
hold: a donor serving the agreed anchor with momentum of its own making (which steers the taker's next outer step
anywhere) is refused. A peer's own state (error feedback, the eager anchor and momentum) is never served.

Every metadata field a donor sends is range-checked in :meth:`StateSharing.check_state` before any arithmetic uses
it (a ``seconds_per_step`` of 5e-320 once overflowed an ``int()`` in the downloader and killed it).

Called by :class:`p2p_diloco.training.sync.SwarmSync` (taking over) and by the averager's state-sharing thread
(serving), both through the stage's state lock.
"""

from __future__ import annotations

import hashlib

import torch

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
    on it and a downloaded state is checked against it, so it covers every value: an anchor-only digest let a donor
    serve the agreed anchor with momentum that steers the taker's next outer step to any model, and a sampled digest
    (it was, for models over 2**20 values) let it change every value the sample skips. The anchor's own digest is
    an input, so the metrics rows' ``anchor_sha256`` costs no second pass over it."""
    header = f"p2p-diloco outer state 1 applied_round={int(applied_round)} outer_steps={int(outer_steps)} " \
             f"anchor={anchor_sha256} momentum="
    return hashlib.sha256(header.encode() + anchor_digest(momentum).encode()).hexdigest()


class StateError(ValueError):
    """A downloaded state does not fit this stage."""


class StateSharing:
    """The state a :class:`~p2p_diloco.round.stage.Stage` serves to the swarm, and how it takes one over: the
    stage's own methods (a mixin of the Stage: it owns the state it changes)."""

    def shareable_state(self, run_id: str, finished_average: list[torch.Tensor] | None = None,
                        finished_group_size: int = 1) -> tuple[dict, list[torch.Tensor]]:
        """What this stage serves to others: metadata and [anchor..., momentum...] (fp32 copies).

        Args:
            run_id: the donor's run.
            finished_average: the average of the round still pending, if it has already arrived.
            finished_group_size: the size of the group that averaged it (its outer step depends on it).
        """
        with self.state_lock:
            # the copies are made in shared memory at once: handed to the averager's process, they travel as handles
            # (a private copy moved there by the pipe's pickler cost the donor two more copies of the state, and
            # the peeked outer step two more: a small donor's peak rose by 3x the state it served)
            anchor = [torch.empty_like(t).share_memory_() for t in self.anchor]
            momentum = [torch.empty_like(m).share_memory_() for m in self.outer_optimizer.momentum_buffers]
            applied, outer_steps = self.applied_round, self.outer_optimizer.num_steps
            pending = self.pending
            arrived = pending.outcome if pending is not None else None
            average, group_size = (arrived.average, arrived.group_size) if arrived is not None and arrived.averaged \
                else (finished_average, finished_group_size)
            if pending is not None and average is not None:
                self.outer_optimizer.peek_into(average, group_size, anchor, momentum)
                applied, outer_steps = pending.round_index, outer_steps + 1
            else:
                for out, t in zip(anchor + momentum, self.anchor + self.outer_optimizer.momentum_buffers):
                    out.copy_(t)
            meta = {"format": STATE_FORMAT, "run_id": run_id, "stage": self.stage_index,
                    "num_stages": self.num_stages, **self.unit, "round": self.round_index, "applied_round": applied,
                    "outer_steps": outer_steps, "round_start_step": self.round_start_step(self.round_index),
                    "inner_step": self.inner_step, "seconds_per_step": float(self.seconds_per_step),
                    "shapes": [list(t.shape) for t in self.anchor]}
        return meta, anchor + momentum


    def check_state(self, run_id: str, meta: dict, tensors: list[torch.Tensor]) -> None:
        """Raise StateError unless ``meta`` and ``tensors`` are a state of this run, stage and shape, all finite, every
        count and time of it in range."""
        if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
            raise StateError("the donor sent no state of a known format")
        unit = self.unit  # a stage of P, or a fragment of F (then the donor's stage, of any split, does not matter)
        expected = (run_id, *unit.values())
        got = (meta.get("run_id"), *(meta.get(key) for key in unit))
        if got != expected:
            raise StateError(f"the donor's state is of run/{'/'.join(unit)} {got}, not {expected}")
        shapes = [list(t.shape) for t in self.anchor]
        if meta.get("shapes") != shapes or len(tensors) != 2 * len(shapes):
            raise StateError("the donor's tensors do not have this stage's shapes")
        for tensor, shape in zip(tensors, shapes + shapes):
            if list(tensor.shape) != shape or not torch.is_floating_point(tensor) or not torch.isfinite(tensor).all():
                raise StateError("the donor's tensors have the wrong shape or non-finite values")
        self._check_counts(meta)
        H, start = self.diloco_cfg.inner_steps, meta["round_start_step"]
        if start != self.round_start_step(meta["round"]) or \
                not start <= meta["inner_step"] <= self.round_end_step(meta["round"]):
            raise StateError(f"the donor's steps do not fit its round {meta['round']} with H={H}: round start "
                             f"{start}, inner step {meta['inner_step']}")
        step_s = meta.get("seconds_per_step")
        if not isinstance(step_s, float) or \
                not (step_s == 0.0 or MIN_SECONDS_PER_STEP <= step_s <= MAX_SECONDS_PER_STEP):
            raise StateError(f"the donor's seconds_per_step is not a step time: {step_s!r}")

    @staticmethod
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

    def state_fingerprint(self) -> tuple[str, str]:
        """(fingerprint of the state this stage would serve now, sha256 of its anchor): see
        :func:`state_fingerprint`. Called by the training thread, which alone changes
        the state."""
        anchor = anchor_digest(self.anchor)
        outer = self.outer_optimizer
        return state_fingerprint(anchor, outer.momentum_buffers, self.applied_round, outer.num_steps), anchor

    def served_fingerprint(self, meta: dict, tensors: list[torch.Tensor]) -> str:
        """The fingerprint of a served state that passed :meth:`check_state`: every tensor and count it holds."""
        count = len(self.anchor)
        return state_fingerprint(anchor_digest(tensors[:count]), tensors[count:], meta["applied_round"],
                                 meta["outer_steps"])


    @torch.no_grad()
    def adopt(self, meta: dict, tensors: list[torch.Tensor], how: str, inner_step: int | None = None,
                    ) -> None:
        """Take a checked state over, as a ``reload`` or a ``resync`` (see the module docstring).

        ``inner_step``: where a reload starts in the donor's round (default: where the donor was; the stages of a
        pipelined peer agree on one).
        """
        assert how in ("reload", "resync"), how
        count = len(self.anchor)
        anchor, momentum = tensors[:count], tensors[count:]
        with self.state_lock:
            old_momentum = [m.clone() for m in self.outer_optimizer.momentum_buffers]
            shift = [new.float() - old for new, old in zip(anchor, self.anchor)]
            for theta, value in zip(self.anchor, anchor):
                theta.copy_(value)
            for buf, value in zip(self.outer_optimizer.momentum_buffers, momentum):
                buf.copy_(value)
            self.outer_optimizer.num_steps = int(meta["outer_steps"])
            self.applied_round = int(meta["applied_round"])
            if how == "reload":
                if self.pending is not None and self.pending.in_flight and self.averager is not None:
                    self.averager.abandon_round()  # its average is never applied: the donor's state replaces it
                self.pending = None
                step = int(meta["inner_step"] if inner_step is None else inner_step)
                self.round_index = int(meta["round"])
                self.inner_step = min(step, self.round_end_step(self.round_index) - 1)  # at least one step of its own
                self.round_first_step = self.inner_step
                self.set_params(self.anchor)
                if self.feedback is not None:
                    self.feedback = [torch.zeros_like(e) for e in self.feedback]
                self._set_eager(shift=None)
                if self.rule.overlaps:
                    self.round_start = [t.clone() for t in self.anchor]
                return
            progress = [s - p.detach().to("cpu", torch.float32) for s, p in zip(self.round_start, self.params)]
            pending = self.pending
            if not self.rule.overlaps or pending is None or pending.round_index > self.applied_round:
                self.set_params([p.detach().to("cpu", torch.float32) + d for p, d in zip(self.params, shift)])
                if self.rule.overlaps:
                    self.round_start = [s + d for s, d in zip(self.round_start, shift)]
                self._set_eager(shift=(shift, [m - old for m, old in zip(momentum, old_momentum)]))
                return
            # the donor's anchor already holds the round in flight: settle it, then drop it (applying it again would
            # count it twice)
            self._settle(pending)
            self.pending = None
            carried = [torch.zeros_like(t) for t in self.anchor]
            if pending.outcome.averaged:
                if self.feedback is not None and pending.outcome.residual is not None:
                    self.feedback = pending.outcome.residual
            elif self.feedback is not None:
                self.feedback = pending.contribution  # not in anyone's average: it goes out with the next round
            else:
                carried = pending.contribution  # not in anyone's average: it stays in this peer's progress
            self._set_eager(shift=None)
            start = self.eager_anchor if self.eager_anchor is not None else self.anchor
            self.round_start = [t.clone() for t in start]
            # the next pseudo-gradient (round start - params) includes what is carried
            self.set_params([t - c - d for t, c, d in zip(start, carried, progress)])


    def _set_eager(self, shift) -> None:
        """Eager mode: this peer's eager state becomes the shared one (``shift`` None), or moves by (anchor shift,
        momentum shift)."""
        if self.eager_anchor is None:
            return
        if shift is None:
            for theta_e, theta in zip(self.eager_anchor, self.anchor):
                theta_e.copy_(theta)
            self.eager_optimizer.load_state_tensors(self.outer_optimizer.momentum_buffers,
                                                     self.outer_optimizer.num_steps)
            return
        for theta_e, m_e, d_theta, d_m in zip(self.eager_anchor, self.eager_optimizer.momentum_buffers, *shift):
            theta_e.add_(d_theta)
            m_e.add_(d_m)
