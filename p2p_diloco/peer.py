"""Building and running one stage process of a peer from a :class:`Config`.

:func:`run_stage` is the whole life of a stage process: data, model slice, DHT node, averager, stage
state, executor, trainer, and a shutdown that always runs. With P = 1 a peer is one such process.
Called by the ``peer`` command (and the pipeline launcher, one call per stage process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco.config import Config, ConfigError, dump_config
from p2p_diloco.data import ShardDataset, WindowSampler, eval_batches, resolve_data_path, seed_from_peer_id
from p2p_diloco.model import build_stage_model, check_split, model_args_from_config
from p2p_diloco.training.executor import LocalExecutor
from p2p_diloco.training.stage import Stage
from p2p_diloco.training.trainer import Reporter, Trainer, TrainSummary

logger = logging.getLogger(__name__)


def select_device(spec: str) -> torch.device:
    """The training device: 'auto' picks CUDA when present."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run.device: {spec!r} was asked for but CUDA is not available on this machine")
    return device


@dataclass
class StageData:
    train: ShardDataset
    eval: Optional[ShardDataset]
    seq_len: int


def load_data(cfg: Config, max_seq_len: int) -> StageData:
    path = resolve_data_path(cfg.data)
    train = ShardDataset(path, "train")
    eval_split = ShardDataset(path, "eval") if "eval" in train.meta.get("splits", {}) else None
    seq_len = cfg.data.seq_len or max_seq_len
    if seq_len > max_seq_len:
        raise ConfigError(f"data.seq_len: {seq_len} is longer than the model's max_seq_len {max_seq_len}")
    return StageData(train, eval_split, seq_len)


def resolve_split(cfg: Config, model_args) -> list[int]:
    """Blocks per stage: the configured split, or one balanced by parameter count."""
    from p2p_diloco.model import balanced_split

    if cfg.pipeline.stage_layers is not None:
        check_split(model_args, cfg.pipeline.stage_layers)
        return list(cfg.pipeline.stage_layers)
    return balanced_split(model_args, cfg.pipeline.stages)


def run_stage(cfg: Config, *, stage_index: int = 0, executor_factory: Optional[Callable] = None,
              peer_name: Optional[str] = None, reporter: Optional[Reporter] = None,
              on_trainer: Optional[Callable[[Trainer], None]] = None, dht=None) -> TrainSummary:
    """Run one stage process to the end of training (or until its trainer is asked to stop).

    Args:
        cfg: validated config.
        stage_index: which stage of the peer's pipeline this process runs.
        executor_factory: builds the executor from (model, device); default: the whole model in-process.
        peer_name: the peer's name (peer id of its stage 0); default: this process's DHT peer id.
        reporter: console progress.
        on_trainer: called with the trainer before training starts (signal handlers hook in here).
        dht: a running DHT to use instead of starting one (it is not shut down here).
    """
    from p2p_diloco.swarm import PseudoGradientAverager, SwarmLink, start_dht, visible_maddrs

    device = select_device(cfg.run.device)
    output_dir = Path(cfg.run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.toml").write_text(dump_config(cfg))

    data = load_data(cfg, max_seq_len=_max_seq_len(cfg))
    model_args = model_args_from_config(cfg.model, data.train.vocab_size)
    split = resolve_split(cfg, model_args)
    model = build_stage_model(model_args, split, stage_index).to(device)

    own_dht = dht is None
    dht = start_dht(cfg.dht) if own_dht else dht
    stage = None
    try:
        logger.info(f"DHT node up; others can join through: {' '.join(visible_maddrs(dht))}")
        peer_name = peer_name or dht.peer_id.to_base58()
        averager = PseudoGradientAverager(
            [p for p in model.parameters() if p.requires_grad], dht, run_id=cfg.run.run_id,
            stage_index=stage_index, num_stages=len(split), cfg=cfg.averaging,
        )
        total_steps = cfg.inner.total_steps or cfg.train.num_rounds * cfg.diloco.inner_steps
        stage = Stage(model, stage_index=stage_index, num_stages=len(split), inner_cfg=cfg.inner,
                      diloco_cfg=cfg.diloco, total_steps=total_steps, averager=averager)
        seed = cfg.data.seed if cfg.data.seed is not None else seed_from_peer_id(peer_name)
        sampler = WindowSampler(data.train, data.seq_len, cfg.data.batch_size, seed)
        eval_data = eval_batches(data.eval, data.seq_len, cfg.data.batch_size, cfg.data.eval_batches) \
            if data.eval is not None else []
        executor = (executor_factory or _local_executor(cfg))(model, device)
        swarm = SwarmLink(dht, cfg.run.run_id, peer_name)
        trainer = Trainer(cfg, stage, executor, sampler, eval_data, swarm=swarm, output_dir=output_dir,
                          peer_name=peer_name, reporter=reporter)
        if on_trainer is not None:
            on_trainer(trainer)
        return trainer.run()
    finally:
        if stage is not None:
            stage.shutdown()
        if own_dht:
            dht.shutdown()


def _local_executor(cfg: Config) -> Callable:
    return lambda model, device: LocalExecutor(model, device, cfg.pipeline.microbatches)


def _max_seq_len(cfg: Config) -> int:
    from p2p_diloco.model import PRESETS

    return cfg.model.max_seq_len or PRESETS[cfg.model.preset]["max_seq_len"]
