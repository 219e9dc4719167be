"""K peers' averaging of one stage in one process, with no network: for learning-quality benchmarks and tests.

:class:`ExactGroup` stands in for hivemind's matchmaking and all-reduce and keeps everything else of a real
round: every peer proposes its compression in the same metadata, the group agrees on the plan with the real
:class:`~p2p_diloco.compression.policy.CompressionPolicy`, each peer's
:class:`~p2p_diloco.swarm.averaging.reduce.RoundReducer` runs its phases (codecs, PowerSGD with warm Qs, error-feedback
residuals), and every part is combined by the robust reducer's rule (:func:`p2p_diloco.swarm.averaging.robust.combine`,
weights capped as the guard caps them) and sent back through the reducer's codec, as
:class:`~p2p_diloco.swarm.averaging.allreduce.ExactAllReduceRunner` does. The group always holds all K peers (the
rounds listed in ``fail_rounds`` fail for everyone), so a simulation measures the algorithm, not the network.

Each peer's :class:`ExactAverager` has the methods :class:`~p2p_diloco.round.stage.Stage` calls on a
:class:`~p2p_diloco.swarm.averaging.averager.PseudoGradientAverager`. Peers may end their rounds from different threads
(blocking mode needs that: each waits for the others' contributions) or, in the overlap modes, one after the
other. Called by ``benchmarks/quality.py`` and the tests.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import torch

from p2p_diloco.compression.codecs import result_codec, roundtrip
from p2p_diloco.compression.policy import CompressionPolicy
from p2p_diloco.config import AveragingConfig
from p2p_diloco.round.outcome import RoundOutcome
from p2p_diloco.swarm.averaging.boundary import OwnRecord, RoundClaim
from p2p_diloco.swarm.averaging.reduce import RoundReducer
from p2p_diloco.swarm.averaging.robust import RobustRule, cap_weights, combine


class ExactGroup:
    """The averaging of K simulated peers of one stage.

    Args:
        k: number of peers.
        shapes: the stage's tensor shapes.
        cfg: the ``[averaging]`` section (compression scheme, bounds, robust rule, weight cap).
        fail_rounds: rounds whose averaging fails for every peer (each then applies its own contribution).
        arrival_steps: a round's average counts as arrived (``round_settled``) once each peer has asked this many
            times, i.e. after this many inner steps of the next round: a stand-in for the network's time.
        seed: shared by the group for seeded low-rank Qs (a real group uses its run id and stage).
        timeout_s: how long a peer waits for the others' contributions before its round fails.
    """

    def __init__(self, k: int, shapes: Sequence[Sequence[int]], cfg: AveragingConfig, *,
                 fail_rounds: Sequence[int] = (), seed: str = "simulation", timeout_s: float = 600.0,
                 arrival_steps: int = 1):
        self.k, self.cfg, self.fail_rounds, self.timeout_s = k, cfg, set(fail_rounds), timeout_s
        self.arrival_steps = arrival_steps
        self.rule = RobustRule(outlier_ratio=cfg.outlier_norm_ratio, clip_ratio=cfg.clip_ratio)
        self.views = [ExactAverager(self, i, CompressionPolicy([tuple(s) for s in shapes], cfg), seed)
                      for i in range(k)]
        self._cond = threading.Condition()
        self._started: dict[int, dict[int, tuple[list[torch.Tensor], float, dict]]] = {}
        self._results: dict[int, dict[int, RoundOutcome]] = {}

    def view(self, index: int) -> ExactAverager:
        return self.views[index]

    def _start(self, index: int, round_index: int, contribution: list[torch.Tensor], weight: float,
               metadata: dict) -> None:
        with self._cond:
            self._started.setdefault(round_index, {})[index] = (contribution, weight, metadata)
            self._cond.notify_all()

    def _finish(self, index: int, round_index: int) -> RoundOutcome:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._started.get(round_index, {})) == self.k
                                       or round_index in self._results, timeout=self.timeout_s):
                return RoundOutcome(fallback_reason=f"TimeoutError: not all {self.k} peers started the round")
            if round_index not in self._results:
                self._results[round_index] = self._average(round_index, self._started.pop(round_index))
            results = self._results[round_index]
            result = results.pop(index)
            if not results:
                del self._results[round_index]
            return result

    def _average(self, round_index: int, started: dict) -> dict[int, RoundOutcome]:
        order = sorted(started)
        if round_index in self.fail_rounds:
            return {i: RoundOutcome(fallback_reason="simulated failure") for i in order}
        weights = cap_weights([started[i][1] for i in order], self.cfg.max_weight_ratio)
        views = [self.views[i] for i in order]
        plan = views[0].policy.agree([started[i][2] for i in order])  # every member computes the same plan
        sent_by_phase: dict[bytes, dict[int, list[torch.Tensor]]] = {}
        averaged_by_phase: dict[bytes, list[torch.Tensor]] = {}
        events: dict[bytes, asyncio.Event] = {}

        def allreduce_of(position: int):
            async def allreduce(tensors, codecs, phase):
                sent = sent_by_phase.setdefault(phase, {})
                sent[position] = [roundtrip(c, t) for t, c in zip(tensors, codecs)]  # what the wire carries
                event = events.setdefault(phase, asyncio.Event())
                if len(sent) == len(order):
                    averaged_by_phase[phase] = [
                        roundtrip(result_codec(codec),
                                  combine([sent[p][j] for p in range(len(order))], weights, self.rule).average)
                        for j, codec in enumerate(codecs)]
                    event.set()
                await event.wait()
                return [t.clone() for t in averaged_by_phase[phase]]
            return allreduce

        async def run_all():
            return await asyncio.gather(*[
                view.reducer.reduce([t.clone() for t in started[i][0]], plan, round_index, allreduce_of(position))
                for position, (i, view) in enumerate(zip(order, views))])

        outcomes = asyncio.run(run_all())
        results = {}
        for i, view, outcome in zip(order, views, outcomes):
            view.own.averaged(outcome.stats, view.policy.next_proposal(plan, outcome.q_avgs, round_index))
            results[i] = RoundOutcome(average=outcome.averaged, averaged=True, group_size=len(order),
                                      group_tokens=sum(weights), residual=outcome.residuals,
                                      compression=dict(outcome.stats), group_peers=tuple(f"sim{j}" for j in order))
        return results


class ExactAverager:
    """One simulated peer's averager (:class:`~p2p_diloco.round.averager.RoundAverager`)."""

    def __init__(self, group: ExactGroup, index: int, policy: CompressionPolicy, seed: str):
        self.group, self.index, self.policy = group, index, policy
        self.cfg: AveragingConfig = group.cfg
        self.reducer = RoundReducer(policy, seed)
        self.own = OwnRecord(policy.initial_proposal(), self.cfg.assumed_bandwidth_mbit)  # as the server's
        self.round_in_flight: int | None = None
        self.polls = 0

    def set_expected_group_size(self, size: int | None) -> None:
        pass

    def start_round(self, contribution: Sequence[torch.Tensor], round_index: int, weight: float,
                    compute_s: float = 0.0, budget_s: float = 0.0) -> None:
        assert self.round_in_flight is None, "finish the previous round before starting another"
        metadata = self.own.record(RoundClaim(round_index, float(weight), float(compute_s)))
        tensors = [t.detach().to(dtype=torch.float32, device="cpu").clone() for t in contribution]
        self.group._start(self.index, round_index, tensors, float(weight), metadata)
        self.round_in_flight, self.polls = round_index, 0

    @property
    def compresses(self) -> bool:
        return self.cfg.compression != "none"

    @property
    def feedback_decay(self) -> float:
        return self.reducer.policy.feedback_decay

    @property
    def round_settled(self) -> bool:
        """Whether the round in flight's average has "arrived": every peer started it, and this peer has asked
        ``arrival_steps`` times."""
        if self.round_in_flight is None:
            return True
        self.polls += 1
        with self.group._cond:  # every peer started it (or a groupmate already took the average: it is done)
            started = len(self.group._started.get(self.round_in_flight, {})) == self.group.k \
                or self.round_in_flight in self.group._results
        return started and self.polls >= self.group.arrival_steps

    def finish_round(self, timeout: float | None = None, hopeless=None, feedback=None) -> RoundOutcome:
        assert self.round_in_flight is not None, "no round in flight"
        round_index, self.round_in_flight = self.round_in_flight, None
        return self.group._finish(self.index, round_index)

    def abandon_round(self) -> None:
        self.round_in_flight = None

    def cancel_round(self) -> None:
        self.round_in_flight = None

    def shutdown(self) -> None:
        pass
