"""A stage process's units (:class:`Held`: each with its swarm link and sync) and what it notes of their rounds: the
metrics rows, the summary and the console, and the anchor each unit's progress records and sync carry after it
changed (a round applied, a merge, a reload or a resync).

Used by :class:`~p2p_diloco.training.trainer.Trainer`, which owns the loop; the units are its ``held`` list.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

from p2p_diloco.monitoring.memtrace import MemoryTrace
from p2p_diloco.round.outcome import RoundReport
from p2p_diloco.round.stage import Stage
from p2p_diloco.swarm.discovery.records import (
    MAX_BANS_SHOWN,
    MAX_EVALS_SHOWN,
    MAX_GROUPS_SHOWN,
    MAX_TRAIN_LOSSES_SHOWN,
)
from p2p_diloco.training.metrics import MetricsWriter
from p2p_diloco.training.summary import TrainSummary, combined_report
from p2p_diloco.training.sync import SwarmSync


@dataclass
class Held:
    """One unit this stage process averages: its whole stage, or (``diloco.fragments``) one fragment it holds, with
    the fragment's own Stage (anchor, outer state, averager), progress records and sync."""

    stage: Stage
    swarm: Optional[object] = None
    """Its :class:`~p2p_diloco.swarm.SwarmLink`, or None to train alone."""
    sync: Optional[SwarmSync] = None


class Ledger:
    """The notes of one stage process's units.

    Args:
        held: the units, in model order.
        metrics: the process's metrics writer.
        summary: its run summary.
        reporter: the console.
        inner_steps: H.
        anchor_digest: whether metrics rows carry each anchor's sha256 (``train.anchor_digest``).
        num_rounds: the run's end (``train.num_rounds``): the records say ``finished`` once every unit applied its
            last round; None: never.
    """

    def __init__(self, held: list, metrics: MetricsWriter, summary: TrainSummary, reporter, inner_steps: int,
                 anchor_digest: bool, num_rounds: Optional[int] = None):
        self.held, self.metrics, self.summary, self.reporter = held, metrics, summary, reporter
        self.inner_steps, self.anchor_digest, self.num_rounds = inner_steps, anchor_digest, num_rounds
        self.last_group: dict[int, list[str]] = {}  # per unit held: the group of its last round applied
        # per unit held: (round applied, its group) of its last rounds averaged, for the records
        self.groups: list[deque[tuple[int, tuple[str, ...]]]] = [deque(maxlen=MAX_GROUPS_SHOWN) for _ in held]
        # (round, sum, count) of the train losses of the last rounds (the last one in progress)
        self.train_losses: deque[tuple[int, float, int]] = deque(maxlen=MAX_TRAIN_LOSSES_SHOWN)
        self.fingerprints: list[str] = [""] * len(held)  # each unit's anchor sha256, as last noted
        self.evals: deque[tuple[int, float]] = deque(maxlen=MAX_EVALS_SHOWN)  # (rounds done, eval loss)
        self.bans: dict[str, str] = {}  # peer -> why, the last MAX_BANS_SHOWN banned
        self.memtrace = MemoryTrace("training")  # off unless P2P_DILOCO_MEMTRACE is set (a diagnostic)
        for index, unit in enumerate(held):
            if unit.swarm is not None:
                unit.swarm.facts = functools.partial(self.facts, index)

    def facts(self, index: int = 0) -> dict:
        """What the records of unit ``index`` tell besides the position (``ProgressRecord.eval_losses`` and the
        rest): the stage process's, and the groups of that unit's last rounds."""
        finished = self.num_rounds is not None and \
            min(unit.stage.applied_round for unit in self.held) >= self.num_rounds - 1
        return {"eval_losses": tuple(self.evals), "bytes_sent": self.summary.bytes_sent,
                "rounds_averaged": self.summary.averaged_rounds, "bans": tuple(self.bans.items()),
                "groups": tuple(self.groups[index]), "finished": finished,
                "train_losses": tuple((r, total / count) for r, total, count in self.train_losses)}

    def note_loss(self, round_index: int, loss: float) -> None:
        """One inner step's train loss (on a peer's last stage), into its round's mean."""
        if not math.isfinite(loss):
            return
        if self.train_losses and self.train_losses[-1][0] == round_index:
            _, total, count = self.train_losses.pop()
            self.train_losses.append((round_index, total + loss, count + 1))
        else:
            self.train_losses.append((round_index, loss, 1))

    def note_eval(self, round_index: int, inner_step: int, loss: float | None, first: bool = False) -> None:
        """An evaluation of the anchor after ``round_index`` rounds (None: not on the last stage), in the metrics,
        the summary (its start, or its final eval loss), the console and the records."""
        self.metrics.write("eval", round=round_index, inner_step=inner_step, eval_loss=loss)
        if first:
            self.summary.eval_loss_start, self.summary.eval_round_start = loss, round_index
        else:
            self.reporter.on_eval(round_index, loss)
            self.summary.eval_loss_final = loss
        if loss is not None:
            self.evals.append((round_index, loss))

    def note_anchor(self, units: list[Held] | None = None) -> None:
        """Publish where each of ``units`` (default: all) stands, after its anchor changed (divergence checks, donor
        choice, state checks). Records carry the fingerprint of the whole shared state (anchor, momentum, counts:
        ``swarm_state.fingerprint``); the metrics rows carry the anchor's full sha256, one of its inputs: each
        tensor is hashed once per change."""
        for unit in self.held if units is None else units:
            fingerprint, self.fingerprints[self.held.index(unit)] = unit.stage.state_fingerprint()
            if unit.swarm is not None:
                unit.swarm.anchor_fingerprint = fingerprint
            if unit.sync is not None:
                unit.sync.remember(fingerprint)
                if unit.swarm is not None:
                    unit.swarm.prior_anchor_fingerprint = unit.sync.fingerprints.get(unit.stage.applied_round - 1, "")

    def log_sync_events(self) -> tuple[bool, bool]:
        """Note the anchors the reloads and resyncs just done changed, and write their metrics and summary: (whether
        there were any, whether the stage process reloaded)."""
        any_events, reloaded = False, False
        changed = [unit for unit in self.held if unit.sync.events]
        self.note_anchor(changed)
        for unit in changed:
            events, unit.sync.events = unit.sync.events, []
            for event in events:
                any_events = True
                digest = self.digest(unit)
                self.metrics.write("sync", **event, **self.unit_facts(unit), inner_step=self.held[0].stage.inner_step,
                                   anchor_sha256=digest)
                if event["action"] == "reload":
                    reloaded = True  # the stage process reloads once, all its fragments together
                else:
                    self.summary.resyncs += 1
        self.summary.reloads += reloaded
        return any_events, reloaded

    def unit_facts(self, unit: Held) -> dict:
        """How metrics rows name a fragment (nothing when the stage is the unit)."""
        return {} if not unit.stage.unit.is_fragment else {"fragment": unit.stage.unit.fragment}

    def write_rounds(self, units: list[Held], reports: list[RoundReport], flush: bool = False) -> None:
        """The metrics row of each unit's round end, and what it tells the sync (the group met, the new anchor)."""
        for unit, report in zip(units, reports):
            self.last_group[self.held.index(unit)] = list(report.outcome.group_peers)
            if report.applied_round is not None and report.outcome.group_peers:
                self.groups[self.held.index(unit)].append((report.applied_round, tuple(report.outcome.group_peers)))
            if unit.sync is not None:  # believed from now on: the groupmates whose parts were not refused
                banned = set(report.outcome.banned)
                unit.sync.witnesses.met_group([p for p in report.outcome.group_peers if p not in banned])
        self.note_anchor(units)
        for unit, report in zip(units, reports):
            self.metrics.write("round", **report.record(), **self.unit_facts(unit),
                               inner_step=self.held[0].stage.inner_step, anchor_sha256=self.digest(unit),
                               anchor_applied_round=unit.stage.applied_round, flush=flush,
                               record_reads=unit.swarm.record_reads if unit.swarm is not None else 0)

    def digest(self, unit: Held) -> str:
        """The metrics rows' ``anchor_sha256`` of a unit (already computed with its fingerprint), if asked for."""
        return self.fingerprints[self.held.index(unit)] if self.anchor_digest else ""

    def account(self, reports: list[RoundReport]) -> None:
        """One round of the peer in the summary and on the console (every unit's round end of it)."""
        if not reports:
            return
        for one in reports:  # each unit's averager bans on its own
            for peer, why in one.outcome.ban_reasons.items():
                self.bans.pop(peer, None)
                self.bans[peer] = why
        while len(self.bans) > MAX_BANS_SHOWN:
            del self.bans[next(iter(self.bans))]
        report = combined_report(reports)
        self.summary.account(report, self.inner_steps)
        self.memtrace.tick()
        self.reporter.on_round(report)
