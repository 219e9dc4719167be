"""Saving a stage process's checkpoint and resuming from one, in agreement with the peer's other stages.

A checkpoint holds the stage (:mod:`p2p_diloco.training.state.stage_state`), the sampler position, the torch RNG
and the summary so far. All stages of a peer resume from the same inner step: the newest one for which
every stage has a checkpoint. Called by :class:`p2p_diloco.training.trainer.Trainer`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import torch

from p2p_diloco.training.stage import Stage
from p2p_diloco.training.state.checkpoint import (
    CheckpointError,
    checkpoint_steps,
    load_latest_checkpoint,
    save_checkpoint,
)
from p2p_diloco.training.summary import RESUMED_FIELDS, TrainSummary

logger = logging.getLogger(__name__)


def save_stage(folder: Path, stage: Stage, sampler, summary: TrainSummary, run_id: str, keep: int,
               data_path: str | None = None) -> Path:
    """Write the stage's checkpoint; its metadata also records the whole model's shape and the shards the run trains
    on, so that ``p2p-diloco export`` and ``generate`` need nothing else."""
    stage_tensors, stage_meta = stage.state_dict()
    meta = dict(stage_meta, sampler=sampler.state_dict(), run_id=run_id, summary=asdict(summary), data_path=data_path)
    model_args = getattr(stage.module, "args", None)
    if model_args is not None:
        meta["model"] = asdict(model_args)
    tensors = dict(stage_tensors, **{"rng/torch": torch.get_rng_state()})
    path = save_checkpoint(folder, stage.inner_step, tensors, meta, keep)
    logger.info(f"Saved checkpoint {path}")
    return path


def resume_stage(folder: Path, stage: Stage, sampler, summary: TrainSummary, run_id: str, executor) -> Path | None:
    """Load the newest checkpoint all the peer's stages have; None if there is none.

    Raises:
        CheckpointError: the checkpoint belongs to another run, does not fit this stage, or the stages
            cannot agree on one.
    """
    steps = executor.common_value(checkpoint_steps(folder))
    common = set(steps[0]).intersection(*steps[1:])
    if not common:
        if any(steps):
            logger.warning(f"The stages' checkpoints have no inner step in common ({steps}): starting fresh")
        return None
    checkpoint = load_latest_checkpoint(folder, at_most_step=max(common))
    loaded = executor.common_value(None if checkpoint is None else checkpoint.step)
    if checkpoint is None and set(loaded) == {None}:  # every candidate failed its checks (warnings above)
        raise CheckpointError(f"no checkpoint in {folder} can be loaded: each is truncated, corrupt or of another "
                              "format (see the warnings above); nothing was changed. Restore a good checkpoint, or "
                              "start fresh with --no-resume or another checkpoint folder")
    if checkpoint is None or len(set(loaded)) != 1:
        raise CheckpointError(f"the stages of this peer could not agree on a checkpoint to resume from (they would "
                              f"load steps {loaded}); use --no-resume or remove the newer checkpoints")
    if checkpoint.meta.get("run_id") != run_id:
        raise CheckpointError(f"checkpoint {checkpoint.path} belongs to run {checkpoint.meta.get('run_id')!r}, "
                              f"not {run_id!r}; use another checkpoint folder or --no-resume")
    try:
        stage.load_state_dict(checkpoint.tensors, checkpoint.meta)
        sampler.load_state_dict(checkpoint.meta["sampler"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {checkpoint.path} does not fit this peer: {e}; "
                              "use another checkpoint folder or --no-resume") from None
    torch.set_rng_state(checkpoint.tensors["rng/torch"])
    previous = checkpoint.meta.get("summary", {})
    for key in RESUMED_FIELDS:
        if key in previous:
            setattr(summary, key, previous[key])
    logger.info(f"Resumed from {checkpoint.path} at round {stage.round_index}, inner step {stage.inner_step}")
    return checkpoint.path
