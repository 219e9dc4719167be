"""Whether every member of a group got the same averages from each reducer: digests compared through the DHT.

A reducer sends each member its slice of the average on a stream of its own, so a hostile reducer could send
different bytes to different members (equivocate), each within the bound the member checks. After a round's
all-reduces, before the average is used, each member publishes one signed record under the group's key
(``<prefix>.digests.<view id>``, subkey its own owner key: signed by its DHT node like the run's records), holding a
digest of the slice it got from every reducer (its own slice: what it served), and reads its groupmates' records,
waiting at most one request timeout for them. It then judges each reducer (:func:`judge`):

- the reducer's own record names what it served. If that differs from what this peer got, the reducer sent this peer
  something else than it says it served everyone: a proof (``equivocated``), banned at once. Nobody else's claim
  enters this verdict, so no member can get an honest reducer banned: it cannot sign the reducer's record;
- with no record of the reducer (withheld, or late), the other members' digests vote: when a strict majority of
  them (this peer included) agree on other bytes than this peer's, the reducer sent this peer a different slice than
  most got (``outvoted average``: an offence, not a proof: it rests on an honest majority of the group);
- either way this peer refuses its average (the all-reduce fails, and the round is retried without the reducer, or
  falls back): members end a round with identical results, or those that got other bytes know which reducer broke it.

Cost: one record of a few hundred bytes written and read once or a few times per round, within one request timeout;
a member that withholds its record costs its group that timeout, not a result. Off for a DHT node that does not sign
(started outside :func:`~p2p_diloco.swarm.discovery.dht.start_dht`: tests). Called by
:class:`p2p_diloco.swarm.averaging.averager.PseudoGradientAverager`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Optional

from p2p_diloco.hivemind_adapter.dht import get_dht_time
from p2p_diloco.swarm.discovery.records import peer_id_of_owner

logger = logging.getLogger(__name__)

DIGEST_BYTES = 16
TTL_S = 60.0  # a group's records are read within a request timeout of its all-reduce
POLL_S = 0.2
MAX_PHASES = 3  # whole tensors, low-rank P, low-rank Q
EQUIVOCATED, OUTVOTED = "equivocated", "outvoted average"

Digests = dict[str, dict[str, str]]
"""phase (hex of its group id suffix) -> reducer (base58 peer id) -> digest (hex) of the slice it got."""


def slice_digest(parts: Iterable[bytes]) -> str:
    """A digest of a reducer's averaged parts, each as the bytes of its serialized tensor, in order."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.digest()[:DIGEST_BYTES].hex()


def parse_claim(value, members: Mapping[str, object]) -> Optional[Digests]:
    """A member's published digests if they have the shape an honest member writes (phases, members, hex digests of
    :data:`DIGEST_BYTES`), else None. ``members``: the group's peer ids (base58)."""
    if not isinstance(value, dict) or not isinstance(value.get("digests"), dict):
        return None
    digests = value["digests"]
    if len(digests) > MAX_PHASES:
        return None
    for phase, per_reducer in digests.items():
        if not isinstance(phase, str) or len(phase) > 8 or not isinstance(per_reducer, dict) or \
                len(per_reducer) > len(members):
            return None
        for reducer, digest in per_reducer.items():
            if reducer not in members or not isinstance(digest, str) or len(digest) != 2 * DIGEST_BYTES:
                return None
    return digests


def judge(me: str, mine: Digests, claims: Mapping[str, Digests]) -> list[tuple[str, str]]:
    """(reducer, reason) for every reducer whose slice this peer cannot show to be the group's (see the module
    docstring). ``mine``: what this peer got; ``claims``: every other member's published digests, by member."""
    found = []
    for phase, per_reducer in mine.items():
        for reducer, digest in per_reducer.items():
            if reducer == me:
                continue  # this peer's own slice: it knows what it served, whatever another member claims
            own_claim = claims.get(reducer, {}).get(phase, {}).get(reducer)
            if own_claim is not None:
                if own_claim != digest:
                    found.append((reducer, EQUIVOCATED))
                continue
            votes = [digest] + [claim[phase][reducer] for member, claim in claims.items()
                                if member not in (me, reducer) and reducer in claim.get(phase, {})]
            winner, count = Counter(votes).most_common(1)[0]
            if winner != digest and 2 * count > len(votes):
                found.append((reducer, OUTVOTED))
    return sorted(set(found))


async def exchange_digests(dht, key: str, owner: bytes, me: str, mine: Digests, members: Mapping[str, object],
                           timeout_s: float) -> dict[str, Digests]:
    """Store this peer's digests under ``key`` (subkey ``owner``: signed by its DHT node), then read the group's
    until every other member's record is in or ``timeout_s`` is up; returns member -> its digests (see
    :func:`read_claims`). A DHT that fails or is slow only leaves records out."""
    loop = asyncio.get_event_loop()
    deadline, others = loop.time() + timeout_s, set(members) - {me}
    claims: dict[str, Digests] = {}
    try:
        await asyncio.wait_for(dht.store(key, {"node": me, "digests": mine}, get_dht_time() + TTL_S, subkey=owner,
                                         return_future=True), timeout=max(0.1, deadline - loop.time()))
        while True:
            found = await asyncio.wait_for(dht.get(key, latest=True, return_future=True),
                                           timeout=max(0.1, deadline - loop.time()))
            claims = read_claims(found, members, me)
            if others <= set(claims) or loop.time() >= deadline:
                return claims
            await asyncio.sleep(POLL_S)
    except Exception as e:  # the DHT's failure, or the bound
        logger.info(f"Compared the group's digests with {len(claims)} of {len(others)} records ({e!r})")
    return claims


def read_claims(found, members: Mapping[str, object], me: str) -> dict[str, Digests]:
    """Member (base58) -> its published digests, from a DHT read of the group's key: only entries signed by a member
    other than this peer, under its own key, naming it as ``node``, of the shape :func:`parse_claim` accepts."""
    claims = {}
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    for subkey, item in entries.items():
        try:
            writer = peer_id_of_owner(subkey)
        except ValueError:
            continue
        value = getattr(item, "value", None)
        claim = parse_claim(value, members)
        if writer in members and writer != me and claim is not None and value.get("node") == writer:
            claims[writer] = claim
    return claims
