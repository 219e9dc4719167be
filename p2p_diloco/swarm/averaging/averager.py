"""Averaging one stage's pseudo-gradients with the same stage of other peers, one round at a time.

:class:`PseudoGradientAverager` is a hivemind ``DecentralizedAverager`` (its own background process,
matchmaking through the DHT, butterfly all-reduce over libp2p) with these additions:

- the group key is ``<run_id>_s<stage>of<P>.0b<round bits>``: peers of another run, stage split or round
  never land in the same group, and the round carried in the gathered metadata is checked again;
- contributions are weighted by the tokens each peer trained on in the round;
- a broken or hostile groupmate cannot poison the average: its metadata is checked and its claims capped
  (:mod:`p2p_diloco.swarm.averaging.guard`), reducers combine parts robustly
  (:mod:`p2p_diloco.swarm.averaging.robust`), averages returned by reducers are checked; offenders are reported with
  each round, and banned after repeat offences; with ``averaging.allowlist``, only members of a private swarm are
  grouped with and exchange state;
- the result is bit-identical on every groupmate (:mod:`p2p_diloco.swarm.averaging.allreduce`), and members compare
  the digests of what each reducer sent them before using it (:mod:`p2p_diloco.swarm.averaging.digests`);
- pseudo-gradients are compressed under a plan the group agrees on from its gathered metadata
  (:mod:`p2p_diloco.compression.policy`), low-rank ones in two phases (:mod:`p2p_diloco.swarm.averaging.reduce`), all in
  the background process; the round returns this peer's error-feedback residual with the average;
- a round is started with :meth:`start_round` and collected with :meth:`finish_round`, which never raises
  for network reasons: a round that fails, times out or finds nobody returns ``None`` and the caller
  falls back to its own pseudo-gradient.

At most one round is in flight per averager (its shared buffers hold one round's contribution).
Called by :class:`p2p_diloco.round.stage.Stage`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import signal
import time
import typing
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from p2p_diloco.compression.codecs import CODECS
from p2p_diloco.compression.policy import CompressionPolicy
from p2p_diloco.config import AveragingConfig
from p2p_diloco.faults import HONEST, Honest, fault_point
from p2p_diloco.process import die_with_parent, leave_signals_to_parent, lower_priority, ready_or_killed
from p2p_diloco.round.outcome import RoundOutcome
from p2p_diloco.swarm.averaging.allreduce import BYTES_RECEIVED, BYTES_SENT, ExactAllReduceRunner, ServedAverages
from p2p_diloco.swarm.averaging.digests import exchange_digests, judge
from p2p_diloco.swarm.averaging.guard import MAX_CATCH_UP, GroupView, GuardedAverager, PeerGuard, read_group
from p2p_diloco.swarm.averaging.hivemind_api import (
    AllreduceException,
    AveragingStage,
    CompressionInfo,
    DecentralizedAverager,
    MatchmakingException,
    MPFuture,
    P2PContext,
    PeerID,
    PerTensorCompression,
    averaging_pb2,
    cancel_step,
    enter_asynchronously,
    groups_registered,
    load_balance_peers,
    matchmaking_of,
    outer_pipe,
    p2p_of,
    running_groups,
)
from p2p_diloco.swarm.averaging.reduce import RoundReducer
from p2p_diloco.swarm.averaging.robust import RobustRule, average_bound
from p2p_diloco.swarm.discovery.records import record_owner
from p2p_diloco.swarm.errors import SwarmError

logger = logging.getLogger(__name__)

MAX_STATE_METADATA_BYTES = 1 << 16  # an honest donor's metadata is a few hundred bytes
ROUND_BITS = 16  # rounds are told apart modulo 2**16 by the group key, exactly by the gathered metadata
PHASES = (b"", b".P", b".Q")  # group id suffixes of a round's all-reduces (whole tensors; low-rank P; low-rank Q)
# the step (hivemind's StepControl) that the running task of the averager's background process serves: each step
# runs in its own task, so the all-reduce of that step can see its cancel (see _unless_cancelled)
_STEP: contextvars.ContextVar = contextvars.ContextVar("p2p_diloco_step", default=None)
SERVED_ALLREDUCES = 8  # the last all-reduces whose averages (this peer's slice) are kept for groupmates to ask again
AVERAGER_START_TIMEOUT_S = 60.0  # its process needs only the local p2p daemon: over a minute means a stuck machine


class _StepCancelled(AllreduceException):
    """The all-reduce was left because this peer cancelled the round's step."""


def _was_signalled(wait: asyncio.Future) -> bool:
    """Whether a step's ``wait_for_cancel()`` ended because the step was cancelled (its signal is set only then)."""
    return wait.done() and not wait.cancelled() and wait.exception() is None


def decode_state_tensor(header, buffer: bytes, shape: tuple) -> torch.Tensor:
    """One tensor of a downloaded state: fp32, uncompressed (what hivemind's state sharing sends by default), of
    exactly ``shape``; anything else is a ValueError, raised before any allocation from the message's claims."""
    if header.compression != 0 or header.dtype != "float32" or tuple(header.size) != tuple(shape) \
            or len(buffer) != 4 * math.prod(shape):
        raise ValueError(f"a state tensor is not fp32 of shape {list(shape)} (compression {header.compression}, "
                         f"dtype {header.dtype[:32]!r}, size {list(header.size)[:8]}, {len(buffer)} bytes)")
    return torch.frombuffer(bytearray(buffer), dtype=torch.float32).reshape(shape)


def group_prefix(run_id: str, stage_index: int, num_stages: int) -> str:
    """DHT prefix shared by stage ``stage_index`` of every peer of a run with ``num_stages`` stages."""
    return f"{run_id}_s{stage_index}of{num_stages}"


def fragment_prefix(run_id: str, fragment: int, num_fragments: int) -> str:
    """DHT prefix shared by fragment ``fragment`` of F (model/fragments.py) on every peer, whatever its split."""
    return f"{run_id}_f{fragment}of{num_fragments}"


def round_bits(round_index: int) -> str:
    return format(round_index % (1 << ROUND_BITS), f"0{ROUND_BITS}b")


@dataclass
class _PendingRound:
    round_index: int
    control: object  # hivemind StepControl
    started_at: float
    traffic_at_start: tuple[int, int]
    timeout_s: float  # of matchmaking, retries included (the all-reduce has its own bound)


class PseudoGradientAverager(GuardedAverager, DecentralizedAverager):
    """Averages pseudo-gradients of one pipeline stage across peers.

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
        behaviour: :data:`~p2p_diloco.faults.HONEST`, or a :class:`~p2p_diloco.faults.Hostility` that tests and
            benchmarks give a hostile peer.
    """

    # hivemind caches a servicer's handlers and stub type on the class, and a subclass inherits the cache when its
    # base was collected first: ours are collected on their own (rpc_fetch_averages is ours alone)
    _rpc_handlers = None
    _stub_type = None
    _workers_niced = False  # in the background process: its executor's threads run at a lower priority (_step)

    def __init__(self, templates: Sequence[torch.Tensor], dht, *, run_id: str, stage_index: int, num_stages: int,
                 cfg: AveragingConfig, behaviour: Honest = HONEST, fragment: Optional[tuple[int, int]] = None):
        self.cfg = cfg
        prefix = fragment_prefix(run_id, *fragment) if fragment is not None else \
            group_prefix(run_id, stage_index, num_stages)
        self.traffic = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._pending: Optional[_PendingRound] = None
        self._abandoned: Optional[_PendingRound] = None  # left to finish in the background, its result unread
        self._last_control = None  # the step of the last round started, until the background has ended it
        # the round whose contribution the buffers hold; a late average of an abandoned round never lands there
        self._buffered_round = torch.full((1,), -1, dtype=torch.int64).share_memory_()
        buffers = [torch.zeros(t.shape, dtype=torch.float32) for t in templates]
        self._residuals = [torch.zeros_like(b).share_memory_() for b in buffers]
        self.policy = CompressionPolicy([tuple(t.shape) for t in templates], cfg)
        self._reducer = RoundReducer(self.policy, seed=prefix)
        self.proposal = self.policy.initial_proposal()
        self.bandwidth_mbit = cfg.assumed_bandwidth_mbit
        self.last_error: Optional[float] = None
        self.state_provider = None  # () -> (metadata, tensors): what this stage serves to newcomers
        self.guard = PeerGuard(cfg.ban_after, cfg.allowlist)  # its state lives in the background process
        self.rule = RobustRule(outlier_ratio=cfg.outlier_norm_ratio, clip_ratio=cfg.clip_ratio)
        self.behaviour = behaviour
        try:  # the subkey this peer's DHT node signs its entries under: the group's digest records (digests.py)
            self._digests_owner: Optional[bytes] = record_owner(dht)
        except SwarmError:  # a node started outside start_dht (tests) signs nothing: no digest comparison
            self._digests_owner = None
        if behaviour is not HONEST:
            logger.warning(f"This peer is hostile to its groupmates ({behaviour}): a test hook")
        super().__init__(
            buffers,
            dht,
            start=False,  # started below, with a bound: hivemind waits for its process to be ready without one
            prefix=prefix,
            initial_group_bits=round_bits(0),
            target_group_size=cfg.target_group_size,
            min_group_size=cfg.min_group_size,
            min_matchmaking_time=cfg.matchmaking_time_s,
            request_timeout=cfg.request_timeout_s,
            allreduce_timeout=cfg.allreduce_timeout_s + 5,  # ours, in _aggregate_with_group, expires first
            next_chunk_timeout=cfg.next_chunk_timeout_s,
            declare_state_period=10,
            shutdown_timeout=5,
        )
        self._start_bounded(AVERAGER_START_TIMEOUT_S)

    def _start_bounded(self, timeout_s: float) -> None:
        """Start the background process and wait until it serves, at most ``timeout_s`` (it only needs the local p2p
        daemon, so a longer wait means a stuck machine): then kill it and raise :class:`SwarmError`."""
        self.run_in_background(await_ready=False)
        if not ready_or_killed(self, self.wait_until_ready, timeout_s):
            raise SwarmError(f"the averager's process was not ready within {timeout_s:.0f} s")

    # ---- runs in the averager's background process -------------------------------------------------
    def run(self) -> None:
        die_with_parent(signal.SIGKILL)  # a peer killed with SIGKILL leaves no averager behind
        leave_signals_to_parent()  # a signal to the whole group is for the training process to handle
        super().run()

    async def _step(self, **kwargs):
        """hivemind's step, with the event loop's work of compression and reduction (all of it in the loop's default
        executor) on threads at a lower CPU priority than training, so that averaging in the background does not
        slow the inner steps down; the loop itself keeps training's priority, as it answers the swarm's
        matchmaking and all-reduce messages (at a lower priority, on a busy machine, a leader answered a join
        request too late for the follower to wait, and groups formed without members that had joined them)."""
        if not self._workers_niced:
            self._workers_niced = True
            asyncio.get_event_loop().set_default_executor(
                ThreadPoolExecutor(thread_name_prefix="averaging", initializer=lower_priority))
        _STEP.set(kwargs.get("step"))
        return await super()._step(**kwargs)

    @staticmethod
    async def _unless_cancelled(work: typing.Awaitable, round_index: int):
        """``work`` (the all-reduce of this task's step), ended at once if the training process cancels the step.

        hivemind sees a cancel only while a step is matching: a step cancelled just as its group forms (its round
        found hopeless a moment before) runs its all-reduce to the end or to the timeout, and the next round's step
        waits for it (a restarted peer's next averaging then starts seconds late, off the swarm's anchor)."""
        step = _STEP.get()
        work = asyncio.ensure_future(work)
        if step is None:
            return await work
        cancelled = asyncio.ensure_future(step.wait_for_cancel())
        try:
            await asyncio.wait({work, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this task was cancelled (hivemind's own all-reduce timeout)
            work.cancel()
            raise
        finally:
            cancelled.cancel()
        # the cancel's own signal decides, not step.cancelled(): StepControl.cancel() sends the signal before it
        # marks the step cancelled, and a training process descheduled between the two (a busy machine) would leave
        # the all-reduce running to its timeout
        if work.done() or not _was_signalled(cancelled):
            return await work
        work.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await work  # its own clean-up (streams, the reducer's state) runs before this step ends
        for _ in range(100):  # until the step reads as cancelled (at most 1 s): then hivemind's step loop ends it
            if step.cancelled():  # rather than looking for a group again
                break
            await asyncio.sleep(0.01)
        raise _StepCancelled(f"round {round_index}'s averaging step was cancelled by this peer")

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info):
        """A round runs up to three all-reduces in its group; register them all (as hivemind's PowerSGD does)."""
        try:
            for phase in PHASES:
                running_groups(self)[group_info.group_id + phase] = asyncio.Future()
            groups_registered(self).set()
            yield
        finally:
            for phase in PHASES:
                running_groups(self).pop(group_info.group_id + phase, None)
            groups_registered(self).set()

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        """Agree on the round's plan, average under it, and leave the average and the residual in shared memory.
        ``group_info.group_id`` is the group's view id (:class:`~p2p_diloco.swarm.averaging.guard.GroupViews`)."""
        try:
            origin = self.group_views.origin(group_info.group_id)
            view = read_group(group_info, self.serializer, self.peer_id, self.guard, self.cfg.max_weight_ratio, origin)
            my_round = view.round_index
            plan = self.policy.agree(list(view.infos.values()))
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, self.total_size, view.bandwidths, min_vector_size)
            kwargs.pop("compression", None), kwargs.pop("tensor_infos", None)

            digests: dict = {}  # phase -> reducer -> digest of the slice this peer got from it

            async def allreduce(tensors, codecs, phase):
                tensors = self.behaviour.outgoing(tensors)
                averaged, digests[phase.decode() or "-"] = await self._allreduce_phase(
                    tensors, codecs, group_info, group_info.group_id + phase, view, peer_fractions=fractions, **kwargs)
                return averaged

            fault_point("allreduce-group-formed")  # test hooks: unset, a dictionary lookup and a no-op
            await self.behaviour.join_allreduce()
            received_before, started = int(self.traffic[BYTES_RECEIVED]), time.monotonic()
            async with enter_asynchronously(self.get_tensors()) as buffers:
                if int(self._buffered_round[0]) != my_round:
                    raise AllreduceException(f"round {my_round} was abandoned by this peer")
                # bounded here rather than by hivemind's timeout, whose expiry is not retried: a group whose
                # all-reduce stalls (a member stopped sending) re-forms and averages again within the round's budget
                outcome = await self._unless_cancelled(asyncio.wait_for(
                    self._reducer.reduce([b.clone() for b in buffers], plan, my_round, allreduce),
                    timeout=self.cfg.allreduce_timeout_s), my_round)
                await self._compare_digests(group_info.group_id, view, digests)
                for buffer, residual, average, error in zip(buffers, self._residuals, outcome.averaged,
                                                            outcome.residuals):
                    buffer.copy_(average)
                    residual.copy_(error)
            received = int(self.traffic[BYTES_RECEIVED]) - received_before
            # a throughput sample only when the payload amortizes the latency and the waits of the group
            measured = received * 8 / 1e6 / max(time.monotonic() - started, 1e-3) if received >= 2**20 else None
            proposal = self.policy.next_proposal(plan, outcome.q_avgs, my_round)
            stats = dict(outcome.stats, bandwidth_mbit=measured)
            return {"gathered": view.infos, "tokens": view.tokens, "stats": stats, "next": proposal}
        except BaseException as e:
            if isinstance(e, _StepCancelled):
                logger.info(f"Left the all-reduce of a group of {len(group_info.peer_ids)}: this peer cancelled the "
                            "round's averaging step")
            elif isinstance(e, Exception):  # hivemind retries the round's matchmaking (within its budget) after this
                logger.warning(f"The all-reduce of a group of {len(group_info.peer_ids)} failed ({e!r}); looking for "
                               "the round's group again")
                logger.debug("The all-reduce's failure", exc_info=True)
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e
        finally:
            self._leave_group(group_info.group_id)

    async def _allreduce_phase(self, tensors, codecs, group_info, group_id, view: GroupView,
                               **kwargs) -> tuple[list[torch.Tensor], dict[str, str]]:
        """One exact, robust all-reduce of ``tensors`` (codec ``codecs[i]`` for tensor i) in the round's group; the
        averages, and a digest of the slice this peer got from each reducer."""
        # an honest average is within robust.average_bound times this peer's part (its own claim is the one it
        # sent); beyond it the average is refused and the reducer left out of the round's retry. Beyond outlier_ratio
        # x the median part (scaled by catch_up, capped: see GroupView.catch_up), with a factor 2 to spare, no honest
        # reducer goes at all (larger parts are left out): an offence
        members, offence_bound = list(view.weights), 2 * self.rule.outlier_ratio * view.catch_up
        plausible = average_bound([view.weights[p] for p in members],
                                  [float(view.infos[p]["tokens"]) for p in members], members.index(self.peer_id),
                                  self.rule, MAX_CATCH_UP)
        runner = ExactAllReduceRunner(
            traffic=self.traffic, weights=view.weights, rule=self.rule, average_bound=offence_bound,
            plausible_bound=min(plausible, offence_bound),
            claims={peer_id: float(info["tokens"]) for peer_id, info in view.infos.items()},
            behaviour=self.behaviour, p2p=p2p_of(self), servicer_type=type(self), prefix=self.prefix, tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, modes=view.modes,
            compression=PerTensorCompression([CODECS[c] for c in codecs]),
            tensor_infos=[CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)], **kwargs,
        )
        assert group_id in running_groups(self), f"group {group_id} was not registered"
        self._keep_served(group_id, runner.served)
        running_groups(self)[group_id].set_result(runner)
        try:
            averaged = [average async for average in runner]
        finally:
            for peer_id, reason in runner.flags:
                self.guard.record(view.round_index, peer_id, reason)
            for peer_id in runner.silent + runner.implausible:
                self.guard.leave_out(view.round_index, peer_id)
            for peer_id in runner.absent:
                self.guard.absent(view.round_index, peer_id)
            if runner.refused_by:
                # groupmates read the group's records differently: what the leader relayed differed between them
                # (or one of them has left the group). Not proof (see guard.py), but the round's retry does
                # without this leader: one that forged other members' records failed every retry of the round
                leader = self.group_views.origin(group_info.group_id).leader
                if leader != self.peer_id:
                    self.guard.leave_out(view.round_index, leader)
        failed = runner.tensor_part_container.failed_size
        if failed:
            # some reducer vanished: part of the result is our own values, so the round is not an average
            raise AllreduceException(f"{failed} of {runner.tensor_part_container.total_size} values were not averaged")
        return averaged, runner.slice_digests()

    async def _compare_digests(self, view_id: bytes, view: GroupView, digests: dict) -> None:
        """Publish the digests of the slices this peer got, read its groupmates' (at most one request timeout), and
        raise AllreduceException, naming the reducer, if one sent this peer other bytes than the group's (see
        :mod:`~p2p_diloco.swarm.averaging.digests`)."""
        if self._digests_owner is None:
            return
        me, members = self.peer_id.to_base58(), {peer_id.to_base58(): peer_id for peer_id in view.infos}
        claims = await exchange_digests(self.dht, f"{self.prefix}.digests.{view_id.hex()}", self._digests_owner, me,
                                        digests, members, self.cfg.request_timeout_s)
        verdict = judge(me, digests, claims)
        for reducer, reason in verdict:
            self.guard.record(view.round_index, members[reducer], reason)
        if verdict:
            raise AllreduceException(f"reducers sent this peer other averages than the group's: {verdict}")

    def _round_averaged(self) -> Optional[int]:
        round_index = int(self._buffered_round[0])
        return None if round_index < 0 else round_index

    def _keep_served(self, allreduce_id: bytes, served: ServedAverages) -> None:
        """Keep the averages of an all-reduce this peer reduces a slice of, for its last :data:`SERVED_ALLREDUCES`
        all-reduces (a round runs one to two; each holds one slice of the round's compressed averages)."""
        kept = vars(self).setdefault("_served", OrderedDict())
        kept[allreduce_id] = served
        while len(kept) > SERVED_ALLREDUCES:
            kept.popitem(last=False)

    async def rpc_fetch_averages(self, request: averaging_pb2.AveragingData,
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """The averages of this peer's slice in the all-reduce ``request.group_id``, again: for a groupmate whose
        stream of them broke. The same bytes every groupmate got, each as soon as it is computed, to the peers that
        all-reduce averaged only (anyone else gets BAD_GROUP_ID)."""
        served = vars(self).get("_served", {}).get(request.group_id)
        if served is None or context.remote_id not in served.senders:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for serialized in served.iterate(timeout_s=2 * self.cfg.next_chunk_timeout_s):
            reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
            self.traffic[BYTES_SENT] += reply.ByteSize()
            yield reply

    async def _set_target_group_size(self, size: Optional[int], future) -> None:
        matchmaking_of(self).target_group_size = size
        matchmaking_of(self).potential_leaders.target_group_size = size
        future.set_result(None)

    async def _report_flags(self, round_index: int, future) -> None:
        future.set_result(self.guard.report(round_index))

    # ---- called from the training process -----------------------------------------------------------
    def set_expected_group_size(self, size: Optional[int]) -> None:
        """Assemble the group as soon as ``size`` peers joined (the live peers of this stage), else wait. A set
        ``averaging.target_group_size`` caps it (groups of k in a larger swarm, as hivemind's own target)."""
        target = self.cfg.target_group_size
        size = target if size is None or size < 2 else size if target is None else min(size, target)
        future = MPFuture()
        outer_pipe(self).send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result(timeout=10)

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
        contribution, claimed_round, weight = self.behaviour.claim(list(contribution), round_index, weight)
        with self.get_tensors() as buffers:
            for buffer, tensor in zip(buffers, contribution):
                buffer.copy_(tensor.detach().to(dtype=torch.float32, device="cpu"))
            self._buffered_round[0] = round_index
        self.set_group_bits(round_bits(round_index))
        metadata = dict(round=claimed_round, tokens=float(weight), compute_s=float(compute_s),
                        bandwidth_mbit=float(self.bandwidth_mbit), compression=self.proposal,
                        last_error=self.last_error)
        timeout = max(self.cfg.round_timeout_s, float(budget_s))
        control = self.step(
            gather=self.behaviour.gather(metadata),
            weight=float(weight),
            timeout=timeout,
            allow_retries=True,
            wait=False,
        )
        traffic = (int(self.traffic[BYTES_SENT]), int(self.traffic[BYTES_RECEIVED]))
        self._pending = _PendingRound(round_index, control, time.monotonic(), traffic, timeout)
        self._last_control = control

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
                     hopeless: Optional[Callable[[int], bool]] = None) -> RoundOutcome:
        """Wait for the round in flight and return it: at most ``timeout`` s, by default what is left of the
        round's own bounds (matchmaking + all-reduce timeouts, counted from its start).

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
            outcome = pending.control.result(timeout=max(0.0, deadline - time.monotonic()))
            gathered = outcome["gathered"]
            rounds = {info["round"] for info in gathered.values()}
            if rounds != {pending.round_index}:
                raise AllreduceException(f"groupmates reported rounds {sorted(rounds)}")
            with self.get_tensors() as buffers:
                found["average"], found["averaged"] = [buffer.clone() for buffer in buffers], True
                found["residual"] = [residual.clone() for residual in self._residuals]
            found["compression"] = outcome["stats"]
            self.proposal = outcome["next"]
            self.last_error = outcome["stats"].get("compression_error")
            if outcome["stats"].get("bandwidth_mbit"):  # an average of the recent samples, with little lag
                self.bandwidth_mbit = 0.5 * self.bandwidth_mbit + 0.5 * float(outcome["stats"]["bandwidth_mbit"])
            found["group_size"] = len(gathered)
            found["group_tokens"] = float(outcome["tokens"])  # claims capped as in the average
            found["group_peers"] = tuple(sorted(str(peer_id) for peer_id in gathered))
        except Exception as e:  # network failures of every kind end in a fallback, never in a crash
            cancel_step(pending.control)
            found = {"fallback_reason": f"{type(e).__name__}: {e}" if str(e) else type(e).__name__}
        suspects, banned = self._flags_of(pending.round_index)
        return RoundOutcome(**found, suspects=suspects, banned=tuple(banned),
                            averaging_s=time.monotonic() - pending.started_at,
                            bytes_sent=int(self.traffic[BYTES_SENT]) - pending.traffic_at_start[0],
                            bytes_received=int(self.traffic[BYTES_RECEIVED]) - pending.traffic_at_start[1])

    def _flags_of(self, round_index: int) -> tuple[dict, list]:
        """The groupmates flagged in a round and the peers banned so far, from the background process."""
        future = MPFuture()
        try:
            outer_pipe(self).send(("_report_flags", [], dict(round_index=round_index, future=future)))
            report = future.result(timeout=10)
            return report["suspects"], report["banned"]
        except Exception as e:  # the report is for metrics only: never fail a round over it
            logger.warning(f"Could not read the groupmates flagged in round {round_index}: {e!r}")
            return {}, []

    # ---- state sharing (hivemind's rpc_download_state, served and asked for) ------------------------------
    def get_current_state(self):
        """Runs in a background thread of the training process when a peer downloads this stage's state."""
        if self.state_provider is None:
            return {}, [], None
        metadata, tensors = self.state_provider()
        return metadata, tensors, None

    def download_state(self, donors: Sequence[str], timeout_s: float):
        """(metadata, tensors) of this stage from the first of ``donors`` (DHT peer ids, in the order to ask them)
        that serves a well-formed state, or None; never longer than ``timeout_s`` in all.

        The caller chooses the donors (from the swarm's signed records: see ``training.sync``), not the priority each
        averager declares for itself in hivemind's unsigned ``all_averagers`` key. What a donor sends is bounded
        as it arrives: one metadata message of at most :data:`MAX_STATE_METADATA_BYTES`, at most one tensor per
        template twice over (anchor and momentum), each fp32 of exactly its template's shape; a donor that sends
        more, or another layout, or too slowly for what is left of the bound, is dropped for the next one."""
        future = MPFuture()
        outer_pipe(self).send(("_download_from", [], dict(donors=[str(d) for d in donors], timeout_s=timeout_s,
                                                          future=future)))
        try:
            return future.result(timeout=timeout_s + 5)
        except Exception as e:  # every network failure ends in "no state", never in a crash
            logger.warning(f"State download failed: {e!r}")
            return None

    async def _download_from(self, donors: list[str], timeout_s: float, future) -> None:
        """In the background process: :meth:`download_state`."""
        deadline = time.monotonic() + timeout_s
        try:
            for index, donor in enumerate(donors):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                peer_id = PeerID.from_base58(donor)
                if peer_id == self.peer_id or self.guard.refuses(peer_id) is not None:
                    continue
                # a donor that trickles its bytes gets a share of the bound, not all of it (the next donors are left
                # the rest); hivemind's per-message timeout alone let one slow donor hold a download forever
                share = remaining if index == len(donors) - 1 else remaining * 0.6
                try:
                    state = await asyncio.wait_for(self._download_one(peer_id), timeout=share)
                except Exception as e:
                    logger.warning(f"State download from {donor} failed: {type(e).__name__}: {e}")
                    continue
                if state is not None:
                    logger.info(f"Downloaded this stage's state from {donor}")
                    future.set_result(state)
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_one(self, peer_id):
        """One donor's state, checked for size and layout as it arrives (see :meth:`download_state`)."""
        shapes = [tuple(t.shape) for t in self._residuals] * 2  # anchor, then momentum
        stub = self.get_stub(p2p_of(self), peer_id, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, tensors, header, chunks, size = None, [], None, [], 0

        def finish_tensor() -> None:
            tensors.append(decode_state_tensor(header, b"".join(chunks), shapes[len(tensors)]))

        async for message in stream:
            if message.metadata:
                if metadata is not None or len(message.metadata) > MAX_STATE_METADATA_BYTES:
                    raise ValueError("the donor sent more than one metadata message, or one too large")
                metadata = self.serializer.loads(message.metadata)
            part = message.tensor_part
            if part.dtype:  # the first chunk of a tensor names its dtype (hivemind's split_for_streaming)
                if header is not None:
                    finish_tensor()
                if len(tensors) >= len(shapes):
                    raise ValueError(f"the donor sent more than the {len(shapes)} tensors of this stage's state")
                header, chunks, size = part, [], 0
            elif header is None and part.buffer:
                raise ValueError("the donor sent tensor bytes before naming a tensor")
            size += len(part.buffer)
            if header is not None and size > 4 * math.prod(shapes[len(tensors)]):
                raise ValueError(f"the donor's tensor {len(tensors)} is larger than its shape "
                                 f"{list(shapes[len(tensors)])}")
            chunks.append(part.buffer)
        if header is not None:
            if size < 4 * math.prod(shapes[len(tensors)]):  # the donor left (or stopped) inside a tensor
                raise ValueError(f"the donor's stream ended inside tensor {len(tensors)} ({size} of "
                                 f"{4 * math.prod(shapes[len(tensors)])} bytes)")
            finish_tensor()
        if not isinstance(metadata, dict):
            logger.debug(f"Peer {peer_id} did not send its state")
            return None
        return metadata, tensors

    @property
    def compresses(self) -> bool:
        """Whether what is sent differs from the contribution (then the stage keeps error feedback)."""
        return self.cfg.compression != "none"

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

    def finished_average(self) -> Optional[list[torch.Tensor]]:
        """The average of the round in flight if it has already arrived (without collecting it), else None."""
        pending = self._pending
        if pending is None or not pending.control.done() or pending.control.exception() is not None:
            return None
        with self.get_tensors() as buffers:
            return [buffer.clone() for buffer in buffers]

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
            self._buffered_round[0] = -1  # no lock: a reduce already under way may finish, unread
            cancel_step(self._pending.control)
            self._pending = None

