"""Whom an averager trusts: groupmates' metadata checked, offences counted, repeat offenders banned, private swarms.

- :func:`read_group` turns a group's gathered metadata (what each member claims: round, tokens, compression
  proposal; each record bounded in size before it is decoded, :mod:`~p2p_diloco.swarm.averaging.gathered`) into
  what this round averages with. An oversized or malformed record or a round other than this peer's excludes
  that member (it becomes an auxiliary peer: it neither sends nor reduces anything); its claimed tokens are capped
  at a multiple of the group's median; claimed link bandwidths are ignored (every member reduces an equal share,
  so nobody can claim the whole vector). Every honest groupmate reads the same records, so all agree.
- The group's leader relays every record, a follower's own included, and may be hostile. So a follower compares
  the relayed copy of its own record with the bytes it sent and refuses the group (a proof against the leader: it
  is banned at once) when they differ; a record that reached this peer only through the leader counts as an offence
  of nobody (it is still excluded and reported: the leader may have forged it), only what came straight from its
  sender does (as a leader, every record; as a follower, the leader's own); and the group's all-reduces run under a
  *view id* (:class:`GroupViews`) that digests the records as this peer read them, so members handed different
  records never exchange a part (none can find another's parts malformed or see it stall).
- :class:`PeerGuard`, in the averager's background process, records why groupmates were flagged each round (by
  this peer's reducer, by the checks of the averages it received, by :func:`read_group`), counts the rounds in
  which a peer committed an offence, and bans it after ``averaging.ban_after`` such rounds; a groupmate that stalled
  an all-reduce (accepted this peer's parts and returned no average within the reducer timeout) is banned after
  stalls in twice as many rounds of the last :data:`STALL_WINDOW` (an honest peer on an overloaded machine stalls
  now and then, a hostile part never comes from an honest peer); with ``averaging.allowlist`` it also knows who is
  in a private swarm.
- What the averager answers to other peers with these decisions (join requests, parts, state) is
  :class:`~p2p_diloco.swarm.averaging.server.AveragingServer`. Everything here is plain logic, tested without a network.

Called by :class:`p2p_diloco.swarm.averaging.server.AveragingServer` and its
:class:`~p2p_diloco.swarm.averaging.server.AveragingServer`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from p2p_diloco.hivemind_adapter.averaging import (
    AllreduceException,
    AveragingMode,
    PeerID,
    averaging_pb2,
)
from p2p_diloco.medians import lower_median
from p2p_diloco.swarm.averaging.boundary import Flags
from p2p_diloco.swarm.averaging.digests import EQUIVOCATED, OUTVOTED
from p2p_diloco.swarm.averaging.gathered import (
    GatheredError,
    decode_record,
)
from p2p_diloco.swarm.averaging.robust import MALFORMED, NONFINITE, TOO_LARGE, cap_weights

logger = logging.getLogger(__name__)

NOT_IN_GROUP = averaging_pb2.GROUP_DISBANDED
"""A reducer's reply to parts sent for a group it is not in (it gave up on the group's leader; see
:meth:`AveragingServer._await_registered`)."""
REGISTERED_POLL_S = 0.1

# why a groupmate is flagged, besides the reducer's reasons (robust.MALFORMED, NONFINITE, TOO_LARGE, CLIPPED)
WRONG_ROUND, METADATA, BAD_AVERAGE = "round", "metadata", "bad average"
FORGED, STALL = "forged record", "stall"
OVERSIZED = "oversized record"
"""A join request, or a group relayed by its leader, over the caps of :mod:`~p2p_diloco.swarm.averaging.gathered`
(a record of more than MAX_GATHERED_BYTES, more members than MAX_GROUP_SIZE, ...): an honest peer's record is about
150 bytes and an honest leader refuses such joins, so whoever sends one (the joiner, or the leader that relays it) is
hostile. Counted as a mere offence, a hostile leader with a 16 MiB record drew the followers of every round for
ban_after rounds, and the honest peers of the byzantine benchmark split into two pairs that never met again."""
IMPLAUSIBLE = "implausible average"  # beyond what an honest reducer returns, within the offence bound: left out
CAPPED, BANNED = "capped", "banned"
OFFENCES = frozenset({MALFORMED, NONFINITE, TOO_LARGE, WRONG_ROUND, METADATA, BAD_AVERAGE, FORGED, EQUIVOCATED,
                      OUTVOTED, OVERSIZED})  # the rest: noted
PROOFS = frozenset({FORGED, EQUIVOCATED, OVERSIZED})  # an offence only a hostile peer commits: one bans at once
STALL_WINDOW = 20  # rounds: stalls in 2 x ban_after of the last STALL_WINDOW rounds ban a peer
MAX_CATCH_UP = 8.0  # see GroupView.catch_up
KEPT_ROUNDS = 8  # flags of older rounds that nobody asked for are dropped
KEPT_GROUPS = 16  # the groups a GroupViews remembers
REPORTED_BANS = 16  # the last bans whose reasons a report carries (the progress records show them)
VIEW_DIGEST_BYTES = 8


class PeerGuard:
    """Offences, stalls and bans of other peers, and the allowlist.

    Args:
        ban_after: rounds with an offence after which a peer is banned (0: never); stalls ban after stalls in twice
            as many of the last :data:`STALL_WINDOW` rounds, and a proof of hostility (:data:`PROOFS`) at once.
        allowlist: peer ids (base58) of a private swarm; empty: anyone may join.
    """

    def __init__(self, ban_after: int, allowlist: Sequence[str] = ()):
        self.ban_after, self.allowlist = ban_after, frozenset(allowlist)
        self.offence_rounds: dict[str, set[int]] = {}
        self.stall_rounds: dict[str, set[int]] = {}
        self.banned: set[str] = set()
        self.ban_reasons: dict[str, str] = {}  # peer -> why it was banned, the last REPORTED_BANS in ban order
        self.flags: dict[int, dict[str, set[str]]] = {}  # round -> peer -> reasons
        self.left_out: dict[str, int] = {}  # peer -> the round whose all-reduce it broke (see leave_out)
        self.absences: dict[str, tuple[int, int]] = {}  # peer -> (round, times it was in no group: see absent)

    def outsider(self, peer_id) -> bool:
        return bool(self.allowlist) and str(peer_id) not in self.allowlist

    def refuses(self, peer_id, round_index: Optional[int] = None) -> Optional[str]:
        """Why this peer does not group with ``peer_id`` (in ``round_index``, the round it is averaging), or None."""
        if self.outsider(peer_id):
            return "not on averaging.allowlist"
        if str(peer_id) in self.banned:
            return "banned for repeated offences"
        if round_index is not None and self.left_out.get(str(peer_id)) == round_index:
            return f"it returned no average in an all-reduce of round {round_index}"
        return None

    def leave_out(self, round_index: int, peer_id) -> None:
        """Group no more with ``peer_id`` in ``round_index``: it took this peer's parts in one of that round's
        all-reduces and returned no average (it died, left or stalled), which failed the all-reduce. The round's
        retry then forms without it; a staller that joined every retry failed every round of its groups."""
        if self.left_out.get(str(peer_id)) != round_index:
            logger.info(f"Round {round_index}: groupmate {peer_id} returned no average, or one no honest reducer "
                        "returns; the round's retry goes on without it")
        self.left_out[str(peer_id)] = round_index

    def absent(self, round_index: int, peer_id) -> None:
        """``peer_id`` said it was in no group when this peer sent it parts in ``round_index`` (a follower that gave
        up on the leader after the leader had counted it in). The group re-forms with it (it is still looking for
        the round's group); the second time in a round it is left out of the round's retry (one that did so on
        purpose would fail every retry)."""
        name = str(peer_id)
        round_seen, times = self.absences.get(name, (round_index, 0))
        times = times + 1 if round_seen == round_index else 1
        self.absences[name] = (round_index, times)
        if times >= 2:
            self.leave_out(round_index, peer_id)

    def record(self, round_index: int, peer_id, reason: str, counted: bool = True) -> None:
        """Note that ``peer_id`` was flagged for ``reason`` in a round; ban it if that makes one offence (or stall)
        too many. ``counted`` False: reported only (this peer cannot tell whether ``peer_id`` is to blame)."""
        name = str(peer_id)
        self.flags.setdefault(round_index, {}).setdefault(name, set()).add(reason)
        for old in [r for r in self.flags if r < round_index - KEPT_ROUNDS]:
            del self.flags[old]
        if not counted:
            if reason in OFFENCES:
                logger.info(f"Round {round_index}: groupmate {name} flagged ({reason}) in a record relayed by the "
                            "group's leader: not counted against it")
        elif reason in OFFENCES:
            rounds = self.offence_rounds.setdefault(name, set())
            if round_index not in rounds:
                rounds.add(round_index)
                logger.warning(f"Round {round_index}: groupmate {name} flagged ({reason}); offences in "
                               f"{len(rounds)} round(s)")
            if reason in PROOFS or len(rounds) >= self.ban_after:
                self._ban(name, f"offences in rounds {sorted(rounds)} ({reason} in round {round_index})")
        elif reason == STALL:
            stalls = {r for r in self.stall_rounds.get(name, ()) if r > round_index - STALL_WINDOW}
            if round_index not in stalls:
                logger.warning(f"Round {round_index}: groupmate {name} stalled the all-reduce; stalls in "
                               f"{len(stalls) + 1} of the last {STALL_WINDOW} rounds")
            self.stall_rounds[name] = stalls = stalls | {round_index}
            if len(stalls) >= 2 * self.ban_after:
                self._ban(name, f"stalls in rounds {sorted(stalls)}")

    def _ban(self, name: str, why: str) -> None:
        if self.ban_after and name not in self.banned:
            self.banned.add(name)
            self.ban_reasons[name] = why
            _keep_last(self.ban_reasons, REPORTED_BANS)
            logger.warning(f"Banned {name} after {why}: this peer no longer groups with it")

    def report(self, round_index: int) -> Flags:
        """The flags of a round (peer -> sorted reasons; forgotten once reported), every banned peer, and why the last
        :data:`REPORTED_BANS` were banned."""
        flags = self.flags.pop(round_index, {})
        return Flags({peer: sorted(reasons) for peer, reasons in sorted(flags.items())}, sorted(self.banned),
                     dict(self.ban_reasons))


@dataclass(frozen=True)
class GroupOrigin:
    """How this peer received a group's records."""

    leader: PeerID
    """The member that relayed them (this peer itself when it led the group: every record came from its sender)."""
    own_record: bytes
    """This peer's record for the round, the exact bytes it sent."""


class GroupViews:
    """The groups this peer was in, as it read them (in the averager's background process).

    Each group's all-reduces run under a *view id*: hivemind's group id followed by a digest of the group's peer ids
    and records as this peer received them. Members handed different records by a hostile leader have different view
    ids, and each refuses at once the parts sent under another view of the group (and those of a group it has left,
    which hivemind would hold until this peer's next group forms: their sender would see this peer stall).
    """

    def __init__(self):
        self.leaders: dict[bytes, PeerID] = {}  # hivemind group id -> the leader this peer followed into it
        self.views: dict[bytes, tuple[bytes, GroupOrigin]] = {}  # hivemind group id -> (view id, origin)
        self.left: set[bytes] = set()  # view ids of the groups this peer is done with

    def followed(self, group_id: bytes, leader: PeerID) -> None:
        self.leaders[group_id] = leader
        _keep_last(self.leaders, KEPT_GROUPS)

    def assembled(self, group_info, own_record: bytes, my_peer_id: PeerID):
        """The group as this peer averages with it: hivemind's ``GroupInfo`` with the view id as its group id."""
        leader = self.leaders.pop(group_info.group_id, my_peer_id)
        view_id = group_info.group_id + view_digest(group_info.peer_ids, group_info.gathered)
        self.views[group_info.group_id] = (view_id, GroupOrigin(leader, own_record))
        _keep_last(self.views, KEPT_GROUPS)
        self.left &= {view for view, _origin in self.views.values()}
        return dataclasses.replace(group_info, group_id=view_id)

    def origin(self, view_id: bytes) -> GroupOrigin:
        view, origin = self.views.get(view_id[:-VIEW_DIGEST_BYTES], (None, None))
        if view != view_id:
            raise AllreduceException("this peer has no record of how it received the group's metadata")
        return origin

    def leave(self, view_id: bytes) -> None:
        self.left.add(view_id)

    def refuses(self, allreduce_id: bytes) -> bool:
        """Whether parts sent under ``allreduce_id`` are for another view of a group this peer is in, or for a group
        it has left (False for a group it has not seen yet: hivemind holds those until it forms its next group)."""
        for group_id, (view_id, _origin) in self.views.items():
            if allreduce_id.startswith(group_id):
                return not allreduce_id.startswith(view_id) or view_id in self.left
        return False


def view_digest(peer_ids: Sequence[PeerID], gathered: Sequence[bytes]) -> bytes:
    """A digest of a group's members and records, in group order (the same on every member that read the same)."""
    digest = hashlib.sha256()
    for item in [peer_id.to_bytes() for peer_id in peer_ids] + list(gathered):
        digest.update(len(item).to_bytes(8, "big") + item)
    return digest.digest()[:VIEW_DIGEST_BYTES]


def _keep_last(entries: dict, count: int) -> None:
    while len(entries) > count:
        del entries[next(iter(entries))]


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
    """The group's median claim over this peer's own, from 1 to :data:`MAX_CATCH_UP`: a peer that trained on fewer
    tokens (it joined the round part-way) has a smaller pseudo-gradient than its groupmates, and may receive a larger
    average. Capped, so that no claim lifts the bound on the averages this peer accepts more than 8-fold: a peer with
    less than 1/8 of the median's tokens judges averages as if it had 1/8 (with the default outlier ratio it accepts
    averages up to 160 times its own part)."""


def read_group(group_info, serializer, my_peer_id, guard: PeerGuard, weight_ratio: float,
               origin: Optional[GroupOrigin] = None) -> GroupView:
    """What this round averages with, from the group's gathered records (see the module docstring).

    Args:
        origin: who relayed the records, and this peer's own record as it sent it; None: this peer led the group
            (every record came straight from its sender).

    Raises:
        AllreduceException: the leader altered this peer's own record, this peer's record is unusable, the group
            holds an outsider of a private swarm, or nobody is left to average with.
    """
    leader = my_peer_id if origin is None else origin.leader
    if origin is not None:
        _check_own_record(group_info, my_peer_id, origin, serializer, guard)
    infos, modes, excluded = {}, [], {}
    for peer_id, raw in zip(group_info.peer_ids, group_info.gathered):
        try:  # sizes and item counts bounded before and while decoding (gathered.py)
            mode, infos[peer_id] = decode_record(raw)
        except GatheredError as e:  # anything a groupmate sends may be oversized or malformed
            logger.debug(f"Malformed group record of {peer_id}: {e}")
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
        # a record that reached this peer through the leader may be the leader's forgery: it counts against nobody
        guard.record(round_index, peer_id, reason, counted=leader in (my_peer_id, peer_id))
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
    own_claim = capped_claims[list(infos).index(my_peer_id)]
    catch_up = min(MAX_CATCH_UP, max(1.0, lower_median(capped_claims) / own_claim))
    return GroupView(infos, tuple(modes), bandwidths, weights, round_index, sum(capped_claims), catch_up)


def _check_own_record(group_info, my_peer_id, origin: GroupOrigin, serializer, guard: PeerGuard) -> None:
    """Raise, and flag the leader, unless the group's record of this peer is the one it sent, byte for byte."""
    relayed = group_info.gathered[list(group_info.peer_ids).index(my_peer_id)]
    if relayed == origin.own_record:
        return
    try:
        round_index = serializer.loads(serializer.loads(origin.own_record)[2])["round"]
    except Exception:  # a hostile test peer's own record may be malformed: flag under no round
        round_index = -1
    guard.record(round_index, origin.leader, FORGED)
    raise AllreduceException(f"the leader {origin.leader} relayed this peer's record altered")
