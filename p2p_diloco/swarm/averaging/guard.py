"""Whom an averager trusts: groupmates' metadata checked, offences counted, repeat offenders banned, private swarms.

- :func:`read_group` turns a group's gathered metadata (what each member claims: round, tokens, compression
  proposal) into what this round averages with. A malformed record or a round other than this peer's excludes
  that member (it becomes an auxiliary peer: it neither sends nor reduces anything); its claimed tokens are capped
  at a multiple of the group's median; claimed link bandwidths are ignored (every member reduces an equal share,
  so nobody can claim the whole vector). Every honest groupmate reads the same records, so all agree.
- :class:`PeerGuard`, in the averager's background process, records why groupmates were flagged each round (by
  this peer's reducer, by the checks of the averages it received, by :func:`read_group`), counts the rounds in
  which a peer committed an offence, and bans it after ``averaging.ban_after`` such rounds; with
  ``averaging.allowlist`` it also knows who is in a private swarm.
- :class:`GuardedAverager`, mixed into the averager, refuses join requests from banned peers and outsiders, does
  not follow them as leaders, and neither serves state to outsiders nor downloads it from them.

Built on hivemind internals (``Matchmaking._request_join_group``, ``_load_state_from_peers``), through
:mod:`p2p_diloco.swarm.averaging.hivemind_api`. Called by
:class:`p2p_diloco.swarm.averaging.averager.PseudoGradientAverager`.
"""

from __future__ import annotations

import logging
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from p2p_diloco.swarm.averaging.hivemind_api import AllreduceException, AveragingMode, P2PContext, averaging_pb2
from p2p_diloco.swarm.averaging.robust import MALFORMED, NONFINITE, TOO_LARGE, cap_weights, lower_median

logger = logging.getLogger(__name__)

# why a groupmate is flagged, besides the reducer's reasons (robust.MALFORMED, NONFINITE, TOO_LARGE, CLIPPED)
WRONG_ROUND, METADATA, BAD_AVERAGE = "round", "metadata", "bad average"
CAPPED, BANNED = "capped", "banned"
OFFENCES = frozenset({MALFORMED, NONFINITE, TOO_LARGE, WRONG_ROUND, METADATA, BAD_AVERAGE})  # the rest: reported
KEPT_ROUNDS = 8  # flags of older rounds that nobody asked for are dropped


class PeerGuard:
    """Offences and bans of other peers, and the allowlist.

    Args:
        ban_after: rounds with an offence after which a peer is banned (0: never).
        allowlist: peer ids (base58) of a private swarm; empty: anyone may join.
    """

    def __init__(self, ban_after: int, allowlist: Sequence[str] = ()):
        self.ban_after, self.allowlist = ban_after, frozenset(allowlist)
        self.offence_rounds: dict[str, set[int]] = {}
        self.banned: set[str] = set()
        self.flags: dict[int, dict[str, set[str]]] = {}  # round -> peer -> reasons

    def outsider(self, peer_id) -> bool:
        return bool(self.allowlist) and str(peer_id) not in self.allowlist

    def refuses(self, peer_id) -> Optional[str]:
        """Why this peer does not group with ``peer_id``, or None."""
        if self.outsider(peer_id):
            return "not on averaging.allowlist"
        return "banned for repeated offences" if str(peer_id) in self.banned else None

    def record(self, round_index: int, peer_id, reason: str) -> None:
        """Note that ``peer_id`` was flagged for ``reason`` in a round; ban it if that makes one offence too many."""
        name = str(peer_id)
        reasons = self.flags.setdefault(round_index, {}).setdefault(name, set())
        if reason in reasons:
            return
        reasons.add(reason)
        if reason not in OFFENCES:
            return
        rounds = self.offence_rounds.setdefault(name, set())
        rounds.add(round_index)
        logger.warning(f"Round {round_index}: groupmate {name} flagged ({reason}); offences in {len(rounds)} round(s)")
        if self.ban_after and len(rounds) >= self.ban_after and name not in self.banned:
            self.banned.add(name)
            logger.warning(f"Banned {name} after offences in rounds {sorted(rounds)}: this peer no longer groups "
                           "with it")
        for old in [r for r in self.flags if r < round_index - KEPT_ROUNDS]:
            del self.flags[old]

    def report(self, round_index: int) -> dict:
        """The flags of a round (peer -> sorted reasons; forgotten once reported) and every banned peer."""
        flags = self.flags.pop(round_index, {})
        return {"suspects": {peer: sorted(reasons) for peer, reasons in sorted(flags.items())},
                "banned": sorted(self.banned)}


@dataclass
class GroupView:
    """A group as this round averages with it."""

    infos: dict
    """Peer id -> gathered metadata, of the members included (all on this peer's round)."""
    modes: tuple
    """AveragingMode of each member in group order; excluded members are AUX."""
    bandwidths: tuple
    """Each member's bandwidth for load balancing: None (an equal share) or 0.0 (nothing to reduce)."""
    weights: dict
    """Peer id -> the weight this peer's reducer gives its parts: claimed tokens, capped; 0 if banned here."""
    round_index: int
    tokens: float
    """The group's tokens: the included members' claims, capped."""
    catch_up: float
    """The group's median claim over this peer's own (at least 1): a peer that trained on fewer tokens (it joined
    the round part-way) has a smaller pseudo-gradient than its groupmates, and may receive a larger average."""


def read_group(group_info, serializer, my_peer_id, guard: PeerGuard, weight_ratio: float) -> GroupView:
    """What this round averages with, from the group's gathered records (see the module docstring).

    Raises:
        AllreduceException: this peer's own record is unusable, the group holds an outsider of a private swarm,
            or nobody is left to average with.
    """
    infos, modes, excluded = {}, [], {}
    for peer_id, raw in zip(group_info.peer_ids, group_info.gathered):
        try:
            _bandwidth, mode_id, user_bytes = serializer.loads(raw)
            mode, info = AveragingMode(mode_id), check_gathered(serializer.loads(user_bytes))
            infos[peer_id] = info
        except Exception as e:  # anything a groupmate sends may be malformed
            logger.debug(f"Malformed group record of {peer_id}: {e!r}")
            mode, excluded[peer_id] = AveragingMode.AUX, METADATA
        modes.append(mode)
    if my_peer_id not in infos:
        raise AllreduceException("the group's record of this peer's own metadata is malformed")
    round_index = infos[my_peer_id]["round"]
    outsiders = [str(peer_id) for peer_id in group_info.peer_ids if guard.outsider(peer_id)]
    if outsiders:
        raise AllreduceException(f"the group holds peers not on averaging.allowlist: {outsiders}")
    for index, peer_id in enumerate(group_info.peer_ids):
        if peer_id in infos and infos[peer_id]["round"] != round_index:
            del infos[peer_id]
            modes[index], excluded[peer_id] = AveragingMode.AUX, WRONG_ROUND
    for peer_id, reason in excluded.items():
        guard.record(round_index, peer_id, reason)
    if len(infos) < 2 and excluded:
        raise AllreduceException(f"no groupmate left to average with (excluded: {sorted(map(str, excluded))})")
    claims = [float(info["tokens"]) for info in infos.values()]
    weights, capped_claims = {}, cap_weights(claims, weight_ratio)
    for peer_id, claim, capped in zip(infos, claims, capped_claims):
        if capped < claim:
            guard.record(round_index, peer_id, CAPPED)
        if str(peer_id) in guard.banned:
            guard.record(round_index, peer_id, BANNED)
        weights[peer_id] = 0.0 if str(peer_id) in guard.banned else capped
    bandwidths = tuple(0.0 if mode in (AveragingMode.CLIENT, AveragingMode.AUX) else None for mode in modes)
    catch_up = max(1.0, lower_median(capped_claims) / capped_claims[list(infos).index(my_peer_id)])
    return GroupView(infos, tuple(modes), bandwidths, weights, round_index, sum(capped_claims), catch_up)


def check_gathered(info) -> dict:
    """A groupmate's gathered metadata if every field has the type and range an honest peer sends; else raises."""
    if not isinstance(info, dict):
        raise ValueError(f"gathered metadata is a {type(info).__name__}, not a mapping")
    _integer(info["round"], "round", minimum=0)
    _number(info["tokens"], "tokens", positive=True)
    _number(info["compute_s"], "compute_s")
    _number(info["bandwidth_mbit"], "bandwidth_mbit", positive=True)
    if info.get("last_error") is not None:
        _number(info["last_error"], "last_error")
    proposal = info["compression"]
    if not isinstance(proposal, dict):
        raise ValueError("compression proposal is not a mapping")
    _integer(proposal["rank"], "compression.rank", minimum=1)
    _integer(proposal["q_round"], "compression.q_round", minimum=-1)
    if proposal["bits"] not in (4, 8) or isinstance(proposal["bits"], bool):
        raise ValueError(f"compression.bits must be 4 or 8, got {proposal['bits']!r}")
    return info


def _integer(value, name: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _number(value, name: str, positive: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0 \
            or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


class GuardedAverager:
    """Mixin for a hivemind ``DecentralizedAverager`` with a ``guard`` attribute (a :class:`PeerGuard`)."""

    guard: PeerGuard

    # hivemind registers rpc_* handlers from their annotations, and needs typing's AsyncIterator there
    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        """As a leader: refuse banned peers and outsiders, before hivemind's matchmaking sees the request."""
        reason = self.guard.refuses(context.remote_id)
        if reason is not None:
            logger.info(f"Refused the join request of {context.remote_id}: {reason}")
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        """Serve this stage's state to members of the swarm only."""
        if self.guard.outsider(context.remote_id):
            logger.warning(f"Refused to serve state to {context.remote_id}: not on averaging.allowlist")
            return
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _step(self, **kwargs):
        self._guard_matchmaking()
        keep_round_key(self._matchmaking.group_key_manager)
        return await super()._step(**kwargs)

    async def _load_state_from_peers(self, future, timeout=None):
        self._guard_donors()
        return await super()._load_state_from_peers(future, timeout)

    def _guard_matchmaking(self) -> None:
        """As a follower: never ask a banned peer or an outsider to lead this peer's group (also when another leader
        redirects to it). Runs in the background process, once, after hivemind made its Matchmaking."""
        matchmaking = self._matchmaking
        if "_request_join_group" in vars(matchmaking):
            return
        request_join_group = matchmaking._request_join_group

        async def join_unless_refused(leader):
            reason = self.guard.refuses(leader)
            if reason is not None:
                logger.debug(f"Not following {leader}: {reason}")
                return None
            return await request_join_group(leader)

        matchmaking._request_join_group = join_unless_refused

    def _guard_donors(self) -> None:
        """Download state from members of a private swarm only: hivemind's download loop asks ``self.get_stub`` for
        each donor in turn, and moves on to the next one when it raises."""
        if not self.guard.allowlist or "get_stub" in vars(self):
            return
        get_stub = self.get_stub

        def get_stub_of_member(p2p, peer, namespace=None):
            if self.guard.outsider(peer):
                raise PermissionError(f"{peer} is not on averaging.allowlist")
            return get_stub(p2p, peer, namespace=namespace)

        self.get_stub = get_stub_of_member


def keep_round_key(key_manager) -> None:
    """Keep a hivemind ``GroupKeyManager``'s key as it was set (the round's key, set when the round starts) until it
    is set again: hivemind moves each member's key to a bucket of its own after every group it assembles, so that
    after a group whose all-reduce failed (a member gone) the survivors retried under different keys and never met
    again. Idempotent."""
    if "update_key_on_group_assembled" in vars(key_manager):
        return

    async def keep_the_round_key(group_info) -> None:
        return None

    key_manager.update_key_on_group_assembled = keep_the_round_key
