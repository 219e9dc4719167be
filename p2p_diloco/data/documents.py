"""The documents of ``prepare-data``'s inputs: an input file (:class:`Document`), one document read from it
(:class:`Record`), the most bytes a document may hold (:data:`MAX_DOCUMENT_BYTES`), and an input file opened
decompressed (:func:`open_input`).

Who calls this: the readers of the formats, :mod:`p2p_diloco.data.readers` (text, JSON Lines) and
:mod:`p2p_diloco.data.columnar` (CSV, Parquet), and :mod:`p2p_diloco.data.prepare` and :mod:`p2p_diloco.data.splits`,
which take their records.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from p2p_diloco.data.errors import DataError
from p2p_diloco.data.streams import CorruptStream, open_decompressed

MAX_DOCUMENT_BYTES = 8 << 20
"""The longest document (a text file or a piece of a longer one, or one record) in bytes, decompressed: preparing one
takes some 20 times its size (its text, its tokens as Python ints, then as int64), so this bounds prepare-data's
memory to a few hundred MB."""


@dataclass(frozen=True)
class Document:
    """One input file; ``key`` (its path relative to the input folder) decides its split, or its records'."""

    path: Path
    key: str
    given: bool = False
    """Named on the command line (an unusable one is an error), not found in a folder (skipped with a warning)."""


@dataclass(frozen=True)
class Record:
    """One document read from an input file: a whole text file (or a piece of a long one), or one record of a JSON
    Lines, CSV or Parquet file."""

    document: Document
    number: int | None
    """Line (JSON Lines), row (CSV, Parquet; 1 is the first under the header) or piece (a text file longer than a
    document; 1 is the first) number; None for a whole text file."""
    text: str | None
    problem: str | None = None
    """Why the record is unusable (then ``text`` is None)."""
    bytes_read: int = 0
    """How far into the input file this record ends, in bytes of the file as stored (for progress)."""
    unit: str = "line"
    num_invalid_bytes: int = 0
    """Bytes of the record that are not UTF-8 (then ``problem`` says so and where the first is)."""

    @property
    def key(self) -> str:
        """A stable name of the record, unique among the inputs, that decides its split."""
        return self.document.key if self.number is None else f"{self.document.key}:{self.number}"

    @property
    def location(self) -> str:
        """Where the record is, for messages: ``path:line``, ``path row N`` or ``path piece N``."""
        if self.number is None:
            return str(self.document.path)
        if self.unit == "line":
            return f"{self.document.path}:{self.number}"
        return f"{self.document.path} {self.unit} {self.number}"


@contextmanager
def open_input(doc: Document, compression: str | None) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """Yield ``(raw, stream)``: the file as stored and its decompressed bytes.

    Raises:
        DataError: the file cannot be opened, or reading it (in the ``with`` block) fails or finds corrupt data.
    """
    try:
        raw = open(doc.path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise DataError(f"{doc.path}: cannot read it ({exc.strerror or exc})") from None
    try:
        yield raw, open_decompressed(raw, compression)
    except (EOFError, zlib.error, gzip.BadGzipFile, CorruptStream) as exc:
        raise DataError(f"{doc.path}: corrupt {compression} data ({exc})") from None
    except OSError as exc:
        raise DataError(f"{doc.path}: cannot read it ({exc})") from None
    finally:
        raw.close()


def decode_utf8(data: bytes, start: int = 0, within: str = "") -> tuple[str | None, str | None, int]:
    """Decode a document's bytes strictly: ``(text, None, 0)``, or ``(None, problem, num_invalid_bytes)`` when they
    are not UTF-8, the problem naming the first bad byte's offset (``start`` plus its place in ``data``, ``within``
    saying of what: '' for the file, ' of the line').

    Bytes that are not UTF-8 make a bad record, as an invalid JSON line does, rather than U+FFFD characters the
    model would learn: the caller's :class:`~p2p_diloco.data.readers.BadRecords` skips (and counts) it or stops.
    """
    try:
        return data.decode("utf-8"), None, 0
    except UnicodeDecodeError as exc:
        # surrogateescape maps each undecodable byte to one lone surrogate: counting those counts the bytes.
        num_invalid = len(_ESCAPED_BYTE.findall(data.decode("utf-8", errors="surrogateescape")))
        problem = (f"not valid UTF-8: {num_invalid} invalid byte{'s' if num_invalid != 1 else ''}, the first at "
                   f"byte offset {start + exc.start}{within} (convert it, e.g. `iconv -f latin1 -t utf-8`)")
        return None, problem, num_invalid


_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


def too_long() -> str:
    """The problem of a record longer than a document may be."""
    return f"longer than {_mib(MAX_DOCUMENT_BYTES)}, the most a document may hold"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:g} MiB"
