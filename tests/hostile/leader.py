"""Hostile peers in matchmaking: a group leader that forges the records it relays, and a follower that ignores its
leaders.

- ``forge-tokens:K`` and ``forge-round`` (:class:`ForgingLeader`): it never follows another peer (``_refuses_leader``),
  so it leads every group it is in, and relays (``rpc_join_group``) to each follower that follower's own record with K
  times fewer tokens, which would let it accept an average K times larger (and as a reducer it returns averages K
  times too large: :class:`~tests.hostile.wire.ScaledReplies`, default 1000); or, ``forge-round``, to the first
  follower in group order the next follower's record on the previous round: that follower alone sees the member
  excluded, and the group reads two different partitions of the vector;
- ``miss-begin:N`` (:class:`MissingBegin`): ignores the first N BEGIN_ALLREDUCE messages of each round from its leaders
  (``_takes_group``), who have counted it into their groups, and goes on looking for the round's group: what a follower
  whose wait for its leader timed out on a busy machine does (default 1).
"""

from __future__ import annotations

import logging
import typing
from typing import Optional

from p2p_diloco.hivemind_adapter.averaging import P2PContext, averaging_pb2
from tests.hostile.base import HostileServer

logger = logging.getLogger(__name__)


class ForgingLeader(HostileServer):
    def _refuses_leader(self, leader) -> Optional[str]:
        return "this hostile test peer follows nobody"

    # hivemind registers rpc_* handlers from their annotations, and needs typing's AsyncIterator there
    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        async for message in super().rpc_join_group(request, context):
            if message.code == averaging_pb2.BEGIN_ALLREDUCE:
                self._forge(message, context.remote_id.to_bytes())
            yield message

    def _forge(self, message, follower: bytes) -> None:
        """The group's records as relayed to ``follower`` (``message`` changed in place)."""
        peer_ids, records = list(message.ordered_peer_ids), list(message.gathered)
        followers = [i for i, peer_id in enumerate(peer_ids) if peer_id != self.peer_id.to_bytes()]
        position = peer_ids.index(follower)
        if self.hostility.kind == "forge-tokens":
            target = position  # the follower's own record
        elif position == followers[0] and len(followers) > 1:
            target = followers[1]  # the first follower is told the second is on another round
        else:
            return
        bandwidth, mode, user_bytes = self.serializer.loads(records[target])
        info = self.serializer.loads(user_bytes)
        if self.hostility.kind == "forge-tokens":
            info["tokens"] = info["tokens"] / self.hostility.value
        else:
            info["round"] = info["round"] - 1 if info["round"] > 0 else info["round"] + 1
        records[target] = self.serializer.dumps([bandwidth, mode, self.serializer.dumps(info)])
        del message.gathered[:]
        message.gathered.extend(records)


class MissingBegin(HostileServer):
    def __init__(self, *args, **kwargs):
        self._missed: dict[Optional[int], int] = {}  # the round's BEGIN_ALLREDUCE messages ignored
        super().__init__(*args, **kwargs)

    def _takes_group(self, leader) -> bool:
        round_index = self._round_averaged()
        missed = self._missed.get(round_index, 0)
        if missed >= self.hostility.value:
            return True
        self._missed = {round_index: missed + 1}
        logger.info(f"Ignored the group {leader} formed with this peer (a test hook)")
        return False
