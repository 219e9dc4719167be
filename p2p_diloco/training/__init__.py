"""Training: the stage's DiLoCo state and round, the inner schedule, the outer optimizer, executors,
the training loop, metrics and checkpoints."""

from p2p_diloco.round.inner import inner_lr
from p2p_diloco.round.outcome import RoundReport
from p2p_diloco.round.outer import OuterOptimizer
from p2p_diloco.round.stage import Stage
from p2p_diloco.training.executor import LocalExecutor
from p2p_diloco.training.metrics import MetricsWriter, read_metrics
from p2p_diloco.training.state.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_steps,
    list_checkpoints,
    load_latest_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from p2p_diloco.training.summary import TrainSummary, anchor_digest
from p2p_diloco.training.trainer import Trainer

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "LocalExecutor",
    "MetricsWriter",
    "OuterOptimizer",
    "RoundReport",
    "Stage",
    "TrainSummary",
    "Trainer",
    "anchor_digest",
    "checkpoint_steps",
    "inner_lr",
    "list_checkpoints",
    "load_latest_checkpoint",
    "read_checkpoint",
    "read_metrics",
    "save_checkpoint",
]
