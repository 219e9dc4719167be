"""Reading the inputs of ``prepare-data``: which files, in which format, and their documents one at a time.

A plain text file (any suffix that is not one below) is one document, up to
:data:`~p2p_diloco.data.documents.MAX_DOCUMENT_BYTES` (decompressed); a longer one is read as consecutive documents
of at most that many bytes, each cut after its last newline (a piece without one at a UTF-8 character boundary), so
an end-of-document token lands at those cuts. A JSON Lines (``.jsonl``, ``.ndjson``, ``.json``), CSV (``.csv``)
or Parquet (``.parquet``) file holds one document per record, the string in its ``text_field``. Text, JSON Lines
and CSV may be compressed (``.gz``, ``.zst``). Folders are walked recursively in sorted order, so every machine reads
the same inputs in the same order.
Records are streamed: memory holds one record (a Parquet or CSV batch at most), never the whole input, and a
document holds at most ``MAX_DOCUMENT_BYTES`` (decompressed), read no further than that: preparing a document takes
some 20 times its size, and a small compressed file can hold one huge document (300 MB of text fit in a 299 KiB
``.txt.gz``).
A record that cannot be used (invalid JSON, no text field, a text that is not a string, a longer one, bytes that are
not UTF-8, in any format: never read with replacement characters) is yielded with its ``problem`` set; the caller
chooses to skip it or stop (:class:`BadRecords`). A file that cannot be read at all (unreadable, unknown format, no
text column, corrupt compression) raises a :class:`DataError` naming it.
Who calls this: :mod:`p2p_diloco.data.prepare`.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from p2p_diloco.data.documents import MAX_DOCUMENT_BYTES, Document, Record, decode_utf8, open_input, too_long
from p2p_diloco.data.errors import DataError
from p2p_diloco.data.streams import COMPRESSIONS

logger = logging.getLogger(__name__)

RECORD_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}
SUPPORTED = ".jsonl, .ndjson, .json, .csv, .parquet (each but .parquet also as .gz or .zst) or plain text"
_BINARY_SNIFF_BYTES = 8192
_UTF8_MAX_BYTES = 4


def input_format(path: Path) -> tuple[str, str | None]:
    """Return ``(format, compression)`` of a file from its suffixes: format 'text', 'jsonl', 'csv' or 'parquet';
    compression 'gzip', 'zstd' or None."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    if compression is not None:
        suffixes = suffixes[:-1]
    return (RECORD_FORMATS.get(suffixes[-1], "text") if suffixes else "text"), compression


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
            found = [Document(root, root.name, given=True)]
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


def usable_documents(documents: Sequence[Document]) -> list[Document]:
    """Keep the documents that can be read: a file that is not text nor of a known format is skipped with a
    warning when found in a folder, and refused when named.

    Raises:
        DataError: a file cannot be opened, a named file is of an unknown format, or a Parquet file is compressed.
    """
    usable = []
    for doc in documents:
        kind, compression = input_format(doc.path)
        if kind == "parquet" and compression is not None:
            raise DataError(f"{doc.path}: Parquet is compressed inside already; give the .parquet file itself")
        if kind != "text":
            with open_input(doc, None):  # only that it opens: its records are checked as they are read
                usable.append(doc)
        elif _looks_like_text(doc, compression):
            usable.append(doc)
        elif doc.given:
            raise DataError(f"{doc.path}: unknown format: not text, and not one of {SUPPORTED}")
        else:
            logger.warning("Skipping %s: looks like a binary file", doc.path)
    return usable


def _looks_like_text(doc: Document, compression: str | None) -> bool:
    with open_input(doc, compression) as (_, stream):
        return b"\x00" not in stream.read(_BINARY_SNIFF_BYTES)


def read_records(doc: Document, text_field: str = "text") -> Iterator[Record]:
    """Yield the documents of one input file in order, streaming (see the module docstring).

    Raises:
        DataError: the file cannot be read, is corrupt, or (CSV, Parquet) has no usable ``text_field`` column.
    """
    kind, compression = input_format(doc.path)
    if kind in ("csv", "parquet"):
        from p2p_diloco.data import columnar  # local import: pyarrow is only needed here

        yield from (columnar.parquet_records(doc, text_field) if kind == "parquet"
                    else columnar.csv_records(doc, compression, text_field))
        return
    with open_input(doc, compression) as (raw, stream):
        if kind == "text":
            yield from _text_records(doc, raw, stream)
        elif kind == "jsonl":
            yield from _jsonl_records(doc, raw, stream, text_field)
        else:
            raise AssertionError(f"unhandled input format {kind!r}")


def _text_records(doc: Document, raw: BinaryIO, stream: BinaryIO) -> Iterator[Record]:
    """A text file as one document, or, longer than a document may be, as consecutive pieces of at most
    MAX_DOCUMENT_BYTES, each cut after its last newline; streaming: memory holds one piece and the byte after it.
    A document that is not UTF-8 is a bad record naming the (decompressed) byte offset of its first invalid byte."""
    limit = MAX_DOCUMENT_BYTES
    buffer = stream.read(limit + 1)
    if len(buffer) <= limit:
        yield _text_record(doc, None, buffer, 0, raw.tell())
        return
    number, offset = 0, 0
    while len(buffer) > limit:
        cut = _piece_end(buffer, limit)
        number += 1
        yield _text_record(doc, number, buffer[:cut], offset, raw.tell())
        offset += cut
        buffer = buffer[cut:]
        buffer += stream.read(limit + 1 - len(buffer))
    yield _text_record(doc, number + 1, buffer, offset, raw.tell())


def _text_record(doc: Document, number: int | None, data: bytes, offset: int, bytes_read: int) -> Record:
    text, problem, num_invalid = decode_utf8(data, start=offset)
    return Record(doc, number, text, problem, bytes_read, unit="piece", num_invalid_bytes=num_invalid)


def _piece_end(buffer: bytes, limit: int) -> int:
    """Where the piece of ``buffer`` (longer than ``limit``) ends: after its last newline within ``limit`` bytes, else
    at the last UTF-8 character boundary within them (any cut, for bytes that are not UTF-8)."""
    newline = buffer.rfind(b"\n", 0, limit)
    if newline >= 0:
        return newline + 1
    for cut in range(limit, max(0, limit - _UTF8_MAX_BYTES), -1):
        if buffer[cut] & 0xC0 != 0x80:  # not a continuation byte: a character starts here
            return cut
    return limit


def _jsonl_records(doc: Document, raw: BinaryIO, stream: BinaryIO, text_field: str) -> Iterator[Record]:
    for number, line in enumerate(_lines(stream, MAX_DOCUMENT_BYTES), start=1):
        if line is None:
            yield Record(doc, number, None, too_long(), raw.tell())
            continue
        if not line.strip():
            continue  # blank lines (a trailing newline too many) are not records
        if number == 1:
            line = line.removeprefix(codecs.BOM_UTF8)  # written by some Windows tools; json.loads refuses it
        if number == 1 and line.lstrip().startswith(b"["):
            raise DataError(f"{doc.path}: a JSON array, not JSON Lines (one object per line); convert it with "
                            f"`jq -c '.[]' {doc.path.name} > {doc.path.stem}.jsonl`")
        text, problem, num_invalid = _json_text(line, text_field)
        yield Record(doc, number, text, problem, raw.tell(), num_invalid_bytes=num_invalid)


def _lines(stream: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """The lines of ``stream``, each read no further than ``limit`` bytes (its newline aside): a longer one is None,
    its rest read and dropped a piece at a time."""
    while line := stream.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := stream.readline(limit)) and not rest.endswith(b"\n"):
            pass
        yield None


def _json_text(line: bytes, text_field: str) -> tuple[str | None, str | None, int]:
    """Return ``(text, None, 0)`` for a usable JSON Lines record, else ``(None, problem, num_invalid_bytes)``."""
    decoded, problem, num_invalid = decode_utf8(line, within=" of the line")
    if decoded is None:
        return None, problem, num_invalid
    try:
        value = json.loads(decoded)
    except ValueError as exc:
        return None, f"not valid JSON ({exc})", 0
    if not isinstance(value, dict):
        return None, f"a JSON {_json_type(value)}, not an object", 0
    if text_field not in value:
        names = ", ".join(list(value)[:10]) or "none"
        return None, f"no field {text_field!r} (fields: {names}); choose one with --text-field", 0
    text = value[text_field]
    if not isinstance(text, str):
        return None, f"field {text_field!r} is a JSON {_json_type(text)}, not a string", 0
    if ("\\ud" in decoded or "\\uD" in decoded) and _has_lone_surrogate(text):  # only a \\u escape can make one
        return None, "the text is not valid Unicode (a lone surrogate escape)", 0
    return text, None, 0


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


class BadRecords:
    """What to do with an unusable record: 'skip' it (counted, the first few named in a warning) or 'stop' the run."""

    def __init__(self, policy: str = "skip", num_named: int = 5) -> None:
        if policy not in ("skip", "stop"):
            raise DataError(f"on_bad_record must be 'skip' or 'stop', got {policy!r}")
        self.policy = policy
        self.num_named = num_named
        self.num_skipped = 0
        self.num_not_utf8 = 0
        """Skipped records that were not UTF-8 (counted in ``num_skipped`` too)."""
        self.num_invalid_bytes = 0
        """Bytes that were not UTF-8 in those records."""

    def handle(self, record: Record) -> None:
        """Count and maybe name a bad record; raise when the policy is 'stop'.

        Raises:
            DataError: ``policy == 'stop'``; the message names the file and line, row, piece or byte offset.
        """
        if self.policy == "stop":
            raise DataError(f"{record.location}: {record.problem} (--on-bad-record skip would skip it)")
        self.num_skipped += 1
        if record.num_invalid_bytes:
            self.num_not_utf8 += 1
            self.num_invalid_bytes += record.num_invalid_bytes
        if self.num_skipped <= self.num_named:
            more = "; further ones are only counted" if self.num_skipped == self.num_named else ""
            logger.warning("Skipping %s: %s%s", record.location, record.problem, more)

    def summary(self) -> str:
        """``N bad records skipped``, and how many of them were not UTF-8 (and their invalid bytes)."""
        text = f"{self.num_skipped:,} bad records skipped"
        if self.num_not_utf8:
            text += (f", {self.num_not_utf8:,} of them not UTF-8 ({self.num_invalid_bytes:,} invalid "
                     f"byte{'s' if self.num_invalid_bytes != 1 else ''})")
        return text
