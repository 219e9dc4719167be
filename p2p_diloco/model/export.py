"""A whole model as a Hugging Face model folder, and back.

:func:`write_hf_folder` writes ``config.json`` (``LlamaForCausalLM``), ``generation_config.json``,
``model.safetensors`` with transformers' names (:mod:`p2p_diloco.model.hf`), the tokenizer (``tokenizer.json``
and ``tokenizer_config.json``) and ``p2p_diloco.json`` (where the weights came from). The folder is written
beside its destination under a temporary name and renamed into place: an interrupted export leaves no half
folder, and an existing folder is never touched. :func:`read_hf_folder` loads such a folder into our decoder
(``p2p-diloco generate`` needs no ``transformers``). Called by ``p2p-diloco export`` and ``generate``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from p2p_diloco.model.hf import args_from_hf_config, hf_config, hf_name, our_name, tokenizer_config
from p2p_diloco.model.llama import ModelArgs

WEIGHTS_FILE = "model.safetensors"
PROVENANCE_FILE = "p2p_diloco.json"


class ExportError(ValueError):
    """An export that cannot be written or a folder that cannot be read; the message names the path and why."""


def write_hf_folder(out_dir: Path, args: ModelArgs, tensors: dict[str, torch.Tensor], *,
                    tokenizer_json: dict | Path, eos_token: Optional[str], eos_token_id: Optional[int],
                    provenance: dict[str, Any]) -> Path:
    """Write the model of shape ``args`` with parameters ``tensors`` (our names) as a transformers folder.

    Raises:
        ExportError: ``out_dir`` exists (nothing is overwritten) or its parent folder cannot be written.
    """
    from safetensors.torch import save_file

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
        weights = {hf_name(name): value.detach().to("cpu", torch.float32).contiguous()
                   for name, value in tensors.items() if not (args.tie_embeddings and name == "output.weight")}
        save_file(weights, str(tmp_dir / WEIGHTS_FILE), metadata={"format": "pt"})
        _write_json(tmp_dir / "config.json", hf_config(args, eos_token_id))
        _write_json(tmp_dir / "generation_config.json", {"eos_token_id": eos_token_id, "do_sample": True})
        if isinstance(tokenizer_json, dict):
            _write_json(tmp_dir / "tokenizer.json", tokenizer_json)
        else:
            shutil.copyfile(tokenizer_json, tmp_dir / "tokenizer.json")
        _write_json(tmp_dir / "tokenizer_config.json", tokenizer_config(eos_token))
        _write_json(tmp_dir / PROVENANCE_FILE, provenance)
        os.rename(tmp_dir, out_dir)  # atomic; fails rather than replace a folder made meanwhile
    except OSError as e:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise ExportError(f"could not write {out_dir}: {e}") from None
    return out_dir


def is_hf_folder(path: Path) -> bool:
    """Whether ``path`` looks like an exported model folder."""
    return (Path(path) / "config.json").is_file() and (Path(path) / WEIGHTS_FILE).is_file()


def read_hf_folder(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """The shape and parameters (our names) of a transformers Llama folder with one ``model.safetensors``.

    Raises:
        ExportError: a missing or unreadable file, a config our decoder cannot run, or a parameter it lacks.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        args = args_from_hf_config(config)
        weights = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError, SafetensorError) as e:
        raise ExportError(f"{path}: not a model folder this decoder can run ({e})") from None
    try:
        tensors = {our_name(name): value.float() for name, value in weights.items()}
    except KeyError as e:
        raise ExportError(f"{path}: parameter {e.args[0]!r} is not one of this decoder's") from None
    return args, tensors


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=False) + "\n", encoding="utf-8")
