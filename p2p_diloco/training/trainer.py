"""The training loop of one stage process: inner steps, a round every H steps, evaluation, checkpoints.

Reads like the algorithm: for each inner step, forward/backward through the executor, clip by the
peer's global gradient norm, AdamW step; every H steps ``stage.end_round()`` (pseudo-gradient, averaging,
outer step). Around it: metrics (JSONL), progress records in the DHT, checkpoints, a clean stop on
request, and a summary for ``p2p-diloco swarm``. Called by :mod:`p2p_diloco.peer`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Protocol

import torch

from p2p_diloco.config import Config
from p2p_diloco.training.checkpoint import CheckpointError, checkpoint_steps, load_latest_checkpoint, save_checkpoint
from p2p_diloco.training.metrics import MetricsWriter
from p2p_diloco.training.stage import RoundReport, Stage

logger = logging.getLogger(__name__)


class Reporter(Protocol):
    """Where the loop reports progress (the CLI's console, or nothing)."""

    def on_start(self, total_steps: int, done_steps: int) -> None: ...
    def on_step(self, step: int, loss: float, tokens_per_s: float) -> None: ...
    def on_round(self, report: RoundReport) -> None: ...
    def on_eval(self, round_index: int, loss: float) -> None: ...
    def close(self) -> None: ...


class NullReporter:
    def on_start(self, total_steps: int, done_steps: int) -> None: ...
    def on_step(self, step: int, loss: float, tokens_per_s: float) -> None: ...
    def on_round(self, report: RoundReport) -> None: ...
    def on_eval(self, round_index: int, loss: float) -> None: ...
    def close(self) -> None: ...


@dataclass
class TrainSummary:
    """What one stage process did, written to ``summary-stage<j>.json`` at the end."""

    peer: str
    run_id: str
    stage: int
    num_stages: int
    num_params: int
    rounds_completed: int = 0
    inner_steps: int = 0
    tokens: int = 0
    averaged_rounds: int = 0
    fallback_rounds: int = 0
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    eval_loss_start: Optional[float] = None
    eval_loss_final: Optional[float] = None
    bytes_sent: int = 0
    bytes_received: int = 0
    allreduce_bytes_equivalent: int = 0
    """Bytes a per-step fp32 ring AllReduce of this stage would have sent over the same inner steps."""
    anchor_sha256: str = ""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes held for parameters, inner optimizer state and outer state (anchor + momentum) by this stage."""
    max_rss_mb: float = 0.0
    """Peak resident memory of this stage process."""
    wall_s: float = 0.0
    stopped_early: bool = False
    group_sizes: list[int] = field(default_factory=list)


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
    """

    def __init__(self, cfg: Config, stage: Stage, executor, sampler, eval_data: list, *, swarm=None,
                 output_dir: Path, peer_name: str, reporter: Optional[Reporter] = None):
        self.cfg, self.stage, self.executor, self.sampler = cfg, stage, executor, sampler
        self.eval_data, self.swarm, self.output_dir = eval_data, swarm, Path(output_dir)
        self.reporter = reporter or NullReporter()
        self.tokens_per_step = cfg.data.batch_size * sampler.seq_len
        self.stop_requested = False
        tag = f"stage{stage.stage_index}"
        self.metrics = MetricsWriter(self.output_dir / f"metrics-{tag}.jsonl")
        self.summary_path = self.output_dir / f"summary-{tag}.json"
        ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.output_dir / "checkpoints"
        self.checkpoint_dir = ckpt_root / f"stage{stage.stage_index}of{stage.num_stages}"
        num_params = sum(p.numel() for p in stage.params)
        self.summary = TrainSummary(peer_name, cfg.run.run_id, stage.stage_index, stage.num_stages, num_params)

    def request_stop(self) -> None:
        """Finish the current inner step, write a checkpoint and return (called from signal handlers)."""
        self.stop_requested = True

    # ---- the loop -----------------------------------------------------------------------------------
    def run(self) -> TrainSummary:
        started = time.monotonic()
        if self.cfg.checkpoint.resume:
            self._maybe_resume()
        H, num_rounds = self.cfg.diloco.inner_steps, self.cfg.train.num_rounds
        self.reporter.on_start(num_rounds * H, self.stage.inner_step)
        self._publish(loss=float("nan"), tokens_per_s=0.0, force=True)
        if self.summary.eval_loss_start is None:
            self.summary.eval_loss_start = self._evaluate()
            self.metrics.write("eval", round=0, inner_step=0, eval_loss=self.summary.eval_loss_start)
        failed = True
        try:
            while self.stage.round_index < num_rounds and not self.stop_requested:
                if not self._train_round(H):
                    break  # stopped mid-round: the partial round is checkpointed, not averaged
                self._after_round()
            failed = False
        finally:
            self.summary.stopped_early = self.stage.round_index < num_rounds
            # after a failure the step in progress may be half-applied on some stage: keep the last checkpoint
            self._finish(started, save=not failed)
        return self.summary

    def _train_round(self, H: int) -> bool:
        """Inner steps up to the end of the current round; False if a stop was requested first."""
        window_start, window_tokens = time.monotonic(), 0
        while self.stage.inner_step < (self.stage.round_index + 1) * H:
            if self.executor.any_stage(self.stop_requested):
                self.stop_requested = True  # every stage of the peer stops after the same inner step
                return False
            inputs, targets = self.sampler.next_batch()
            loss = self.executor.forward_backward(inputs, targets)
            norms = self.executor.gather_across_stages(self.stage.grad_norms())  # per-tensor, all stages
            total_norm = torch.linalg.vector_norm(norms, 2)
            lr = self.stage.inner_update(total_norm)
            grad_norm = float(total_norm)
            window_tokens += self.tokens_per_step
            step = self.stage.inner_step
            self._record_loss(loss)
            if step % self.cfg.train.log_every == 0 or step % H == 0:
                tokens_per_s = window_tokens / max(time.monotonic() - window_start, 1e-9)
                self.metrics.write("step", inner_step=step, round=self.stage.round_index, loss=loss, lr=lr,
                                   grad_norm=grad_norm, tokens_per_s=tokens_per_s)
                self.reporter.on_step(step, loss, tokens_per_s)
                self._publish(loss, tokens_per_s)
                window_start, window_tokens = time.monotonic(), 0
        return True

    def _after_round(self) -> None:
        tokens = self.cfg.diloco.inner_steps * self.tokens_per_step
        expected = self.swarm.expected_group_size(self.stage) if self.swarm else 1
        report = self.stage.end_round(tokens, expected)
        self._account_round(report)
        self.reporter.on_round(report)
        round_index = self.stage.round_index
        every = self.cfg.train.eval_every_rounds
        if (every and round_index % every == 0) or round_index == self.cfg.train.num_rounds:
            loss = self._evaluate()
            self.metrics.write("eval", round=round_index, inner_step=self.stage.inner_step, eval_loss=loss)
            self.reporter.on_eval(round_index, loss)
            self.summary.eval_loss_final = loss
        every = self.cfg.checkpoint.every_rounds
        if every and round_index % every == 0:
            self._save_checkpoint()
        self._publish(self.summary.last_loss or float("nan"), 0.0, force=True)

    def _account_round(self, report: RoundReport) -> None:
        s = self.summary
        s.rounds_completed += 1
        s.bytes_sent += report.bytes_sent
        s.bytes_received += report.bytes_received
        s.group_sizes.append(report.group_size)
        if report.averaged:
            s.averaged_rounds += 1
            g = report.group_size
            s.allreduce_bytes_equivalent += int(self.cfg.diloco.inner_steps * 2 * (g - 1) / g * 4 * s.num_params)
        else:
            s.fallback_rounds += 1
        digest = anchor_digest(self.stage.anchor) if self.cfg.train.anchor_digest else ""
        self.metrics.write("round", **asdict(report), inner_step=self.stage.inner_step, anchor_sha256=digest)

    # ---- pieces -------------------------------------------------------------------------------------
    def _record_loss(self, loss: float) -> None:
        if not self.executor.is_last_stage:
            return
        if self.summary.first_loss is None:
            self.summary.first_loss = loss
        self.summary.last_loss = loss

    def _evaluate(self) -> Optional[float]:
        if not self.eval_data:
            return None
        with self.stage.anchor_weights():
            loss = self.executor.evaluate(self.eval_data)
        return loss if self.executor.is_last_stage else None

    def _publish(self, loss: float, tokens_per_s: float, force: bool = False) -> None:
        if self.swarm is not None:
            self.swarm.publish(self.stage, loss, tokens_per_s, force=force)

    def _save_checkpoint(self) -> None:
        meta = dict(self.stage.state_meta(), sampler=self.sampler.state_dict(), run_id=self.cfg.run.run_id,
                    summary=asdict(self.summary))
        tensors = dict(self.stage.state_tensors(), **{"rng/torch": torch.get_rng_state()})
        path = save_checkpoint(self.checkpoint_dir, self.stage.inner_step, tensors, meta, self.cfg.checkpoint.keep)
        logger.info(f"Saved checkpoint {path}")

    def _maybe_resume(self) -> None:
        # every stage of the peer must resume from the same inner step: the newest one they all have
        steps = self.executor.common_value(checkpoint_steps(self.checkpoint_dir))
        common = set(steps[0]).intersection(*steps[1:])
        if not common:
            if any(steps):
                logger.warning(f"The stages' checkpoints have no inner step in common ({steps}): starting fresh")
            return
        checkpoint = load_latest_checkpoint(self.checkpoint_dir, at_most_step=max(common))
        loaded = self.executor.common_value(None if checkpoint is None else checkpoint.step)
        if checkpoint is None or len(set(loaded)) != 1:
            raise CheckpointError(f"the stages of this peer could not agree on a checkpoint to resume from "
                             f"(they would load steps {loaded}); use --no-resume or remove the newer checkpoints")
        if checkpoint.meta.get("run_id") != self.cfg.run.run_id:
            raise CheckpointError(f"checkpoint {checkpoint.path} belongs to run {checkpoint.meta.get('run_id')!r}, "
                                  f"not {self.cfg.run.run_id!r}; use another checkpoint folder or --no-resume")
        try:
            self.stage.load_state(checkpoint.tensors, checkpoint.meta)
            self.sampler.load_state_dict(checkpoint.meta["sampler"])
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {checkpoint.path} does not fit this peer: {e}; "
                                  "use another checkpoint folder or --no-resume") from None
        torch.set_rng_state(checkpoint.tensors["rng/torch"])
        previous = checkpoint.meta.get("summary", {})
        for key in ("rounds_completed", "averaged_rounds", "fallback_rounds", "bytes_sent", "bytes_received",
                    "allreduce_bytes_equivalent", "first_loss", "eval_loss_start", "group_sizes"):
            if key in previous:
                setattr(self.summary, key, previous[key])
        logger.info(f"Resumed from {checkpoint.path} at round {self.stage.round_index}")
        self.metrics.write("resume", round=self.stage.round_index, inner_step=self.stage.inner_step,
                           checkpoint=str(checkpoint.path))

    def _finish(self, started: float, save: bool) -> None:
        s = self.summary
        s.inner_steps = self.stage.inner_step
        s.tokens = s.inner_steps * self.tokens_per_step
        s.anchor_sha256 = anchor_digest(self.stage.anchor)
        s.state_bytes = self.stage.num_state_bytes()
        s.max_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        s.wall_s = time.monotonic() - started
        if save and self.stage.inner_step > 0:
            self._save_checkpoint()  # mid-round too: phi, phi0 and the sampler position resume the round
        self.metrics.write("summary", **asdict(s))
        self.metrics.close()
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(s), indent=2))
        tmp.replace(self.summary_path)
        self.reporter.close()


def anchor_digest(anchor: list[torch.Tensor]) -> str:
    """sha256 of the anchor's bytes: equal digests mean bit-identical anchors."""
    digest = hashlib.sha256()
    for tensor in anchor:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
