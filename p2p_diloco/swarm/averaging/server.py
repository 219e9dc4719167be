"""The averager's server: what runs in its background process (hivemind's ``DecentralizedAverager``).

:class:`AveragingServer` finds the round's group through the DHT and averages one stage's (or fragment's)
pseudo-gradients with it over libp2p, answering other peers as it goes:

- the group key is ``<prefix>.0b<round bits>``: peers of another run, stage split or round never land in the same
  group, and the round carried in the gathered metadata is checked again (:func:`~p2p_diloco.swarm.averaging.guard.
  read_group`, which also caps the tokens each member claims and drops what a broken or hostile member sent);
- the group agrees on the round's compression plan from its gathered metadata (:mod:`p2p_diloco.compression.policy`)
  and averages under it, low-rank in two phases (:mod:`p2p_diloco.swarm.averaging.reduce`), each phase an exact,
  robust all-reduce (:mod:`p2p_diloco.swarm.averaging.allreduce`) whose result is bit-identical on every member;
  members compare the digests of what each reducer sent them before using it
  (:mod:`p2p_diloco.swarm.averaging.digests`);
- the average and this peer's error-feedback residual are left in shared memory for the client;
- downloads of a stage's state run here too (:mod:`p2p_diloco.swarm.averaging.download`);
- what it answers to other peers is guarded: join requests from banned peers and outsiders, or with a record over the
  size cap, are refused; a group relayed with oversized records is refused; banned peers and outsiders are never
  followed as leaders; hivemind gets each group under its view id
  (:class:`~p2p_diloco.swarm.averaging.guard.GroupViews`), so parts sent under another view of a group, or for a
  group this peer has left, are refused at once; the averages of its slice are served again to the groupmates of
  that all-reduce only; and no state is served to outsiders (at most a bounded number of streams at a time:
  :class:`~p2p_diloco.swarm.averaging.limits.StateGate`). What it decides with is the plain logic of
  :mod:`~p2p_diloco.swarm.averaging.guard`; the matchmaking swaps it installs are the adapter's
  (:mod:`p2p_diloco.hivemind_adapter.averaging`).

One class, in one file: hivemind registers a servicer's ``rpc_*`` handlers from its class, so what the averager
answers to other peers lives on it with the round it runs.

The training process talks to it only through :class:`p2p_diloco.swarm.averaging.averager.PseudoGradientAverager`,
the client: the shared buffers (:attr:`residuals`, :attr:`traffic`, :attr:`buffered_round`, hivemind's
``get_tensors``), hivemind's ``step`` and ``set_group_bits``, and its typed calls (:meth:`set_target_group_size`,
:meth:`report_flags`, :meth:`download_from`; what crosses: :mod:`~p2p_diloco.swarm.averaging.boundary`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
import time
import typing
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Optional

import torch

from p2p_diloco.compression.codecs import codec_for, result_codec
from p2p_diloco.compression.policy import CompressionPolicy
from p2p_diloco.config import AveragingConfig
from p2p_diloco.faults import fault_point
from p2p_diloco.hivemind_adapter.averaging import (
    AllreduceException,
    CompressionInfo,
    DecentralizedAverager,
    MatchmakingException,
    MPFuture,
    P2PContext,
    PerTensorCompression,
    achain,
    as_aiter,
    averaging_pb2,
    cancel_signalled,
    enter_asynchronously,
    groups_registered,
    keep_round_key,
    load_balance_peers,
    matchmaking_of,
    outer_pipe,
    p2p_of,
    quiet_if_cancelled,
    replace_group_assembly,
    running_groups,
    set_data_for_gather,
    wrap_join_request,
)
from p2p_diloco.monitoring.memtrace import MemoryTrace
from p2p_diloco.process import (
    die_with_parent,
    freeze_before_fork,
    leave_signals_to_parent,
    lower_priority,
    name_process,
    ready_or_killed,
    release_free_memory,
)
from p2p_diloco.swarm.averaging.allreduce import BYTES_RECEIVED, BYTES_SENT, ExactAllReduceRunner
from p2p_diloco.swarm.averaging.boundary import Flags, GroupResult, OwnRecord, RoundClaim
from p2p_diloco.swarm.averaging.digests import exchange_digests, judge
from p2p_diloco.swarm.averaging.download import download_from
from p2p_diloco.swarm.averaging.gathered import MAX_GATHERED_BYTES, join_refusal, relayed_group_refusal
from p2p_diloco.swarm.averaging.guard import (
    MAX_CATCH_UP,
    NOT_IN_GROUP,
    OVERSIZED,
    GroupView,
    GroupViews,
    PeerGuard,
    read_group,
)
from p2p_diloco.swarm.averaging.limits import StateGate
from p2p_diloco.swarm.averaging.reduce import RoundReducer
from p2p_diloco.swarm.averaging.robust import RobustRule, average_bound
from p2p_diloco.swarm.averaging.slices import ServedAverages
from p2p_diloco.swarm.averaging.state_host import StateHost
from p2p_diloco.swarm.discovery.records import record_owner
from p2p_diloco.swarm.errors import SwarmError

logger = logging.getLogger(__name__)

PHASES = (b"", b".P", b".Q")  # group id suffixes of a round's all-reduces (whole tensors; low-rank P; low-rank Q)
# the step (hivemind's StepControl) this task serves: each step runs in its own task (its cancel: _unless_cancelled)
_STEP: contextvars.ContextVar = contextvars.ContextVar("p2p_diloco_step", default=None)
# when this task's step began (time.monotonic()): its matchmaking time is from there to its group's formation
_STEP_STARTED: contextvars.ContextVar = contextvars.ContextVar("p2p_diloco_step_started", default=None)
AVERAGER_START_TIMEOUT_S = 60.0  # its process needs only the local p2p daemon: over a minute means a stuck machine
REGISTERED_POLL_S = 0.1
SERVED_ALLREDUCES = 8  # the last all-reduces whose averages (this peer's slice) are kept for groupmates to ask again


class _StepCancelled(AllreduceException):
    """The all-reduce was left because this peer cancelled the round's step."""


class AveragingServer(DecentralizedAverager):
    """Averages the pseudo-gradients of one stage (or fragment) with the same unit of other peers.

    Args:
        templates: tensors with the shapes of the unit's parameters (values are not used).
        dht: a running hivemind DHT.
        prefix: the unit's group key prefix (:meth:`~p2p_diloco.unit.Unit.group_prefix`; several units on one DHT
            each have their own, and their own RPC namespace).
        initial_group_bits: the group key's round bits of round 0.
        cfg: the ``[averaging]`` section.

    Seams for tests (``tests/hostile`` subclasses them to lie to groupmates): :attr:`runner_type`, the all-reduce each
    phase runs; :meth:`_record`, the record this peer gathers into a round's group; :meth:`_allreduce_phase`, which
    gets the tensors this peer sends; :meth:`_aggregate_with_group`, what it does with a group formed;
    :meth:`get_current_state`, the state it serves; ``rpc_join_group``, the group it relays as a leader; and
    :meth:`_refuses_leader` and :meth:`_takes_group`, whom it follows.
    """

    # hivemind caches a servicer's handlers and stub type on the class, and a subclass inherits the cache when its
    # base was collected first: ours are collected on their own (rpc_fetch_averages is ours alone)
    _rpc_handlers = None
    _stub_type = None
    _workers_niced = False  # in the background process: its executor's threads run at a lower priority (_step)
    runner_type: typing.Callable[..., ExactAllReduceRunner] = ExactAllReduceRunner  # each phase's all-reduce

    def __init__(self, templates: Sequence[torch.Tensor], dht, *, prefix: str, initial_group_bits: str,
                 cfg: AveragingConfig):
        self.cfg = cfg
        self.traffic = torch.zeros(2, dtype=torch.int64).share_memory_()
        # the round whose contribution the buffers hold; a late average of an abandoned round never lands there
        self.buffered_round = torch.full((1,), -1, dtype=torch.int64).share_memory_()
        buffers = [torch.zeros(t.shape, dtype=torch.float32) for t in templates]
        self.residuals = [torch.zeros_like(b).share_memory_() for b in buffers]
        self.policy = CompressionPolicy([tuple(t.shape) for t in templates], cfg)
        # what this peer's records add to the training process's claims, from round to round (background process)
        self.own = OwnRecord(self.policy.initial_proposal(), cfg.assumed_bandwidth_mbit)
        self._reducer = RoundReducer(self.policy, seed=prefix)
        self.state_provider = None  # () -> (metadata, tensors): what this unit serves to newcomers
        self.guard = PeerGuard(cfg.ban_after, cfg.allowlist)  # its state lives in the background process
        self.rule = RobustRule(outlier_ratio=cfg.outlier_norm_ratio, clip_ratio=cfg.clip_ratio)
        self._memtrace = MemoryTrace(f"averager {prefix}")  # off unless P2P_DILOCO_MEMTRACE is set (a diagnostic)
        try:  # the subkey this peer's DHT node signs its entries under: the group's digest records (digests.py)
            self._digests_owner: Optional[bytes] = record_owner(dht)
        except SwarmError:  # a node started outside start_dht (tests) signs nothing: no digest comparison
            self._digests_owner = None
        super().__init__(
            buffers,
            dht,
            start=False,  # started below, with a bound: hivemind waits for its process to be ready without one
            prefix=prefix,
            initial_group_bits=initial_group_bits,
            target_group_size=cfg.target_group_size,
            min_group_size=cfg.min_group_size,
            min_matchmaking_time=cfg.matchmaking_time_s,
            request_timeout=cfg.request_timeout_s,
            allreduce_timeout=cfg.allreduce_timeout_s + 5,  # ours, in _aggregate_with_group, expires first
            next_chunk_timeout=cfg.next_chunk_timeout_s,
            declare_state_period=10,
            shutdown_timeout=5,
        )
        self.state_host = StateHost(self.get_current_state, self.serializer)  # for rpc_download_state
        self._start_bounded(AVERAGER_START_TIMEOUT_S)

    # ---- called from the training process (by the client) ------------------------------------------
    def set_target_group_size(self, size: Optional[int], within_s: float) -> None:
        """Assemble the round's group as soon as ``size`` peers joined (None: wait out the matchmaking time)."""
        self._ask(self._set_target_group_size, within_s, size=size)

    def report_flags(self, round_index: int, within_s: float) -> Flags:
        """The groupmates flagged in ``round_index`` and the peers banned so far (:meth:`PeerGuard.report`)."""
        return self._ask(self._report_flags, within_s, round_index=round_index)

    def download_from(self, donors: list[str], timeout_s: float):
        """(metadata, tensors) from the first of ``donors`` that serves a well-formed state, or None:
        :func:`~p2p_diloco.swarm.averaging.download.download_from`, never longer than ``timeout_s``."""
        return self._ask(self._download_from, timeout_s + 5, donors=donors, timeout_s=timeout_s)

    def _ask(self, method, within_s: float, /, **kwargs):
        """Run ``method(**kwargs, future=...)`` (a coroutine method of this server) in its background process and
        return what it sets, waiting at most ``within_s`` (raises what the future raises): hivemind's pipe to the
        background process, which names the method."""
        future = MPFuture()
        outer_pipe(self).send((method.__name__, [], dict(kwargs, future=future)))
        return future.result(timeout=within_s)

    def _record(self, claim: RoundClaim) -> dict:
        """The record this peer gathers into the round's group: the training process's claim, completed with what
        this process keeps (:class:`~p2p_diloco.swarm.averaging.boundary.OwnRecord`). A seam."""
        return self.own.record(claim)

    def get_current_state(self):
        """Runs in a background thread of the training process when a peer downloads this unit's state."""
        if self.state_provider is None:
            return {}, [], None
        metadata, tensors = self.state_provider()
        return metadata, tensors, None

    def _start_bounded(self, timeout_s: float) -> None:
        """Start the background process and wait until it serves, at most ``timeout_s`` (it only needs the local p2p
        daemon, so a longer wait means a stuck machine): then kill it and raise :class:`SwarmError`."""
        freeze_before_fork()  # the fork shares this process's heap with the averager's: keep it shared
        self.run_in_background(await_ready=False)
        if not ready_or_killed(self, self.wait_until_ready, timeout_s):
            raise SwarmError(f"the averager's process was not ready within {timeout_s:.0f} s")

    # ---- runs in the background process ------------------------------------------------------------
    def run(self) -> None:
        die_with_parent(signal.SIGKILL)  # a peer killed with SIGKILL leaves no averager behind
        name_process("diloco-avg")
        leave_signals_to_parent()  # a signal to the whole group is for the training process to handle
        super().run()

    async def _step(self, **kwargs):
        """hivemind's step, its compression and reduction (the loop's default executor) on threads at a lower CPU
        priority than training, so that averaging does not slow the inner steps; the loop keeps training's priority
        to answer matchmaking and all-reduce messages in time (at a lower one, a busy machine's leader answered a join
        too late, and groups formed without members that had joined). A step cancelled as it ends stops quietly
        (:func:`quiet_if_cancelled`); after it, free heap pages go back to the system (:func:`release_free_memory`)."""
        if not self._workers_niced:
            self._workers_niced = True
            asyncio.get_event_loop().set_default_executor(
                ThreadPoolExecutor(thread_name_prefix="averaging", initializer=lower_priority))
        step = kwargs.get("step")
        if step is not None:  # the training process's claim, completed into this round's record
            bandwidth, mode, claim = self.serializer.loads(step.data_for_gather)
            record = self._record(RoundClaim.from_gather(self.serializer.loads(claim)))
            set_data_for_gather(step, self.serializer.dumps([bandwidth, mode, self.serializer.dumps(record)]))
        _STEP.set(step)
        self._memtrace.tick()
        _STEP_STARTED.set(time.monotonic())
        try:
            return await quiet_if_cancelled(self._matchmaking_step(**kwargs), kwargs.get("step"))
        finally:
            release_free_memory()

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
        if work.done() or not cancel_signalled(cancelled):
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

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """hivemind's, mended: it calls ``finalize`` on each running group's future, not on the runner the future
        holds, so an averager shut down with a group registered (its peer stopping mid-round: a stage of its pipeline
        died) printed an AttributeError traceback above the peer's one-line error. A runner's ``finalize`` cancels
        its all-reduce at once (nothing to wait for: ``timeout`` is hivemind's bound of that wait)."""
        if not self.client_mode:
            await self.remove_p2p_handlers(p2p_of(self), namespace=self.prefix)
        for future in list(running_groups(self).values()):
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)

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
                averaged, digests[phase.decode() or "-"] = await self._allreduce_phase(
                    tensors, codecs, group_info, group_info.group_id + phase, view, peer_fractions=fractions, **kwargs)
                return averaged

            step_started = _STEP_STARTED.get()
            matched_s = time.monotonic() - step_started if step_started is not None else None
            fault_point("allreduce-group-formed")  # fault injection (faults.py): unset, a dictionary lookup
            received_before, started = int(self.traffic[BYTES_RECEIVED]), time.monotonic()
            async with enter_asynchronously(self.get_tensors()) as buffers:
                if int(self.buffered_round[0]) != my_round:
                    raise AllreduceException(f"round {my_round} was abandoned by this peer")
                # bounded here rather than by hivemind's timeout, whose expiry is not retried: a group whose
                # all-reduce stalls (a member stopped sending) re-forms and averages again within the round's budget
                # the buffers are read in place (the reduce writes none of them) and the residuals written straight
                # into their shared buffers; each average then replaces its contribution, one tensor at a time
                outcome = await self._unless_cancelled(asyncio.wait_for(
                    self._reducer.reduce(buffers, plan, my_round, allreduce, residuals_out=self.residuals),
                    timeout=self.cfg.allreduce_timeout_s), my_round)
                await self._compare_digests(group_info.group_id, view, digests)
                for i, buffer in enumerate(buffers):
                    buffer.copy_(outcome.average_of(i))
            received = int(self.traffic[BYTES_RECEIVED]) - received_before
            # a throughput sample only when the payload amortizes the latency and the waits of the group
            measured = received * 8 / 1e6 / max(time.monotonic() - started, 1e-3) if received >= 2**20 else None
            # matched_s: from the step's start to this group (failed groups of the round's retries included)
            stats = dict(outcome.stats, bandwidth_mbit=measured, matched_s=matched_s)
            self.own.averaged(stats, self.policy.next_proposal(plan, outcome.q_avgs, my_round))
            return GroupResult(view.infos, view.tokens, stats)
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
        runner = self.runner_type(
            traffic=self.traffic, weights=view.weights, rule=self.rule, average_bound=offence_bound,
            plausible_bound=min(plausible, offence_bound),
            claims={peer_id: float(info["tokens"]) for peer_id, info in view.infos.items()},
            p2p=p2p_of(self), servicer_type=type(self), prefix=self.prefix, tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, modes=view.modes,
            compression=PerTensorCompression([codec_for(c) for c in codecs]),
            result_compression=PerTensorCompression([codec_for(result_codec(c)) for c in codecs]),
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
        round_index = int(self.buffered_round[0])
        return None if round_index < 0 else round_index

    async def _set_target_group_size(self, size: Optional[int], future) -> None:
        matchmaking_of(self).target_group_size = size
        matchmaking_of(self).potential_leaders.target_group_size = size
        future.set_result(None)

    async def _report_flags(self, round_index: int, future) -> None:
        future.set_result(self.guard.report(round_index))

    async def _download_from(self, donors: list[str], timeout_s: float, future) -> None:
        """:func:`~p2p_diloco.swarm.averaging.download.download_from` (asked by the client's ``download_state``)."""
        try:
            future.set_result(await download_from(self, donors, timeout_s))
        finally:
            if not future.done():
                future.set_result(None)

    # ---- what it answers to other peers, and whom it follows (background process) --------------------------------
    @property
    def group_views(self) -> GroupViews:
        """The groups this peer was in (made on first use, in the background process)."""
        views = vars(self).get("_group_views")
        if views is None:
            views = self._group_views = GroupViews()
        return views

    # hivemind registers rpc_* handlers from their annotations, and needs typing's AsyncIterator there
    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        """As a leader: refuse banned peers and outsiders, and a record over the size cap (the sender's offence:
        :mod:`~p2p_diloco.swarm.averaging.gathered`), before hivemind's matchmaking keeps the request."""
        reason = self.guard.refuses(context.remote_id, self._round_averaged())
        if reason is not None:
            logger.info(f"Refused the join request of {context.remote_id}: {reason}")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        reason = join_refusal(request, len(matchmaking_of(self).current_followers))
        if reason is not None:
            logger.info(f"Refused the join request of {context.remote_id}: {reason}")
            if len(request.gather) > MAX_GATHERED_BYTES:  # its own bytes: a proof (a full group is nobody's fault)
                self.guard.record(self._round_or_none(), context.remote_id, OVERSIZED)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's routing of a sender's parts to this peer's all-reduce, but parts sent for another view of a
        group, or for a group this peer has left, are refused at once; and a sender that gives up waiting for this
        peer's all-reduce to start no longer cancels it for every other sender (hivemind's handlers all await the
        same future: the first to time out cancelled it, and the others' streams ended too)."""
        request = await anext(stream)
        if self.group_views.refuses(request.group_id):
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        if not await self._await_registered(request.group_id):
            yield averaging_pb2.AveragingData(code=NOT_IN_GROUP)
            return
        future = running_groups(self).get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        runner = await asyncio.shield(future)
        async for message in runner.rpc_aggregate_part(achain(as_aiter(request), stream), context):
            yield message

    async def _await_registered(self, allreduce_id: bytes) -> bool:
        """hivemind's wait for an all-reduce this peer has not registered (its leader may have begun it before its
        BEGIN_ALLREDUCE reached this peer): until a group of this peer registers. But False once this peer has
        followed no leader and assembled no group for one request timeout: a follower that gives up waiting for its
        leader (on a busy machine) after the leader has counted it in is in no group, and the senders wait out
        their reducer timeout for its averages while it goes on looking for the round's group, and the round falls
        back for every member. Told at once, they re-form and meet it again."""
        matchmaking, loop = matchmaking_of(self), asyncio.get_event_loop()
        alone_since = None
        while allreduce_id not in running_groups(self) and not groups_registered(self).is_set():
            now = loop.time()
            if matchmaking.current_leader is not None or matchmaking.assembled_group.done():
                alone_since = None
            elif alone_since is None:
                alone_since = now
            elif now - alone_since >= matchmaking.request_timeout:
                return False
            try:
                await asyncio.wait_for(groups_registered(self).wait(), timeout=REGISTERED_POLL_S)
            except TimeoutError:
                pass
        return True

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """Serve this stage's state to members of the swarm only, to a bounded number of peers at a time, each at a
        minimum rate (each stream holds a copy of anchor and momentum: see
        :class:`~p2p_diloco.swarm.averaging.limits.StateGate`). A refused request makes no copy: it ends with no
        data, and the downloader moves on to its next donor."""
        if self.guard.outsider(context.remote_id):
            logger.warning(f"Refused to serve state to {context.remote_id}: not on averaging.allowlist")
            return
        serve = StateGate.of(self).serve(context.remote_id, partial(super().rpc_download_state, request, context),
                                         averaging_pb2.DownloadData.ByteSize)
        async for message in serve:
            yield message

    async def _get_current_state_from_host_process(self):
        """hivemind's request for the state to serve, through :class:`StateHost` (which keeps none of it)."""
        return await self.state_host.request()

    def shutdown(self) -> None:
        self.state_host.close()
        super().shutdown()

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

    def _round_or_none(self) -> int:
        """The round offences found outside a group are recorded under (-1 when this peer averages none)."""
        round_index = self._round_averaged()
        return -1 if round_index is None else round_index

    async def _matchmaking_step(self, **kwargs):
        """hivemind's step, with this peer's matchmaking guarded and the round's group key kept."""
        self._guard_matchmaking()
        keep_round_key(matchmaking_of(self).group_key_manager)
        return await super()._step(**kwargs)

    def _guard_matchmaking(self) -> None:
        """As a follower: never ask a banned peer or an outsider to lead this peer's group (also when another leader
        redirects to it). Note whom this peer followed into each group and the exact record it sent, and hand
        hivemind each group under its view id (:class:`GroupViews`). Runs in the background process, once, after
        hivemind made its Matchmaking."""
        matchmaking = matchmaking_of(self)

        def unless_refused(request_join_group):
            async def join_unless_refused(leader):
                reason = self._refuses_leader(leader)
                if reason is not None:
                    logger.debug(f"Not following {leader}: {reason}")
                    return None
                return await request_join_group(leader)
            return join_unless_refused

        if not wrap_join_request(matchmaking, unless_refused):
            return
        look_for_group, follower_assemble_group = matchmaking.look_for_group, matchmaking.follower_assemble_group
        views = self.group_views

        async def assemble_as_follower(leader, msg):
            if not self._takes_group(leader):
                return None
            reason = relayed_group_refusal(msg)
            if reason is not None:  # an honest leader refuses oversized records at the join: the leader's proof
                logger.warning(f"Refused the group relayed by {leader}: {reason}")
                self.guard.record(self._round_or_none(), leader, OVERSIZED)
                return None
            views.followed(msg.group_id, leader)
            return await follower_assemble_group(leader, msg)

        async def look_for_viewed_group(step):
            group_info = await look_for_group(step)
            return None if group_info is None else views.assembled(group_info, step.data_for_gather, self.peer_id)

        replace_group_assembly(matchmaking, assemble_as_follower, look_for_viewed_group)

    def _refuses_leader(self, leader) -> Optional[str]:
        """As a follower: why this peer does not ask ``leader`` to lead its group (a banned peer, an outsider), or
        None."""
        return self.guard.refuses(leader, self._round_averaged())

    def _takes_group(self, leader) -> bool:
        """As a follower: whether this peer takes the group ``leader`` has just formed with it (before its relayed
        records are checked): always (a seam)."""
        return True

    def _leave_group(self, view_id: bytes) -> None:
        """Done with a group (averaged, refused or failed): parts sent for it from now on are refused at once, and
        so are those already waiting for one of its all-reduces that will not start."""
        self.group_views.leave(view_id)
        for allreduce_id, future in list(running_groups(self).items()):
            if allreduce_id.startswith(view_id) and not future.done():
                future.set_exception(AllreduceException("this peer has left the group"))
                future.exception()  # retrieved here: nobody may be waiting for it
