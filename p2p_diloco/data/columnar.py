"""CSV and Parquet inputs of ``prepare-data``, read with pyarrow a batch at a time: one record per row.

Only the text column is read (pyarrow's ``include_columns`` / ``columns``), so other columns are neither parsed
nor held, and a CSV column whose inferred type changes half-way cannot fail the run. Text is read as bytes and
decoded strictly: a text that is not UTF-8 is a bad record, as in every format. A CSV row with the wrong number of
fields is a bad record (pyarrow's ``invalid_row_handler`` names its row); a missing text column, or a Parquet text
column that is not strings, is an error for the whole file. A CSV is parsed a block of ``MAX_DOCUMENT_BYTES`` at a
time; a Parquet file, whose pages pyarrow decompresses at whatever size they declare, in a child process with a
memory limit (:mod:`~p2p_diloco.data.watched`).
Who calls this: :func:`p2p_diloco.data.readers.read_records` (pyarrow is imported only when a CSV or Parquet
file is read).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import pyarrow as pa
from pyarrow import csv as pa_csv
from pyarrow import parquet as pa_parquet

from p2p_diloco.data.documents import MAX_DOCUMENT_BYTES, Document, Record, decode_utf8, open_input, too_long
from p2p_diloco.data.errors import DataError
from p2p_diloco.data.watched import watched

BATCH_ROWS = 1024
BATCH_BYTES = 16 << 20  # of a Parquet batch, as the file's metadata tells
CSV_BLOCK_BYTES = MAX_DOCUMENT_BYTES
"""pyarrow parses a CSV a block at a time and needs each row inside one block: the longest text a CSV row may hold."""
PARQUET_MEMORY_BYTES = 256 << 20
PARQUET_MEMORY_PER_FILE_BYTE = 16
"""How much the process reading one Parquet file may grow: :data:`PARQUET_MEMORY_BYTES` and this many times the file's
size. pyarrow holds a row group's dictionary page whole, and its writer puts up to 1,024 values in one before it falls
back to plain pages: 1,600 documents of 100 KB, written with its defaults (80 MB), take 200 MB to read, 4 MB ones
340 MB. A bomb, a small file that decodes to far more, gets the base alone."""
PARQUET_BUFFER_BYTES = 1 << 20  # read buffer of a column chunk: pages are read one at a time through it


def csv_records(doc: Document, compression: str | None, text_field: str) -> Iterator[Record]:
    """Yield one record per data row of a CSV file (optionally compressed) with a header row.

    Raises:
        DataError: no ``text_field`` column (the message lists the columns), or pyarrow cannot parse the file.
    """
    invalid_rows: list[int | None] = []

    def on_invalid_row(row) -> str:  # pyarrow counts the header as row 1, and -1 when it does not know
        invalid_rows.append(row.number - 1 if row.number > 0 else None)
        return "skip"

    with open_input(doc, compression) as (raw, stream):
        try:
            reader = pa_csv.open_csv(
                stream, read_options=pa_csv.ReadOptions(use_threads=False, block_size=CSV_BLOCK_BYTES),
                parse_options=pa_csv.ParseOptions(newlines_in_values=True, invalid_row_handler=on_invalid_row),
                convert_options=pa_csv.ConvertOptions(include_columns=[text_field],
                                                      column_types={text_field: pa.large_binary()}))
        except KeyError:  # pyarrow.lib.ArrowKeyError: the column is not in the header
            columns = ", ".join(_csv_columns(doc, compression))
            raise DataError(f"{doc.path}: no column {text_field!r} (columns: {columns}); choose one with --text-field"
                            ) from None
        except pa.ArrowInvalid as exc:
            raise DataError(f"{doc.path}: not a readable CSV file ({_csv_problem(exc)})") from None
        row = 0  # data rows read so far, valid or not
        for batch in _checked(reader, doc, "CSV"):
            bad_rows = sorted(n for n in invalid_rows if n is not None)  # the invalid rows of this batch's block
            num_unnumbered = len(invalid_rows) - len(bad_rows)
            invalid_rows.clear()
            i = 0
            for value in batch.column(0).to_pylist():
                row += 1
                while i < len(bad_rows) and bad_rows[i] <= row:
                    yield _bad_row(doc, bad_rows[i], raw)
                    row, i = max(row, bad_rows[i] + 1), i + 1
                yield _row_record(doc, row, value, raw.tell())
            for number in bad_rows[i:] + [None] * num_unnumbered:
                yield _bad_row(doc, number, raw)
                row = max(row, number or 0)


def _csv_problem(exc: Exception) -> str:
    """pyarrow's complaint, said in the terms of prepare-data where it is about a row's length."""
    if "straddl" in str(exc):  # "straddling object straddles two block boundaries (try to increase block size?)"
        return f"a row longer than {CSV_BLOCK_BYTES / 2**20:g} MiB, the most a document may hold, or a quote left open"
    return str(exc)


def _bad_row(doc: Document, number: int | None, raw: BinaryIO) -> Record:
    return Record(doc, number, None, "not the header's number of fields", raw.tell(), unit="row")


def _csv_columns(doc: Document, compression: str | None) -> list[str]:
    """The header's column names, read again from the start (only to explain a missing column)."""
    with open_input(doc, compression) as (_, stream):
        return pa_csv.open_csv(stream, read_options=pa_csv.ReadOptions(use_threads=False)).schema.names


def parquet_records(doc: Document, text_field: str) -> Iterator[Record]:
    """Yield one record per row of a Parquet file's ``text_field`` column (a string or binary column), read in a child
    process whose memory may grow by :data:`PARQUET_MEMORY_BYTES` and :data:`PARQUET_MEMORY_PER_FILE_BYTE` times the
    file's size (:mod:`~p2p_diloco.data.watched`: pyarrow decompresses a page of whatever size the file declares). A
    value longer than ``MAX_DOCUMENT_BYTES`` is a bad record.

    Raises:
        DataError: the file is not Parquet, is corrupt, has no such text column, or its reader outgrew its memory.
    """
    try:
        budget = PARQUET_MEMORY_BYTES + PARQUET_MEMORY_PER_FILE_BYTE * doc.path.stat().st_size
    except OSError as exc:
        raise DataError(f"{doc.path}: cannot read it ({exc.strerror or exc})") from None
    yield from watched(functools.partial(_parquet_rows, doc, text_field), doc.path, budget)


def _parquet_rows(doc: Document, text_field: str) -> Iterator[Record]:
    """The records of a Parquet file, in the child that :func:`parquet_records` watches."""
    # the C library's allocator: every allocation counts against the child's limit, where mimalloc (pyarrow's default)
    # would first fill the arenas this process reserved before the fork (they count as the parent's)
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        # pages read one at a time (not a row group's whole column chunk at once, pyarrow's default)
        parquet = pa_parquet.ParquetFile(doc.path, pre_buffer=False, buffer_size=PARQUET_BUFFER_BYTES)
    except OSError as exc:
        raise DataError(f"{doc.path}: cannot read it ({exc})") from None
    except pa.ArrowException as exc:
        raise DataError(f"{doc.path}: not a readable Parquet file ({exc})") from None
    with parquet:
        schema = parquet.schema_arrow
        if text_field not in schema.names:
            raise DataError(f"{doc.path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                            "choose one with --text-field")
        column_type = schema.field(text_field).type
        if not any(check(column_type) for check in (pa.types.is_string, pa.types.is_large_string,
                                                     pa.types.is_binary, pa.types.is_large_binary)):
            raise DataError(f"{doc.path}: column {text_field!r} holds {column_type}, not text; "
                            "choose another with --text-field")
        num_rows, size = max(1, parquet.metadata.num_rows), doc.path.stat().st_size
        row = 0
        batches = parquet.iter_batches(batch_size=_batch_rows(parquet, text_field), columns=[text_field],
                                       use_threads=False)
        for batch in _checked(batches, doc, "Parquet"):
            for value in batch.column(0).to_pylist():
                row += 1
                yield _row_record(doc, row, value, size * row // num_rows)


def _batch_rows(parquet: pa_parquet.ParquetFile, text_field: str) -> int:
    """Rows a batch holds: :data:`BATCH_ROWS`, fewer where the file's metadata says its rows are long (a batch of
    :data:`BATCH_BYTES` or so; the metadata may lie, the reader's memory bound holds anyway)."""
    metadata = parquet.metadata
    paths = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
    if text_field not in paths:
        return BATCH_ROWS
    column = paths.index(text_field)
    text_bytes = sum(metadata.row_group(i).column(column).total_uncompressed_size
                     for i in range(metadata.num_row_groups))
    return max(1, min(BATCH_ROWS, BATCH_BYTES * max(1, metadata.num_rows) // max(1, text_bytes)))


def _row_record(doc: Document, row: int, value: str | bytes | None, bytes_read: int) -> Record:
    if value is None:
        return Record(doc, row, None, "the text is null", bytes_read, unit="row")
    if len(value) > MAX_DOCUMENT_BYTES:  # characters of a string: at least as many bytes
        return Record(doc, row, None, too_long(), bytes_read, unit="row")
    if isinstance(value, str):
        return Record(doc, row, value, None, bytes_read, unit="row")
    text, problem, num_invalid = decode_utf8(value, within=" of the text")
    return Record(doc, row, text, problem, bytes_read, unit="row", num_invalid_bytes=num_invalid)


def _checked(batches: Iterable[pa.RecordBatch], doc: Document, kind: str) -> Iterator[pa.RecordBatch]:
    """``batches``, with pyarrow's errors while reading them turned into a DataError naming the file."""
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except MemoryError:  # pyarrow's ArrowMemoryError too: the limit of a watched reader, said by its caller
            raise
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{doc.path}: corrupt or unreadable {kind} data ({_csv_problem(exc)})") from None
        yield batch
