"""Turning local files into a shards folder, and the built-in corpus (the Python standard library's source).

Every document (a text file or an 8 MiB piece of a longer one, or one record of a JSON Lines, CSV or Parquet file;
see :mod:`readers`) is encoded, begun with the tokenizer's beginning-of-sequence token where it has one (the model
was pretrained with it; ``bos=False`` leaves it out) and ended with its end-of-document token, streaming: memory holds
one document at a time (and the two that :class:`~p2p_diloco.data.splits.SplitRouter` holds back), whatever the size
of the input. A held-out eval split is a deterministic subset of whole documents, chosen by a stable hash of each
document's key (its relative path, and line, row or piece), so eval tokens never appear in train and every machine
makes the same split.
Who calls this: the ``prepare-data`` CLI command (:func:`prepare_data`) and every peer at start-up
(:func:`resolve_data_path`, which prepares the built-in corpus on first use).
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from p2p_diloco.data.documents import Document
from p2p_diloco.data.errors import DataError
from p2p_diloco.data.readers import BadRecords, collect_documents, input_format, read_records, usable_documents
from p2p_diloco.data.shards import (
    DEFAULT_TOKENS_PER_SHARD,
    META_FILE,
    TOKENIZER_FILE,
    ShardWriter,
    atomic_output_dir,
    dtype_for_vocab,
    write_meta,
)
from p2p_diloco.data.splits import SplitRouter, choose_eval_documents
from p2p_diloco.data.tokenizer import ByteTokenizer, Tokenizer

if TYPE_CHECKING:
    from p2p_diloco.config.sections import DataConfig

logger = logging.getLogger(__name__)

BUILTIN_NAME = "builtin-stdlib-byte-v1"
BUILTIN_EVAL_FRACTION = 0.02
BUILTIN_MAX_BYTES = 9_000_000
"""Cap on the built-in corpus' source bytes, so first-use preparation stays well under 20 s on 2 CPU cores."""
BUILTIN_LOCK_TIMEOUT_S = 600.0
# Folders of the standard library left out of the built-in corpus: third-party code, test suites, tools,
# and generated tables (codec maps, pydoc topics) that are data rather than Python code.
STDLIB_EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "ensurepip", "venv", "__pycache__",
    "encodings", "pydoc_data",
})


def prepare_data(inputs: Sequence[Path], out_dir: Path, tokenizer: Tokenizer, eval_fraction: float = 0.01,
                 tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD, extensions: Iterable[str] | None = None,
                 progress: bool = True, text_field: str = "text",
                 bad_records: BadRecords | None = None, bos: bool = True) -> dict[str, Any]:
    """Tokenize text, JSON Lines, CSV and Parquet files into a shards folder with a train and an eval split.

    Args:
        inputs: files and folders; folders are searched recursively, in sorted order.
        out_dir: the shards folder to write; replaced atomically if it already is one.
        tokenizer: see :func:`p2p_diloco.data.load_tokenizer`.
        eval_fraction: share of documents held out for the eval split (at least one document).
        tokens_per_shard: tokens per ``.bin`` file.
        extensions: keep only files with these suffixes (e.g. ``(".py",)``) when searching folders.
        progress: show a progress bar (only when stderr is a terminal).
        text_field: the JSON field or CSV/Parquet column that holds each record's text.
        bad_records: skip or stop at an unusable record, and count those skipped (default: skip).
        bos: put the tokenizer's beginning-of-sequence token (if it has one) before each document.

    Returns:
        The meta.json written.

    Raises:
        DataError: an input does not exist or cannot be read, no input file is found, a record is bad under
            the 'stop' policy, or a split ends up empty.
    """
    out_dir = Path(out_dir).expanduser()
    suffixes = tuple(extensions) if extensions else None
    documents = collect_documents([Path(p).expanduser() for p in inputs], suffixes, exclude=out_dir)
    if not documents:
        wanted = f" with extension {', '.join(suffixes)}" if suffixes else ""
        raise DataError(f"no input files{wanted} found in {', '.join(str(p) for p in inputs) or '(no inputs)'}")
    return write_corpus(documents, out_dir, tokenizer, eval_fraction, tokens_per_shard, progress, text_field,
                        bad_records, bos)


def write_corpus(documents: Sequence[Document], out_dir: Path, tokenizer: Tokenizer, eval_fraction: float,
                 tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD, progress: bool = True, text_field: str = "text",
                 bad_records: BadRecords | None = None, bos: bool = True) -> dict[str, Any]:
    """Encode ``documents`` into the shards folder ``out_dir`` (atomically) and return its meta.json.

    The split follows :mod:`p2p_diloco.data.splits`: by rank of the files' hashes when every input is a text file,
    else by each document's own hash; a single document's last ~``eval_fraction`` of tokens is held out.
    """
    if not 0 < eval_fraction < 1:
        raise DataError(f"eval_fraction must be between 0 and 1 (exclusive), got {eval_fraction}")
    documents = usable_documents(documents)
    if not documents:
        raise DataError(f"{out_dir}: none of the input files is readable text")
    bad_records = bad_records if bad_records is not None else BadRecords()
    eval_documents = None  # the hashed rule, unless every input is a text file (its pieces go with it)
    if len(documents) > 1 and all(input_format(doc.path)[0] == "text" for doc in documents):
        eval_documents = {documents[i] for i in choose_eval_documents(documents, eval_fraction)}
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    ends = {"bos_id": tokenizer.bos_id if bos else None, "eot_id": tokenizer.eot_id}
    start_s = time.monotonic()
    with atomic_output_dir(out_dir) as tmp_dir:
        writers = {split: ShardWriter(tmp_dir, split, dtype, tokens_per_shard) for split in ("train", "eval")}
        with writers["train"], writers["eval"]:
            router = SplitRouter(writers, eval_fraction, eval_documents)
            _write_documents(documents, tokenizer, ends["bos_id"], router, text_field, bad_records, progress)
            num_documents = router.finish()
        splits = {}
        for split, writer in writers.items():
            splits[split] = {**writer.close(), "num_documents": num_documents[split]}
            if splits[split]["num_tokens"] == 0:
                raise DataError(f"{out_dir}: the {split} split would be empty; the inputs hold too little text"
                                + (f" ({bad_records.summary()})" if bad_records.num_skipped else ""))
        meta = write_meta(tmp_dir, dtype, tokenizer.vocab_size, tokenizer.name, splits, documents=ends)
        if getattr(tokenizer, "path", None) is not None:  # the shards' tokenizer, for export and generate
            shutil.copyfile(tokenizer.path, tmp_dir / TOKENIZER_FILE)
    logger.info("Prepared %s in %.1f s: train %d tokens (%d documents), eval %d tokens (%d documents), %s",
                out_dir, time.monotonic() - start_s, splits["train"]["num_tokens"], splits["train"]["num_documents"],
                splits["eval"]["num_tokens"], splits["eval"]["num_documents"], bad_records.summary())
    return meta


def _write_documents(documents: Sequence[Document], tokenizer: Tokenizer, bos_id: int | None, router: SplitRouter,
                     text_field: str, bad_records: BadRecords, progress: bool) -> None:
    """Read, encode and route every document of every input, one at a time."""
    sizes = [doc.path.stat().st_size for doc in documents]
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="tokenizing", leave=False,
              disable=not (progress and sys.stderr.isatty())) as bar:
        for doc, size in zip(documents, sizes, strict=True):
            done = 0
            for record in read_records(doc, text_field):
                bar.update(max(0, record.bytes_read - done))
                done = max(done, record.bytes_read)
                if record.problem is not None:
                    bad_records.handle(record)
                else:
                    router.add(record, _encode(record.text, tokenizer, bos_id))
            bar.update(max(0, size - done))


def _encode(text: str, tokenizer: Tokenizer, bos_id: int | None) -> np.ndarray:
    ids = tokenizer.encode(text)
    if bos_id is not None:
        ids.insert(0, bos_id)
    if tokenizer.eot_id is not None:
        ids.append(tokenizer.eot_id)
    return np.asarray(ids, dtype=np.int64)


def stdlib_documents(max_bytes: int = BUILTIN_MAX_BYTES) -> list[Document]:
    """Return the standard library's own ``.py`` files (see ``STDLIB_EXCLUDED_DIRS``), in sorted order,
    up to ``max_bytes`` of source."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        raise DataError(f"{stdlib}: the Python standard library folder does not exist; "
                        "prepare your own data with `p2p-diloco prepare-data` and set data.path")
    documents, total_bytes = [], 0
    for doc in collect_documents([stdlib], (".py",), excluded_dirs=STDLIB_EXCLUDED_DIRS):
        size = doc.path.stat().st_size
        if total_bytes + size > max_bytes:
            break
        documents.append(doc)
        total_bytes += size
    if not documents:
        raise DataError(f"{stdlib}: no Python source files found for the built-in corpus; "
                        "prepare your own data with `p2p-diloco prepare-data` and set data.path")
    return documents


def builtin_corpus(cache_dir: str | Path) -> Path:
    """Return the shards folder of the built-in corpus, preparing it on first use.

    The corpus is the Python standard library's source, byte-tokenized, in ``<cache_dir>/builtin-stdlib-byte-v1``.
    Safe to call from several processes at once: one prepares it under an exclusive file lock, the others
    wait for it and reuse it.

    Raises:
        DataError: the standard library has no source files, or another process held the lock too long.
    """
    cache = Path(cache_dir).expanduser()
    target = cache / BUILTIN_NAME
    if (target / META_FILE).is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    lock_path = cache / f".{BUILTIN_NAME}.lock"
    with open(lock_path, "a") as lock_file:
        _lock_exclusive(lock_file.fileno(), lock_path)
        # Another process may have prepared it while this one waited for the lock.
        if not (target / META_FILE).is_file():
            _remove_stale_temp_dirs(cache, BUILTIN_NAME)
            logger.info("Preparing the built-in corpus (Python standard library source) in %s; first use only",
                        target)
            write_corpus(stdlib_documents(), target, ByteTokenizer(), BUILTIN_EVAL_FRACTION)
    return target


def _lock_exclusive(fd: int, lock_path: Path, timeout_s: float = BUILTIN_LOCK_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise DataError(f"{lock_path}: another process has been preparing the built-in corpus for over "
                                f"{timeout_s:.0f} s; giving up") from None
            time.sleep(0.05)


def _remove_stale_temp_dirs(cache: Path, name: str) -> None:
    # Only called under the lock, so any temporary folder left is from a process that died mid-write.
    for stale in cache.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def resolve_data_path(cfg: DataConfig) -> Path:
    """Return the shards folder that ``cfg.path`` names: the built-in corpus for 'builtin', else the folder.

    Raises:
        DataError: the folder does not exist or has no meta.json.
    """
    if cfg.path == "builtin":
        return builtin_corpus(cfg.cache_dir)
    path = Path(cfg.path).expanduser()
    if not path.is_dir():
        raise DataError(f"data.path: {path} does not exist; make a shards folder from your text files with "
                        "`p2p-diloco prepare-data`, or use data.path='builtin'")
    if not (path / META_FILE).is_file():
        raise DataError(f"data.path: {path} has no {META_FILE}, so it is not a shards folder; make one with "
                        "`p2p-diloco prepare-data`")
    return path


def recorded_data_path(cfg: DataConfig) -> str | None:
    """The shards folder ``cfg`` names, absolute, for a checkpoint's record; None where it does not resolve (only a
    record: a checkpoint is never lost for it)."""
    try:
        return str(resolve_data_path(cfg).resolve())
    except Exception:  # noqa: BLE001
        return None
