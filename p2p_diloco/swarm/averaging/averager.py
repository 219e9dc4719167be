"""Averaging one stage's (or fragment's) pseudo-gradients with the same unit of other peers, one round at a time:
the client, in the training process.

:class:`PseudoGradientAverager` implements :class:`~p2p_diloco.round.averager.RoundAverager` (what a
:class:`~p2p_diloco.round.stage.Stage` sees). It starts and owns an
:class:`~p2p_diloco.swarm.averaging.server.AveragingServer`, hivemind's averager in its own background process
(matchmaking through the DHT, the robust exact all-reduce over libp2p, serving other peers), and reaches it only
through the server's shared buffers, hivemind's ``step`` (with the round's :class:`~.boundary.RoundClaim`) and the
server's typed calls (:mod:`~p2p_diloco.swarm.averaging.boundary`).

- A round is started with :meth:`start_round` (the contribution copied into the shared buffers, the round's group
  key and gathered metadata set, hivemind's step begun) and collected with :meth:`finish_round`, which never raises
  for network reasons: a round that fails, times out or finds nobody returns an outcome with its fallback reason and
  the caller falls back to its own pseudo-gradient.
- What the client keeps between rounds lives here, in the training process: the round in flight and a round abandoned
  to finish in the background. The compression proposal, the last error and the link's bandwidth live with the
  policy, in the averaging process, which completes the round's record (:class:`~.boundary.OwnRecord`).
- :meth:`download_state` fetches a unit's state from donors the caller chose (checked as it arrives:
  :mod:`~p2p_diloco.swarm.averaging.download`); ``state_provider`` is what this peer serves.

At most one round is in flight per averager (the shared buffers hold one round's contribution).
Called by :class:`p2p_diloco.round.stage.Stage` and ``stage_process``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from p2p_diloco.config import AveragingConfig
from p2p_diloco.hivemind_adapter.averaging import AllreduceException, AveragingStage, cancel_step
from p2p_diloco.round.outcome import RoundOutcome
from p2p_diloco.swarm.averaging.allreduce import BYTES_RECEIVED, BYTES_SENT
from p2p_diloco.swarm.averaging.boundary import GroupResult, RoundClaim
from p2p_diloco.swarm.averaging.server import AveragingServer
from p2p_diloco.unit import Unit

logger = logging.getLogger(__name__)

ROUND_BITS = 16  # rounds are told apart modulo 2**16 by the group key, exactly by the gathered metadata
ASK_TIMEOUT_S = 10.0  # the background process answers a call at once: longer is a stuck machine


def group_prefix(run_id: str, stage_index: int, num_stages: int) -> str:
    """DHT prefix shared by stage ``stage_index`` of every peer of a run with ``num_stages`` stages
    (:meth:`~p2p_diloco.unit.Unit.group_prefix`)."""
    return Unit(stage_index, num_stages).group_prefix(run_id)


def round_bits(round_index: int) -> str:
    return format(round_index % (1 << ROUND_BITS), f"0{ROUND_BITS}b")


@dataclass
class _PendingRound:
    round_index: int
    control: object  # hivemind StepControl
    started_at: float
    traffic_at_start: tuple[int, int]
    timeout_s: float  # of matchmaking, retries included (the all-reduce has its own bound)


class PseudoGradientAverager:
    """The training process's side of one unit's averaging (see the module's docstring).

    Args:
        templates: tensors with the shapes of the stage's parameters (values are not used).
        dht: a running hivemind DHT.
        run_id: the swarm's run id.
        stage_index: this stage's index.
        num_stages: P, stages per peer.
        cfg: the ``[averaging]`` section.
        fragment: (f, F): average fragment f of F instead (its group key is the fragment's, the same on peers of
            any pipeline split; one averager per fragment a stage holds, several on one DHT, each with its own
            RPC namespace).
        server_type: the server to start (a seam: tests start subclasses that serve their state another way, or
            that lie to their groupmates: ``tests/hostile``).

    :meth:`_contribution_to_send` is a seam too: what this peer claims for a round is what it trained, and a test's
    hostile subclass claims otherwise.
    """

    def __init__(self, templates: Sequence[torch.Tensor], dht, *, run_id: str, stage_index: int, num_stages: int,
                 cfg: AveragingConfig, fragment: Optional[tuple[int, int]] = None,
                 server_type: Callable[..., AveragingServer] = AveragingServer):
        self.cfg = cfg
        prefix = Unit.of(stage_index, num_stages, fragment).group_prefix(run_id)
        self.server = server_type(templates, dht, prefix=prefix, initial_group_bits=round_bits(0), cfg=cfg)
        self._pending: Optional[_PendingRound] = None
        self._abandoned: Optional[_PendingRound] = None  # left to finish in the background, its result unread
        self._last_control = None  # the step of the last round started, until the background has ended it

    @property
    def peer_id(self):
        return self.server.peer_id

    @property
    def dht(self):
        return self.server.dht

    @property
    def prefix(self) -> str:
        return self.server.prefix

    @property
    def state_provider(self) -> Optional[Callable]:
        """() -> (metadata, tensors): what this unit serves to newcomers (called in a thread of this process)."""
        return self.server.state_provider

    @state_provider.setter
    def state_provider(self, provider: Optional[Callable]) -> None:
        self.server.state_provider = provider

    @property
    def pid(self) -> Optional[int]:
        """The server's background process."""
        return self.server.pid

    def shutdown(self) -> None:
        self.server.shutdown()

    def set_expected_group_size(self, size: Optional[int]) -> None:
        """Assemble the group as soon as ``size`` peers joined (the live peers of this stage), else wait. A set
        ``averaging.target_group_size`` caps it (groups of k in a larger swarm, as hivemind's own target)."""
        target = self.cfg.target_group_size
        size = target if size is None or size < 2 else size if target is None else min(size, target)
        self.server.set_target_group_size(size, ASK_TIMEOUT_S)

    def start_round(self, contribution: Sequence[torch.Tensor], round_index: int, weight: float,
                    compute_s: float = 0.0, budget_s: float = 0.0) -> None:
        """Start averaging ``contribution`` in the background. The previous round must be finished.

        Args:
            contribution: this peer's pseudo-gradient plus its error feedback, one tensor per parameter.
            round_index: the round it belongs to.
            weight: tokens trained on in the round.
            compute_s: how long the round's inner steps took (the group's shortest sets the bandwidth budget).
            budget_s: how long the round may take (at least ``round_timeout_s``). An all-reduce that fails
                (a groupmate vanished or stopped sending) is tried again with a new group of the same round, the
                same contributions, until then.
        """
        assert self._pending is None, "finish the previous round before starting another"
        self._collect_abandoned()
        self._await_step_ended()
        assert weight > 0, "a contribution needs a positive weight (tokens trained on)"
        contribution, claimed_round, weight = self._contribution_to_send(contribution, round_index, weight)
        with self.server.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, contribution):
                buffer.copy_(tensor.detach().to(dtype=torch.float32, device="cpu"))
            self.server.buffered_round[0] = round_index
        self.server.set_group_bits(round_bits(round_index))
        # the averaging process completes the claim into the round's record (boundary.OwnRecord)
        claim = RoundClaim(claimed_round, float(weight), float(compute_s))
        timeout = max(self.cfg.round_timeout_s, float(budget_s))
        control = self.server.step(
            gather=claim.to_gather(),
            weight=float(weight),
            timeout=timeout,
            allow_retries=True,
            wait=False,
        )
        traffic = (int(self.server.traffic[BYTES_SENT]), int(self.server.traffic[BYTES_RECEIVED]))
        self._pending = _PendingRound(round_index, control, time.monotonic(), traffic, timeout)
        self._last_control = control

    def _contribution_to_send(self, contribution: Sequence[torch.Tensor], round_index: int,
                              weight: float) -> tuple[Sequence[torch.Tensor], int, float]:
        """(contribution, round, weight) this peer sends for ``round_index``: what it trained, as it is (a seam)."""
        return contribution, round_index, weight

    def _await_step_ended(self, timeout_s: float = 10.0) -> None:
        """Wait until the background process has ended the previous round's step. A cancel reaches it through
        another pipe than the next round's group key: a step cancelled but still matching when the key changes
        would look for a group under the new round's key, with the old round's metadata (on a loaded machine a
        newcomer's stale step joins the others' next group, and its real step comes too late)."""
        control, self._last_control = self._last_control, None
        deadline = time.monotonic() + timeout_s
        while control is not None and control.stage != AveragingStage.FINISHED:
            if time.monotonic() >= deadline:
                logger.warning("The previous round's averaging step has not ended after "
                               f"{timeout_s:.0f} s (it is at {control.stage.name}); starting the next round anyway")
                return
            time.sleep(0.01)

    @property
    def round_in_flight(self) -> Optional[int]:
        return None if self._pending is None else self._pending.round_index

    def finish_round(self, timeout: Optional[float] = None,
                     hopeless: Optional[Callable[[int], bool]] = None,
                     feedback: Optional[list[torch.Tensor]] = None) -> RoundOutcome:
        """Wait for the round in flight and return it: at most ``timeout`` s, by default what is left of the
        round's own bounds (matchmaking + all-reduce timeouts, counted from its start).

        The average returned is the shared buffers themselves, valid until the next :meth:`start_round` (the round
        end applies it before then); an averaged round's residual is copied into ``feedback`` when given (the
        stage's error feedback, returned as the residual), else into new tensors: the training process makes no
        copy of either.

        ``hopeless(round)``, asked every second while the round is still matching: True when no group can form
        any more (every other peer has applied that round already); the round then fails at once instead of
        waiting out its timeout.
        """
        assert self._pending is not None, "no round in flight"
        pending, self._pending = self._pending, None
        if timeout is None:
            bound = pending.timeout_s + self.cfg.allreduce_timeout_s + 5
            timeout = max(1.0, bound - (time.monotonic() - pending.started_at))
        found: dict = {}
        try:
            deadline = time.monotonic() + timeout
            while hopeless is not None and not pending.control.done():
                try:
                    pending.control.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise
                    matching = pending.control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
                    if matching and hopeless(pending.round_index):
                        raise AllreduceException("the other peers have all moved past this round") from None
            result: GroupResult = pending.control.result(timeout=max(0.0, deadline - time.monotonic()))
            gathered = result.gathered
            rounds = {info["round"] for info in gathered.values()}
            if rounds != {pending.round_index}:
                raise AllreduceException(f"groupmates reported rounds {sorted(rounds)}")
            with self.server.get_tensors() as buffers:
                found["average"], found["averaged"] = list(buffers), True
                if feedback is None:
                    found["residual"] = [residual.clone() for residual in self.server.residuals]
                else:
                    for e, residual in zip(feedback, self.server.residuals):
                        e.copy_(residual)
                    found["residual"] = feedback
            found["compression"] = result.stats
            found["group_size"] = len(gathered)
            found["group_tokens"] = float(result.tokens)  # claims capped as in the average
            found["group_peers"] = tuple(sorted(str(peer_id) for peer_id in gathered))
        except Exception as e:  # network failures of every kind end in a fallback, never in a crash
            cancel_step(pending.control)
            found = {"fallback_reason": f"{type(e).__name__}: {e}" if str(e) else type(e).__name__}
        suspects, banned, ban_reasons = self._flags_of(pending.round_index)
        return RoundOutcome(**found, suspects=suspects, banned=tuple(banned), ban_reasons=ban_reasons,
                            averaging_s=time.monotonic() - pending.started_at,
                            bytes_sent=int(self.server.traffic[BYTES_SENT]) - pending.traffic_at_start[0],
                            bytes_received=int(self.server.traffic[BYTES_RECEIVED]) - pending.traffic_at_start[1])

    def _flags_of(self, round_index: int) -> tuple[dict, list, dict]:
        """The groupmates flagged in a round, the peers banned so far and why the last of them were, from the
        background process."""
        try:
            flags = self.server.report_flags(round_index, ASK_TIMEOUT_S)
            return flags.suspects, flags.banned, flags.ban_reasons
        except Exception as e:  # the report is for metrics only: never fail a round over it
            logger.warning(f"Could not read the groupmates flagged in round {round_index}: {e!r}")
            return {}, [], {}

    def download_state(self, donors: Sequence[str], timeout_s: float):
        """(metadata, tensors) of this stage from the first of ``donors`` (DHT peer ids, in the order to ask them)
        that serves a well-formed state, or None; never longer than ``timeout_s`` in all.

        The caller chooses the donors (from the swarm's signed records: see ``training.sync``), not the priority each
        averager declares for itself in hivemind's unsigned ``all_averagers`` key. What a donor sends is bounded
        as it arrives: one metadata message of at most :data:`MAX_STATE_METADATA_BYTES`, at most one tensor per
        template twice over (anchor and momentum), each fp32 of exactly its template's shape; a donor that sends
        more, or another layout, or too slowly for what is left of the bound, is dropped for the next one."""
        try:
            return self.server.download_from([str(d) for d in donors], timeout_s)
        except Exception as e:  # every network failure ends in "no state", never in a crash
            logger.warning(f"State download failed: {e!r}")
            return None

    @property
    def compresses(self) -> bool:
        """Whether what is sent differs from the contribution (then the stage keeps error feedback)."""
        return self.cfg.compression != "none"

    @property
    def feedback_decay(self) -> float:
        """SparseLoCo's beta (``averaging.sparse_feedback_decay``), else 1."""
        return self.server.policy.feedback_decay

    @property
    def round_settled(self) -> bool:
        """No round in flight, or its averaging is over (its outcome not yet collected)."""
        pending = self._pending
        return pending is None or pending.control.done()

    def wait_for_round(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the round in flight, if any, is over; never raises."""
        pending = self._pending
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.control.result(timeout=timeout_s)

    def finished_average(self) -> Optional[tuple[list[torch.Tensor], int]]:
        """The average of the round in flight and the size of its group, if it has already arrived (without
        collecting it), else None."""
        pending = self._pending
        if pending is None or not pending.control.done() or pending.control.exception() is not None:
            return None
        group_size = len(pending.control.result().gathered)
        with self.server.get_tensors() as buffers:
            return [buffer.clone() for buffer in buffers], group_size

    def abandon_round(self) -> None:
        """Stop caring about the round in flight without cancelling it: it finishes with its group in the
        background (the others still get this peer's contribution; cancelling a step in the middle of
        matchmaking can leave the others waiting on a leader that is gone), and its result is never read."""
        if self._pending is not None:
            self._collect_abandoned()
            self._abandoned, self._pending = self._pending, None

    def _collect_abandoned(self) -> None:
        """Before reusing the buffers: wait for the abandoned round if it is averaging (bounded by its own
        timeouts; normally long over), cancel it if it is still matching."""
        abandoned, self._abandoned = self._abandoned, None
        if abandoned is not None and abandoned.control.stage in (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP):
            cancel_step(abandoned.control)  # a round a round ago that is still matching will not find its group
        elif abandoned is not None:
            bound = abandoned.timeout_s + self.cfg.allreduce_timeout_s + 5
            try:
                abandoned.control.result(timeout=max(0.1, bound - (time.monotonic() - abandoned.started_at)))
            except Exception:
                cancel_step(abandoned.control)

    def cancel_round(self) -> None:
        """Cancel the round in flight, if any (shutdown path)."""
        if self._pending is not None:
            self.server.buffered_round[0] = -1  # no lock: a reduce already under way may finish, unread
            cancel_step(self._pending.control)
            self._pending = None

