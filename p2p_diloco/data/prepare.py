"""Turning local text files into a shards folder, and the built-in corpus (the Python standard library's source).

Every document (one input file) is encoded and ended with the tokenizer's end-of-document token. A held-out
eval split is a deterministic subset of whole documents, chosen by a stable hash of each document's relative
path, so eval tokens never appear in train and every machine makes the same split from the same files.
Who calls this: the ``prepare-data`` CLI command (:func:`prepare_data`) and every peer at start-up
(:func:`resolve_data_path`, which prepares the built-in corpus on first use).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from p2p_diloco.data.errors import DataError
from p2p_diloco.data.shards import (
    DEFAULT_TOKENS_PER_SHARD,
    META_FILE,
    TOKENIZER_FILE,
    ShardWriter,
    atomic_output_dir,
    dtype_for_vocab,
    write_meta,
)
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
_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class Document:
    """One input file; ``key`` (its path relative to the input folder) decides its split."""

    path: Path
    key: str


def prepare_data(inputs: Sequence[Path], out_dir: Path, tokenizer: Tokenizer, eval_fraction: float = 0.01,
                 tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD, extensions: Iterable[str] | None = None,
                 progress: bool = True) -> dict[str, Any]:
    """Tokenize text files into a shards folder with a train and an eval split.

    Args:
        inputs: files and folders; folders are searched recursively, in sorted order.
        out_dir: the shards folder to write; replaced atomically if it already is one.
        tokenizer: see :func:`p2p_diloco.data.load_tokenizer`.
        eval_fraction: share of documents held out for the eval split (at least one document).
        tokens_per_shard: tokens per ``.bin`` file.
        extensions: keep only files with these suffixes (e.g. ``(".py",)``) when searching folders.
        progress: show a progress bar (only when stderr is a terminal).

    Returns:
        The meta.json written.

    Raises:
        DataError: an input does not exist, no input file is found, or a split ends up empty.
    """
    out_dir = Path(out_dir).expanduser()
    suffixes = tuple(extensions) if extensions else None
    documents = collect_documents([Path(p).expanduser() for p in inputs], suffixes, exclude=out_dir)
    if not documents:
        wanted = f" with extension {', '.join(suffixes)}" if suffixes else ""
        raise DataError(f"no input files{wanted} found in {', '.join(str(p) for p in inputs) or '(no inputs)'}")
    return write_corpus(documents, out_dir, tokenizer, eval_fraction, tokens_per_shard, progress)


def collect_documents(inputs: Sequence[Path], extensions: tuple[str, ...] | None = None,
                      exclude: Path | None = None, excluded_dirs: frozenset[str] = frozenset()) -> list[Document]:
    """List the files of ``inputs`` as documents: files as given, folders walked recursively in sorted order.

    ``extensions`` and ``excluded_dirs`` (folder names) filter what folder walks find; ``exclude`` is a
    folder never entered (the output folder). A file reached twice is listed once.
    """
    documents: list[Document] = []
    seen: set[Path] = set()
    skip = exclude.resolve() if exclude is not None else None
    for root in inputs:
        if root.is_file():
            found = [Document(root, root.name)]
        elif root.is_dir():
            found = _walk_folder(root, extensions, skip, excluded_dirs)
        else:
            raise DataError(f"{root}: input does not exist")
        for doc in found:
            resolved = doc.path.resolve()
            if resolved not in seen:
                seen.add(resolved)
                documents.append(doc)
    return documents


def _walk_folder(root: Path, extensions: tuple[str, ...] | None, skip: Path | None,
                 excluded_dirs: frozenset[str]) -> list[Document]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in excluded_dirs and (here / d).resolve() != skip)
        for name in sorted(filenames):
            if extensions is None or name.endswith(extensions):
                found.append(Document(here / name, (here / name).relative_to(root).as_posix()))
    return sorted(found, key=lambda doc: doc.key)


def _is_readable_text(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(_BINARY_SNIFF_BYTES)
    except OSError as exc:
        logger.warning("Skipping %s: cannot read it (%s)", path, exc)
        return False
    if b"\x00" in head:
        logger.warning("Skipping %s: looks like a binary file", path)
        return False
    return True


def choose_eval_documents(documents: Sequence[Document], eval_fraction: float) -> set[int]:
    """Return the indices of the eval documents: the ~``eval_fraction`` with the smallest hash of their key.

    At least one document is chosen, and at least one is left for train when there are two or more.
    """
    def rank(i: int) -> tuple[bytes, str, int]:
        return hashlib.sha256(documents[i].key.encode("utf-8")).digest(), documents[i].key, i

    num_eval = max(1, round(eval_fraction * len(documents)))
    if len(documents) > 1:
        num_eval = min(num_eval, len(documents) - 1)
    return set(sorted(range(len(documents)), key=rank)[:num_eval])


def _encode_document(path: Path, tokenizer: Tokenizer) -> np.ndarray | None:
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        logger.warning("Skipping %s: cannot read it (%s)", path, exc)
        return None
    ids = tokenizer.encode(text)
    if tokenizer.eot_id is not None:
        ids.append(tokenizer.eot_id)
    return np.asarray(ids, dtype=np.int64)


def write_corpus(documents: Sequence[Document], out_dir: Path, tokenizer: Tokenizer, eval_fraction: float,
                 tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD, progress: bool = True) -> dict[str, Any]:
    """Encode ``documents`` into the shards folder ``out_dir`` (atomically) and return its meta.json.

    A single document cannot be split by documents: its last ~``eval_fraction`` of tokens is held out instead.
    """
    if not 0 < eval_fraction < 1:
        raise DataError(f"eval_fraction must be between 0 and 1 (exclusive), got {eval_fraction}")
    documents = [doc for doc in documents if _is_readable_text(doc.path)]
    if not documents:
        raise DataError(f"{out_dir}: none of the input files is readable text")
    eval_ids = choose_eval_documents(documents, eval_fraction)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    start_s = time.monotonic()
    with atomic_output_dir(out_dir) as tmp_dir:
        writers = {split: ShardWriter(tmp_dir, split, dtype, tokens_per_shard) for split in ("train", "eval")}
        with writers["train"], writers["eval"]:
            num_documents = _write_documents(documents, eval_ids, tokenizer, writers, eval_fraction, progress)
        splits = {}
        for split, writer in writers.items():
            splits[split] = {**writer.close(), "num_documents": num_documents[split]}
            if splits[split]["num_tokens"] == 0:
                raise DataError(f"{out_dir}: the {split} split would be empty; the inputs hold too little text")
        meta = write_meta(tmp_dir, dtype, tokenizer.vocab_size, tokenizer.name, splits)
        if getattr(tokenizer, "path", None) is not None:  # the shards' tokenizer, for export and generate
            shutil.copyfile(tokenizer.path, tmp_dir / TOKENIZER_FILE)
    logger.info("Prepared %s in %.1f s: train %d tokens (%d documents), eval %d tokens (%d documents)", out_dir,
                time.monotonic() - start_s, splits["train"]["num_tokens"], splits["train"]["num_documents"],
                splits["eval"]["num_tokens"], splits["eval"]["num_documents"])
    return meta


def _write_documents(documents: Sequence[Document], eval_ids: set[int], tokenizer: Tokenizer,
                     writers: dict[str, ShardWriter], eval_fraction: float, progress: bool) -> dict[str, int]:
    """Encode each document into its split's writer; return the number of documents per split."""
    num_documents = {"train": 0, "eval": 0}
    with _progress_bar(documents, progress) as bar:
        for i, doc in enumerate(documents):
            tokens = _encode_document(doc.path, tokenizer)
            bar.update(doc.path.stat().st_size)
            if tokens is None:
                continue
            if len(documents) == 1:
                _split_single_document(doc, tokens, eval_fraction, writers)
                return {"train": 1, "eval": 1}
            split = "eval" if i in eval_ids else "train"
            writers[split].append(tokens)
            num_documents[split] += 1
    return num_documents


def _progress_bar(documents: Sequence[Document], progress: bool) -> tqdm:
    total_bytes = sum(doc.path.stat().st_size for doc in documents)
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", leave=False,
                disable=not (progress and sys.stderr.isatty()))


def _split_single_document(doc: Document, tokens: np.ndarray, eval_fraction: float,
                           writers: dict[str, ShardWriter]) -> None:
    num_eval = max(1, round(eval_fraction * len(tokens)))
    logger.info("Only one input document (%s): holding out its last %d tokens for eval", doc.path, num_eval)
    writers["train"].append(tokens[:-num_eval])
    writers["eval"].append(tokens[-num_eval:])


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
