"""The units one stage process averages, each a :class:`Stage`: its whole stage (F = 1), or each fragment of the model
it holds (``diloco.fragments``: docs/design.md 2.11), and when each ends its rounds.

An inner step is the stage process's, over all its units: one clip by the total norm over every unit (in the model's
parameter order, so bit-identical to one stage over the whole model; a pipelined peer gathers the norms of all its
stages first), then each unit's AdamW step and, in ``delayed`` mode, its merge when due. With streaming sync
(:meth:`Fragments.stagger`) fragment f's round r ends after inner step ``(r + 1) H - s_f`` (``s_f`` from
:func:`~p2p_diloco.model.fragments.round_shifts`), a few steps before the peer's regular round end; the run's last round
of every fragment ends on the run's last step, so that no step is left unaveraged.

The same code for the peer's trainer (:class:`~p2p_diloco.training.trainer.Trainer`, one holder per stage process, its
units paired with their swarm links and syncs) and for ``benchmarks/quality.py`` (one holder per simulated worker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from p2p_diloco.model.fragments import round_shifts
from p2p_diloco.round.outcome import RoundReport
from p2p_diloco.round.stage import Stage


class Fragments:
    """The units of one stage process, in model order.

    Args:
        stages: one :class:`Stage` per unit: the stage's own (F = 1), or one per fragment held, each with its
            ``fragment`` (f, F) set.
    """

    def __init__(self, stages: list[Stage]):
        if not stages:
            raise ValueError("a stage process averages at least one unit")
        self.stages = list(stages)
        self.H = stages[0].diloco_cfg.inner_steps

    def stagger(self, num_rounds: int) -> None:
        """Streaming sync: each fragment's rounds end ``s_f`` steps before the regular round end, except the run's last
        round (``num_rounds - 1``), which ends on the run's last step. Nothing for a whole stage."""
        for stage in self.stages:
            if stage.unit.num_fragments > 1:
                stage.round_shift = round_shifts(stage.unit.num_fragments, self.H)[stage.unit.fragment]
                stage.last_round = num_rounds - 1

    # ---- one inner step ------------------------------------------------------------------------------------
    def grad_norms(self) -> torch.Tensor:
        """Every gradient's norm, all units in model order (the clip's input: see :meth:`inner_update`)."""
        return torch.cat([stage.grad_norms() for stage in self.stages])

    def inner_update(self, total_norm: torch.Tensor) -> float:
        """AdamW on every unit, its gradients clipped by ``total_norm`` (of all the peer's gradients); the inner
        learning rate (the same schedule on every unit)."""
        return [stage.inner_update(total_norm) for stage in self.stages][0]

    def merge_due(self) -> list[int]:
        """``delayed`` mode: apply each unit's previous round's average that is due now; the positions merged."""
        due = [i for i, stage in enumerate(self.stages) if stage.merge_due]
        for i in due:
            self.stages[i].merge()
        return due

    # ---- round ends ----------------------------------------------------------------------------------------
    def ending_early(self, peer_round: int, step: int) -> list[int]:
        """Streaming sync: the positions of the units whose round ``peer_round`` ends after inner ``step``, before the
        peer's regular end of that round."""
        return [i for i, stage in enumerate(self.stages) if stage.round_index == peer_round
                and step == stage.round_end_step(peer_round) < (peer_round + 1) * self.H]

    def ending(self, peer_round: int) -> list[int]:
        """At the peer's regular end of ``peer_round``: the positions of the units still on it (the others ended it
        earlier in the round)."""
        return [i for i, stage in enumerate(self.stages) if stage.round_index == peer_round]

    @staticmethod
    def round_tokens(stage: Stage, step: int, tokens_per_step: int) -> int:
        """The tokens ``stage`` trained in its round that ends after inner ``step`` (its averaging weight): the steps
        since its round began, or since a reload put it part-way in; that mark is spent."""
        started = stage.round_first_step if stage.round_first_step is not None else \
            stage.round_start_step(stage.round_index)
        stage.round_first_step = None
        return max(0, step - started) * tokens_per_step

    def skip_to(self, step: int) -> None:
        """The swarm ended the peer's round before this peer trained it all: the inner steps up to ``step`` are
        nobody's (a round's tokens count the steps trained)."""
        skipped = step - self.stages[0].inner_step
        for stage in self.stages:
            started = stage.round_first_step if stage.round_first_step is not None else \
                stage.round_start_step(stage.round_index)
            stage.round_first_step = started + skipped
            stage.inner_step = step

    def flush(self) -> list[RoundReport | None]:
        """Every unit's round still in flight applied (the run's end; overlap modes), one report each (None: none)."""
        return [stage.flush() for stage in self.stages]

    @contextlib.contextmanager
    def anchor_weights(self) -> Iterator[None]:
        """Every unit's anchor in the working parameters, for evaluating the agreed model."""
        with contextlib.ExitStack() as stack:
            for stage in self.stages:
                stack.enter_context(stage.anchor_weights())
            yield
