"""A peer's own check of a state from others: what no number of identities can vote through (docs/threat-model.md 6).

Every state a stage takes from other peers (a reload, a resync, a newcomer's download, the run's final state) has
passed the record checks of :mod:`p2p_diloco.training.fetch`: it is exactly the state the believed records vouch for.
Those records are the word of identities, and identities are cheap: a few that averaged with a peer, or made up
for a newcomer, can vouch for any state. So before a state replaces this peer's own, the peer measures it itself, on
its own held-out batches (the first :data:`OWN_BATCHES` of its evaluation split), against its own anchor:

- a peer holding a trained anchor refuses a state whose loss there is more than :data:`WORSE_BY` above its own
  anchor's (a wiped, shrunk or scrambled model fails at once; the swarm's state, however far ahead, does not: its
  loss is lower or about the same);
- a peer still holding the run's initial model (a newcomer) refuses a state that has not learned at least
  :data:`GAIN_FROM_INIT` on those batches: an all-zero model scores the uniform loss, just below a random init's.

A state that passes can still be a bad one that is not worse on this peer's batches: an older state of the swarm,
one that has learned something else as well (a backdoor), or, for a newcomer, any model that learned something. What
it cannot be is a model that undoes this peer's training.

Where the loss cannot be had, the check is the distance instead (:func:`steps_between`): a stage of a pipelined peer
deciding a resync or the run's end alone (its evaluation needs the peer's other stages, which decide theirs at
other times), or a run with ``data.eval_batches = 0``: the state must be within :data:`NEAR_STEPS` of this stage's
own outer steps (the norm of its last pseudo-gradient, scaled by the outer step). Reloads, and the end taken at the
start, are decided by all stages together and always use the loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from contextlib import ExitStack

import torch

from p2p_diloco.training.run_end import NEAR_STEPS, distance

logger = logging.getLogger(__name__)

OWN_BATCHES = 4
"""Held-out batches of this peer's evaluation split that judge a state (at most; fewer when the split has fewer)."""
WORSE_BY = 0.10
"""How much higher (relative) a state's loss on this peer's own held-out batches may be than its own anchor's. Honest
states score up to 2.9% above a peer's own on its 2-4 batches in the test suite (a restarted peer's checkpoint
against the swarm's newer state, two halves of a swarm at the end); a wiped model is 40% or more above, one shrunk
by 7% 70% (the tiny model)."""
GAIN_FROM_INIT = 0.01
"""How much lower (relative) than the run's initial model a state must score for a peer still holding that model."""
# NEAR_STEPS (from the run's end): where the loss cannot be had, how far a state may be from this stage's own


def steps_between(stage, anchor: Sequence[torch.Tensor], momentum: Sequence[torch.Tensor]) -> float:
    """How far a state is from ``stage``'s own (anchor and outer momentum), in ``stage``'s own outer steps: the
    anchor's distance over lr (1 + mu) |g| (lr |g| without Nesterov), the momentum's over |g|, g its last
    pseudo-gradient; infinite before its first outer step."""
    outer = stage.outer_optimizer
    grad = float(outer.last_grad_norm)
    if not grad > 0:
        return math.inf
    per_grad = outer.last_lr * (1 + outer.momentum if outer.nesterov else 1.0)
    with stage.state_lock:
        to_anchor = distance(anchor, stage.anchor)
        to_momentum = distance(momentum, outer.momentum_buffers)
    return max(to_anchor / (per_grad * grad), to_momentum / grad)


class OwnCheck:
    """Judges states offered by other peers on this peer's own held-out batches (see the module docstring).

    Args:
        executor: the peer's executor (a pipelined peer's stages evaluate together through it).
        eval_batches: this peer's held-out batches (its evaluation split).
        stages: the units this process holds, in the order of the peer's syncs.
    """

    def __init__(self, executor, eval_batches: Sequence, stages: Sequence):
        self.executor, self.stages = executor, list(stages)
        self.batches = list(eval_batches)[:OWN_BATCHES]
        # a stage of a pipeline cannot evaluate alone: its resyncs and its end are judged by distance
        self.alone = bool(getattr(executor, "is_first_stage", True) and executor.is_last_stage)
        self.last: dict = {}  # the losses of the last judgement, for the sync event

    def _loss(self, weights: dict[int, Sequence[torch.Tensor]]) -> float:
        """The loss on the own batches with unit i's parameters at ``weights[i]``, every other unit's at its anchor
        (collective: every stage of a pipelined peer calls it at the same point)."""
        with ExitStack() as stack:
            for i, stage in enumerate(self.stages):
                stack.enter_context(stage.weights_of(list(weights[i])) if i in weights else stage.anchor_weights())
            loss = self.executor.evaluate(self.batches)
        return float(self.executor.common_value(loss)[-1])  # the last stage's (the others' are NaN)

    def _verdict(self, own: float, offered: float, at_init: bool) -> str | None:
        self.last = {"own_loss": round(own, 5), "offered_loss": round(offered, 5)}
        if not math.isfinite(offered):
            return f"its loss on this peer's own held-out batches is {offered}"
        if at_init and not offered <= own * (1 - GAIN_FROM_INIT):
            return (f"it has learned nothing on this peer's own held-out batches: loss {offered:.4f} against the "
                    f"run's initial model's {own:.4f} (it must be at least {GAIN_FROM_INIT:.0%} lower)")
        if not at_init and not offered <= own * (1 + WORSE_BY):
            return (f"its loss on this peer's own held-out batches is {offered:.4f}, above this peer's own anchor's "
                    f"{own:.4f} by more than {WORSE_BY:.0%}")
        return None

    def judge_all(self, offered: dict[int, tuple[dict, list[torch.Tensor]]]) -> str | None:
        """Why the states ``offered`` (unit index -> (meta, [anchor..., momentum...])) cannot replace the units' own
        together (a reload, or the run's end taken at the start), or None. Collective: called by every stage process
        of the peer at the same point; every one decides the same."""
        at_init = all(stage.applied_round < 0 for stage in self.stages)
        if all(meta["applied_round"] < 0 for meta, _ in offered.values()) and at_init:
            local = None  # the run's initial state (its fingerprint was checked against this stage's own)
        elif not self.batches:
            local = self._by_distance(offered, at_init)
        else:
            anchors = {i: tensors[:len(self.stages[i].anchor)] for i, (_, tensors) in offered.items()}
            own, other = self._loss({}), self._loss(anchors)
            local = self._verdict(own, other, at_init)
        return next((why for why in self.executor.common_value(local) if why is not None), None)

    def judge_unit(self, index: int, meta: dict, tensors: list[torch.Tensor]) -> str | None:
        """Why one unit's state (a resync, the run's final state) cannot replace its own, or None. Not collective:
        where this process cannot evaluate alone, by distance."""
        stage = self.stages[index]
        if not self.alone or not self.batches:
            return self._by_distance({index: (meta, tensors)}, stage.applied_round < 0)
        own, other = self._loss({}), self._loss({index: tensors[:len(stage.anchor)]})
        return self._verdict(own, other, stage.applied_round < 0)

    def _by_distance(self, offered, at_init: bool) -> str | None:
        if at_init:
            # nothing of its own to measure a state against: the records' word is all (data.eval_batches = 0)
            logger.warning("No held-out batches (data.eval_batches = 0): a state from other peers is taken on their "
                           "word alone")
            return None
        for i, (meta, tensors) in offered.items():
            stage = self.stages[i]
            count = len(stage.anchor)
            steps = steps_between(stage, tensors[:count], tensors[count:])
            # a state some rounds ahead is about one outer step further per round
            bound = NEAR_STEPS + max(0, int(meta["applied_round"]) - stage.applied_round)
            self.last = {"steps_away": round(steps, 3)}
            if not steps <= bound:
                return (f"it is {steps:.1f} of this peer's outer steps from its own state (at most {bound:g} where "
                        f"its loss cannot be measured)")
        return None
