"""``p2p-diloco export``: a peer's trained model as a Hugging Face folder that transformers loads.

Reads the newest checkpoint every stage of the peer has (or ``--step``), joins the stages' anchors into the whole
model (:mod:`p2p_diloco.training.state.anchor`) and writes it with its tokenizer
(:mod:`p2p_diloco.model.export`). Also holds what ``generate`` shares with it: finding the model and the tokenizer
of a checkpoint or an exported folder.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a checkpoint's model as a Hugging Face folder (LlamaForCausalLM + tokenizer)",
        allow_abbrev=False,
        description="Write the model a peer trained (the anchor: the swarm's agreed model after its last applied "
        "round, every pipeline stage joined) as a Hugging Face folder: config.json for LlamaForCausalLM, "
        "model.safetensors with transformers' parameter names, and the tokenizer (tokenizer.json). Load it with "
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
                        help="'byte' or a tokenizer.json (default: the tokenizer of the shards the run trained on)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, _overrides) -> int:
    from p2p_diloco.model.export import ExportError, write_hf_folder
    from p2p_diloco.training.state.anchor import load_peer_anchor

    out = Path(args.out).expanduser()
    if out.exists():  # before reading anything: nothing is overwritten
        raise ExportError(f"{out} exists; give a new folder (nothing was overwritten)")
    anchor = load_peer_anchor(Path(args.checkpoint), args.step)
    tokenizer = checkpoint_tokenizer(anchor.data_path, anchor.config_path, args.tokenizer, anchor.args.vocab_size)
    files = tokenizer_files(tokenizer)
    num_values = sum(t.numel() for t in anchor.tensors.values())
    provenance = {"source": str(anchor.folders[0].parent.resolve()), "step": anchor.step, "round": anchor.round_index,
                  "applied_round": anchor.applied_round, "stages": len(anchor.folders),
                  "tokenizer": tokenizer.name, "parameters": num_values}
    write_hf_folder(out, anchor.args, anchor.tensors, tokenizer_json=files.json, eos_token=files.eos_token,
                    eos_token_id=tokenizer.eot_id, provenance=provenance)
    applied = f"rounds up to {anchor.applied_round} applied" if anchor.applied_round >= 0 \
        else "no round applied yet: the initial model"
    print(f"Exported the anchor at inner step {anchor.step} ({applied}) of a "
          f"{len(anchor.folders)}-stage peer, {num_values:,} parameters, tokenizer {tokenizer.name}, to {out}\n"
          f"Load it with transformers: AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


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
