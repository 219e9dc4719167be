"""``p2p-diloco export``: a peer's trained model as a Hugging Face folder that transformers loads.

Reads the newest checkpoint every stage of the peer has (or ``--step``), joins the stages' anchors into the whole
model (:mod:`p2p_diloco.training.state.anchor`) and writes it with its tokenizer
(:mod:`p2p_diloco.model.export`). Also holds what ``generate`` shares with it: finding the model and the tokenizer
of a checkpoint or an exported folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

    from p2p_diloco.model.hf_folder import HFFolder
    from p2p_diloco.training.state.anchor import PeerAnchor

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # model.export.DTYPES, named here without importing torch


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a checkpoint's model as a Hugging Face folder (LlamaForCausalLM + tokenizer)",
        allow_abbrev=False,
        description="Write the model a peer trained (the anchor: the swarm's agreed model after its last applied "
        "round, every pipeline stage joined) as a Hugging Face folder: config.json for LlamaForCausalLM, "
        "model.safetensors (or shards and their index) with transformers' parameter names, and the tokenizer. A "
        "run that started from a folder (model.init_from) gets that folder back: its dtype, every config.json "
        "field, and its tokenizer and generation files as they are. Load it with "
        "transformers.AutoModelForCausalLM.from_pretrained(OUT) and AutoTokenizer.from_pretrained(OUT). "
        "Nothing is overwritten: OUT must not exist.",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a peer's output folder (with checkpoints/ and config.toml), its checkpoints folder, or "
                        "one stage's checkpoint folder")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write (must not exist)")
    parser.add_argument("--step", type=int, metavar="N",
                        help="the inner step of the checkpoint (default: the newest that every stage has)")
    parser.add_argument("--tokenizer", metavar="SPEC",
                        help="'byte' or a tokenizer.json (default: the tokenizer of the shards the run trained on; "
                        "a run from model.init_from keeps its folder's tokenizer files)")
    parser.add_argument("--dtype", choices=["auto", *DTYPE_NAMES], default="auto",
                        help="the weights' dtype (default auto: each tensor's dtype in the model.init_from folder the "
                        "run started from, else float32)")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="the most bytes of one weights file, as transformers' save_pretrained (default 5GB; "
                        "e.g. 500MB, 2GiB): a larger model is written as model-0000k-of-0000n.safetensors shards "
                        "and model.safetensors.index.json")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, _overrides) -> int:
    from p2p_diloco.model.export import DTYPES, ExportError, parse_size, write_hf_folder
    from p2p_diloco.training.state.anchor import load_peer_anchor

    out = Path(args.out).expanduser()
    if out.exists():  # before reading anything: nothing is overwritten
        raise ExportError(f"{out} exists; give a new folder (nothing was overwritten)")
    try:
        max_shard_bytes = parse_size(args.max_shard_size)
    except ValueError as e:
        raise ExportError(f"--max-shard-size: {e}") from None
    anchor = load_peer_anchor(Path(args.checkpoint), args.step)
    source = init_from_source(anchor)
    if source is not None and args.tokenizer is not None:
        raise ExportError(f"--tokenizer: the run started from {source.path} (model.init_from), whose tokenizer files "
                          "are exported as they are; leave --tokenizer out")
    num_values = sum(t.numel() for t in anchor.tensors.values())
    provenance = {"source": str(anchor.folders[0].parent.resolve()), "step": anchor.step, "round": anchor.round_index,
                  "applied_round": anchor.applied_round, "stages": len(anchor.folders), "parameters": num_values}
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    if source is not None:
        described = f"the tokenizer and settings of {source.path}"
        provenance.update(init_from=str(source.path.resolve()), tokenizer="model.init_from")
        write_hf_folder(out, anchor.args, anchor.tensors, provenance=provenance, source=source, dtype=dtype,
                        max_shard_bytes=max_shard_bytes)
    else:
        tokenizer = checkpoint_tokenizer(anchor.data_path, anchor.config_path, args.tokenizer,
                                         anchor.args.vocab_size)
        files = tokenizer_files(tokenizer)
        described = f"tokenizer {tokenizer.name}"
        provenance.update(tokenizer=tokenizer.name)
        write_hf_folder(out, anchor.args, anchor.tensors, provenance=provenance, tokenizer_json=files.json,
                        eos_token=files.eos_token, eos_token_id=tokenizer.eot_id, dtype=dtype,
                        max_shard_bytes=max_shard_bytes)
    applied = f"rounds up to {anchor.applied_round} applied" if anchor.applied_round >= 0 \
        else "no round applied yet: the initial model"
    print(f"Exported the anchor at inner step {anchor.step} ({applied}) of a "
          f"{len(anchor.folders)}-stage peer, {num_values:,} parameters, {described}, to {out}\n"
          f"Load it with transformers: AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def init_from_source(anchor: PeerAnchor) -> Optional[HFFolder]:
    """The ``model.init_from`` folder the peer started from (its config.toml says), checked to be of the
    checkpoint's shape; None for a run from random weights. A recorded folder that is gone or no longer fits is a
    warning, and the export is written as for a run without one."""
    import dataclasses

    from p2p_diloco.config import load_config
    from p2p_diloco.model.hf_folder import FolderError, open_hf_folder
    from p2p_diloco.model.init_from import recorded_folder

    if anchor.config_path is None:
        return None
    given = load_config(anchor.config_path).model.init_from
    if given is None:
        return None
    path = recorded_folder(given, anchor.config_path.parent)
    try:
        if path is None:
            raise FolderError(Path(given), "not here")
        source = open_hf_folder(path)
    except FolderError as e:
        print(f"warning: the run started from {e.path} (model.init_from), which cannot be read ({e.reason}): "
              "exporting without its dtype, settings and tokenizer files", file=sys.stderr)
        return None
    if dataclasses.replace(source.args, init_seed=0) != dataclasses.replace(anchor.args, init_seed=0):
        print(f"warning: the run started from {path} (model.init_from), whose config.json no longer gives the "
              "checkpoint's shape: exporting without its dtype, settings and tokenizer files", file=sys.stderr)
        return None
    return source


@dataclass
class TokenizerFiles:
    json: Any  # a tokenizer.json as a dict, or the path of one
    eos_token: Optional[str]


def tokenizer_files(tokenizer) -> TokenizerFiles:
    """What an exported folder holds of ``tokenizer``."""
    from p2p_diloco.data import ByteTokenizer
    from p2p_diloco.model.hf import BYTE_EOT, byte_tokenizer_json

    if isinstance(tokenizer, ByteTokenizer):
        return TokenizerFiles(byte_tokenizer_json(), BYTE_EOT)
    eos = None if tokenizer.eot_id is None else tokenizer._tokenizer.id_to_token(tokenizer.eot_id)
    return TokenizerFiles(tokenizer.path, eos)


def checkpoint_tokenizer(data_path: Optional[str], config_path: Optional[Path], spec: Optional[str], vocab_size: int):
    """The tokenizer of a checkpoint's model: ``spec`` if given, else that of the shards the run trained on.

    Raises:
        DataError: no way to tell, or a tokenizer with more ids than the model's vocabulary.
    """
    from p2p_diloco.data import ByteTokenizer, DataError, load_tokenizer, shards_tokenizer

    if spec is not None:
        tokenizer = load_tokenizer(spec)
    else:
        if data_path is None and config_path is not None:
            from p2p_diloco.config import load_config

            path = load_config(config_path).data.path
            if path == "builtin":
                return ByteTokenizer()
            given = Path(path).expanduser()  # relative to where the peer ran, or else to its output folder
            data_path = str(given if given.is_dir() or given.is_absolute() else config_path.parent / given)
        if data_path is None or not Path(data_path).is_dir():
            raise DataError("cannot tell which tokenizer this model was trained with (its shards folder "
                            f"{data_path or '(not recorded)'} is not here): give --tokenizer byte or a tokenizer.json")
        tokenizer = shards_tokenizer(data_path)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, more than the model's vocabulary "
                        f"of {vocab_size}")
    return tokenizer


def load_model_source(source: Path, step: Optional[int], spec: Optional[str]):
    """(model args, parameters, tokenizer, a description) of a checkpoint or an exported folder."""
    from p2p_diloco.data import ByteTokenizer, load_tokenizer
    from p2p_diloco.model.export import PROVENANCE_FILE, is_hf_folder, read_hf_folder
    from p2p_diloco.training.state.anchor import check_whole_model, load_peer_anchor

    if is_hf_folder(source):
        args, tensors = read_hf_folder(source)
        check_whole_model(args, tensors, str(source))
        if spec is None:
            provenance = _read_json(source / PROVENANCE_FILE)
            spec = "byte" if provenance.get("tokenizer") == "byte" else str(source / "tokenizer.json")
        tokenizer = ByteTokenizer() if spec == "byte" else load_tokenizer(spec)
        return args, tensors, tokenizer, f"exported model {source}"
    anchor = load_peer_anchor(source, step)
    tokenizer = checkpoint_tokenizer(anchor.data_path, anchor.config_path, spec, anchor.args.vocab_size)
    return anchor.args, anchor.tensors, tokenizer, f"the anchor at inner step {anchor.step} of {source}"


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def device_of(spec: str) -> torch.device:
    from p2p_diloco.stage_process import select_device

    return select_device(spec)
