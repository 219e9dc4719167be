"""The documents of ``prepare-data``'s inputs: an input file (:class:`Document`), one document read from it
(:class:`Record`), the most bytes a document may hold (:data:`MAX_DOCUMENT_BYTES`), and an input file opened
decompressed (:func:`open_input`).

Who calls this: the readers of the formats, :mod:`p2p_diloco.data.readers` (text, JSON Lines) and
:mod:`p2p_diloco.data.columnar` (CSV, Parquet), and :mod:`p2p_diloco.data.prepare` and :mod:`p2p_diloco.data.splits`,
which take their records.
"""

from __future__ import annotations

import gzip
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


def too_long() -> str:
    """The problem of a record longer than a document may be."""
    return f"longer than {_mib(MAX_DOCUMENT_BYTES)}, the most a document may hold"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:g} MiB"
