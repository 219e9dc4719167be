"""What an averager answers to other peers, guarded: join requests, parts of all-reduces, averages asked for again,
and its state, each refused to banned peers and outsiders; and the matchmaking it runs as a follower.

:class:`GuardedAverager`, mixed into the averager's server (:class:`~p2p_diloco.swarm.averaging.server.AveragingServer`,
in the background process), refuses join requests from banned peers and outsiders and those whose record is over the
size cap, refuses a group relayed with oversized records, does not follow banned peers and outsiders as leaders, hands
hivemind each group under its view id (:class:`~p2p_diloco.swarm.averaging.guard.GroupViews`), serves the averages of
its slice again to the groupmates of that all-reduce only, and serves no state to outsiders (at most a bounded number
of streams at a time: :class:`~p2p_diloco.swarm.averaging.limits.StateGate`). What it decides with is the plain logic
of :mod:`~p2p_diloco.swarm.averaging.guard`.

Built on hivemind internals (``Matchmaking._request_join_group``, ``look_for_group``, ``follower_assemble_group``,
``GroupKeyManager.update_key_on_group_assembled``), through :mod:`p2p_diloco.hivemind_adapter.averaging`.
"""

from __future__ import annotations

import asyncio
import logging
import typing
from collections import OrderedDict
from functools import partial
from typing import Optional

from p2p_diloco.hivemind_adapter.averaging import (
    AllreduceException,
    P2PContext,
    achain,
    as_aiter,
    averaging_pb2,
    groups_registered,
    keep_round_key,
    matchmaking_of,
    replace_group_assembly,
    running_groups,
    wrap_join_request,
)
from p2p_diloco.swarm.averaging.allreduce import BYTES_SENT
from p2p_diloco.swarm.averaging.gathered import MAX_GATHERED_BYTES, join_refusal, relayed_group_refusal
from p2p_diloco.swarm.averaging.guard import NOT_IN_GROUP, OVERSIZED, GroupViews, PeerGuard
from p2p_diloco.swarm.averaging.limits import StateGate
from p2p_diloco.swarm.averaging.slices import ServedAverages
from p2p_diloco.swarm.averaging.state_host import StateHost

logger = logging.getLogger(__name__)

REGISTERED_POLL_S = 0.1
SERVED_ALLREDUCES = 8  # the last all-reduces whose averages (this peer's slice) are kept for groupmates to ask again


class GuardedAverager:
    """Mixin for a hivemind ``DecentralizedAverager`` with a ``guard`` attribute (a :class:`PeerGuard`).

    Seams for tests (``tests/hostile`` subclasses them to lie): ``rpc_join_group``, the group this peer relays as a
    leader; ``_step``, a round's step as it begins; :meth:`_refuses_leader` and :meth:`_takes_group`, whom it follows.
    """

    guard: PeerGuard
    state_host: StateHost  # made in the training process before the fork

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

    def _round_averaged(self) -> Optional[int]:
        """The round this peer is averaging, if any (None here; the averager knows)."""
        return None

    def _round_or_none(self) -> int:
        """The round offences found outside a group are recorded under (-1 when this peer averages none)."""
        round_index = self._round_averaged()
        return -1 if round_index is None else round_index

    async def _step(self, **kwargs):
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
