"""The training loop of one stage process: inner steps, a round every H steps, evaluation, checkpoints.

Reads like the algorithm: for each inner step, forward/backward through the executor, clip by the
peer's global gradient norm, AdamW step; every H steps ``stage.end_round()`` (pseudo-gradient, averaging,
outer step; with overlap, the previous round's average is applied while this round's averages in the
background). At the end ``stage.flush()`` applies the round still in flight. Around it: metrics (JSONL, and
TensorBoard or W&B when asked), progress records in the DHT, checkpoints, a clean stop on request, and a
summary for ``p2p-diloco swarm``. Called by :mod:`p2p_diloco.stage_process`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import resource
import time
from dataclasses import asdict
from pathlib import Path

import torch

from p2p_diloco.config import Config, dump_config
from p2p_diloco.data.prepare import recorded_data_path
from p2p_diloco.faults import hold_point
from p2p_diloco.monitoring.sinks import open_sinks
from p2p_diloco.round.fragments import Fragments
from p2p_diloco.round.outcome import RoundReport
from p2p_diloco.round.stage import Stage
from p2p_diloco.training.ledger import Held, Ledger
from p2p_diloco.training.metrics import MetricsWriter
from p2p_diloco.training.own_check import OwnCheck
from p2p_diloco.training.round_ends import end_rounds, wait_for_groupmates
from p2p_diloco.training.state.persist import resume_stage, save_stage
from p2p_diloco.training.summary import (
    NullReporter,
    Reporter,
    TrainSummary,
    anchor_digest,
)
from p2p_diloco.training.sync import SwarmSync, SyncGroup

logger = logging.getLogger(__name__)


class Trainer:
    """Drives one stage process through ``train.num_rounds`` rounds.

    Args:
        cfg: the whole config (the trainer reads train, data, diloco and checkpoint).
        stage: the stage's DiLoCo state.
        executor: runs forward/backward (LocalExecutor, or a pipeline stage executor).
        sampler: the peer's window sampler (``next_batch``, ``state_dict``, ``load_state_dict``).
        eval_data: held-out batches (the same on every peer).
        swarm: a :class:`SwarmLink`, or None to train alone.
        output_dir: where metrics, checkpoints and the summary go.
        peer_name: the peer's name in metrics and records (peer id of its stage 0).
        reporter: console progress.
        sync: keeps the stage in step with the swarm (reloads, resyncs), or None.
        held: in a run averaged by fragment, the fragments this stage process holds, in model order (``stage``,
            ``swarm`` and ``sync`` are then the first one's): one inner step for all (the clip by the norm over
            every fragment), and at each round end every fragment's own round; reloads decided together.
    """

    def __init__(self, cfg: Config, stage: Stage, executor, sampler, eval_data: list, *, swarm=None,
                 output_dir: Path, peer_name: str, reporter: Reporter | None = None, sync: SwarmSync | None = None,
                 held: list[Held] | None = None):
        self.held = held or [Held(stage, swarm, sync)]
        stage, swarm, sync = self.held[0].stage, self.held[0].swarm, self.held[0].sync
        self.fragments = Fragments([unit.stage for unit in self.held])  # the same order: position i is held[i]
        if cfg.diloco.streaming:  # fragments' rounds staggered (a whole stage's are not)
            self.fragments.stagger(cfg.train.num_rounds)
        self.cfg, self.stage, self.executor, self.sampler = cfg, stage, executor, sampler
        self.eval_data, self.swarm, self.output_dir = eval_data, swarm, Path(output_dir)
        self.reporter = reporter or NullReporter()
        # a peer of D data-parallel replicas trains D batches per inner step (p2p_diloco.pipeline.replicas)
        self.tokens_per_step = cfg.data.batch_size * sampler.seq_len * cfg.pipeline.replicas
        self.replicas = getattr(executor, "replicas", None)
        self.stop_requested = False
        self.tokens_per_s = 0.0  # last measured: for progress records and the metrics endpoint
        self._round_compute_s = 0.0
        self._round_steps = 0  # inner steps this peer trained in the round that just ended
        self._round_reports: list[RoundReport] = []  # fragments whose round ended early in this round (streaming)
        self._peer_round = 0  # the round _train_round trained
        self._reloaded_at: int | None = None  # the inner step a reload put the peer at, until its round is trained
        # a round ends when another peer has ended it (peers of unequal speed meet at the round end)
        self.follow_swarm = swarm is not None and cfg.diloco.round_end == "swarm"
        tag = f"stage{stage.stage_index}"
        sinks = open_sinks(cfg, output_dir=self.output_dir, peer_name=peer_name, stage_index=stage.stage_index,
                           num_stages=stage.num_stages)  # TensorBoard, W&B: none unless [metrics] asks
        self.metrics = MetricsWriter(self.output_dir / f"metrics-{tag}.jsonl", sinks)
        self.summary_path = self.output_dir / f"summary-{tag}.json"
        ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.output_dir / "checkpoints"
        # one folder per unit: the stage's, or each fragment's (a peer of another split resumes the same fragments)
        self.checkpoint_dirs = [ckpt_root / u.stage.unit.folder for u in self.held]
        num_params = sum(p.numel() for unit in self.held for p in unit.stage.params)
        self.summary = TrainSummary(peer_name, cfg.run.run_id, stage.stage_index, stage.num_stages, num_params,
                                    mode=stage.mode)
        self.ledger = Ledger(self.held, self.metrics, self.summary, self.reporter, cfg.diloco.inner_steps,
                             cfg.train.anchor_digest, num_rounds=cfg.train.num_rounds)
        # every state from other peers passes this peer's own check on its held-out batches first
        self.syncs = SyncGroup([u.sync for u in self.held], executor,
                               OwnCheck(executor, eval_data, [u.stage for u in self.held])) \
            if sync is not None else None
        for unit in self.held:
            if unit.swarm is not None and unit.sync is not None:  # the peers met in recent groups time the rounds
                unit.swarm.peers_met = unit.sync.witnesses.recently_met
                unit.swarm.discredited = unit.sync.witnesses.now_discredited

    @property
    def stages(self) -> list[Stage]:
        return self.fragments.stages

    @property
    def round_index(self) -> int:
        """The peer's round (rounds of H steps) that the next inner step belongs to. With streaming sync a fragment
        whose round ended a few steps before the regular round end is already on its next one (and a stage process
        may hold only such fragments), so the peer's round is counted by inner steps, not by its fragments' rounds."""
        return self.stage.inner_step // self.cfg.diloco.inner_steps

    def request_stop(self) -> None:
        """Finish the current inner step, apply the round in flight, checkpoint and return (signal handlers)."""
        self.stop_requested = True

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self) -> TrainSummary:
        hold_point("start")  # test hooks: unset, a dictionary lookup and a no-op
        started = time.monotonic()
        resumed = self.cfg.checkpoint.resume and self._resume()
        self._write_config()
        H, num_rounds = self.cfg.diloco.inner_steps, self.cfg.train.num_rounds
        self.ledger.note_anchor()  # the records carry this stage's anchor from the start (donors are chosen by it)
        self._publish(loss=float("nan"), tokens_per_s=0.0, force=True)
        self._wait_for_peers()
        if self.syncs is not None:
            self.syncs.at_start(resumed)
            self._log_sync_events()
        for unit in self.held:
            if unit.stage.pending is not None:  # resumed with a round in flight, and not replaced by a reload
                unit.stage.restart_pending(unit.swarm.expected_group_size(unit.stage.round_index)
                                           if unit.swarm else 1)
        self.reporter.on_start(num_rounds * H, self.stage.inner_step)
        if not resumed:  # (a resumed peer's last stage holds its start loss, the others none: the decision is the
            # peer's, or the others would wait in the evaluation's pipeline for a last stage that skips it)
            # a late joiner evaluates the state it downloaded: its round is the rounds that state holds
            self.ledger.note_eval(self._rounds_applied(), self.stage.inner_step, self._evaluate(), first=True)
        failed, save_at_finish = True, True
        try:
            while self.round_index < num_rounds and not self.stop_requested:
                if not self._train_round(H):
                    break  # stopped mid-round: the partial round is checkpointed, not averaged
                self._after_round()
            if self.round_index < num_rounds:
                for stage in self.stages:
                    stage.settle()  # a stop: keep the average in flight for the checkpoint, resume continues
            else:
                hold_point("end")
                self._flush()  # the end: apply the last round's average
                self._save_checkpoint()  # the end, saved before leaving: a failure while leaving keeps it
                changes = self.summary.reloads + self.summary.resyncs
                self._leave()
                hold_point("leave")
                # saved once, unless leaving took the swarm's agreed final state instead
                save_at_finish = self.summary.reloads + self.summary.resyncs != changes
            failed = False
        finally:
            self.summary.stopped_early = self.round_index < num_rounds
            # after a failure the step in progress may be half-applied on some stage: keep the last checkpoint
            self._finish(started, save=not failed and save_at_finish)
            if self.replicas is not None and not failed:  # (after a failure, the launcher stops the followers)
                self.replicas.stop()
        return self.summary

    def _wait_for_peers(self) -> None:
        wanted = self.cfg.train.wait_for_peers
        if self.swarm is not None and self.round_index > 0 and self.swarm.joined_swarm:
            # resumed mid-run (a restart after a crash): the swarm's records take a moment to reach a fresh DHT node,
            # and deciding on none makes a peer resumed with a round in flight wait out that round's timeouts for a
            # group the others have long finished, instead of reloading at once
            bound = self.cfg.averaging.matchmaking_time_s
            if self.swarm.wait_for_peers(self.stage.position(), 2, bound, poll_s=0.25) < 2:
                logger.info(f"No other peer of this stage visible after {bound:.0f} s; going on")
            return
        if self.swarm is None or wanted <= 1 or self.round_index > 0:
            return
        logger.info(f"Waiting for {wanted} peers of run {self.cfg.run.run_id} before the first round "
                    f"(at most {self.cfg.train.wait_for_peers_timeout_s:.0f} s)")
        seen = self.swarm.wait_for_peers(
            self.stage.position(), wanted, self.cfg.train.wait_for_peers_timeout_s,
            progress=lambda here, left_s: logger.info(f"Waiting for peers: {here} of {wanted} here, starting in at "
                                                      f"most {left_s:.0f} s"))
        if seen < wanted:
            logger.warning(f"Starting with {seen} of the {wanted} peers waited for")

    def _train_round(self, H: int) -> bool:
        """Inner steps up to the end of the current round; False if a stop was requested first.

        The round ends after its H steps, or (``diloco.round_end = "swarm"``) as soon as another peer of the
        swarm has ended it, after at least one step of this peer's own: a slower peer contributes what it
        trained in the time the fastest took for H steps, and meets the others at the round end. A peer whose
        remaining steps take less than a quarter of the matchmaking time finishes them (it reaches the others'
        group in time; peers of equal speed a few steps apart would otherwise lose those steps every round)."""
        window_start, window_tokens = time.monotonic(), 0
        train_s_before = self.summary.train_s
        peer_round = self._peer_round = self.round_index
        # a reload put the peer part-way into this round: its steps count from there
        first = max(peer_round * H, self._reloaded_at if self._reloaded_at is not None else 0)
        self._reloaded_at = None
        slowdown = self.cfg.train.slowdown
        # with streaming, only a fragment whose rounds end on the regular round end tells when the swarm ended the
        # peer's round (a shifted one's records name the next round a few steps early); every peer has one, on its
        # last stage, and its stages decide together
        paced = [unit for unit in self.held if unit.stage.round_shift == 0]
        touched = True  # the weights changed outside the inner step since the followers' last step (replicas)
        while self.stage.inner_step < (peer_round + 1) * H:
            ended = self.follow_swarm and self.stage.inner_step > first and not self._nearly_done(H) and \
                any([unit.swarm.others_ended_round(peer_round, (self.stage.inner_step - peer_round * H) / H)
                     for unit in paced])
            stop, ended = self.executor.any_stages(self.stop_requested, ended)  # every stage of the peer agrees
            if stop:
                self.stop_requested = True  # every stage of the peer stops after the same inner step
                return False
            if ended:
                break
            if self.replicas is not None:  # the round's first step, or after a merge or an early round end
                self.replicas.before_step(self.stage.inner_step, weights=touched,
                                          optimizer=self.stage.inner_step == first)
                touched = False
            step_started = time.monotonic()
            inputs, targets = self.sampler.next_batch()
            loss = self.executor.forward_backward(inputs, targets)
            # per-tensor, all fragments and stages in model order: the clip is bit-identical whatever the split
            norms = self.executor.gather_across_stages(self.fragments.grad_norms())
            total_norm = torch.linalg.vector_norm(norms, 2)
            lr = self.fragments.inner_update(total_norm)
            if slowdown > 1:  # a slower machine, for tests and benchmarks of unequal peers
                time.sleep((slowdown - 1) * (time.monotonic() - step_started))
            step_s = time.monotonic() - step_started
            self.summary.train_s += step_s
            self.summary.tokens += self.tokens_per_step
            merge_started = time.monotonic()
            due = self.fragments.merge_due()
            touched = touched or bool(due)
            if due:  # delayed mode: the previous round's average is applied now
                self.summary.train_s += time.monotonic() - merge_started
                # the anchor changed: the records published from now on name the round just applied, so they
                # must carry its fingerprint (a stale one would make peers that compare at this round see
                # divergence where there is none, and miss it where there is)
                self.ledger.note_anchor([self.held[i] for i in due])
                self._publish(loss, self.tokens_per_s, force=True)
            seconds_per_step = step_s if not self.stage.seconds_per_step else \
                0.9 * self.stage.seconds_per_step + 0.1 * step_s
            for stage in self.stages:
                stage.seconds_per_step = seconds_per_step
            window_tokens += self.tokens_per_step
            self._record_loss(loss)
            step = self.stage.inner_step
            early = [self.held[i] for i in self.fragments.ending_early(peer_round, step)]
            if early:  # streaming sync: these fragments' rounds end now, a few steps before the regular round end
                touched = True
                round_started = time.monotonic()
                self._round_reports += self._end_rounds(early, loss)
                self.summary.train_s += time.monotonic() - round_started
            if step % self.cfg.train.log_every == 0 or step % H == 0:
                tokens_per_s = self.tokens_per_s = window_tokens / max(time.monotonic() - window_start, 1e-9)
                self.metrics.write("step", inner_step=step, round=peer_round, loss=loss, lr=lr,
                                   grad_norm=float(total_norm), tokens_per_s=tokens_per_s)
                self.reporter.on_step(step, loss, tokens_per_s)
                self._publish(loss, tokens_per_s)
                window_start, window_tokens = time.monotonic(), 0
        self._round_steps = self.stage.inner_step - first
        if self.stage.inner_step < (peer_round + 1) * H:  # ended by the swarm: skip the rest of it
            logger.info(f"Stage {self.stage.stage_index} round {peer_round}: ended by the swarm after "
                        f"{self._round_steps} of {H} steps")
            self.fragments.skip_to((peer_round + 1) * H)
        self._round_compute_s = self.summary.train_s - train_s_before
        return True

    def _nearly_done(self, H: int) -> bool:
        remaining = (self.round_index + 1) * H - self.stage.inner_step
        return remaining * self.stage.seconds_per_step <= 0.25 * self.cfg.averaging.matchmaking_time_s

    def _after_round(self) -> None:
        peer_round = self._peer_round  # the round just trained (the inner step is on the next one now)
        ending = [self.held[i] for i in self.fragments.ending(peer_round)]
        if self.follow_swarm:  # the others end this round now too (they wait for this peer's contribution)
            for unit in ending:
                unit.swarm.announce(unit.stage.position(), unit.stage.round_index + 1,
                                    self.summary.last_loss or float("nan"), self.tokens_per_s)
        round_started = time.monotonic()
        reports, self._round_reports = self._round_reports + self._end_rounds(ending), []
        self.summary.train_s += time.monotonic() - round_started
        self.summary.rounds_completed += 1
        self.ledger.account(reports)
        round_index = self.round_index
        every = self.cfg.train.eval_every_rounds
        if every and round_index % every == 0 and round_index < self.cfg.train.num_rounds:
            self._evaluate_and_log(round_index)
        every = self.cfg.checkpoint.every_rounds
        if every and round_index % every == 0 and round_index < self.cfg.train.num_rounds:
            self._save_checkpoint()  # (the last round's is the run's end, saved after its flush)
        self._publish(self.summary.last_loss or float("nan"), self.tokens_per_s, force=True)
        if self.syncs is not None:
            self.syncs.after_round()
            if self._log_sync_events():
                self._publish(self.summary.last_loss or float("nan"), self.tokens_per_s, force=True)

    def _end_rounds(self, units: list[Held], loss: float | None = None) -> list[RoundReport]:
        """End the round of each of ``units`` now (:func:`~p2p_diloco.training.round_ends.end_rounds`), with its
        metrics row and its records."""
        if not units:  # streaming: every fragment of this stage process ended its round earlier in it
            return []
        reports = end_rounds(units, self.fragments, self.stage.inner_step, self.tokens_per_step,
                             self._round_compute_s)
        self.ledger.write_rounds(units, reports)
        if loss is not None:  # mid-round: the records name the round these fragments are on now
            self._publish(loss, self.tokens_per_s, force=True)
        return reports

    def _flush(self) -> None:
        """Apply the round still in flight (overlap modes), then evaluate the final anchor."""
        flush_started = time.monotonic()
        reports = self.fragments.flush()
        self.summary.train_s += time.monotonic() - flush_started  # the last round's wait counts, as all others
        flushed = [(unit, report) for unit, report in zip(self.held, reports) if report is not None]
        if flushed:
            self.ledger.write_rounds([u for u, _ in flushed], [r for _, r in flushed], flush=True)
            self.ledger.account([r for _, r in flushed])
        if self.round_index == self.cfg.train.num_rounds:
            self._evaluate_and_log(self.round_index)

    def _leave(self) -> None:
        """At the end of the run, stay until the groupmates of the last round have its result too
        (:func:`~p2p_diloco.training.round_ends.wait_for_groupmates`), and until the peers that applied it agree on
        one final state (:meth:`SyncGroup.agree_at_end`): where the last round left the swarm on more than one (its
        groups split, or this peer fell back), the peers off the state most finished peers hold download it, and the
        peers holding it stay until they have; all of it within ``averaging.round_timeout_s`` of the last round's end
        here (the bound of a round: a peer that cannot take it by then, a forger for one, does not keep the others
        waiting longer)."""
        if self.swarm is None:
            return
        self._publish(self.summary.last_loss or float("nan"), self.tokens_per_s, force=True)
        started = time.monotonic()
        wait_for_groupmates(self.held, self.ledger.last_group, started + self.cfg.averaging.next_chunk_timeout_s)
        if self.syncs is None:
            return

        def on_change() -> None:
            if self._log_sync_events():
                self._publish(self.summary.last_loss or float("nan"), self.tokens_per_s, force=True)

        if self.syncs.agree_at_end(started + self.cfg.averaging.round_timeout_s, on_change):
            return
        if self.syncs.believed_agree_at_end():  # only peers never met disagree: a claim, not a split of the swarm
            logger.info("Leaving while peers this one never met still claim another final anchor")
        else:
            logger.warning("Leaving while peers that finished the run still hold another final anchor (they could "
                           "not take the agreed one in time): their models differ from this one")

    def _log_sync_events(self) -> bool:
        """The reloads and resyncs just done, noted (:meth:`Ledger.log_sync_events`); whether there were any."""
        any_events, reloaded = self.ledger.log_sync_events()
        if reloaded:
            self._reloaded_at = self.stage.inner_step
        return any_events

    # ---- pieces -------------------------------------------------------------------------------------
    def _record_loss(self, loss: float) -> None:
        if not self.executor.is_last_stage:
            return
        if self.summary.first_loss is None:
            self.summary.first_loss = loss
        self.summary.last_loss = loss
        self.ledger.note_loss(self._peer_round, loss)

    def _rounds_applied(self) -> int:
        """Rounds the anchor holds (its stages' applied round + 1): 0 at a fresh start, more after a reload."""
        return min(stage.applied_round for stage in self.stages) + 1

    def _evaluate(self) -> float | None:
        if not self.eval_data:
            return None
        with self.fragments.anchor_weights():
            loss = self.executor.evaluate(self.eval_data)
        return loss if self.executor.is_last_stage else None

    def _evaluate_and_log(self, round_index: int) -> None:
        self.ledger.note_eval(round_index, self.stage.inner_step, self._evaluate())

    def _publish(self, loss: float, tokens_per_s: float, force: bool = False) -> None:
        for unit in self.held:
            if unit.swarm is not None:
                unit.swarm.publish(unit.stage.position(), loss, tokens_per_s, force=force)

    @functools.cached_property
    def data_path(self) -> str | None:
        """The shards folder this run trains on, absolute (recorded in checkpoints for export and generate)."""
        return recorded_data_path(self.cfg.data)

    def _save_checkpoint(self) -> None:
        for folder, stage in zip(self.checkpoint_dirs, self.stages):
            save_stage(folder, stage, self.sampler, self.summary, self.cfg.run.run_id, self.cfg.checkpoint.keep,
                       data_path=self.data_path)

    def _write_config(self) -> None:
        """``config.toml``, the resolved config of this start, once every check of the start passed (config, data,
        init_from, memory, the DHT and the swarm's fingerprint in :func:`~p2p_diloco.stage_process.run_stage`, then
        the checkpoint resumed here): a start that fails leaves the previous one. Written atomically, by stage 0."""
        if self.stage.stage_index != 0:
            return
        path = self.output_dir / "config.toml"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(dump_config(self.cfg))
        os.replace(tmp, path)

    def _resume(self) -> bool:
        path = resume_stage(list(zip(self.checkpoint_dirs, self.stages)), self.sampler, self.summary,
                            self.cfg.run.run_id, self.executor)
        if path is None:
            return False
        self.metrics.write("resume", round=self.round_index, inner_step=self.stage.inner_step,
                           checkpoint=str(path))
        return True

    def _finish(self, started: float, save: bool) -> None:
        s = self.summary
        s.inner_steps = self.stage.inner_step
        s.anchor_sha256 = anchor_digest([t for stage in self.stages for t in stage.anchor])
        s.state_bytes = {key: sum(stage.num_state_bytes()[key] for stage in self.stages)
                         for key in self.stage.num_state_bytes()}
        s.max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        s.wall_s = time.monotonic() - started
        if save and (self.stage.inner_step > 0 or self.cfg.train.num_rounds == 0):
            # mid-round too: phi, phi0 and the sampler position resume the round; a run of 0 rounds keeps its start
            self._save_checkpoint()
        self.metrics.write("summary", **asdict(s))
        self.metrics.close()
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(s), indent=2))
        tmp.replace(self.summary_path)
        self.reporter.close()
