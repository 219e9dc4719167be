"""``p2p-diloco prepare-data``: turn local text, JSON Lines, CSV or Parquet files or folders into token shards."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from p2p_diloco.cli.logs import configure_logging


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare-data", help="turn text, JSON Lines, CSV or Parquet files or folders into token shards",
        allow_abbrev=False,
        description="Tokenize local files (folders are read recursively, in sorted order) into a shards folder "
        "(meta.json + *.bin of uint16/uint32 tokens) with a train and a held-out eval split. A plain text file is "
        "one document; a .jsonl/.ndjson/.json (JSON Lines), .csv or .parquet file holds one document per record, "
        "in its --text-field. Text, JSON Lines and CSV may be compressed (.gz, .zst). Inputs are streamed: memory "
        "does not grow with their size. Use the result with --data.path DIR. Nothing is downloaded: the tokenizer "
        "is byte-level, or a local tokenizer.json.",
    )
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="files or folders")
    parser.add_argument("-o", "--output", required=True, type=Path, metavar="DIR", help="shards folder to write")
    parser.add_argument("--tokenizer", default="byte", metavar="SPEC",
                        help="'byte' (default) or the path of a local HF tokenizer.json")
    parser.add_argument("--eval-fraction", type=float, default=0.01, metavar="F",
                        help="fraction of documents held out for evaluation (default 0.01)")
    parser.add_argument("--extensions", metavar=".EXT,...",
                        help="only read files with these endings in folders, e.g. .txt,.md or .jsonl.gz "
                        "(default: every text file and every file of a known format)")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the JSON field or CSV/Parquet column that holds each record's text (default text)")
    parser.add_argument("--on-bad-record", choices=("skip", "stop"), default="skip",
                        help="a record that is not valid JSON, lacks the text field or whose text is not a string: "
                        "skip it (default: a few broken lines should not cost a long run; each is counted, the "
                        "first 5 are named with file:line) or stop the run with the file and line")
    parser.add_argument("--tokens-per-shard", type=int, default=2**24, metavar="N",
                        help="tokens per .bin file (default 16777216)")
    parser.set_defaults(run=run, accepts_overrides=False)


def run(args: argparse.Namespace, overrides: list) -> int:
    from p2p_diloco.config import ConfigError
    from p2p_diloco.data import BadRecords, load_tokenizer, prepare_data

    configure_logging("INFO")
    if not 0 < args.eval_fraction < 1:
        raise ConfigError(f"--eval-fraction: must be between 0 and 1, got {args.eval_fraction}")
    if args.tokens_per_shard <= 0:
        raise ConfigError(f"--tokens-per-shard: must be positive, got {args.tokens_per_shard}")
    if not args.text_field:
        raise ConfigError("--text-field: must not be empty")
    extensions = tuple(e.strip() if e.strip().startswith(".") else "." + e.strip()
                       for e in args.extensions.split(",") if e.strip()) if args.extensions else None
    bad_records = BadRecords(args.on_bad_record)
    meta = prepare_data(list(args.inputs), args.output, load_tokenizer(args.tokenizer),
                        eval_fraction=args.eval_fraction, tokens_per_shard=args.tokens_per_shard,
                        extensions=extensions, text_field=args.text_field, bad_records=bad_records)
    splits = {name: split["num_tokens"] for name, split in meta["splits"].items()}
    num_documents = sum(split["num_documents"] for split in meta["splits"].values())
    print(f"Wrote {args.output}: {num_documents:,} documents, {sum(splits.values()):,} tokens ("
          + ", ".join(f"{name} {n:,}" for name, n in splits.items())
          + f"), {bad_records.num_skipped:,} bad records skipped")
    print(json.dumps({"output": str(args.output), "vocab_size": meta["vocab_size"], "splits": splits,
                      "num_documents": num_documents, "num_skipped_records": bad_records.num_skipped}))
    return 0
