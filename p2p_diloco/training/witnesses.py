"""Whose word counts for one stage: which signed progress records it believes, and which donors hold the state those
records agree on (docs/design.md 4.1).

Whom it believes (a public swarm holds hostile peers; records are signed by their writer's libp2p identity, see
``swarm.discovery.records``), in this order, the first that has a live record:

1. in a private swarm, the peers on ``averaging.allowlist``, and nobody else, ever;
2. the peers met in this stage's groups of the last :data:`TRUSTED_ROUNDS` rounds: averaging with this peer is
   what an identity must have done to count;
3. for a stage that has met nobody (a newcomer), the **bootstrap peers**, those of ``dht.initial_peers``: the user
   chose them, and they already decide this peer's view of the DHT (a hostile bootstrap peer can eclipse it), so
   believing their records adds no trust that was not already given;
4. else every signed record. This is the residual risk, said plainly: identities are free, so a newcomer of a
   public swarm whose bootstrap peers hold no record (a plain ``bootstrap`` node) believes a majority of
   identities, which an attacker with many keys can be. What that buys: the newcomer may start from a state those
   identities vouch for (the state must still be exactly the one they vouch for, and served by one of them) or be
   kept from reloading; it then trains one round on it, averages with its first group (the robust combine bounds
   its part), and from then on only its groupmates count: off their state, it resyncs. Honest peers' states are not
   moved by it. A newcomer that wants no such round names a training peer as its initial peer (or uses an allowlist).

Pure logic over the records: :class:`Witnesses` keeps what this stage has seen of the swarm (the groups it averaged
in, the donors caught lying) and never reads the network itself. Used by :class:`~p2p_diloco.training.sync.SwarmSync`
(its decisions) and :class:`~p2p_diloco.training.fetch.StateFetcher` (its donors and the state check).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

from p2p_diloco.medians import lower_median

TRUST_LEVELS = ("the peers met in recent groups", "the bootstrap peers", "every signed record")
TRUSTED_ROUNDS = 8  # the groups of this many recent rounds are the peers whose records count
DISCREDIT_ROUNDS = 3  # a donor caught serving a state its own record does not claim counts for nothing this long
REFUSED_ROUNDS = 10  # ... and one vouching for a state this peer's own check refused (a model, not a race of records)


def bootstrap_peer_ids(initial_peers) -> frozenset[str]:
    """The peer ids in ``dht.initial_peers`` multiaddrs (``.../p2p/<peer id>``; the config requires one in each)."""
    return frozenset(maddr.rstrip("/").rsplit("/p2p/", 1)[1].split("/")[0] for maddr in initial_peers
                     if "/p2p/" in maddr)


def anchor_votes(records, applied_round: int) -> dict[str, list[str]]:
    """Fingerprint -> the nodes whose records say it is the anchor after ``applied_round`` (their anchor, or the
    anchor before theirs for a record one round further on)."""
    votes: dict[str, list[str]] = {}
    for r in records:
        fingerprint = r.anchor if r.applied_round == applied_round else \
            r.prior_anchor if r.applied_round == applied_round + 1 else ""
        if fingerprint:
            votes.setdefault(fingerprint, []).append(r.node)
    return votes


def canonical_of(votes: dict[str, list[str]]) -> str:
    """Most votes; a tie goes to the fingerprint held by the smallest node id (the same on every peer, every round)."""
    return min(votes, key=lambda fp: (-len(votes[fp]), min(votes[fp])))


class Witnesses:
    """The records one stage believes, in the order of :data:`TRUST_LEVELS` (an allowlist replaces them all).

    Args:
        node: this stage's own node id (never its own witness).
        round_now: this stage's round now (a discredit lasts :data:`DISCREDIT_ROUNDS` of its rounds).
        allowlist: ``averaging.allowlist`` (a private swarm's peer ids): only their records count.
        bootstrap: the peer ids of ``dht.initial_peers``: what a stage that has met nobody believes, if they have
            records.
    """

    def __init__(self, node: str, round_now: Callable[[], int], allowlist=(), bootstrap=()):
        self.node, self.round_now = node, round_now
        self.allowlist, self.bootstrap = frozenset(allowlist), frozenset(bootstrap)
        self.met: deque[frozenset] = deque(maxlen=TRUSTED_ROUNDS)  # the groups of the last rounds
        # while above 0, the records of a later level of TRUST_LEVELS count: a download from the earlier levels
        # gave no usable state (see StateFetcher.download)
        self.widening = 0
        # donor -> the last round of this stage in which its records count for nothing: it served a state that its
        # own signed record contradicts (see StateFetcher)
        self.discredited: dict[str, int] = {}

    def met_group(self, peers) -> None:
        """Note the group of a round this stage averaged in (their records count from now on)."""
        if peers:
            self.met.append(frozenset(peers) - {self.node})

    def recently_met(self) -> frozenset:
        """The nodes of this stage's groups of the last :data:`TRUSTED_ROUNDS` rounds."""
        return frozenset().union(*self.met)

    def counted(self, records) -> list:
        """The records whose word counts (the order of trust: this module's docstring), less those of
        discredited donors."""
        if self.allowlist:
            return [r for r in self.credited(records) if r.node in self.allowlist]
        levels = self.levels(records)
        return levels[min(self.widening, len(levels) - 1)][1] if levels else []

    def credited(self, records) -> list:
        """``records`` less those of the donors discredited until now."""
        now = self.round_now()
        self.discredited = {node: until for node, until in self.discredited.items() if until >= now}
        return [r for r in records if r.node not in self.discredited]

    def now_discredited(self) -> frozenset:
        """The nodes whose records count for nothing now (for the round timing, too: ``SwarmLink.discredited``)."""
        now = self.round_now()
        return frozenset(node for node, until in self.discredited.items() if until >= now)

    def discredit(self, node: str, rounds: int = DISCREDIT_ROUNDS) -> None:
        """``node`` served a state its own signed record contradicts (or vouched for a state this peer's own check
        refused): its records count for nothing for ``rounds`` rounds."""
        self.discredited[node] = max(self.discredited.get(node, -1), self.round_now() + rounds)

    def earned(self, records) -> bool:
        """Whether the records counted now are of peers this stage has reason to believe (an allowlist's, the peers
        met, the bootstrap peers the user named), rather than of every signed record: identities anyone can make.
        A claim only such identities make (the run is over) is one this stage cannot verify."""
        if self.allowlist:
            return True
        levels = self.levels(records)
        return bool(levels) and levels[min(self.widening, len(levels) - 1)][0] != TRUST_LEVELS[-1]

    def discredit_vouchers(self, records, applied_round: int, fingerprint: str) -> list[str]:
        """Discredit every node whose record vouches for ``fingerprint`` after ``applied_round`` (a state this stage's
        own check refused: vouching for it is worth nothing) for :data:`REFUSED_ROUNDS`; the nodes."""
        nodes = anchor_votes(records, applied_round).get(fingerprint, [])
        for node in nodes:
            self.discredit(node, REFUSED_ROUNDS)
        return nodes

    def levels(self, records) -> list[tuple[str, list]]:
        """The levels of :data:`TRUST_LEVELS` that have live records, in order: (name, their records)."""
        met, records = self.recently_met(), self.credited(records)
        chosen = ([r for r in records if r.node in met], [r for r in records if r.node in self.bootstrap], records)
        return [(name, level) for name, level in zip(TRUST_LEVELS, chosen) if level]

    def donors(self, others, own_round: int | None = None, strangers=()) -> list[str]:
        """Nodes to download from: the counted peers whose state is the agreed one after their applied round and
        whose round is not beyond the swarm's (a record far ahead of the others' is not believed); those whose state
        another counted peer vouches for first, the most advanced first (ties in random order, so that newcomers
        spread over them), then those only they vouch for (so that a record one round ahead with a state nobody
        else holds, an attacker's, is not asked first), then the ``strangers`` (other signed records) holding an agreed
        state, in the same order.

        ``own_round``: this stage's round, where it trains with the swarm (a resync): it counts in the swarm's round.
        Left out, a dead peer's record (it stays in the DHT for its TTL) can be the lower median of a survivor's two
        others, and the live survivor looks too far ahead to be a donor: two survivors of a broken round then
        average onto their two anchors to the run's end."""
        if not others:
            return []
        swarm_round = lower_median([r.round for r in others] + ([own_round] if own_round is not None else []))
        counted = {r.node for r in others}
        candidates = list(others) + [r for r in strangers if r.node not in counted]
        ranked = []
        for r in candidates:
            votes = anchor_votes(others, r.applied_round)
            if r.anchor and r.round <= swarm_round + 1 and votes and r.anchor == canonical_of(votes):
                vouched = bool(set(votes[r.anchor]) - {r.node})
                ranked.append((r.node not in counted, not vouched, -r.applied_round, random.random(), r.node))
        return list(dict.fromkeys(node for *_, node in sorted(ranked)))
