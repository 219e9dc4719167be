"""A stage process's view of the swarm (:class:`SwarmLink`): it publishes this stage's progress records and reads
the other peers' of the same stage, for the round's timing (when to end a round, how large a group to wait for,
whether a round is hopeless) and for the sync (docs/design.md 3.1, 4.1). The records themselves, their key and their
checks: :mod:`p2p_diloco.swarm.discovery.progress`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Optional

from p2p_diloco.round.position import Position
from p2p_diloco.swarm.discovery.pace import WATCH_FLOOR_S, Pace, watch_interval
from p2p_diloco.swarm.discovery.progress import (
    ProgressRecord,
    could_join,
    fetch_progress,
    live_group_size,
    parse_progress,
    publish_progress,
    records_run,
    request_progress,
)
from p2p_diloco.swarm.discovery.records import record_owner

logger = logging.getLogger(__name__)

def ended_by_half(believed: list[ProgressRecord], round_index: int) -> bool:
    """Whether the records ``believed`` end ``round_index`` for this stage: at least half of those on that round, the
    next or the previous one (a slower peer, or a record not yet refreshed as a round begins) name the next round (at
    least one). A peer of unequal speed still meets the others at the round end when most of them are faster; a
    minority of believed identities (ones that averaged honestly for a while, then lie) cannot end every round after
    a step or two by naming the next one."""
    near = [r for r in believed if round_index - 1 <= r.round <= round_index + 1]
    ended = sum(r.round == round_index + 1 for r in near)
    return ended > 0 and 2 * ended >= len(near)


UNMET_END_FLOOR = 0.5
"""The share of a round's H steps a stage that has met nobody yet trains before any record may end its round
(``diloco.round_end = swarm``): it believes every record until its first group, and one record of a stranger naming
the next round would otherwise end its rounds after one step until then (the first two rounds of a fresh swarm in
``delayed`` mode, in the byzantine benchmark). A peer at half the others' speed still ends its rounds with theirs."""


class SwarmLink:
    """A stage process's view of the swarm: publishes its progress, reads the other peers' of the same stage.

    Args:
        dht: this stage process's running DHT.
        run_id: the swarm's run id.
        peer_name: the peer this stage belongs to (peer id of its stage 0).
        stage_index, num_stages: the stage this process trains, of how many.
        inner_steps: H, the steps of a round (an announced round starts at its first step).
        fingerprint: this peer's config fingerprint, republished with every forced progress record.
        publish_every_s: refresh the record at most this often (rounds always refresh it).
        ttl_s: a record expires this long after it was written unless refreshed.
        joined_swarm: this node was started with initial peers (it did not start a new swarm).
        num_rounds: the run's end (``train.num_rounds``), or None: a peer whose record says it applied the last
            round has finished and is never expected in a group again.
        fragment: (f, F) in a run averaged by fragment: this link is fragment f's (``stage_index``/``num_stages``
            are then f and F). Its records go under the fragment's own key, ``<run_id>_f<f>of<F>_progress``: one
            signed record per writer and key, and a stage process that holds several fragments writes one for each.
        allowlist: ``averaging.allowlist`` (a private swarm's peer ids): only its members' records count for timing.
        stranger_wait_s: the longest a stage waits for a group that only strangers' records say they could still
            join (``averaging.matchmaking_time_s`` plus ``request_timeout_s``: an honest one is in the group by then).

    :meth:`_progress_told` is a seam: the records tell where this stage is, and a test's hostile subclass
    (``tests/hostile``) tells otherwise.
    """

    # the peers whose records count for nothing now (they vouched for a state this peer's own check refused, or
    # served one their own record contradicts): the trainer points it at its sync's witnesses
    discredited: Callable[[], frozenset] = frozenset

    def __init__(self, dht, run_id: str, peer_name: str, *, stage_index: int = 0, num_stages: int = 1,
                 inner_steps: int = 1, fingerprint: Optional[dict] = None, publish_every_s: float = 10.0,
                 ttl_s: float = 120.0, joined_swarm: bool = True, num_rounds: Optional[int] = None,
                 fragment: Optional[tuple[int, int]] = None, allowlist=(), stranger_wait_s: float = 8.0):
        self.dht, self.run_id, self.peer_name, self.fingerprint = dht, run_id, peer_name, fingerprint
        self.allowlist, self.stranger_wait_s = frozenset(allowlist), stranger_wait_s
        # the nodes of this stage's recent groups: the trainer points it at its SwarmSync's recently_met
        self.peers_met: Callable[[], frozenset] = frozenset
        # what the records tell besides the position, for `status` (ProgressRecord's eval_losses, bytes_sent,
        # rounds_averaged, bans): the trainer's ledger points it at its notes
        self.facts: Callable[[], dict] = dict
        self._matching_since: dict[int, float] = {}  # round -> when this stage began looking for its group
        if fragment is not None:
            stage_index, num_stages = fragment
        self.records_run = records_run(run_id, fragment)  # the key prefix of the records this link reads and writes
        self.num_rounds = num_rounds
        self.stage_index, self.num_stages, self.inner_steps = stage_index, num_stages, inner_steps
        self.joined_swarm = joined_swarm
        self.anchor_fingerprint = ""  # set by the trainer whenever the anchor takes an average
        self.prior_anchor_fingerprint = ""  # the one before (see ProgressRecord.prior_anchor)
        self.node = dht.peer_id.to_base58()
        record_owner(dht, self.records_run)  # fails here, not later, on a DHT node that does not check signatures
        self.publish_every_s, self.ttl_s = publish_every_s, ttl_s
        self._last_publish = float("-inf")
        self.watch_every_s = WATCH_FLOOR_S  # how often others_ended_round reads the records again (pace.py: more
        # seldom while no believed peer can end the round soon)
        self._pace = Pace()
        self.watch_reads = 0  # reads the watch started (the round-end watch is most of a peer's DHT traffic)
        self.record_reads = 0  # reads of the records of every kind (the watch's included): the metrics' round rows
        self._watch = None  # the read in flight (a future of the DHT's answer)
        self._watch_at = float("-inf")
        self._watched: list[ProgressRecord] = []  # the other peers of this stage, as the watch last read them
        # the watch's last answer, with the time its read started: a round end uses it while it is this fresh
        # instead of reading the records again (a read is a DHT search: seconds on a busy machine, and the
        # peer comes late to its round's group, which forms without it)
        self.fresh_read_s = 1.0
        self._last_read: tuple[float, list[ProgressRecord]] | None = None
        self._others_seen_at = float("-inf")  # when expected_group_size last saw another live peer

    def _progress_told(self, position: Position) -> tuple[int, int, str, str]:
        """(round, applied round, anchor, prior anchor) this stage's record tells: where it is (a seam)."""
        return position.round, position.applied_round, self.anchor_fingerprint, self.prior_anchor_fingerprint

    def publish(self, position: Position, loss: float, tokens_per_s: float, force: bool = False) -> None:
        """Refresh this stage's record (at most every ``publish_every_s`` unless ``force``)."""
        from p2p_diloco.hivemind_adapter.dht import get_dht_time

        now = time.monotonic()
        if not force and now - self._last_publish < self.publish_every_s:
            return
        self._last_publish = now
        told_round, applied_round, anchor, prior_anchor = self._progress_told(position)
        record = ProgressRecord(peer=self.peer_name, stage=self.stage_index, num_stages=self.num_stages,
                                round=told_round, inner_step=position.inner_step + (told_round - position.round) *
                                self.inner_steps, tokens_per_s=float(tokens_per_s), loss=float(loss),
                                time=get_dht_time(), applied_round=applied_round, anchor=anchor,
                                prior_anchor=prior_anchor, **self.facts())
        try:
            publish_progress(self.dht, self.records_run, record, self.ttl_s)
            if self.fingerprint is not None and force:
                from p2p_diloco.swarm.discovery.fingerprint import publish_fingerprint

                publish_fingerprint(self.dht, self.run_id, self.fingerprint, self.ttl_s)
        except Exception as e:  # the DHT process may be shutting down; progress is best effort
            logger.debug(f"Could not publish progress: {e!r}")

    def announce(self, position: Position, round_index: int, loss: float = float("nan"),
                 tokens_per_s: float = 0.0) -> None:
        """Publish that this stage is about to be in ``round_index``, ahead of its own position: the next round when
        it ends one (before the averaging, so that slower peers end theirs too: see :meth:`others_ended_round`),
        or the swarm's round it is about to reload into (before the download, so that the peers ending that round
        count it in their group size and wait for it, bounded by their matchmaking time)."""
        ahead = Position(round_index, round_index * self.inner_steps, position.applied_round)
        self.publish(ahead, loss, tokens_per_s, force=True)

    def expected_group_size(self, round_index: int) -> int | None:
        """Live peers of this stage (this one included) for the group of ``round_index``, which this stage starts
        looking for now; None when unknown: nobody is visible yet, but this is the first round of a peer that joined
        a swarm, whose peers started at the same time may not have published their records yet (then a lone peer
        pays one matchmaking timeout, once).

        Believed peers (:meth:`believed`) at most a round apart count, and those met in recent groups further ahead:
        a groupmate whose records claim rounds it is not on still joins the groups, and left uncounted it made the
        group form one peer short, without the last honest peer to arrive, every round. Strangers at most a round
        apart count too (a newcomer announces the round it reloads into), but never more of them than the believed
        peers (this one included) less one, and at least one: a group they fail to join forms after one matchmaking
        time all the same, and in a group of the size waited for the believed peers stay a majority (five records of
        never-met identities made a peer of a group of three wait for eight)."""
        read = self._recent_read()
        if read is None:
            read = self._fetch()
        now = time.monotonic()
        self._matching_since = {r: t for r, t in self._matching_since.items() if r > round_index - 4}
        self._matching_since[round_index] = now
        believed, strangers = self.believed(self._of_stage(read))
        met, near = self.peers_met(), lambda r: abs(r.round - round_index) <= 1
        counted = {r.node for r in believed if not self.finished(r)
                   and (near(r) or (r.node in met and r.round > round_index + 1))}
        others = {r.node for r in strangers if not self.finished(r) and near(r)} - counted
        if not counted and not others and any(self.finished(r) for r in believed):
            return 1  # the read worked and the others of this stage have finished the run: alone, for certain
        if counted:
            self._others_seen_at = now
        size = 1 + len(counted) + min(len(others), max(1, len(counted)))
        if size <= 1 and round_index == 0 and self.joined_swarm:
            return None
        if size <= 1 and now - self._others_seen_at < self.ttl_s:
            # the others' records outlive them by ttl_s: none at all so soon after seeing some is a failed or slow
            # read, not a swarm that left. Concluding "alone" skips the network for the round and costs the
            # others their group too; unknown tries it, bounded by matchmaking
            return None
        return size

    def finished(self, record: ProgressRecord) -> bool:
        """Whether ``record``'s peer has applied the run's last round: it averages no round again. (Counted as a
        groupmate met in recent groups, a peer that has finished makes one that is rounds behind it wait out every
        round's timeouts alone to the end of the run.)"""
        return self.num_rounds is not None and record.round >= self.num_rounds and \
            record.applied_round >= self.num_rounds - 1

    def wait_for_peers(self, position: Position, count: int, timeout_s: float, poll_s: float = 1.0,
                       progress: Optional[Callable[[int, float], None]] = None, progress_every_s: float = 30.0) -> int:
        """Wait until ``count`` peers (this one included) train this stage, at most ``timeout_s``, publishing
        ``position`` meanwhile; returns how many were seen. ``progress(seen, seconds_left)`` is told whenever the
        count changes, and every ``progress_every_s`` meanwhile (a first peer may wait half an hour)."""

        deadline = time.monotonic() + timeout_s
        told, told_at = None, time.monotonic()
        while True:
            seen = live_group_size(self.believed(self._fetch())[0], self.stage_index,
                                   self.num_stages, self.node)
            if seen >= count or time.monotonic() >= deadline:
                return seen
            now = time.monotonic()
            changed = told is not None and seen != told
            if progress is not None and (changed or now - told_at >= progress_every_s):
                progress(seen, deadline - now)
                told_at = now
            told = seen
            self.publish(position, float("nan"), 0.0, force=True)
            time.sleep(poll_s)

    def wait_for_groupmates(self, nodes: list[str], applied_round: int, timeout_s: float,
                            poll_s: float = 0.25) -> set[str]:
        """Wait until every one of ``nodes`` (other than this one) has a record of this stage with
        ``applied_round`` or later, or none at all (it left), at most ``timeout_s``; returns those still
        waited for."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                records = {r.node: r for r in self.others()}
            except Exception as e:  # a DHT hiccup: ask again
                logger.debug(f"Could not read progress records: {e!r}")
                records = {node: None for node in nodes}
            waiting = {node for node in nodes if node != self.node and node in records and
                       (records[node] is None or records[node].applied_round < applied_round)}
            if not waiting or time.monotonic() >= deadline:
                return waiting
            time.sleep(poll_s)

    def moved_past(self, round_index: int) -> bool:
        """Whether no group can form for ``round_index`` any more: no other live peer of the stage can still
        average it (one on that round, or on the next with that round not yet applied, averaging it in the
        background). Peers further behind will reload rather than join it. False when no other peer is
        visible (a DHT hiccup looks the same), until the round has looked for its group ``stranger_wait_s`` (a
        matchmaking window and a request) and no other peer of the stage was seen for a record's lifetime
        (``ttl_s``): then it is alone, and the round ends at once. (A lone peer waited out its whole
        ``round_timeout_s``, 180 s in ``peers/peer.toml``, before its first round fell back, and a one-round run's
        end as long.)

        Only believed records (:meth:`believed`) keep this stage waiting for as long as the round's own bounds
        allow; strangers' records that say they could still join keep it waiting ``stranger_wait_s`` after it began
        looking for the group, no longer (a lone peer next to a few never-met records waited out its whole
        ``round_timeout_s`` every round)."""
        try:
            others = self.others()
        except Exception:  # a DHT hiccup: keep waiting
            return False
        believed, strangers = self.believed(others)
        if could_join(believed, round_index):
            return False
        started = self._matching_since.setdefault(round_index, time.monotonic())
        if not believed and not strangers:
            now = time.monotonic()
            return now - started >= self.stranger_wait_s and now - self._others_seen_at >= self.ttl_s
        if could_join(strangers, round_index) and time.monotonic() - started < self.stranger_wait_s:
            return False
        return any(r.round <= round_index + 2 for r in [*believed, *strangers])  # (less the discredited)

    def others_ended_round(self, round_index: int, trained_fraction: float = 1.0) -> bool:
        """Whether at least half of the believed peers of this stage (:meth:`believed`) on ``round_index`` or the next
        have ended ``round_index`` (:func:`ended_by_half`): their records name the next round (a peer announces the
        next round as it ends one, before averaging). Answers at once
        from the last read of the records; a new read is started in the DHT process at most every
        ``watch_every_s``, so asking at every inner step costs nothing. A record of a peer that died just after
        ending the round ends it here too, as the live peer would have; one of a peer further ahead does not (this
        peer is behind: the sync reloads it after the round; ending every round at once instead made a swarm next
        to one peer that had finished the run rush through its rounds a step each). A stranger's record never ends
        a round: one record naming the next round ended every round of a peer after one inner step. Before its
        first group a stage believes every record, and then only after ``trained_fraction`` (of the round's H
        steps, this stage's own) reaches :data:`UNMET_END_FLOOR`."""
        watch = self._watch
        if watch is not None and watch.done():
            self._watch = None
            try:
                records = parse_progress(watch.result())
            except Exception as e:  # a DHT hiccup: keep the last answer
                logger.debug(f"Could not read progress records: {e!r}")
            else:
                self._watched = self._of_stage(records)
                self._last_read = (self._watch_at, records)
                self._pace.update(self._watched)
                self.watch_every_s = self._next_watch(round_index)
        if self._watch is None and time.monotonic() - self._watch_at >= self.watch_every_s:
            self._watch_at = time.monotonic()
            try:
                self.watch_reads += 1
                self.record_reads += 1
                self._watch = request_progress(self.dht, self.records_run)
            except Exception as e:  # the DHT process may be shutting down
                logger.debug(f"Could not read progress records: {e!r}")
        if trained_fraction < UNMET_END_FLOOR and not self.allowlist and not self.peers_met():
            return False  # met nobody yet: a stranger's record may end this round, but not before the floor
        return ended_by_half(self.believed(self._watched)[0], round_index)

    def _next_watch(self, round_index: int) -> float:
        """The wait before the watch's next read: short while a believed peer may end ``round_index`` soon, by the
        pace of its records (:mod:`~p2p_diloco.swarm.discovery.pace`), or while the pace of one is unknown."""
        from p2p_diloco.hivemind_adapter.dht import get_dht_time

        believed = self.believed(self._watched)[0]
        if not believed:
            return WATCH_FLOOR_S  # a newcomer's or a restarted peer's record may come in any time
        return watch_interval(self._pace.seconds_to_end(believed, round_index, self.inner_steps, get_dht_time()),
                              self._pace.round_s(believed, self.inner_steps))

    def believed(self, records: list[ProgressRecord]) -> tuple[list[ProgressRecord], list[ProgressRecord]]:
        """``records`` split into those whose word counts for this stage's round timing and those of strangers.

        With ``averaging.allowlist``: its members' records, and no strangers (nobody else joins a group of a private
        swarm). Otherwise the records of the peers met in this stage's recent groups (``peers_met``) against all
        others; before its first group a stage has met nobody, and every record counts (a swarm that starts
        together, and a newcomer, meet at the round end this way)."""
        discredited = self.discredited()
        if discredited:
            records = [r for r in records if r.node not in discredited]
        if self.allowlist:
            return [r for r in records if r.node in self.allowlist], []
        met = self.peers_met()
        if not met:
            return list(records), []
        return [r for r in records if r.node in met], [r for r in records if r.node not in met]

    def _recent_read(self) -> list[ProgressRecord] | None:
        """The records the watch of :meth:`others_ended_round` read, if that read started at most ``fresh_read_s``
        ago (they are as fresh as a new read, less its latency); else None."""
        if self._last_read is None or time.monotonic() - self._last_read[0] > self.fresh_read_s:
            return None
        return self._last_read[1]

    def others(self) -> list[ProgressRecord]:
        """Live records of the same stage of other peers."""
        return self._of_stage(self._fetch())

    def _fetch(self) -> list[ProgressRecord]:
        self.record_reads += 1
        return fetch_progress(self.dht, self.records_run)

    def _of_stage(self, records: list[ProgressRecord]) -> list[ProgressRecord]:
        return [r for r in records
                if r.stage == self.stage_index and r.num_stages == self.num_stages and r.node != self.node]
