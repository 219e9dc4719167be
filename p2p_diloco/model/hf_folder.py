"""A transformers ``LlamaForCausalLM`` folder read one stage at a time: its shape, where each tensor lies, a digest.

:func:`open_hf_folder` reads ``config.json`` and the safetensors headers only (``model.safetensors``, or the shards
that ``model.safetensors.index.json`` names) and checks that the files hold exactly the parameters of that shape,
each a float tensor of the right shape: a folder our decoder cannot run is refused before anything is built.
:func:`load_stage` then fills one stage's model (or the whole model) with its own tensors only, read one at a
time with ``safetensors.safe_open``, so a peer that owns one stage never holds the whole model.
:func:`weights_digest` hashes every parameter's bytes as stored, streaming, in a canonical order: the same
weights give the same digest however the folder is sharded. Called by :mod:`p2p_diloco.model.init_from`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.model.hf import args_from_hf_config, hf_name, our_name
from p2p_diloco.model.llama import ModelArgs

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURE = "LlamaForCausalLM"
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on a header
_ROTARY_BUFFER = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # older checkpoints save it
DIGEST_VERSION = b"p2p-diloco-weights-v1\n"


@dataclass(frozen=True)
class StoredTensor:
    """Where one parameter lies in the folder: its file, transformers' name, dtype, shape and byte range."""

    file: Path
    hf_name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int


@dataclass
class HFFolder:
    """A checked folder: the model's shape and, by our parameter name, each parameter's place."""

    path: Path
    args: ModelArgs
    tensors: dict[str, StoredTensor]
    config: dict = field(default_factory=dict)  # config.json as read (export keeps every field it does not change)

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})


class FolderError(ConfigError):
    """A folder that cannot be loaded: ``path`` and ``reason`` kept apart for a caller that is not ``init_from``."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"model.init_from: {path}: {reason}")
        self.path, self.reason = path, reason


def folder_error(path: Path, message: str) -> FolderError:
    return FolderError(path, message)


def open_hf_folder(path: str | Path) -> HFFolder:
    """Read and check a ``LlamaForCausalLM`` folder without loading any tensor.

    Raises:
        ConfigError: no such folder, another architecture, a shape our decoder cannot build, a missing or damaged
            weights file, or tensors that are not exactly that shape's parameters (naming the file and tensor).
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise folder_error(path, "not a folder (expected a Hugging Face model folder with config.json and "
                                 "model.safetensors)")
    config = _read_json(path, "config.json")
    architectures = config.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures or config.get("model_type") != "llama":
        raise folder_error(path, f"config.json describes a {config.get('model_type')!r} model ({architectures}); "
                                 f"only {ARCHITECTURE} (model_type 'llama') folders can be loaded")
    try:
        args = args_from_hf_config(config)
    except (ValueError, TypeError) as e:  # ConfigError (a shape ModelArgs refuses) is a ValueError too
        raise folder_error(path, f"{e}") from None
    stored = _stored_tensors(path, args)
    _check_against(path, args, stored)
    return HFFolder(path, args, stored, config)


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model of shape ``args`` (our names) and its shape, without building it."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    block = {"attention.wq.weight": (q_dim, args.dim), "attention.wk.weight": (kv_dim, args.dim),
             "attention.wv.weight": (kv_dim, args.dim), "attention.wo.weight": (args.dim, q_dim),
             "feed_forward.w1.weight": (args.ffn_dim, args.dim), "feed_forward.w3.weight": (args.ffn_dim, args.dim),
             "feed_forward.w2.weight": (args.dim, args.ffn_dim), "attention_norm.weight": (args.dim,),
             "ffn_norm.weight": (args.dim,)}
    shapes = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    shapes.update({f"layers.{i}.{name}": shape for i in range(args.n_layers) for name, shape in block.items()})
    shapes["norm.weight"] = (args.dim,)
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    return shapes


@torch.no_grad()
def load_stage(folder: HFFolder, model: nn.Module) -> None:
    """Copy the folder's values into every parameter of ``model`` (a stage or the whole model, our names), as its
    dtype; each file is opened once and only this model's tensors are read from it."""
    from safetensors import SafetensorError, safe_open

    by_file: dict[Path, list[tuple[StoredTensor, nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        assert name in folder.tensors, f"{name} is not in the checked folder"  # open_hf_folder checked them all
        by_file.setdefault(folder.tensors[name].file, []).append((folder.tensors[name], param))
    for file, pairs in sorted(by_file.items()):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for stored, param in pairs:
                    param.copy_(handle.get_tensor(stored.hf_name))
        except (OSError, SafetensorError) as e:
            raise folder_error(folder.path, f"cannot read {file.name}: {e}") from None


def weights_digest(folder: HFFolder, chunk_bytes: int = 1 << 24) -> str:
    """sha256 of every parameter, by transformers' name in sorted order: a line of name, dtype, shape and size, then
    its bytes as stored (little-endian). Independent of the sharding and of the order in the files; read in chunks.
    """
    digest = hashlib.sha256(DIGEST_VERSION)
    for stored in sorted(folder.tensors.values(), key=lambda t: t.hf_name):
        digest.update(f"{stored.hf_name}\t{stored.dtype}\t{list(stored.shape)}\t{stored.end - stored.begin}\n"
                      .encode())
        try:
            with open(stored.file, "rb") as handle:
                handle.seek(stored.begin)
                remaining = stored.end - stored.begin
                while remaining:
                    chunk = handle.read(min(chunk_bytes, remaining))
                    if not chunk:
                        raise OSError(f"{stored.file.name} ends inside {stored.hf_name}")
                    digest.update(chunk)
                    remaining -= len(chunk)
        except OSError as e:
            raise folder_error(folder.path, f"cannot read {stored.file.name}: {e}") from None
    return digest.hexdigest()


def _read_json(path: Path, name: str) -> dict:
    try:
        value = json.loads((path / name).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise folder_error(path, f"no {name}") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise folder_error(path, f"{name} is not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise folder_error(path, f"{name} is not a JSON object")
    return value


def _weight_files(path: Path) -> dict[Path, set[str]]:
    """The weights files and, from the index, the tensors each must hold (none listed for a single file)."""
    if (path / INDEX_FILE).is_file():
        weight_map = _read_json(path, INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise folder_error(path, f"{INDEX_FILE} has no weight_map")
        files: dict[Path, set[str]] = {}
        for name, file_name in weight_map.items():
            if not isinstance(file_name, str) or Path(file_name).name != file_name:
                raise folder_error(path, f"{INDEX_FILE} names {file_name!r} for {name}, not a file in the folder")
            files.setdefault(path / file_name, set()).add(name)
        missing = sorted(f.name for f in files if not f.is_file())
        if missing:
            raise folder_error(path, f"{missing[0]} is missing (named in {INDEX_FILE}; {len(missing)} of "
                                     f"{len(files)} shard files are missing)")
        return files
    if (path / WEIGHTS_FILE).is_file():
        return {path / WEIGHTS_FILE: set()}
    raise folder_error(path, f"no {WEIGHTS_FILE} and no {INDEX_FILE}")


def _stored_tensors(path: Path, args: ModelArgs) -> dict[str, StoredTensor]:
    """Our name -> where the tensor lies, for every tensor of every weights file (a rotary buffer and a tied head
    saved anyway are left out)."""
    out: dict[str, StoredTensor] = {}
    for file, listed in sorted(_weight_files(path).items()):
        header = _read_header(file)
        absent = sorted(listed - set(header))
        if absent:
            raise folder_error(path, f"{file.name} does not hold {absent[0]}, which {INDEX_FILE} says it does")
        for theirs, stored in header.items():
            if _ROTARY_BUFFER.fullmatch(theirs) or (args.tie_embeddings and theirs == "lm_head.weight"):
                continue
            try:
                name = our_name(theirs)
            except KeyError:
                raise folder_error(path, f"{file.name}: tensor {theirs!r} is not a parameter of the Llama "
                                         "decoder this trainer runs (no biases, no extra modules)") from None
            if name in out:
                raise folder_error(path, f"{theirs} is in both {out[name].file.name} and {file.name}")
            out[name] = stored
    return out


def _check_against(path: Path, args: ModelArgs, stored: dict[str, StoredTensor]) -> None:
    expected = expected_shapes(args)
    missing = [name for name in expected if name not in stored]
    if missing:
        raise folder_error(path, f"no tensor {hf_name(missing[0])} ({len(missing)} of the {len(expected)} "
                                 "parameters config.json implies are missing)")
    for name, shape in expected.items():
        found = stored[name]
        if found.shape != shape:
            raise folder_error(path, f"{found.file.name}: {found.hf_name} has shape {list(found.shape)}, but the "
                                     f"model of config.json needs {list(shape)}")
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise folder_error(path, f"{stored[extra[0]].file.name}: {stored[extra[0]].hf_name} is not a parameter of "
                                 f"the model config.json describes ({args.n_layers} layers)")


def _read_header(file: Path) -> dict[str, StoredTensor]:
    """A safetensors file's header, each entry checked against the file's size and its dtype's byte count."""
    where = file.parent
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size < 8 or not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("not a safetensors file (bad header length)")
            header = json.loads(handle.read(length))
    except (OSError, ValueError) as e:
        raise folder_error(where, f"{file.name} cannot be read: {e}") from None
    if not isinstance(header, dict):
        raise folder_error(where, f"{file.name}: not a safetensors header")
    out, data_start = {}, 8 + length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(n) for n in info["shape"]), info["data_offsets"]
            if dtype not in FLOAT_BYTES:
                raise ValueError(f"dtype {dtype} is not a float type (F32, F16, BF16, F64)")
            if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
                    and data_start + end <= size and end - begin == FLOAT_BYTES[dtype] * math.prod(shape)):
                raise ValueError(f"its byte range {[begin, end]} does not fit its shape or the file")
        except (KeyError, TypeError, ValueError) as e:
            raise folder_error(where, f"{file.name}: tensor {name!r}: {e}") from None
        out[name] = StoredTensor(file, name, dtype, shape, data_start + begin, data_start + end)
    return out
