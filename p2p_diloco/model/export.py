"""A whole model as a Hugging Face model folder, and back.

:func:`write_hf_folder` writes the weights with transformers' names (:mod:`p2p_diloco.model.hf`) as
``model.safetensors``, or, past ``max_shard_bytes``, as ``model-0000k-of-0000n.safetensors`` shards and their
``model.safetensors.index.json`` (cut as transformers' ``save_pretrained`` cuts them), and ``p2p_diloco.json``
(where the weights came from). A run that started from a folder (``model.init_from``, its *source*) gets that
folder back: each tensor in the dtype the source stored it in, its ``config.json`` with every field kept (only the
dtype changes, when one is asked for), and its other files (tokenizer, generation config, chat template, license)
copied as they are. A run without a source gets a ``config.json`` for ``LlamaForCausalLM``, a
``generation_config.json`` and the run's tokenizer (``tokenizer.json`` and ``tokenizer_config.json``), in fp32
unless asked otherwise. The folder is written beside its destination under a temporary name and renamed into
place: an interrupted export leaves no half folder, and an existing folder is never touched.
:func:`read_hf_folder` loads such a folder into our decoder (``p2p-diloco generate`` needs no ``transformers``).
Called by ``p2p-diloco export`` and ``generate``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from p2p_diloco.model.hf import hf_config, hf_name, hf_order, tokenizer_config
from p2p_diloco.model.hf_folder import INDEX_FILE, FolderError, HFFolder, open_hf_folder
from p2p_diloco.model.llama import ModelArgs

WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "p2p_diloco.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
_SIZE = re.compile(r"\s*(\d+)\s*([kmgt]i?b|b)?\s*", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# a source's files that are weights (of this or another format) or its index: never copied
_WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx",
                     ".index.json")


class ExportError(ValueError):
    """An export that cannot be written or a folder that cannot be read; the message names the path and why."""


def parse_size(text: str) -> int:
    """Bytes of a size written as transformers writes ``max_shard_size``: ``5GB`` (10^9), ``500MiB`` (2^20), or an
    integer of bytes (ValueError: anything else, or not positive)."""
    match = _SIZE.fullmatch(str(text))
    if match is None or int(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB, or a number of bytes)")
    return int(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]


def write_hf_folder(out_dir: Path, args: ModelArgs, tensors: dict[str, torch.Tensor], *,
                    provenance: dict[str, Any], source: Optional[HFFolder] = None,
                    tokenizer_json: dict | Path | None = None, eos_token: Optional[str] = None,
                    eos_token_id: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                    max_shard_bytes: int = parse_size(DEFAULT_MAX_SHARD_SIZE)) -> Path:
    """Write the model of shape ``args`` with parameters ``tensors`` (our names) as a transformers folder.

    Args:
        source: the folder the run started from (of shape ``args``): its config and other files are kept, and
            ``dtype`` None keeps each tensor's stored dtype. Without one, the tokenizer is ``tokenizer_json`` (a
            dict or a file) with ``eos_token`` and ``dtype`` None is fp32.
        max_shard_bytes: the most bytes of tensors in one file; a model that fits is one ``model.safetensors``.

    Raises:
        ExportError: ``out_dir`` exists (nothing is overwritten) or its parent folder cannot be written.
    """
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists():
        raise ExportError(f"{out_dir} exists; give a new folder (nothing was overwritten)")
    parent = out_dir.parent
    if not parent.is_dir():
        raise ExportError(f"{parent} does not exist; create it or give another output folder")
    tmp_dir = parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        tmp_dir.mkdir()
        weights = {hf_name(name): tensors[name].detach().to("cpu", _dtype_of(name, source, dtype)).contiguous()
                   for name in hf_order(args)}
        _write_weights(tmp_dir, weights, max_shard_bytes)
        if source is not None:
            _write_json(tmp_dir / "config.json", source_config(source.config, dtype))
            _copy_other_files(source.path, tmp_dir)
        else:
            dtype_name = next(k for k, v in DTYPES.items() if v == (dtype or torch.float32))
            _write_json(tmp_dir / "config.json", hf_config(args, eos_token_id, dtype_name))
            _write_json(tmp_dir / "generation_config.json", {"eos_token_id": eos_token_id, "do_sample": True})
            if isinstance(tokenizer_json, dict):
                _write_json(tmp_dir / "tokenizer.json", tokenizer_json)
            else:
                shutil.copyfile(tokenizer_json, tmp_dir / "tokenizer.json")
            _write_json(tmp_dir / "tokenizer_config.json", tokenizer_config(eos_token, args.max_seq_len))
        _write_json(tmp_dir / PROVENANCE_FILE, provenance)
        os.rename(tmp_dir, out_dir)  # atomic; fails rather than replace a folder made meanwhile
    except OSError as e:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ExportError(f"could not write {out_dir}: {e}") from None
    return out_dir


def source_config(config: dict, dtype: Optional[torch.dtype]) -> dict:
    """The source's ``config.json`` with every field kept; a dtype asked for is written where it names one."""
    out = dict(config)
    if dtype is not None:
        name = next(k for k, v in DTYPES.items() if v == dtype)
        keys = [key for key in ("torch_dtype", "dtype") if key in out] or ["torch_dtype"]
        out.update({key: name for key in keys})
    return out


def shard_names(weights: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """The tensors of each file, in order, cut as ``huggingface_hub.split_torch_state_dict_into_shards`` cuts them:
    a new file when the next tensor would pass the bound; a tensor larger than the bound alone in its file."""
    shards, current, current_bytes = [], [], 0
    for name, value in weights.items():
        size = value.numel() * value.element_size()
        if size > max_shard_bytes:
            shards.append([name])
            continue
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    return shards + ([current] if current else [])


def _write_weights(folder: Path, weights: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    shards = shard_names(weights, max_shard_bytes)
    if len(shards) == 1:
        save_file(weights, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: weights[name] for name in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in names})
    total = sum(value.numel() * value.element_size() for value in weights.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _dtype_of(name: str, source: Optional[HFFolder], dtype: Optional[torch.dtype]) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.float32 if source is None else _STORED_DTYPES[source.tensors[name].dtype]


def _copy_other_files(source: Path, folder: Path) -> None:
    """Every file of the source beside its weights and config.json, as it is (subfolders are not copied)."""
    for path in sorted(source.iterdir()):
        if path.is_file() and not path.name.startswith(".") and path.name not in ("config.json", PROVENANCE_FILE) \
                and not path.name.endswith(_WEIGHTS_SUFFIXES):
            shutil.copyfile(path, folder / path.name)


def is_hf_folder(path: Path) -> bool:
    """Whether ``path`` looks like an exported model folder (one weights file or an index of shards)."""
    path = Path(path)
    return (path / "config.json").is_file() and ((path / WEIGHTS_FILE).is_file() or (path / INDEX_FILE).is_file())


def read_hf_folder(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """The shape and parameters (our names, in fp32) of a transformers Llama folder, sharded or not.

    Raises:
        ExportError: a missing or unreadable file, a config our decoder cannot run, or a parameter it lacks.
    """
    from safetensors import SafetensorError, safe_open

    try:
        folder = open_hf_folder(path)
    except FolderError as e:
        raise ExportError(f"{e.path}: not a model folder this decoder can run ({e.reason})") from None
    tensors = {}
    for file in folder.files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                tensors.update({name: handle.get_tensor(stored.hf_name).float()
                                for name, stored in folder.tensors.items() if stored.file == file})
        except (OSError, SafetensorError) as e:
            raise ExportError(f"{folder.path}: cannot read {file.name} ({e})") from None
    return folder.args, tensors


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n", encoding="utf-8")
