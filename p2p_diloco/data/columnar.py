"""CSV and Parquet inputs of ``prepare-data``, read with pyarrow a batch at a time: one record per row.

Only the text column is read (pyarrow's ``include_columns`` / ``columns``), so other columns are neither parsed
nor held, and a CSV column whose inferred type changes half-way cannot fail the run. Text is read as bytes and
decoded with replacement, as text files are. A CSV row with the wrong number of fields is a bad record (pyarrow's
``invalid_row_handler`` names its row); a missing text column, or a Parquet text column that is not strings,
is an error for the whole file.
Who calls this: :func:`p2p_diloco.data.readers.read_records` (pyarrow is imported only when a CSV or Parquet
file is read).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import BinaryIO

import pyarrow as pa
from pyarrow import csv as pa_csv
from pyarrow import parquet as pa_parquet

from p2p_diloco.data.errors import DataError
from p2p_diloco.data.readers import Document, Record, open_input

BATCH_ROWS = 1024
CSV_BLOCK_BYTES = 8 << 20
"""pyarrow parses a CSV a block at a time and needs each row inside one block: the longest text a CSV row may hold."""


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
            raise DataError(f"{doc.path}: not a readable CSV file ({exc})") from None
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


def _bad_row(doc: Document, number: int | None, raw: BinaryIO) -> Record:
    return Record(doc, number, None, "not the header's number of fields", raw.tell(), unit="row")


def _csv_columns(doc: Document, compression: str | None) -> list[str]:
    """The header's column names, read again from the start (only to explain a missing column)."""
    with open_input(doc, compression) as (_, stream):
        return pa_csv.open_csv(stream, read_options=pa_csv.ReadOptions(use_threads=False)).schema.names


def parquet_records(doc: Document, text_field: str) -> Iterator[Record]:
    """Yield one record per row of a Parquet file's ``text_field`` column (a string or binary column).

    Raises:
        DataError: the file is not Parquet, is corrupt, or has no such text column.
    """
    try:
        parquet = pa_parquet.ParquetFile(doc.path)
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
        for batch in _checked(parquet.iter_batches(batch_size=BATCH_ROWS, columns=[text_field]), doc, "Parquet"):
            for value in batch.column(0).to_pylist():
                row += 1
                yield _row_record(doc, row, value, size * row // num_rows)


def _row_record(doc: Document, row: int, value: str | bytes | None, bytes_read: int) -> Record:
    if value is None:
        return Record(doc, row, None, "the text is null", bytes_read, unit="row")
    text = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
    return Record(doc, row, text, None, bytes_read, unit="row")


def _checked(batches: Iterable[pa.RecordBatch], doc: Document, kind: str) -> Iterator[pa.RecordBatch]:
    """``batches``, with pyarrow's errors while reading them turned into a DataError naming the file."""
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{doc.path}: corrupt or unreadable {kind} data ({exc})") from None
        yield batch
