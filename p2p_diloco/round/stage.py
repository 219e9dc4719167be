"""One pipeline stage's DiLoCo state and its round, as in docs/design.md §2.4 ("One round on one stage").

A :class:`Stage` owns a slice of the model (the whole model when P = 1) and everything DiLoCo keeps
for it: the working parameters phi (on the device), the anchor theta (fp32, CPU, identical on every
peer that saw the same averages), the outer momentum, the inner AdamW, the round's starting point phi0
and the averager that talks to the same stage of other peers. The trainer drives the inner steps and
calls :meth:`Stage.end_round` every H steps. Called by :class:`p2p_diloco.training.trainer.Trainer`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from p2p_diloco.config import DiLoCoConfig, InnerConfig
from p2p_diloco.round.averager import RoundAverager, RoundRecords
from p2p_diloco.round.inner import inner_lr, make_inner_optimizer
from p2p_diloco.round.outcome import PendingRound, RoundOutcome, RoundReport
from p2p_diloco.round.outer import OuterOptimizer
from p2p_diloco.round.position import Position
from p2p_diloco.round.rules import RULES
from p2p_diloco.round.stage_state import StageCheckpoint
from p2p_diloco.round.swarm_state import StateSharing

logger = logging.getLogger(__name__)


class Stage(StageCheckpoint, StateSharing):
    """DiLoCo state of one pipeline stage.

    Args:
        module: this stage's slice of the model, already on its device.
        stage_index: index of the stage in the peer's pipeline.
        num_stages: P.
        inner_cfg: the ``[inner]`` section.
        diloco_cfg: the ``[diloco]`` section.
        total_steps: length of the inner lr schedule.
        averager: what averages this stage's rounds (:class:`~p2p_diloco.round.averager.RoundAverager`: the swarm's
            or the simulator's), or None to train alone.
        records: the swarm's records of this unit's peers (:class:`~p2p_diloco.round.averager.RoundRecords`), read
            while a round waits for its group; None: a round waits out its own bounds.
        fragment: (f, F) when the run averages by fragment (``diloco.fragments``): this Stage holds fragment f of
            the model (``module`` a :class:`~p2p_diloco.model.fragments.FragmentView`), on pipeline stage
            ``stage_index``; its state is the fragment's, served to and taken from peers of any split.
    """

    def __init__(self, module: nn.Module, *, stage_index: int, num_stages: int, inner_cfg: InnerConfig,
                 diloco_cfg: DiLoCoConfig, total_steps: int, averager: RoundAverager | None = None,
                 fragment: tuple[int, int] | None = None, records: RoundRecords | None = None):
        self.module = module
        self.stage_index, self.num_stages = stage_index, num_stages
        self.fragment = fragment  # (f, F) in a run averaged by fragment: this Stage is fragment f of the model
        self.inner_cfg, self.diloco_cfg, self.total_steps = inner_cfg, diloco_cfg, total_steps
        self.averager, self.records = averager, records
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.anchor = [p.detach().to(device="cpu", dtype=torch.float32, copy=True) for p in self.params]
        self.rule = RULES[diloco_cfg.mode]  # the round end of this mode (round/rules.py)
        self.mode = self.rule.name
        # phi0: in blocking mode every round starts from the anchor; with overlap, from the rebased params
        self.round_start = [t.clone() for t in self.anchor] if self.rule.overlaps else self.anchor
        self.pending: PendingRound | None = None
        self.applied_group_size = 1  # the group of the average step 5 last collected (1: a fallback, or none)
        # error feedback e (fp32, CPU), kept while pseudo-gradients are compressed
        compressed = averager is not None and averager.compresses
        self.feedback = [torch.zeros_like(t) for t in self.anchor] if compressed else None
        self.inner_optimizer = make_inner_optimizer(named, inner_cfg)
        self.outer_optimizer = self._make_outer(self.anchor)
        # eager mode: this peer's own copy of the outer state (docs/design.md §2.7); the shared anchor stays the
        # agreed one (state sharing, fingerprints, evaluation) and this copy is where the peer trains from
        self.eager_anchor = [t.clone() for t in self.anchor] if self.rule.keeps_eager_state else None
        self.eager_optimizer = self._make_outer(self.eager_anchor) if self.rule.keeps_eager_state else None
        # delayed mode: the latest inner step of round r+1 at which round r's average is applied
        self.overlap_steps = min(diloco_cfg.merge_step, diloco_cfg.inner_steps)
        # streaming sync (model/fragments.py): this stage's rounds end this many steps before every H-th step
        self.round_shift = 0
        # the run's last round (train.num_rounds - 1) when its rounds are shifted: the last one ends on the run's
        # last step (it is longer by the shift), so that no step is left out of a round
        self.last_round: int | None = None
        self._merged: RoundReport | None = None  # a merge done mid-round, reported with the round end
        self.inner_step = 0
        self.round_first_step: int | None = None  # set when this round's work began mid-round (after a reload)
        self.seconds_per_step = 0.0  # recent inner step time (set by the trainer; served to newcomers)
        self.round_index = 0
        self.applied_round = -1  # the last round whose average the anchor took
        self.state_lock = threading.RLock()  # held while the round end changes the anchor; state serving reads it

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
            logger.warning(f"{self.label} step {self.inner_step}: non-finite gradient norm, "
                           "step skipped")
        self.inner_optimizer.zero_grad(set_to_none=True)
        self.inner_step += 1
        return lr

    # ---- the round ----------------------------------------------------------------------------------
    def end_round(self, tokens: int, expected_group_size: int | None, compute_s: float = 0.0) -> RoundReport:
        """Steps 2-6 of the round (docs/design.md §2.4) (see :meth:`_end_round`), under the state lock.

        In delayed/eager mode the wait for the previous round's average comes first, outside the lock: state
        serving goes on meanwhile. (Held through the wait, the lock keeps a peer whose rounds all fail after
        their timeouts from serving newcomers almost all the time: a peer one round behind it can
        never download and catch up, so the two never meet in a round again.)"""
        waited = self._settle(self.pending) if self.pending is not None and self.rule.overlaps else 0.0
        with self.state_lock:
            report = self._end_round(tokens, expected_group_size, compute_s)
        report.waited_s += waited
        report.round_end_s += waited
        return report

    @torch.no_grad()
    def _end_round(self, tokens: int, expected_group_size: int | None, compute_s: float = 0.0) -> RoundReport:
        """Steps 2-6 of the round (docs/design.md §2.4): pseudo-gradient, averaging, outer step, new starting point.

        Args:
            tokens: tokens this peer trained on in the round (the averaging weight).
            expected_group_size: live peers of this stage in the swarm, this one included; 1 skips the network,
                None (unknown) tries it anyway.
            compute_s: how long the round's inner steps took (for the compression's bandwidth budget).
        """
        started = time.monotonic()
        delta = self.pseudo_gradient()  # 2. this round's local progress
        report = RoundReport(self.round_index, tokens=int(tokens),
                             delta_norm=float(torch.sqrt(sum(d.pow(2).sum() for d in delta))))
        round_index = self.round_index

        def start(contribution: list[torch.Tensor], share: float = 1.0) -> None:  # 4.
            self._start(round_index, contribution, tokens, expected_group_size, compute_s, share)

        self.rule.end(self, delta, report, start)  # 3-6, in this mode's order
        self.round_index += 1
        report.round_end_s = time.monotonic() - started
        return report

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """phi0 - phi: the progress since the round's starting point (fp32, CPU)."""
        return [start - p.detach().to(device="cpu", dtype=torch.float32)
                for start, p in zip(self.round_start, self.params)]

    def restart_from_params(self) -> None:
        """The next round starts from the working params as they are (overlap modes), copied into phi0's own
        buffers: a round end allocates no new copy of the weights."""
        self._own_round_start()
        for start, p in zip(self.round_start, self.params):
            start.copy_(p.detach())

    def _own_round_start(self) -> None:
        """phi0 in buffers of its own (in blocking mode it is the anchor itself), before it is written in place."""
        if self.round_start is self.anchor:
            self.round_start = [t.clone() for t in self.anchor]

    @property
    def merge_due(self) -> bool:
        """delayed mode: apply the previous round's average now, because it has arrived, or because this round
        has reached ``overlap_steps`` (the merge then waits for it). The anchor does not depend on when."""
        return self.rule.merge_due(self)

    def average_arrived(self) -> bool:
        pending = self.pending
        if pending.settled:
            return True
        return pending.in_flight and self.averager is not None and self.averager.round_settled

    def merge(self) -> float:
        """delayed mode, once the previous round's average has arrived (at the latest ``overlap_steps`` into this
        round): apply it to the anchor and rebase the working params on it (the new anchor minus this round's
        progress so far). Returns the time spent waiting for it; the round end that follows reports the merge."""
        waited = self._settle(self.pending) if self.pending is not None else 0.0
        with self.state_lock:
            report = RoundReport(self.round_index)
            self.merge_now(report)
            report.waited_s += waited
            self._merged = report
        return waited

    def report_merge(self, report: RoundReport) -> None:
        """delayed mode, at a round end: report the merge done earlier in the round (if any) with it."""
        merged, self._merged = self._merged, None
        if merged is not None:
            report.applied_round, report.outcome, report.waited_s, report.outer_lr = \
                merged.applied_round, merged.outcome, merged.waited_s, merged.outer_lr

    @torch.no_grad()
    def merge_now(self, report: RoundReport) -> None:
        """Step 5-6 of a delayed round: theta = outer_step(theta, avg_prev); phi = theta - progress since the
        round started; the round now starts from theta."""
        self._merged = None
        applied = self.collect(report)
        if applied is None:
            return
        self._own_round_start()
        self.outer_optimizer.step(applied, self.applied_group_size)
        self._rebase(restart_from=self.anchor)

    def _rebase(self, restart_from: list[torch.Tensor] | None) -> None:
        """phi = theta - (phi0 - phi), the progress since the round started carried onto the new anchor, then phi0
        = ``restart_from`` (None: the rebased params). One tensor at a time, in place: one tensor's temporary,
        not three copies of the weights (the progress, the new params, the new phi0)."""
        for i, (p, start, theta) in enumerate(zip(self.params, self.round_start, self.anchor)):
            progress = start - p.detach().to(device="cpu", dtype=torch.float32)
            p.copy_(theta - progress)
            start.copy_(p.detach() if restart_from is None else restart_from[i])

    def with_feedback(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """delta + beta e, written into ``delta`` (the round end's own tensors, used for nothing else after): what
        the compressor left out of earlier rounds goes out with this one (beta: the averager's ``feedback_decay``,
        below 1 for SparseLoCo, whose decaying feedback plays the outer momentum)."""
        if self.feedback is None:
            return delta
        decay = self.averager.feedback_decay
        for d, e in zip(delta, self.feedback):
            d.add_(e if decay == 1.0 else decay * e)
        return delta

    @torch.no_grad()
    def flush(self) -> RoundReport | None:
        """Apply the round still pending (delayed/eager) at the end of training: nothing is left unaveraged."""
        with self.state_lock:
            return self._flush()

    def _flush(self) -> RoundReport | None:
        if self.pending is None:
            return None
        report = RoundReport(self.round_index - 1)
        self._own_round_start()  # (phi0 - phi is the progress of a round stopped half-way: the outer step keeps it)
        self.outer_optimizer.step(self.collect(report), self.applied_group_size)
        if self.eager_anchor is not None:  # the shared anchor now holds every contribution, exactly once
            outer = self.outer_optimizer
            self.eager_optimizer.load_state_tensors(outer.momentum_buffers, outer.num_steps)
            for theta_e, theta in zip(self.eager_anchor, self.anchor):
                theta_e.copy_(theta)
        self._rebase(restart_from=None)
        return report

    def settle(self) -> None:
        """Wait (bounded) for the round in flight and keep its average for the next round end, without applying
        it: before a shutdown, so that the checkpoint holds it and a resume continues exactly."""
        if self.pending is not None:
            self._settle(self.pending)

    def restart_pending(self, expected_group_size: int | None) -> None:
        """After a resume from a checkpoint written while a round was in flight: average that contribution again
        (the swarm may have finished the round meanwhile, and then it falls back like any failed round)."""
        pending = self.pending
        if pending is not None and not pending.settled:
            self._start(pending.round_index, pending.contribution, pending.weight, expected_group_size, 0.0,
                        pending.share)

    def _start(self, round_index: int, contribution: list[torch.Tensor], tokens: float,
               expected_group_size: int | None, compute_s: float, share: float = 1.0) -> None:
        """Step 4: start averaging a round's contribution (or note why the network is skipped)."""
        pending = PendingRound(round_index, contribution, float(tokens), share=share)
        if self.averager is None:
            pending.outcome = RoundOutcome(fallback_reason="training without a swarm")
        elif expected_group_size is not None and expected_group_size <= 1:
            pending.outcome = RoundOutcome(fallback_reason="no other live peer of this stage in the swarm")
        else:
            self.averager.set_expected_group_size(expected_group_size)
            # a failed all-reduce (a groupmate gone) is retried by the rest of the group within the round's budget:
            # with overlap, the next round's compute (docs/design.md §2.6); blocking, the matchmaking bound
            budget = compute_s if self.rule.overlaps else 0.0
            self.averager.start_round(contribution, round_index, weight=float(tokens), compute_s=compute_s,
                                      budget_s=budget)
            pending.in_flight = True
        self.pending = pending

    def _settle(self, pending: PendingRound) -> float:
        """Wait for ``pending``'s averaging (at most what is left of its own timeouts); returns the wait."""
        if not pending.in_flight:
            return 0.0
        started = time.monotonic()
        outcome = self.averager.finish_round(hopeless=None if self.records is None else self.records.moved_past,
                                             feedback=self.feedback)
        waited = time.monotonic() - started
        pending.in_flight, pending.outcome = False, outcome
        if outcome.suspects:
            logger.warning(f"{self.label} round {pending.round_index}: flagged groupmates "
                           f"{outcome.suspects}")
        if not outcome.averaged:
            logger.warning(f"{self.label} round {pending.round_index}: averaging failed "
                           f"({outcome.fallback_reason}); applying this peer's own pseudo-gradient")
        return waited

    def collect(self, report: RoundReport) -> list[torch.Tensor] | None:
        """Step 5: the pending round's average, or its own contribution if that round failed; None if nothing
        is pending. ``applied_group_size`` is then the size of the group that averaged it (1: a fallback)."""
        pending = self.pending
        self.applied_group_size = 1
        if pending is None:
            return None
        report.waited_s = self._settle(pending)
        self.pending = None
        report.applied_round = self.applied_round = pending.round_index
        outcome = pending.outcome
        # the report keeps the facts, not the tensors: the average is the caller's until its outer step, the
        # residual becomes e (held past the step, the report's copy of the average was a whole copy of the weights
        # kept until the next round end)
        report.outcome = dataclasses.replace(outcome, average=None, residual=None)
        if outcome.averaged:  # the outer step of an average grows with its group (round/outer.py, group_lr)
            self.applied_group_size = outcome.group_size
        report.outer_lr = self.outer_optimizer.lr_for(self.applied_group_size)
        if not outcome.averaged:  # the whole own contribution, feedback included, is applied: nothing is owed
            if self.feedback is not None:
                self.feedback = [torch.zeros_like(e) for e in self.feedback]
            return pending.contribution
        if self.feedback is not None and outcome.residual is not None:
            self.feedback = outcome.residual
        return outcome.average

    def _make_outer(self, anchor: list[torch.Tensor]) -> OuterOptimizer:
        cfg = self.diloco_cfg
        return OuterOptimizer(anchor, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.nesterov,
                              group_exponent=cfg.outer_lr_group_exponent, largest_group=cfg.outer_lr_largest_group)

    def set_params(self, values: list[torch.Tensor]) -> None:
        for p, value in zip(self.params, values):
            p.copy_(value)

    # ---- where rounds start and end (streaming sync shifts them: docs/design.md 2.11) -------------------
    def round_start_step(self, round_index: int) -> int:
        """The inner step after which round ``round_index`` begins: ``r H`` less this stage's shift (0 for round 0)."""
        return max(0, round_index * self.diloco_cfg.inner_steps - self.round_shift)

    def round_end_step(self, round_index: int) -> int:
        """The inner step after which round ``round_index`` ends: ``(r + 1) H`` less the shift; the run's last round
        ends on the run's last step."""
        H = self.diloco_cfg.inner_steps
        if self.last_round is not None and round_index >= self.last_round:
            return (round_index + 1) * H
        return (round_index + 1) * H - self.round_shift

    def round_at(self, inner_step: int) -> int:
        """The round the step after ``inner_step`` belongs to."""
        r = (inner_step + self.round_shift) // self.diloco_cfg.inner_steps
        return min(r, self.last_round) if self.last_round is not None else r

    # ---- helpers ------------------------------------------------------------------------------------
    @property
    def unit(self) -> dict:
        """What this Stage averages, as its states and checkpoints name it: a fragment of F, or a stage of P."""
        if self.fragment is not None:
            return {"fragment": self.fragment[0], "num_fragments": self.fragment[1]}
        return {"stage": self.stage_index, "num_stages": self.num_stages}

    @property
    def label(self) -> str:
        """For logs: "Stage 1", or "Stage 1 fragment 2"."""
        return f"Stage {self.stage_index}" + (f" fragment {self.fragment[0]}" if self.fragment is not None else "")

    def position(self) -> Position:
        """Where this stage stands, for its progress record."""
        return Position(self.round_index, self.inner_step, self.applied_round)

    def anchor_weights(self) -> AbstractContextManager[None]:
        """Temporarily make the anchor the working parameters (to evaluate the agreed model): :meth:`weights_of`."""
        return self.weights_of(self.anchor)

    @contextmanager
    def weights_of(self, weights: list[torch.Tensor]) -> Iterator[None]:
        """Temporarily make ``weights`` (an anchor's shapes: this stage's own, or a state offered by another peer)
        the working parameters. A parameter of their device and dtype (fp32 on CPU) is pointed at their storage,
        its own kept aside: no copy; any other (on a GPU, in bf16) is saved, overwritten and restored."""
        swapped, saved = [], []
        with torch.no_grad():
            for p, theta in zip(self.params, weights, strict=True):
                if p.device == theta.device and p.dtype == theta.dtype and p.shape == theta.shape:
                    swapped.append((p, p.data))
                    p.data = theta
                else:
                    saved.append((p, p.detach().clone()))
                    p.copy_(theta)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, own in swapped:
                    p.data = own
                for p, value in saved:
                    p.copy_(value)

    def num_state_bytes(self) -> dict[str, int]:
        """Bytes held for parameters, inner optimizer state and DiLoCo state (anchor, momentum)."""
        params = sum(p.numel() * p.element_size() for p in self.params)
        inner = sum(t.numel() * t.element_size() for state in self.inner_optimizer.state.values()
                    for t in state.values() if torch.is_tensor(t))
        outer_state = self.anchor + self.outer_optimizer.momentum_buffers
        if self.eager_anchor is not None:
            outer_state += self.eager_anchor + self.eager_optimizer.momentum_buffers
        outer = sum(t.numel() * t.element_size() for t in outer_state)
        return {"params": params, "inner_optimizer": inner, "outer_state": outer}

    def shutdown(self) -> None:
        if self.averager is not None:
            self.averager.cancel_round()
            self.averager.shutdown()
            self.averager = None
