"""``p2p-diloco prepare-data``: turn local text files or folders into token shards."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from p2p_diloco.cli.logs import configure_logging


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare-data", help="turn text files or folders into token shards", allow_abbrev=False,
        description="Tokenize local text files (folders are read recursively) into a shards folder "
        "(meta.json + *.bin of uint16/uint32 tokens) with a train and a held-out eval split. Use the result "
        "with --data.path DIR. Nothing is downloaded: the tokenizer is byte-level, or a local tokenizer.json.",
    )
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text files or folders")
    parser.add_argument("-o", "--output", required=True, type=Path, metavar="DIR", help="shards folder to write")
    parser.add_argument("--tokenizer", default="byte", metavar="SPEC",
                        help="'byte' (default) or the path of a local HF tokenizer.json")
    parser.add_argument("--eval-fraction", type=float, default=0.01, metavar="F",
                        help="fraction of documents held out for evaluation (default 0.01)")
    parser.add_argument("--extensions", metavar=".EXT,...",
                        help="only read files with these endings in folders, e.g. .txt,.md (default: all text files)")
    parser.add_argument("--tokens-per-shard", type=int, default=2**24, metavar="N",
                        help="tokens per .bin file (default 16777216)")
    parser.set_defaults(run=run, accepts_overrides=False)


def run(args: argparse.Namespace, overrides: list) -> int:
    from p2p_diloco.config import ConfigError
    from p2p_diloco.data import load_tokenizer, prepare_data

    configure_logging("INFO")
    if not 0 < args.eval_fraction < 1:
        raise ConfigError(f"--eval-fraction: must be between 0 and 1, got {args.eval_fraction}")
    if args.tokens_per_shard <= 0:
        raise ConfigError(f"--tokens-per-shard: must be positive, got {args.tokens_per_shard}")
    extensions = tuple(e.strip() if e.strip().startswith(".") else "." + e.strip()
                       for e in args.extensions.split(",") if e.strip()) if args.extensions else None
    meta = prepare_data(list(args.inputs), args.output, load_tokenizer(args.tokenizer),
                        eval_fraction=args.eval_fraction, tokens_per_shard=args.tokens_per_shard,
                        extensions=extensions)
    splits = {name: split["num_tokens"] for name, split in meta["splits"].items()}
    print(f"Wrote {args.output}: " + ", ".join(f"{name} {n:,} tokens" for name, n in splits.items()))
    print(json.dumps({"output": str(args.output), "vocab_size": meta["vocab_size"], "splits": splits}))
    return 0
