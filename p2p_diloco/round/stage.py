"""One pipeline stage's DiLoCo state and its round, as in docs/design.md §2.4 ("One round on one stage").

A :class:`Stage` owns a slice of the model (the whole model when P = 1), its inner AdamW, and the parts DiLoCo keeps
for it: the outer state (:class:`~p2p_diloco.round.outer_state.OuterState`: the anchor theta, identical on every peer
that saw the same averages, the outer momentum, the round's starting point phi0, error feedback, eager's copy), the
averaging of its rounds with the same unit of other peers (:class:`~p2p_diloco.round.exchange.Exchange`), and where it
stands (:class:`~p2p_diloco.round.position.Clock`). Its mode's rule (:mod:`.rules`) orders each round end on them;
its checkpoint (:mod:`.stage_state`) and the state it shares with the swarm (:mod:`.swarm_state`) are functions of
them. The trainer drives the inner steps and calls :meth:`Stage.end_round` every H steps. Called by
:class:`p2p_diloco.training.trainer.Trainer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn

from p2p_diloco.config import DiLoCoConfig, InnerConfig
from p2p_diloco.round import stage_state, swarm_state
from p2p_diloco.round.averager import RoundAverager, RoundRecords
from p2p_diloco.round.exchange import Exchange, RoundEnd
from p2p_diloco.round.inner import inner_lr, make_inner_optimizer
from p2p_diloco.round.outcome import RoundReport
from p2p_diloco.round.outer_state import OuterState
from p2p_diloco.round.position import Clock, Position
from p2p_diloco.round.rules import RULES, Delayed
from p2p_diloco.unit import Unit

logger = logging.getLogger(__name__)


class _Part:
    """A Stage attribute that one of its parts holds, read and written through the Stage under the name callers
    use (``stage.anchor`` is ``stage.outer.anchor``)."""

    def __init__(self, part: str, name: str | None = None):
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, stage, owner=None):
        return self if stage is None else getattr(getattr(stage, self.part), self.name)

    def __set__(self, stage, value) -> None:
        setattr(getattr(stage, self.part), self.name, value)


class Stage:
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

    # the outer state's (round/outer_state.py)
    anchor = _Part("outer")
    outer_optimizer = _Part("outer")
    round_start = _Part("outer")
    feedback = _Part("outer")
    eager_anchor = _Part("outer")
    eager_optimizer = _Part("outer")
    applied_round = _Part("outer")
    state_lock = _Part("outer", "lock")
    # the averaging's (round/exchange.py)
    averager = _Part("exchange")
    records = _Part("exchange")
    pending = _Part("exchange")
    applied_group_size = _Part("exchange")
    _merged = _Part("exchange", "merged")
    # the clock's (round/position.py)
    round_index = _Part("clock")
    inner_step = _Part("clock")
    round_first_step = _Part("clock")
    round_shift = _Part("clock")
    last_round = _Part("clock")
    seconds_per_step = _Part("clock")

    def __init__(self, module: nn.Module, *, stage_index: int, num_stages: int, inner_cfg: InnerConfig,
                 diloco_cfg: DiLoCoConfig, total_steps: int, averager: RoundAverager | None = None,
                 fragment: tuple[int, int] | None = None, records: RoundRecords | None = None):
        self.module = module
        self.unit = Unit.of(stage_index, num_stages, fragment)  # its stage, or fragment f of F held on that stage
        self.inner_cfg, self.diloco_cfg, self.total_steps = inner_cfg, diloco_cfg, total_steps
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.param_names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.rule = RULES[diloco_cfg.mode]  # the round end of this mode (round/rules.py)
        self.mode = self.rule.name
        self.outer = OuterState(self.param_names, self.params, diloco_cfg, overlaps=self.rule.overlaps,
                                keeps_eager_state=self.rule.keeps_eager_state,
                                compressed=averager is not None and averager.compresses)
        self.exchange = Exchange(averager, records, overlaps=self.rule.overlaps, label=self.label)
        self.clock = Clock(diloco_cfg.inner_steps)
        self.inner_optimizer = make_inner_optimizer(named, inner_cfg)
        # delayed mode: the latest inner step of round r+1 at which round r's average is applied
        self.overlap_steps = min(diloco_cfg.merge_step, diloco_cfg.inner_steps)

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

        In delayed/eager mode the wait for the previous round's average comes first, outside the lock, so that
        state serving goes on meanwhile: held through the wait, the lock would keep a peer whose rounds all fail
        after their timeouts from serving newcomers almost all the time, and a peer one round behind it could never
        download and catch up."""
        waited = self.exchange.settle(self.outer.feedback) if self.rule.overlaps else 0.0
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
        delta = self.outer.pseudo_gradient()  # 2. this round's local progress
        end = RoundEnd(self.round_index, tokens, expected_group_size, compute_s)
        report = self.rule.end(self.outer, delta, self.exchange, end)  # 3-6, in this mode's order
        self.round_index += 1
        report.round_end_s = time.monotonic() - started
        return report

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """phi0 - phi: the progress since the round's starting point (fp32, CPU)."""
        return self.outer.pseudo_gradient()

    @property
    def merge_due(self) -> bool:
        """delayed mode: apply the previous round's average now, because it has arrived, or because this round
        has reached ``overlap_steps`` (the merge then waits for it). The anchor does not depend on when."""
        return self.rule.merge_due(self.exchange, self.clock.steps_into_round() >= self.overlap_steps)

    def merge(self) -> float:
        """delayed mode, once the previous round's average has arrived (at the latest ``overlap_steps`` into this
        round): apply it to the anchor and rebase the working params on it (the new anchor minus this round's
        progress so far). Returns the time spent waiting for it; the round end that follows reports the merge."""
        waited = self.exchange.settle(self.outer.feedback)
        with self.state_lock:
            report = RoundReport(self.round_index)
            self.merge_now(report)
            report.waited_s += waited
            self.exchange.merged = report
        return waited

    def merge_now(self, report: RoundReport) -> None:
        """Steps 5-6 of a delayed round, now (:meth:`Delayed.merge <p2p_diloco.round.rules.Delayed.merge>`)."""
        Delayed.merge(self.outer, self.exchange, report)

    @torch.no_grad()
    def flush(self) -> RoundReport | None:
        """Apply the round still pending (delayed/eager) at the end of training: nothing is left unaveraged."""
        with self.state_lock:
            return self._flush()

    def _flush(self) -> RoundReport | None:
        if self.pending is None:
            return None
        report = RoundReport(self.round_index - 1)
        outer = self.outer
        outer.own_round_start()  # (phi0 - phi is the progress of a round stopped half-way: the outer step keeps it)
        outer.outer_optimizer.step(self.exchange.collect(report, outer), self.exchange.applied_group_size)
        outer.reset_eager()  # the shared anchor now holds every contribution, exactly once
        outer.rebase(restart_from=None)
        return report

    def settle(self) -> None:
        """Wait (bounded) for the round in flight and keep its average for the next round end, without applying
        it: before a shutdown, so that the checkpoint holds it and a resume continues exactly."""
        self.exchange.settle(self.outer.feedback)

    def restart_pending(self, expected_group_size: int | None) -> None:
        """After a resume from a checkpoint written while a round was in flight: average that contribution again
        (the swarm may have finished the round meanwhile, and then it falls back like any failed round)."""
        pending = self.pending
        if pending is not None and not pending.settled:
            self.exchange.start(RoundEnd(pending.round_index, pending.weight, expected_group_size, 0.0),
                                pending.contribution, pending.share)

    def set_params(self, values: list[torch.Tensor]) -> None:
        """phi = ``values``."""
        self.outer.set_params(values)

    # ---- where rounds start and end (streaming sync shifts them: docs/design.md 2.11) -------------------
    def round_start_step(self, round_index: int) -> int:
        """The inner step after which round ``round_index`` begins: :meth:`Clock.round_start_step`."""
        return self.clock.round_start_step(round_index)

    def round_end_step(self, round_index: int) -> int:
        """The inner step after which round ``round_index`` ends: :meth:`Clock.round_end_step`."""
        return self.clock.round_end_step(round_index)

    def round_at(self, inner_step: int) -> int:
        """The round the step after ``inner_step`` belongs to."""
        return self.clock.round_at(inner_step)

    # ---- its checkpoint (round/stage_state.py) and the state it shares (round/swarm_state.py) ----------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, metadata) of everything a resume needs: :func:`~p2p_diloco.round.stage_state.state_dict`."""
        header = {**self.unit.names, "mode": self.mode}
        return stage_state.state_dict(self.outer, self.exchange, self.clock, self.inner_optimizer, header)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Restore the stage from :meth:`state_dict`'s tensors and metadata; ValueError naming the first mismatch."""
        stage_state.check_unit(meta, self.unit, self.mode)
        stage_state.load_state_dict(self.outer, self.exchange, self.clock, self.inner_optimizer, tensors, meta)

    def shareable_state(self, run_id: str, finished_average: list[torch.Tensor] | None = None,
                        finished_group_size: int = 1) -> tuple[dict, list[torch.Tensor]]:
        """What this stage serves to others: :func:`~p2p_diloco.round.swarm_state.shareable_state`."""
        return swarm_state.shareable_state(self.outer, self.exchange, self.clock, self.unit.names, run_id,
                                           finished_average, finished_group_size)

    def check_state(self, run_id: str, meta: dict, tensors: list[torch.Tensor]) -> None:
        """Raise StateError unless a served state fits this stage: :func:`~p2p_diloco.round.swarm_state.check_state`."""
        swarm_state.check_state(self.outer, self.clock, self.unit, run_id, meta, tensors)

    def state_fingerprint(self) -> tuple[str, str]:
        """(fingerprint of the state this stage would serve now, sha256 of its anchor):
        :func:`~p2p_diloco.round.swarm_state.fingerprint`."""
        return swarm_state.fingerprint(self.outer)

    def served_fingerprint(self, meta: dict, tensors: list[torch.Tensor]) -> str:
        """The fingerprint of a served state that passed :meth:`check_state`."""
        return swarm_state.served_fingerprint(self.outer, meta, tensors)

    def adopt(self, meta: dict, tensors: list[torch.Tensor], how: str, inner_step: int | None = None) -> None:
        """Take a checked state over, as a ``reload`` or a ``resync``: :func:`~p2p_diloco.round.swarm_state.adopt`."""
        swarm_state.adopt(self.outer, self.exchange, self.clock, meta, tensors, how, inner_step)

    # ---- helpers ------------------------------------------------------------------------------------
    @property
    def stage_index(self) -> int:
        return self.unit.stage

    @property
    def num_stages(self) -> int:
        return self.unit.num_stages

    @property
    def fragment(self) -> tuple[int, int] | None:
        """(f, F) in a run averaged by fragment, else None."""
        return self.unit.fragment_pair

    @property
    def label(self) -> str:
        """For logs: "Stage 1", or "Stage 1 fragment 2"."""
        return self.unit.label

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
        return {"params": params, "inner_optimizer": inner, "outer_state": self.outer.num_bytes()}

    def shutdown(self) -> None:
        """Cancel the round in flight, if any, and stop the averager."""
        self.exchange.shutdown()
