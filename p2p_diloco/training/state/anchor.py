"""A peer's trained model at rest: the anchors of every stage of one of its checkpoints, joined into the whole model.

The anchor (the model the swarm agrees on after the last applied round) is what a user takes away from a run, not
a stage's inner parameters, which are partway through a round. A pipelined peer keeps one checkpoint folder per
stage (``checkpoints/stage<j>of<P>/``), a peer of a run averaged by fragment one per fragment
(``checkpoints/fragment<f>of<F>/``); :func:`load_peer_anchor` takes the newest inner step that every stage has
a checkpoint of (as a resume does), checks each file, and joins the stages' anchors by their (global) names.
Called by ``p2p-diloco export`` and ``p2p-diloco generate``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from p2p_diloco.model import ModelArgs, Transformer
from p2p_diloco.training.state.checkpoint import CheckpointError, checkpoint_steps, list_checkpoints, read_checkpoint

STAGE_FOLDER = re.compile(r"(stage|fragment)(\d+)of(\d+)")  # a peer averaged by fragment keeps one per fragment


@dataclass
class PeerAnchor:
    """The whole model of a peer's checkpoint."""

    args: ModelArgs
    tensors: dict[str, torch.Tensor]  # our parameter names -> fp32 anchor values
    step: int
    round_index: int  # the round the peer was in; the anchor holds the rounds before it that were applied
    applied_round: int
    folders: list[Path] = field(default_factory=list)  # one per stage
    data_path: Optional[str] = None  # the shards the run trained on, if the checkpoint says
    config_path: Optional[Path] = None  # the peer's config.toml, if found beside its checkpoints


def checkpoint_root(path: Path) -> Path:
    """The folder holding a peer's ``stage<j>of<P>`` folders, from the path a user gives: the peer's output folder,
    its checkpoints folder, or one stage's folder."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if STAGE_FOLDER.fullmatch(path.name):
        return path.parent
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def load_peer_anchor(path: Path, step: Optional[int] = None) -> PeerAnchor:
    """The joined anchor of the checkpoint at ``step`` (default: the newest that every stage has).

    Raises:
        CheckpointError: no stage folder, a stage missing, no common step, a file that fails its checks, stages of
            different runs, or anchors that do not make one whole model of the recorded shape.
    """
    root = checkpoint_root(path)
    stages = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and STAGE_FOLDER.fullmatch(p.name)) \
            if root.is_dir() else []:
        kind, index, count = STAGE_FOLDER.fullmatch(folder.name).groups()
        if list_checkpoints(folder):
            stages.setdefault((kind, int(count)), {})[int(index)] = folder
    if not stages:
        raise CheckpointError(f"no loadable checkpoint in {root}: expected a peer's output folder or its checkpoints "
                              "folder, holding stage<j>of<P> (or fragment<f>of<F>) folders with step-*.json "
                              "checkpoints")
    if len(stages) > 1:
        raise CheckpointError(f"{root} holds checkpoints of {', '.join(f'{c} {k}s' for k, c in sorted(stages))}; give "
                              "the folder of one run")
    ((kind, count), folders), = stages.items()
    missing = [j for j in range(count) if j not in folders]
    if missing:
        raise CheckpointError(f"{root}: {kind} {missing[0]} of {count} has no checkpoint (expected "
                              f"{root / f'{kind}{missing[0]}of{count}'}); every {kind} is needed for the whole model")
    ordered = [folders[j] for j in range(count)]
    common = set(checkpoint_steps(ordered[0])).intersection(*(checkpoint_steps(f) for f in ordered[1:]))
    if step is not None and step not in common:
        raise CheckpointError(f"{root}: no checkpoint of inner step {step} in every stage (steps in common: "
                              f"{sorted(common) or 'none'})")
    if not common:
        raise CheckpointError(f"{root}: the stages have no checkpoint of the same inner step")
    step = max(common) if step is None else step
    tensors, metas = {}, []
    for folder in ordered:
        manifest = next(p for p in list_checkpoints(folder) if p.name == f"step-{step:08d}.json")
        checkpoint = read_checkpoint(manifest)
        metas.append(checkpoint.meta)
        tensors.update({name[len("anchor/"):]: value.float() for name, value in checkpoint.tensors.items()
                        if name.startswith("anchor/")})
    if len({meta.get("run_id") for meta in metas}) != 1:
        raise CheckpointError(f"{root}: the stages' checkpoints belong to different runs "
                              f"({sorted({str(meta.get('run_id')) for meta in metas})})")
    config_path = root.parent / "config.toml"
    args = _model_args(metas[0], config_path if config_path.is_file() else None, tensors, root)
    check_whole_model(args, tensors, str(root))
    return PeerAnchor(args, tensors, step, int(metas[-1].get("round", 0)), int(metas[-1].get("applied_round", -1)),
                      ordered, metas[0].get("data_path"), config_path if config_path.is_file() else None)


def check_whole_model(args: ModelArgs, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Raise CheckpointError unless ``tensors`` are exactly the parameters of the whole model of shape ``args``."""
    expected = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{where}: the anchors are not one whole model of the recorded shape (missing "
                              f"{missing[:3] or 'none'}, unexpected {extra[:3] or 'none'})")
    wrong = [name for name, shape in expected.items() if tuple(tensors[name].shape) != shape]
    if wrong:
        raise CheckpointError(f"{where}: {wrong[0]} has shape {list(tensors[wrong[0]].shape)}, the model's is "
                              f"{list(expected[wrong[0]])}")
    bad = [name for name, value in tensors.items() if not torch.isfinite(value).all()]
    if bad:
        raise CheckpointError(f"{where}: {bad[0]} holds non-finite values")


def _model_args(meta: dict, config_path: Optional[Path], tensors: dict, root: Path) -> ModelArgs:
    """The model's shape: from the checkpoint where it records it, else from the peer's config.toml beside it
    with the vocabulary of the embedding."""
    from p2p_diloco.config import ConfigError, load_config
    from p2p_diloco.model import model_args_from_config

    try:
        if isinstance(meta.get("model"), dict):
            return ModelArgs(**meta["model"])
        if config_path is None:
            raise CheckpointError(f"{root}: the checkpoint does not record the model's shape (written before issue "
                                  "17) and no config.toml is beside it")
        embedding = tensors.get("tok_embeddings.weight")
        vocab = int(embedding.shape[0]) if embedding is not None else None
        cfg = load_config(config_path)
        return model_args_from_config(cfg.model, vocab if vocab is not None else cfg.model.vocab_size or 0)
    except (TypeError, ConfigError) as e:
        raise CheckpointError(f"{root}: the model's shape cannot be read ({e})") from None
