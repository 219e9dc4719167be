"""The on-disk token shard format: writing it atomically, validating it, and reading windows from it.

A shards folder holds ``meta.json`` and ``<split>_<NNNNNN>.bin`` files of raw little-endian uint16 tokens
(uint32 when the vocabulary has more than 65536 ids). meta.json::

    {"format": "p2p-diloco-shards", "version": 1, "dtype": "uint16", "vocab_size": 257, "tokenizer": "byte",
     "splits": {"train": {"files": ["train_000000.bin"], "num_tokens": 123, "num_documents": 4}, "eval": {...}}}

A folder is written into a temporary sibling and renamed into place only when complete, so a reader never
sees a half-written folder and a failed write leaves an existing folder as it was.
Who calls this: :mod:`p2p_diloco.data.prepare` (writing) and :mod:`p2p_diloco.data.sampler` (reading).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from p2p_diloco.data.errors import DataError

logger = logging.getLogger(__name__)

FORMAT = "p2p-diloco-shards"
VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"  # a copy of the HF tokenizer the shards were made with (none for bytes)
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
DEFAULT_TOKENS_PER_SHARD = 2**24
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_-]+\.bin$")


def dtype_for_vocab(vocab_size: int) -> str:
    """Return the narrowest shard dtype name ('uint16' or 'uint32') that holds every id below ``vocab_size``."""
    if vocab_size <= 0 or vocab_size > 2**32:
        raise DataError(f"vocab_size must be in [1, 2**32], got {vocab_size}")
    return "uint16" if vocab_size <= 2**16 else "uint32"


class ShardWriter:
    """Appends token arrays to ``<split>_<NNNNNN>.bin`` files in one folder, starting a new file every
    ``tokens_per_shard`` tokens. Use as a context manager, or call :meth:`close` to get the split's entry."""

    def __init__(self, out_dir: Path, split: str, dtype: str, tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD):
        if dtype not in DTYPES:
            raise DataError(f"unknown shard dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        if tokens_per_shard <= 0:
            raise DataError(f"tokens_per_shard must be positive, got {tokens_per_shard}")
        if not re.fullmatch(r"[A-Za-z0-9-]+", split):
            raise DataError(f"split name {split!r} must be letters, digits or '-'")
        self.out_dir = Path(out_dir)
        self.split = split
        self.dtype = DTYPES[dtype]
        self.tokens_per_shard = tokens_per_shard
        self.files: list[str] = []
        self.num_tokens = 0
        self._file = None
        self._tokens_in_file = 0

    def append(self, tokens: np.ndarray | Sequence[int]) -> None:
        """Append token ids (any integer array), rolling over to a new file when the current one is full."""
        array = np.asarray(tokens)
        if array.size == 0:
            return
        if array.min() < 0 or array.max() > np.iinfo(self.dtype).max:
            raise DataError(f"token ids must be in [0, {np.iinfo(self.dtype).max}] for {self.dtype.name} shards, "
                            f"got values in [{array.min()}, {array.max()}]")
        array = array.astype(self.dtype, copy=False).ravel()
        while array.size:
            if self._file is None or self._tokens_in_file == self.tokens_per_shard:
                self._roll()
            take = min(array.size, self.tokens_per_shard - self._tokens_in_file)
            self._file.write(array[:take].tobytes())
            self._tokens_in_file += take
            self.num_tokens += take
            array = array[take:]

    def close(self) -> dict[str, Any]:
        """Flush the last file to disk and return this split's meta.json entry: files and num_tokens."""
        self._close_file()
        return {"files": list(self.files), "num_tokens": self.num_tokens}

    def _roll(self) -> None:
        self._close_file()
        name = f"{self.split}_{len(self.files):06d}.bin"
        self._file = open(self.out_dir / name, "wb")  # noqa: SIM115 - closed by _close_file
        self.files.append(name)
        self._tokens_in_file = 0

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close_file()


def write_meta(out_dir: Path, dtype: str, vocab_size: int, tokenizer_name: str,
               splits: dict[str, dict[str, Any]], documents: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``meta.json`` into ``out_dir`` and return it.

    Args:
        out_dir: the folder the shard files were written to.
        dtype: 'uint16' or 'uint32', as given to the :class:`ShardWriter`s.
        vocab_size: every token id is below this.
        tokenizer_name: the tokenizer's ``name`` ('byte' or 'hf:<file name>').
        splits: split name -> the entry returned by :meth:`ShardWriter.close` (extra keys are kept).
        documents: how each document was encoded (``bos_id``, ``eot_id``: the ids put before and after it, or
            None), recorded as meta.json's ``documents``; left out when None.
    """
    if dtype not in DTYPES:
        raise DataError(f"unknown shard dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    meta = {"format": FORMAT, "version": VERSION, "dtype": dtype, "vocab_size": int(vocab_size),
            "tokenizer": tokenizer_name, "splits": splits}
    if documents is not None:
        meta["documents"] = documents
    with open(Path(out_dir) / META_FILE, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return meta


@contextmanager
def atomic_output_dir(out_dir: Path) -> Iterator[Path]:
    """Yield a temporary folder next to ``out_dir``; on success, rename it to ``out_dir``.

    On an exception the temporary folder is removed and an existing ``out_dir`` is left untouched.
    An existing ``out_dir`` is only replaced when it is empty or a shards folder (has meta.json).
    The temporary folder's name holds this host and process id, so a later write of the same folder removes the one
    a killed process left (:func:`remove_stale_temp_dirs`).
    """
    out_dir = Path(out_dir).expanduser()
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(out_dir)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(out_dir)}{os.getpid()}-{_host()}-", dir=out_dir.parent))
    done = False
    try:
        yield tmp_dir
        _swap_into_place(tmp_dir, out_dir)
        done = True
    finally:
        if not done:
            shutil.rmtree(tmp_dir, ignore_errors=True)


def remove_stale_temp_dirs(out_dir: Path) -> list[Path]:
    """Remove the temporary folders of ``out_dir`` whose writer, a process of this host, is gone; return them.

    A folder of another host, or of a live process (or one this process cannot signal), is left alone.
    """
    prefix = _temp_prefix(out_dir)
    removed = []
    for stale in out_dir.parent.glob(f"{glob.escape(prefix)}*"):
        pid, sep, rest = stale.name[len(prefix):].partition("-")
        if not (pid.isdigit() and sep and rest.rpartition("-")[0] == _host()) or _process_alive(int(pid)):
            continue
        shutil.rmtree(stale, ignore_errors=True)
        logger.info("Removed %s, left by process %s, which is gone", stale, pid)
        removed.append(stale)
    return removed


def _temp_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.tmp-"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir}: exists and is not a folder; refusing to replace it")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / META_FILE).is_file():
        raise DataError(f"{out_dir}: exists, is not empty and has no {META_FILE}; refusing to replace a folder "
                        "that is not a shards folder (choose another output folder)")


def _swap_into_place(tmp_dir: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.replace(tmp_dir, out_dir)
    else:
        # Directories cannot be renamed over non-empty ones: move the old one aside first.
        old_dir = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old_dir)
        try:
            os.replace(tmp_dir, out_dir)
        except OSError:
            os.replace(old_dir, out_dir)
            raise
        shutil.rmtree(old_dir, ignore_errors=True)
    dir_fd = os.open(out_dir.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_meta(path: Path) -> dict[str, Any]:
    """Read and check the ``meta.json`` of the shards folder ``path`` (not the shard files themselves).

    Raises:
        DataError: the folder or meta.json is missing, meta.json is not valid JSON, or it has an unknown
            format, version or dtype, or a malformed field.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        raise DataError(f"{path}: shards folder does not exist (make one with `p2p-diloco prepare-data`)")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise DataError(f"{path}: no {META_FILE}; not a shards folder made by `p2p-diloco prepare-data`")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{meta_path}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(f"{meta_path}: unknown format {found!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise DataError(f"{meta_path}: unsupported format version {meta.get('version')!r}, this build reads {VERSION}")
    if meta.get("dtype") not in DTYPES:
        raise DataError(f"{meta_path}: unknown dtype {meta.get('dtype')!r}, expected one of {', '.join(DTYPES)}")
    vocab_size = meta.get("vocab_size")
    if not isinstance(vocab_size, int) or not 0 < vocab_size <= np.iinfo(DTYPES[meta["dtype"]]).max + 1:
        raise DataError(f"{meta_path}: vocab_size {vocab_size!r} is not a positive integer that fits {meta['dtype']}")
    if not isinstance(meta.get("splits"), dict) or not isinstance(meta.get("tokenizer"), str):
        raise DataError(f"{meta_path}: 'splits' must be an object and 'tokenizer' a string")
    return meta


class ShardDataset:
    """One split of a shards folder, memory-mapped: windows are read on demand, nothing is loaded up front.

    Opening checks meta.json, that every listed file exists with the size meta.json implies, and that every
    token id is below the vocabulary size (a chunked scan).
    """

    def __init__(self, path: Path, split: str = "train", check_tokens: bool = True) -> None:
        """Open ``split`` of the shards folder ``path``.

        Args:
            path: a folder made by :func:`p2p_diloco.data.prepare_data` (or ShardWriter + write_meta).
            split: 'train' or 'eval' (or any split meta.json lists).
            check_tokens: scan the data for out-of-range token ids (see :meth:`check_token_range`).

        Raises:
            DataError: the folder, meta.json or a shard file is missing, corrupt or inconsistent.
        """
        self.path = Path(path).expanduser()
        self.split = split
        self.meta = read_meta(self.path)
        self.dtype = DTYPES[self.meta["dtype"]]
        self.vocab_size: int = self.meta["vocab_size"]
        self.tokenizer_name: str = self.meta["tokenizer"]
        self.files = self._check_files()
        self._arrays = [np.memmap(f, dtype=self.dtype, mode="r") for f in self.files]
        sizes = np.array([len(a) for a in self._arrays], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.num_tokens = int(sizes.sum())
        if check_tokens:
            self.check_token_range()

    def _split_entry(self) -> tuple[list[str], int]:
        where = self.path / META_FILE
        splits = self.meta["splits"]
        if self.split not in splits:
            raise DataError(f"{where}: no split {self.split!r} (it has: {', '.join(splits) or 'none'})")
        entry = splits[self.split]
        files, num_tokens = entry.get("files"), entry.get("num_tokens")
        if not isinstance(files, list) or not all(isinstance(f, str) and _SHARD_NAME.match(f) for f in files):
            raise DataError(f"{where}: split {self.split!r} must list plain '*.bin' file names, got {files!r}")
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise DataError(f"{where}: split {self.split!r} has an invalid num_tokens {num_tokens!r}")
        if not files or num_tokens == 0:
            raise DataError(f"{where}: split {self.split!r} is empty (no tokens); prepare it from more input")
        return files, num_tokens

    def _check_files(self) -> list[Path]:
        names, num_tokens = self._split_entry()
        itemsize = self.dtype.itemsize
        paths, total_bytes = [], 0
        for name in names:
            file = self.path / name
            if not file.is_file():
                raise DataError(f"{file}: listed in {META_FILE} (split {self.split!r}) but missing")
            size = file.stat().st_size
            if size == 0 or size % itemsize:
                raise DataError(f"{file}: size {size} bytes is not a positive multiple of {itemsize} "
                                f"({self.dtype.name} tokens); the file is truncated or corrupt")
            paths.append(file)
            total_bytes += size
        if total_bytes != num_tokens * itemsize:
            raise DataError(f"{self.path}: split {self.split!r} files hold {total_bytes // itemsize} tokens but "
                            f"{META_FILE} says {num_tokens}; the folder is incomplete or corrupt")
        return paths

    def check_token_range(self, vocab_size: int | None = None, chunk_tokens: int = 2**24) -> None:
        """Scan the split in chunks; raise DataError naming the file, its largest id and the first offending
        position if any id is >= ``vocab_size`` (default: meta.json's; the peer also checks the model's)."""
        limit = self.vocab_size if vocab_size is None else vocab_size
        source = f"vocab_size {limit} from {META_FILE}" if vocab_size is None else \
            f"the model's vocabulary size {limit} (model.vocab_size)"
        for file, array in zip(self.files, self._arrays, strict=True):
            first, max_id = None, -1
            for begin in range(0, len(array), chunk_tokens):
                chunk = array[begin:begin + chunk_tokens]
                max_id = max(max_id, int(chunk.max()))
                if first is None and max_id >= limit:
                    first = begin + int(np.argmax(chunk >= limit))
            if first is not None:
                raise DataError(f"{file}: token id {int(array[first])} at position {first} is not below {source} "
                                f"(the largest id in this file is {max_id}); the data does not match its tokenizer "
                                "or this model, or is corrupt")

    def window(self, start: int, length: int) -> np.ndarray:
        """Return tokens ``[start, start + length)`` of the split as a new int64 array (may span several files)."""
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"window [{start}, {start + length}) is outside the split's {self.num_tokens} tokens")
        out = np.empty(length, dtype=np.int64)
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            offset = start + filled - int(self._starts[shard])
            take = min(length - filled, len(self._arrays[shard]) - offset)
            out[filled:filled + take] = self._arrays[shard][offset:offset + take]
            filled += take
            shard += 1
        return out

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"ShardDataset({str(self.path)!r}, split={self.split!r}, num_tokens={self.num_tokens}, "
                f"vocab_size={self.vocab_size}, files={len(self.files)})")
