"""Hostile peers for tests and benchmarks: subclasses of the honest averager's parts that lie to their groupmates and
the swarm, injected through the honest code's seams (the honest code has no hostile branch).

A kind is named ``<kind>[:<value>]`` (:func:`parse_hostility`); :data:`KINDS` lists them, each with its default value
and the parts it replaces. By concern: on the wire and as a reducer (:mod:`.wire`), in the round's metadata
(:mod:`.metadata`), in matchmaking as a leader or a follower (:mod:`.leader`), to the swarm's sync (:mod:`.state`).
In a test, ``parse_hostility(spec).averager(...)`` is a hostile :class:`~p2p_diloco.swarm.PseudoGradientAverager`; a
hostile peer process is ``python -m tests.hostile.peer <kind>[:<value>] -- <the arguments of p2p-diloco peer>``
(:mod:`.peer`).
"""

from __future__ import annotations

import math

from tests.hostile.base import HostileAverager, HostileLink, HostileRunner, HostileServer, Hostility, Kind
from tests.hostile.leader import ForgingLeader, MissingBegin
from tests.hostile.metadata import FatRecord, InflatedTokens, Lowball, MalformedProposal, StaleReplay
from tests.hostile.state import (
    COLLUDE_AHEAD,
    TINY_CLOCK_S,
    CollusionLink,
    CollusionState,
    FalseStateLink,
    PoisonedMomentum,
    ShiftedState,
    TinyClock,
)
from tests.hostile.wire import (
    Equivocating,
    NaNReplies,
    NoisyParts,
    NonFiniteParts,
    OversizedShapes,
    ScaledParts,
    ScaledReplies,
    Stalling,
)

KINDS: dict[str, Kind] = {
    "scale": Kind(1000.0, server=ScaledParts),
    "noise": Kind(100.0, server=NoisyParts),
    "nan": Kind(None, server=NonFiniteParts),
    "inf": Kind(None, server=NonFiniteParts),
    "shape": Kind(None, runner=OversizedShapes),
    "tokens": Kind(1000.0, averager=InflatedTokens),
    "stale": Kind(1.0, averager=StaleReplay),
    "metadata": Kind(None, server=MalformedProposal),
    "fat-metadata": Kind(4.0, server=FatRecord),
    "lowball": Kind(None, server=Lowball),
    "reply-nan": Kind(None, runner=NaNReplies),
    "reply-scale": Kind(1000.0, runner=ScaledReplies),
    "equivocate": Kind(1.5, runner=Equivocating),
    "forge-tokens": Kind(1000.0, server=ForgingLeader, runner=ScaledReplies),
    "forge-round": Kind(None, server=ForgingLeader),
    "miss-begin": Kind(1.0, server=MissingBegin),
    "stall": Kind(30.0, server=Stalling),
    "false-state": Kind(1000.0, server=ShiftedState, link=FalseStateLink),
    "poison-momentum": Kind(1 / (0.7 * 0.5**2), server=PoisonedMomentum),
    "tiny-clock": Kind(None, server=TinyClock),
    "collude-wipe": Kind(3.0, server=CollusionState, link=CollusionLink),
    "collude-end": Kind(3.0, server=CollusionState, link=CollusionLink),
}


def parse_hostility(spec: str) -> Hostility:
    """The hostility ``<kind>[:<value>]`` names; ValueError if it is malformed."""
    kind, _, value = spec.strip().partition(":")
    if kind not in KINDS:
        raise ValueError(f"hostility: unknown kind {kind!r}; one of {', '.join(KINDS)}")
    default = KINDS[kind].default
    if default is None:
        if value:
            raise ValueError(f"hostility: {kind} takes no value, got {spec!r}")
        return Hostility(kind, None, KINDS[kind])
    try:
        number = float(value) if value else default
    except ValueError:
        raise ValueError(f"hostility: {kind} takes a number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"hostility: {kind} takes a positive number, got {value!r}")
    return Hostility(kind, number, KINDS[kind])


__all__ = ["COLLUDE_AHEAD", "KINDS", "TINY_CLOCK_S", "HostileAverager", "HostileLink", "HostileRunner",
           "HostileServer", "Hostility", "Kind", "parse_hostility"]
