"""Saving a stage process's checkpoint and resuming from one, in agreement with the peer's other stages.

A checkpoint holds the stage (:mod:`p2p_diloco.round.stage_state`), the sampler position, the torch RNG
and the summary so far. All stages of a peer resume from the same inner step: the newest one for which
every stage has a checkpoint. Called by :class:`p2p_diloco.training.trainer.Trainer`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from p2p_diloco.round.stage import Stage
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
    started = time.monotonic()
    path = save_checkpoint(folder, stage.inner_step, tensors, meta, keep)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    logger.info(f"Saved checkpoint {path} ({size / 1e6:.1f} MB in {time.monotonic() - started:.2f} s)")
    return path


def resume_stage(held: list[tuple[Path, Stage]], sampler, summary: TrainSummary, run_id: str,
                 executor) -> Path | None:
    """Load the newest checkpoint that every unit of every stage of the peer has (``held``: this stage process's
    units, each with its checkpoint folder: its stage's, or each fragment's); None if there is none.

    Raises:
        CheckpointError: the checkpoint belongs to another run, does not fit this stage, or the stages
            cannot agree on one.
    """
    folders = [folder for folder, _ in held]
    mine = set(checkpoint_steps(folders[0])).intersection(*(checkpoint_steps(f) for f in folders[1:]))
    if len(folders) > 1 and not mine and any(checkpoint_steps(f) for f in folders):
        logger.warning(f"The fragments' checkpoints in {folders[0].parent} have no inner step in common: "
                       "starting fresh")
    steps = executor.common_value(sorted(mine))
    common = set(steps[0]).intersection(*steps[1:])
    if not common:
        if any(steps):
            logger.warning(f"The stages' checkpoints have no inner step in common ({steps}): starting fresh")
        return None
    loaded = []
    for folder, _ in held:
        checkpoint = load_latest_checkpoint(folder, at_most_step=max(common))
        loaded.append(checkpoint)
        if checkpoint is None or checkpoint.step != loaded[0].step:
            break
    local = None if None in loaded or len({c.step for c in loaded}) != 1 else loaded[0].step
    agreed = executor.common_value(local)
    if local is None and set(agreed) == {None} and None in loaded:  # every candidate failed its checks (warnings above)
        folder = folders[loaded.index(None)]
        raise CheckpointError(f"no checkpoint in {folder} can be loaded: each is truncated, corrupt or of another "
                              "format (see the warnings above); nothing was changed. Restore a good checkpoint, or "
                              "start fresh with --no-resume or another checkpoint folder")
    if local is None or len(set(agreed)) != 1:
        raise CheckpointError(f"the stages of this peer could not agree on a checkpoint to resume from (they would "
                              f"load steps {agreed}); use --no-resume or remove the newer checkpoints")
    for checkpoint in loaded:
        if checkpoint.meta.get("run_id") != run_id:
            raise CheckpointError(f"checkpoint {checkpoint.path} belongs to run {checkpoint.meta.get('run_id')!r}, "
                                  f"not {run_id!r}; use another checkpoint folder or --no-resume")
    for checkpoint, (_, stage) in zip(loaded, held):
        try:
            stage.load_state_dict(checkpoint.tensors, checkpoint.meta)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {checkpoint.path} does not fit this peer: {e}; "
                                  "use another checkpoint folder or --no-resume") from None
    checkpoint = loaded[0]
    try:
        sampler.load_state_dict(checkpoint.meta["sampler"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {checkpoint.path} does not fit this peer: {e}; "
                              "use another checkpoint folder or --no-resume") from None
    torch.set_rng_state(checkpoint.tensors["rng/torch"])
    previous = checkpoint.meta.get("summary", {})
    for key in RESUMED_FIELDS:
        if key in previous:
            setattr(summary, key, previous[key])
    stage = held[0][1]
    logger.info(f"Resumed from {checkpoint.path}{f' and {len(held) - 1} more' if len(held) > 1 else ''} at round "
                f"{stage.round_index}, inner step {stage.inner_step}")
    return checkpoint.path
