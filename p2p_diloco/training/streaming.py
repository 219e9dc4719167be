"""Streaming sync on one stage process: a :class:`Stage` per fragment it holds, and when each ends its rounds.

Fragments (:mod:`p2p_diloco.model.fragments`) are averaged one at a time (docs/design.md 2.11): fragment f's
round r ends after inner step ``(r + 1) H - s_f`` (``s_f`` from :func:`~p2p_diloco.model.fragments.round_shifts`),
and a fragment whose last round ended before the run's last step averages those steps in one short round at
the end, so that no step is left unaveraged. Each fragment is a :class:`Stage` of its own over a
:class:`~p2p_diloco.model.fragments.FragmentView` of the model's parameters (anchor, outer momentum, error
feedback, averager and round rule); an inner step is the stage process's: one clip by the total norm over all
fragments (in the model's parameter order, so bit-identical to one stage over the whole model), then each
fragment's AdamW step and, in ``delayed`` mode, its merge when due. With F = 1 this is one Stage and its rounds.

Used by ``benchmarks/quality.py`` (rows ``mode/compression~F``); the peer's trainer does not use it yet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from p2p_diloco.config import DiLoCoConfig, InnerConfig
from p2p_diloco.model.fragments import FragmentView, round_shifts, split_parameters
from p2p_diloco.round.stage import Stage


class FragmentStages:
    """The fragments one stage process holds, each a :class:`Stage`, and their staggered round ends.

    Args:
        module: the stage's model (the whole model when P = 1), already on its device.
        parts: the model's fragment cut (``fragment_parts``); F = len(parts).
        averagers: fragment index -> its averager (None, or a missing key: that fragment trains alone).
        inner_cfg, diloco_cfg, total_steps: as for :class:`Stage`.
        stream: stagger the fragments' rounds (streaming sync); False: every fragment ends its rounds on the
            regular round end (all at once).
    """

    def __init__(self, module: nn.Module, parts: Sequence[int], *, averagers=None, inner_cfg: InnerConfig,
                 diloco_cfg: DiLoCoConfig, total_steps: int, stream: bool = True):
        self.H, self.total_steps = diloco_cfg.inner_steps, total_steps
        averagers = averagers or {}
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        held = split_parameters(named, parts)
        shifts = round_shifts(len(parts), self.H) if stream and len(parts) > 1 else [0] * len(parts)
        self.fragments = list(held)
        self.stages: list[Stage] = []
        for f, params in held.items():
            view = module if len(held) == 1 and len(params) == len(named) else FragmentView(params)
            stage = Stage(view, stage_index=0, num_stages=1, inner_cfg=inner_cfg, diloco_cfg=diloco_cfg,
                          total_steps=total_steps, averager=averagers.get(f))
            stage.round_shift = shifts[f]
            self.stages.append(stage)
        self.last_end = [0] * len(self.stages)  # the inner step each fragment's last round ended after

    def inner_update(self) -> None:
        """One inner step's update, after forward/backward: clip by the total norm over every fragment, AdamW on
        each, and each delayed fragment's merge when it is due."""
        norm = torch.linalg.vector_norm(torch.cat([stage.grad_norms() for stage in self.stages]), 2)
        for stage in self.stages:
            stage.inner_update(norm)
            if stage.merge_due:
                stage.merge()

    def ending(self, step: int) -> list[int]:
        """The positions (in :attr:`stages`) of the fragments whose round ends after inner step ``step`` (counted
        from 1): at ``(r + 1) H - s_f``, and every fragment not just ended at the run's last step."""
        return [i for i, stage in enumerate(self.stages)
                if step > self.last_end[i] and ((step + stage.round_shift) % self.H == 0 or step == self.total_steps)]

    def steps_in_round(self, i: int, step: int) -> int:
        """The inner steps of fragment ``i``'s round that ends after ``step`` (its averaging weight's steps)."""
        return step - self.last_end[i]

    def ended(self, i: int, step: int) -> None:
        """Note that fragment ``i``'s round ended after ``step`` (call once its ``end_round`` has returned)."""
        self.last_end[i] = step

    @contextlib.contextmanager
    def anchor_weights(self) -> Iterator[None]:
        """Every fragment's anchor in the working parameters, for evaluating the agreed model."""
        with contextlib.ExitStack() as stack:
            for stage in self.stages:
                stack.enter_context(stage.anchor_weights())
            yield
