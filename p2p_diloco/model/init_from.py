"""A run that starts from a Hugging Face model folder (``model.init_from``) rather than from random weights.

The folder's ``config.json`` gives the model's shape: the ``[model]`` keys that would give it too (``preset``, the
shape keys, ``tie_embeddings = true``) must be left unset, or equal; a different value is an error naming both
(:func:`init_model_args`). Its ``tokenizer.json`` must encode text as the data's tokenizer does
(:func:`check_tokenizer`). Every peer of a run must start from the same weights, so the sha256 of the tensors
(:func:`~p2p_diloco.model.hf_folder.weights_digest`) is part of the run's config fingerprint; computing it reads
every byte once, so it is cached beside the peer's output (:func:`init_digest`) and a restart, or the other stages
of the peer, need not read the model again. Called by :mod:`p2p_diloco.stage_process` and the ``peer`` command.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.sections import ModelConfig
from p2p_diloco.model.hf_folder import HFFolder, folder_error, open_hf_folder, weights_digest
from p2p_diloco.model.llama import ModelArgs

logger = logging.getLogger(__name__)
DIGEST_CACHE_FILE = "init_from.json"
# each config key and the config.json key that gives it in a folder
_SHAPE_KEYS = (("dim", "hidden_size"), ("n_layers", "num_hidden_layers"), ("n_heads", "num_attention_heads"),
               ("n_kv_heads", "num_key_value_heads"), ("ffn_dim", "intermediate_size"),
               ("max_seq_len", "max_position_embeddings"), ("vocab_size", "vocab_size"))
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def open_init(cfg: ModelConfig) -> tuple[HFFolder, ModelArgs]:
    """The checked folder of ``cfg.init_from`` and the model's shape (see :func:`init_model_args`)."""
    folder = open_hf_folder(cfg.init_from)
    return folder, init_model_args(cfg, folder)


def init_model_args(cfg: ModelConfig, folder: HFFolder) -> ModelArgs:
    """The model's shape: the folder's, checked against the ``[model]`` keys that were set.

    Raises:
        ConfigError: a preset, or a shape key with another value than config.json's (naming both).
    """
    where = folder.path / "config.json"
    if cfg.preset is not None:
        raise ConfigError(f"model.preset: {cfg.preset!r} conflicts with model.init_from ({where} gives the shape); "
                          "leave model.preset unset")
    for key, theirs in _SHAPE_KEYS:
        mine, value = getattr(cfg, key), getattr(folder.args, key)
        if mine is not None and mine != value:
            raise ConfigError(f"model.{key}: {mine} conflicts with model.init_from's {theirs} {value} ({where}); "
                              f"leave model.{key} unset (the shape comes from the folder)")
    if cfg.tie_embeddings and not folder.args.tie_embeddings:
        raise ConfigError(f"model.tie_embeddings: true conflicts with model.init_from's tie_word_embeddings false "
                          f"({where}); leave model.tie_embeddings unset")
    return dataclasses.replace(folder.args, init_seed=0)  # nothing is drawn: every parameter is loaded


def check_tokenizer(folder: HFFolder, data_path: Path, data_tokenizer: str) -> None:
    """Refuse a folder whose ``tokenizer.json`` does not give the ids the data was prepared with: the same
    vocabulary, merges, special tokens, normalizer and pre-tokenizer (the byte tokenizer as ``export`` writes it).

    Raises:
        ConfigError: the folder has no tokenizer.json, or it differs from the data's (naming what differs).
    """
    from p2p_diloco.data.shards import TOKENIZER_FILE
    from p2p_diloco.model.hf import byte_tokenizer_json

    mine_path = folder.path / "tokenizer.json"
    if not mine_path.is_file():
        raise folder_error(folder.path, f"no tokenizer.json, so its tokenizer cannot be checked against the data's "
                                        f"({data_tokenizer}); add the model's tokenizer.json to the folder")
    mine = _read_tokenizer(mine_path)
    if data_tokenizer == "byte":
        theirs, described = byte_tokenizer_json(), "the byte tokenizer"
    else:
        theirs_path = Path(data_path) / TOKENIZER_FILE
        if not theirs_path.is_file():
            raise ConfigError(f"model.init_from: the data {data_path} was made with {data_tokenizer!r}, but its "
                              f"{TOKENIZER_FILE} is not in the folder to check the model's tokenizer against")
        theirs, described = _read_tokenizer(theirs_path), str(theirs_path)
    for part, view in (("vocabularies", _vocabulary), ("merges", _merges), ("special tokens", _added),
                       ("normalizers", lambda t: t.get("normalizer")),
                       ("pre-tokenizers", lambda t: t.get("pre_tokenizer"))):
        if view(mine) != view(theirs):
            raise ConfigError(f"model.init_from: the folder's tokenizer ({mine_path}) is not the one the data was "
                              f"prepared with ({described}): their {part} differ; prepare the data with "
                              f"`p2p-diloco prepare-data --tokenizer {mine_path}`")


def init_digest(folder: HFFolder, cache_dir: Path) -> str:
    """The folder's weights digest, from ``cache_dir/init_from.json`` when that was computed for these very files
    (path, names, sizes and modification times of config.json, which tells a tied head, and of the weights), else
    computed and cached (a cache that cannot be written is only logged)."""
    files = [folder.path / "config.json", *folder.files]
    signature = {"path": str(folder.path.resolve()),
                 "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
    cache = Path(cache_dir) / DIGEST_CACHE_FILE
    try:
        cached = json.loads(cache.read_text(encoding="utf-8"))
        if cached.get("signature") == signature and _HEX_DIGEST.fullmatch(str(cached.get("sha256"))):
            return cached["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # none yet, or unreadable: computed again
    logger.info(f"Hashing the weights of {folder.path} (every peer of the run must start from the same ones)")
    digest = weights_digest(folder)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"signature": signature, "sha256": digest}, indent=1), encoding="utf-8")
        tmp.replace(cache)
    except OSError as e:
        logger.warning(f"Could not cache the weights digest in {cache}: {e}")
    return digest


def recorded_folder(given: str, output_dir: Path) -> Path | None:
    """Where the ``model.init_from`` folder of a peer's config (``given``, as the user wrote it) is now: the absolute
    path its digest cache in ``output_dir`` records, else ``given`` from here or from ``output_dir``; None if none
    of them is a folder. Called by ``p2p-diloco export``."""
    candidates = []
    try:
        cached = json.loads((Path(output_dir) / DIGEST_CACHE_FILE).read_text(encoding="utf-8"))
        candidates.append(Path(cached["signature"]["path"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no cache (or an unreadable one): the path as written
    path = Path(given).expanduser()
    candidates += [path] if path.is_absolute() else [path, Path(output_dir) / path]
    return next((candidate for candidate in candidates if candidate.is_dir()), None)


def _read_tokenizer(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"model.init_from: {path} is not a readable tokenizer.json ({e})") from None
    if not isinstance(value, dict) or not isinstance(value.get("model"), dict):
        raise ConfigError(f"model.init_from: {path} is not a tokenizer.json (no model)")
    return value


def _vocabulary(tokenizer: dict):
    vocab = tokenizer["model"].get("vocab")  # a dict (BPE, WordPiece) or a list of [piece, score] (Unigram)
    return (tokenizer["model"].get("type"), vocab)


def _merges(tokenizer: dict) -> list[tuple[str, ...]]:
    """BPE merges, written as "a b" by older ``tokenizers`` and as ["a", "b"] by newer ones."""
    merges = tokenizer["model"].get("merges") or []
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def _added(tokenizer: dict) -> list[tuple]:
    return sorted(((t.get("id"), t.get("content"), bool(t.get("special")))
                   for t in tokenizer.get("added_tokens") or [] if isinstance(t, dict)), key=repr)
