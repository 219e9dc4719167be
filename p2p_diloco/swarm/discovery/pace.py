"""How soon another peer of a stage could end the round this one is on, from the pace its progress records show:
the round-end watch (:meth:`SwarmLink.others_ended_round`) reads the records often only when that is near.

A record carries the writer's inner step (counted over the run: round * H + steps into the round) and the writer's
DHT time; two records of the same writer give its steps per second, and a writer on round r or behind cannot end
round ``r`` before it has reached step ``(r + 1) * H``. The estimate is only as honest as the records: a believed
peer that claims a slow pace and then ends its round at once is noticed :data:`WATCH_CEILING_S` late at most, which
the others' matchmaking (``averaging.matchmaking_time_s``, 5 s by default) absorbs. Pure logic.
"""

from __future__ import annotations

import math

from p2p_diloco.swarm.discovery.progress import ProgressRecord

WATCH_FLOOR_S = 0.5
"""The round-end watch reads the records at most this often (every stage process, every fragment's link): the pace
of the watch before this module, when it read them all the time. On the WAN benchmark's 10 Mbit/s links those reads
were 30-50 kB/s per host, a third of what its peers put on the wire in a run (BENCHMARKS.md, "The wire")."""
WATCH_CEILING_S = 3.0
"""... and at least this often, however far the round's end ..."""
WATCH_ROUND_SHARE = 0.05
"""... and at least every this share of a round at the fastest believed writer's pace: a pace misjudged (a record
written while its writer was slowed down, a machine busier at one moment than the next) delays the notice of a
round's end by this share of a round at most, not by the ceiling. On rounds of a few seconds (the tests' on 2 busy
cores) the watch reads at the floor, as before this module; a peer at half speed that noticed 3 s late trained
80% of the others' tokens instead of about half (a fresh-clone busy CI run)."""


class Pace:
    """Each writer's steps per second, from the last two of its records that differ in time."""

    def __init__(self):
        self._last: dict[str, tuple[float, int]] = {}  # writer -> (record time, inner step)
        self._rate: dict[str, float | None] = {}  # writer -> steps per second (None: unknown)

    def update(self, records: list[ProgressRecord]) -> None:
        """Take a read of the records (every writer absent from it is forgotten)."""
        present = {r.node for r in records}
        for node in set(self._last) - present:
            del self._last[node]
            self._rate.pop(node, None)
        for r in records:
            before = self._last.get(r.node)
            if before is not None and r.time <= before[0]:
                continue  # the same record again (or an older one)
            if before is not None:
                steps = r.inner_step - before[1]
                # a step count that went back (a restart, a reload) says nothing of its pace
                self._rate[r.node] = steps / (r.time - before[0]) if steps > 0 else None
            self._last[r.node] = (r.time, r.inner_step)

    def seconds_to_end(self, records: list[ProgressRecord], round_index: int, inner_steps: int,
                       now: float) -> float | None:
        """The soonest any of ``records``' writers on ``round_index`` or behind can end that round, in seconds from
        ``now`` (DHT time); None when one of them has no known pace yet; inf when none is on it or behind."""
        end_step = (round_index + 1) * inner_steps
        soonest = math.inf
        for r in records:
            if r.round > round_index:
                continue  # it has ended the round already: the watch answers that at once
            rate = self._rate.get(r.node)
            if not rate or not math.isfinite(rate):
                return None
            soonest = min(soonest, (end_step - r.inner_step) / rate - (now - r.time))
        return soonest


    def round_s(self, records: list[ProgressRecord], inner_steps: int) -> float | None:
        """A round's length at the pace of the fastest of ``records``' writers whose pace is known (None: none)."""
        rates = [rate for r in records if (rate := self._rate.get(r.node)) and math.isfinite(rate)]
        return inner_steps / max(rates) if rates else None


def watch_interval(seconds_to_end: float | None, round_s: float | None = None) -> float:
    """How long the round-end watch waits before its next read: half the time to the soonest possible end, within
    [:data:`WATCH_FLOOR_S`, :data:`WATCH_CEILING_S`] and at most :data:`WATCH_ROUND_SHARE` of a round of ``round_s``
    (not below the floor); the floor when a pace is unknown."""
    if seconds_to_end is None:
        return WATCH_FLOOR_S
    ceiling = WATCH_CEILING_S if round_s is None else min(WATCH_CEILING_S, round_s * WATCH_ROUND_SHARE)
    return max(WATCH_FLOOR_S, min(ceiling, seconds_to_end / 2))
