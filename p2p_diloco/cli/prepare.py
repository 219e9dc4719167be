"""``p2p-diloco prepare-data``: turn local text, JSON Lines, CSV or Parquet files or folders into token shards."""

from __future__ import annotations

import argparse
import json
import signal
from contextlib import contextmanager
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
        "does not grow with their size. Each document is encoded as the tokenizer's BOS token (where it has one), "
        "its text, and its end-of-document token. Use the result with --data.path DIR. Nothing is downloaded: the "
        "tokenizer is byte-level, or a local tokenizer.json.",
    )
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="files or folders")
    parser.add_argument("-o", "--output", required=True, type=Path, metavar="DIR", help="shards folder to write")
    parser.add_argument("--force", action="store_true",
                        help="replace the output folder if it is already a shards folder (default: refuse)")
    parser.add_argument("--tokenizer", default="byte", metavar="SPEC",
                        help="'byte' (default) or the path of a local HF tokenizer.json")
    parser.add_argument("--no-bos", action="store_true",
                        help="do not put the tokenizer's beginning-of-sequence token (Llama's <s>) before each "
                        "document (default: put it where the tokenizer's post-processor adds one, as transformers "
                        "does; the byte tokenizer has none)")
    parser.add_argument("--eval-fraction", type=float, default=0.01, metavar="F",
                        help="fraction of documents held out for evaluation (default 0.01)")
    parser.add_argument("--extensions", metavar=".EXT,...",
                        help="only read files with these endings in folders, e.g. .txt,.md or .jsonl.gz "
                        "(default: every text file and every file of a known format)")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the JSON field or CSV/Parquet column that holds each record's text (default text)")
    parser.add_argument("--on-bad-record", choices=("skip", "stop"), default="skip",
                        help="a record that is not valid JSON, lacks the text field or whose text is not a string, "
                        "or a document (a text file, a record) that is not UTF-8: skip it (default: a few broken "
                        "lines should not cost a long run; each is counted, the first 5 are named with file:line "
                        "or byte offset) or stop the run with the file and line or byte offset")
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
    output = args.output.expanduser()
    if output.is_dir() and any(output.iterdir()) and not args.force:
        raise ConfigError(f"--output: {output} exists and is not empty; give --force to replace it, or a new folder "
                          "(nothing was overwritten)")
    bad_records = BadRecords(args.on_bad_record)
    with _sigterm_as_interrupt():  # so the temporary folder is removed on SIGTERM as on Ctrl-C
        meta = prepare_data(list(args.inputs), output, load_tokenizer(args.tokenizer),
                            eval_fraction=args.eval_fraction, tokens_per_shard=args.tokens_per_shard,
                            extensions=extensions, text_field=args.text_field, bad_records=bad_records,
                            bos=not args.no_bos)
    splits = {name: split["num_tokens"] for name, split in meta["splits"].items()}
    num_documents = sum(split["num_documents"] for split in meta["splits"].values())
    print(f"Wrote {args.output}: {num_documents:,} documents, {sum(splits.values()):,} tokens ("
          + ", ".join(f"{name} {n:,}" for name, n in splits.items()) + f"), {bad_records.summary()}")
    print(json.dumps({"output": str(args.output), "vocab_size": meta["vocab_size"], "splits": splits,
                      "num_documents": num_documents, "num_skipped_records": bad_records.num_skipped,
                      "num_not_utf8_records": bad_records.num_not_utf8,
                      "num_invalid_utf8_bytes": bad_records.num_invalid_bytes, **meta["documents"]}))
    return 0


@contextmanager
def _sigterm_as_interrupt():
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
