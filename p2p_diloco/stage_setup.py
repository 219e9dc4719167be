"""What a stage process builds from its config before it trains, the same in every replica of its stage: its data,
the model's shape (from ``model.init_from``) and split into stages, the units it averages, and its executor.

Called by :func:`~p2p_diloco.stage_process.run_stage` (replica 0, and a peer of one replica) and
:func:`~p2p_diloco.pipeline.replicas.run_follower` (replicas 1..D-1), which must build what replica 0 builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from p2p_diloco.config import Config, ConfigError
from p2p_diloco.data import ShardDataset, resolve_data_path
from p2p_diloco.model import PRESETS, ModelArgs, balanced_split, check_split
from p2p_diloco.model.fragments import FragmentView, check_split_fits, fitting_split, split_parameters
from p2p_diloco.model.hf_folder import HFFolder
from p2p_diloco.model.init_from import open_init
from p2p_diloco.training.executor import LocalExecutor


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
    data = StageData(train, eval_split, seq_len)
    check_eval_fits(data, cfg.data.batch_size, cfg.data.eval_batches)
    return data


def check_eval_fits(data: StageData, batch_size: int, num_eval_batches: int) -> None:
    """Refuse, before training, an eval split that does not hold one eval batch; the message names the options that
    fix it, with values that fit: no evaluation, a smaller batch or window, or a larger eval split."""
    if data.eval is None or num_eval_batches == 0:
        return
    window_len = data.seq_len + 1
    num_needed, num_have = batch_size * window_len, data.eval.num_tokens
    if num_have >= num_needed:
        return
    fixes = ["--data.eval_batches 0 (no evaluation)"]
    if num_have // window_len >= 1:
        fixes.append(f"--data.batch_size {num_have // window_len}")
    if num_have // batch_size - 1 > 1:
        fixes.append(f"--data.seq_len {num_have // batch_size - 1}")
    fraction = num_needed / (data.train.num_tokens + num_have)
    if fraction < 0.5:  # the split is by whole documents: ask for a margin over the tokens needed
        fixes.append(f"the shards made again with `prepare-data --eval-fraction {math.ceil(fraction * 1250) / 1000:g}`")
    raise ConfigError(f"data.eval_batches: the eval split of {data.eval.path} has {num_have} tokens, fewer than one "
                      f"eval batch of data.batch_size {batch_size} x (data.seq_len + 1) {window_len} = {num_needed}; "
                      f"use {', or '.join(fixes)}")


def check_vocab(data: StageData, vocab_size: int) -> None:
    """Refuse, before training, data with token ids the model's embedding does not have (a model.vocab_size below
    the data's); DataError names the file and its largest id."""
    if vocab_size < data.train.vocab_size:
        for split in (data.train, data.eval):
            if split is not None:
                split.check_token_range(vocab_size)


def max_seq_len(cfg: Config) -> int:
    """The model's longest sequence: ``model.max_seq_len``, or its preset's."""
    return cfg.model.max_seq_len or PRESETS[cfg.model.preset_name]["max_seq_len"]


def resolve_split(cfg: Config, model_args, parts: Optional[list[int]] = None) -> list[int]:
    """Blocks per stage: the configured split, or one balanced by parameter count. In a run averaged by fragment
    (``parts``: the model's fragment cut), a stage holds whole fragments: a configured split that cuts one is refused,
    and the balanced one is of whole fragments."""
    if cfg.pipeline.stage_layers is not None:
        check_split(model_args, cfg.pipeline.stage_layers)
        if parts is not None:
            check_split_fits(cfg.pipeline.stage_layers, parts)
        return list(cfg.pipeline.stage_layers)
    if parts is not None:
        return fitting_split(model_args, parts, cfg.pipeline.stages)
    return balanced_split(model_args, cfg.pipeline.stages)


def resolve_init(cfg: Config) -> tuple[HFFolder, ModelArgs]:
    """The checked ``model.init_from`` folder and the model's shape it gives (:func:`open_init`).

    Raises:
        ConfigError: see :func:`open_init`; or a folder of tied embeddings for a peer of several stages.
    """
    folder, args = open_init(cfg.model)
    if args.tie_embeddings and cfg.pipeline.stages > 1:
        raise ConfigError(f"pipeline.stages: {folder.path / 'config.json'} ties the output head to the embedding "
                          f"(tie_word_embeddings), which needs both on one stage; got {cfg.pipeline.stages} stages")
    return folder, args


def stage_units(model, parts) -> list[tuple]:
    """What this stage process averages, as (fragment or None, module, named parameters): its stage, or each fragment
    it holds (each with its own group key, records, state sharing and sync: peers of any split meet per
    fragment)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if parts is None:
        return [(None, model, named)]
    return [((f, len(parts)), _fragment_view(model, params), params)
            for f, params in split_parameters(named, parts).items()]


def _fragment_view(model, params) -> FragmentView:
    """A fragment's parameters as a module of their own (the same tensors), which still knows the model's shape
    (checkpoints record it for ``export`` and ``generate``)."""
    view = FragmentView(params)
    view.args = getattr(model, "args", None)
    return view


def make_executor(cfg: Config, pipeline, model, device):
    """The executor of this stage: local with P = 1 (DDP over the stage's replicas, if any), else pipelined."""
    if pipeline is None or pipeline.num_stages == 1:
        return LocalExecutor(model, device, cfg.pipeline.microbatches,
                             replica_group=pipeline.replica_group if pipeline is not None else None)
    from p2p_diloco.pipeline.executor import PipelineExecutor  # (torch's pipelining: only a peer of P > 1 needs it)

    return PipelineExecutor(pipeline, model, cfg.pipeline)
