"""prepare-data's inputs beyond text files: JSON Lines, CSV and Parquet, gzip/zstd, folders of them, bad records,
the split of records, and the one-line errors for files it cannot use."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pa_parquet
import pytest
import zstandard

from p2p_diloco.cli.main import main
from p2p_diloco.data import BadRecords, ByteTokenizer, DataError, ShardDataset, prepare_data, read_records, readers
from p2p_diloco.data.documents import MAX_DOCUMENT_BYTES
from p2p_diloco.data.readers import collect_documents
from tests.unit.test_data import all_tokens, decoded_documents

TEXTS = [f'record {i}: héllo, "quoted", a,comma\nsecond line ✓ {"x" * (i % 9)}' for i in range(60)] + ["", "😀 end"]
FORMATS = ["jsonl", "ndjson", "json", "jsonl.gz", "jsonl.zst", "csv", "csv.gz", "csv.zst", "parquet"]


def compress(data: bytes, suffix: str) -> bytes:
    if suffix.endswith(".gz"):
        return gzip.compress(data)
    if suffix.endswith(".zst"):
        return zstandard.ZstdCompressor().compress(data)
    return data


def write_records(path: Path, texts: list, field: str = "text") -> Path:
    """Write ``texts`` (None for a null) as one record each, in the format the name's suffixes say."""
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.name
    table = pa.table({"id": list(range(len(texts))), field: texts})
    if ".parquet" in name:
        pa_parquet.write_table(table, path, row_group_size=16)
    elif ".csv" in name:
        sink = pa.BufferOutputStream()
        pa_csv.write_csv(table, sink)
        path.write_bytes(compress(sink.getvalue().to_pybytes(), name))
    else:
        lines = "".join(json.dumps({"id": i, field: text}) + "\n" for i, text in enumerate(texts))
        path.write_bytes(compress(lines.encode(), name))
    return path


def all_texts(out: Path) -> list[str]:
    return sorted(decoded_documents(out, "train") + decoded_documents(out, "eval"))


@pytest.mark.parametrize("suffix", FORMATS)
def test_every_format_gives_its_records_as_documents(tmp_path: Path, suffix: str) -> None:
    path = write_records(tmp_path / f"data.{suffix}", TEXTS)
    meta = prepare_data([path], tmp_path / "out", ByteTokenizer(), eval_fraction=0.1, progress=False)
    assert all_texts(tmp_path / "out") == sorted(TEXTS)
    train, held_out = decoded_documents(tmp_path / "out", "train"), decoded_documents(tmp_path / "out", "eval")
    assert meta["splits"]["eval"]["num_documents"] == len(held_out) >= 1 and not set(held_out) & set(train)
    # progress: each record says how far into the stored file it ends; the last one ends at its size
    positions = [record.bytes_read for record in read_records(collect_documents([path])[0])]
    assert positions == sorted(positions) and positions[-1] == path.stat().st_size


def test_records_go_to_eval_by_the_hash_of_file_and_line(tmp_path: Path) -> None:
    texts = [f"document {i}\n" for i in range(400)]
    path = write_records(tmp_path / "data.jsonl", texts)
    meta = prepare_data([path], tmp_path / "out", ByteTokenizer(), eval_fraction=0.1, progress=False)

    def fraction(line: int) -> float:  # the rule, written out independently of p2p_diloco.data.splits
        return int(hashlib.sha256(f"data.jsonl:{line}".encode()).hexdigest()[:16], 16) / 2**64

    expected = {texts[line - 1] for line in range(1, 401) if fraction(line) < 0.1}
    assert set(decoded_documents(tmp_path / "out", "eval")) == expected and 20 <= len(expected) <= 60
    assert meta["splits"]["train"]["num_documents"] + meta["splits"]["eval"]["num_documents"] == 400
    again = prepare_data([path], tmp_path / "again", ByteTokenizer(), eval_fraction=0.1, progress=False)
    assert again == meta
    for split in ("train", "eval"):
        for name in meta["splits"][split]["files"]:
            assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_few_records_still_fill_both_splits(tmp_path: Path) -> None:
    path = write_records(tmp_path / "two.jsonl", ["first\n", "second\n"])
    meta = prepare_data([path], tmp_path / "out", ByteTokenizer(), eval_fraction=0.01, progress=False)
    assert {split: entry["num_documents"] for split, entry in meta["splits"].items()} == {"train": 1, "eval": 1}
    fractions = {text: hashlib.sha256(f"two.jsonl:{line}".encode()).digest() for line, text in
                 enumerate(["first\n", "second\n"], start=1)}
    assert decoded_documents(tmp_path / "out", "eval") == [min(fractions, key=fractions.get)]  # the most eval-like

    three = write_records(tmp_path / "three.jsonl", ["a\n", "b\n", "c\n"])  # all three fall in eval by hash
    meta = prepare_data([three], tmp_path / "mostly_eval", ByteTokenizer(), eval_fraction=0.999, progress=False)
    assert {split: entry["num_documents"] for split, entry in meta["splits"].items()} == {"train": 1, "eval": 2}

    one = write_records(tmp_path / "one.jsonl", ["to be or not to be\n" * 20])
    prepare_data([one], tmp_path / "single", ByteTokenizer(), eval_fraction=0.1, progress=False)
    train, held_out = (all_tokens(ShardDataset(tmp_path / "single", split)) for split in ("train", "eval"))
    assert len(held_out) == round(0.1 * (20 * 19 + 1))  # like a single text file: its tail is held out
    assert ByteTokenizer().decode(train.tolist() + held_out.tolist()) == "to be or not to be\n" * 20


def test_a_folder_of_mixed_formats_is_read_in_sorted_order(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    folder = tmp_path / "mixed"
    write_records(folder / "b.jsonl.gz", TEXTS[:20])
    write_records(folder / "sub" / "c.parquet", TEXTS[20:40])
    write_records(folder / "sub" / "a.csv.zst", TEXTS[40:])
    (folder / "notes.txt").write_text("a plain text document\n")
    (folder / "zz.txt.gz").write_bytes(gzip.compress(b"a compressed text document\n"))
    (folder / "image.bin").write_bytes(b"\x89PNG\x00\x00binary")
    assert [doc.key for doc in collect_documents([folder])] == [
        "b.jsonl.gz", "image.bin", "notes.txt", "sub/a.csv.zst", "sub/c.parquet", "zz.txt.gz"]
    with caplog.at_level(logging.WARNING):
        meta = prepare_data([folder], tmp_path / "out", ByteTokenizer(), eval_fraction=0.1, progress=False)
    assert "image.bin: looks like a binary file" in caplog.text
    assert all_texts(tmp_path / "out") == sorted(TEXTS + ["a plain text document\n", "a compressed text document\n"])
    again = prepare_data([folder], tmp_path / "again", ByteTokenizer(), eval_fraction=0.1, progress=False)
    assert again == meta


def test_text_field_names_the_field_or_column(tmp_path: Path) -> None:
    for name in ("a.jsonl", "b.csv", "c.parquet"):
        write_records(tmp_path / "in" / name, TEXTS[:10], field="content")
    prepare_data([tmp_path / "in"], tmp_path / "out", ByteTokenizer(), text_field="content", progress=False)
    assert all_texts(tmp_path / "out") == sorted(TEXTS[:10] * 3)


BAD_LINES = [
    ('{"text": "good one"}', None),
    ("{not json", "bad.jsonl:2: not valid JSON"),
    ('{"content": "x", "id": 3}', "bad.jsonl:3: no field 'text' (fields: content, id); choose one with --text-field"),
    ('{"text": 7}', "bad.jsonl:4: field 'text' is a JSON number, not a string"),
    ('{"text": null}', "bad.jsonl:5: field 'text' is a JSON null, not a string"),
    ("", None),  # a blank line is not a record
    ('["text"]', "bad.jsonl:7: a JSON array, not an object"),
    ('{"text": "lone \\ud800 surrogate"}', "bad.jsonl:8: the text is not valid Unicode"),
    ('{"text": "good two"}', None),
    (b'{"text": "\xff"}', "bad.jsonl:10: not valid JSON"),
]


def write_bad_jsonl(path: Path) -> Path:
    lines = [line if isinstance(line, bytes) else line.encode() for line, _ in BAD_LINES]
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")  # a UTF-8 byte order mark first, as some tools write
    return path


def test_bad_records_are_skipped_counted_and_the_first_few_named(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                                ) -> None:
    path = write_bad_jsonl(tmp_path / "bad.jsonl")
    bad_records = BadRecords("skip", num_named=5)
    with caplog.at_level(logging.WARNING):
        prepare_data([path], tmp_path / "out", ByteTokenizer(), eval_fraction=0.4, bad_records=bad_records,
                     progress=False)
    assert all_texts(tmp_path / "out") == ["good one", "good two"]
    expected = [message for _, message in BAD_LINES if message]
    assert bad_records.num_skipped == len(expected) == 7
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5 and "further ones are only counted" in warnings[-1]
    for warning, message in zip(warnings, expected, strict=False):
        assert message in warning


def test_stop_at_a_bad_record_names_file_and_line(tmp_path: Path) -> None:
    path = write_bad_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON .*--on-bad-record skip"):
        prepare_data([path], tmp_path / "out", ByteTokenizer(), bad_records=BadRecords("stop"), progress=False)
    assert not (tmp_path / "out").exists()


def test_bad_csv_and_parquet_rows_are_named_by_row(tmp_path: Path) -> None:
    csv = tmp_path / "data.csv"
    csv.write_text('id,text\n1,"first,\nsecond line"\n2,two,extra\n3,three\n')
    with pytest.raises(DataError, match=r"data\.csv row 2: not the header's number of fields"):
        prepare_data([csv], tmp_path / "out", ByteTokenizer(), bad_records=BadRecords("stop"), progress=False)
    skipped = BadRecords("skip")
    prepare_data([csv], tmp_path / "out", ByteTokenizer(), eval_fraction=0.4, bad_records=skipped, progress=False)
    assert all_texts(tmp_path / "out") == ["first,\nsecond line", "three"] and skipped.num_skipped == 1
    rows = [(r.number, r.text) for r in read_records(collect_documents([csv])[0])]
    assert rows == [(1, "first,\nsecond line"), (2, None), (3, "three")]

    parquet = write_records(tmp_path / "data.parquet", ["one", None, "three"])
    with pytest.raises(DataError, match=r"data\.parquet row 2: the text is null"):
        prepare_data([parquet], tmp_path / "out", ByteTokenizer(), bad_records=BadRecords("stop"), progress=False)


def reference_pieces(text: str, limit: int) -> list[str]:
    """A text cut the slow, obvious way: each piece as many whole lines as fit in ``limit`` UTF-8 bytes, or, when not
    even its first line fits, as many whole characters; the rest once it fits."""
    pieces = []
    while len(text.encode()) > limit:
        piece = ""
        for line in re.findall(r"[^\n]*\n|[^\n]+", text):
            if len((piece + line).encode()) > limit:
                break
            piece += line
        if not piece:  # not even its first line fits
            for char in text:
                if len((piece + char).encode()) > limit:
                    break
                piece += char
        pieces.append(piece)
        text = text[len(piece):]
    return [*pieces, text]


@pytest.mark.parametrize("suffix", ["txt", "txt.gz", "txt.zst"])
def test_a_text_file_longer_than_the_limit_is_read_as_documents_cut_at_line_ends(tmp_path: Path, monkeypatch,
                                                                                  suffix: str) -> None:
    """A text file up to MAX_DOCUMENT_BYTES (decompressed) is one document; a longer one is read a piece at a time
    (so a small compressed file cannot make prepare-data hold gigabytes: tests/integration/test_prepare_memory.py), as
    consecutive documents of at most that many bytes, each cut after its last newline or, in a line longer than a
    document, between two characters: together they are the file, each ended by an end-of-document token."""
    limit = 64
    monkeypatch.setattr(readers, "MAX_DOCUMENT_BYTES", limit)
    fits = tmp_path / f"fits.{suffix}"
    fits.write_bytes(compress(b"a" * (limit - 1) + b"\n", fits.name))
    whole = [(r.number, r.text) for r in read_records(collect_documents([fits])[0])]
    assert whole == [(None, "a" * (limit - 1) + "\n")]
    text = "".join(f"line {i}: héllo {'x' * (i * 7 % 50)}\n" for i in range(30)) + "x" + "é" * 50 + "😀" * 40 + \
        "\nlast line, no newline " + "✓" * 30
    path = tmp_path / f"long.{suffix}"
    path.write_bytes(compress(text.encode(), path.name))
    records = list(read_records(collect_documents([path])[0]))
    assert [r.text for r in records] == reference_pieces(text, limit)
    assert "".join(r.text for r in records) == text and len(records) > 10
    assert [r.number for r in records] == list(range(1, len(records) + 1))
    assert records[0].location == f"{path} piece 1"
    progress = [r.bytes_read for r in records]
    assert progress == sorted(progress) and progress[-1] == path.stat().st_size
    prepare_data([path], tmp_path / "out", ByteTokenizer(), eval_fraction=0.2, progress=False)
    assert all_texts(tmp_path / "out") == sorted(reference_pieces(text, limit))
    other = tmp_path / f"other.{suffix}"
    other.write_bytes(compress(b"another file", other.name))
    prepare_data([path, other], tmp_path / "out2", ByteTokenizer(), eval_fraction=0.5, progress=False)
    eval_texts = decoded_documents(tmp_path / "out2", "eval")
    assert eval_texts in (["another file"], reference_pieces(text, limit))  # a long file's pieces go with it


def test_a_record_longer_than_the_limit_is_a_bad_record_naming_the_file_and_the_limit(tmp_path: Path) -> None:
    """A record is read no further than MAX_DOCUMENT_BYTES (decompressed), so a small compressed file cannot make
    prepare-data hold gigabytes (tests/integration/test_prepare_memory.py): a longer one is a bad record (its line or
    row named), and the records after it are read as before."""
    limit = MAX_DOCUMENT_BYTES
    long_text = "b" * (limit + 1)
    for name in ("records.jsonl.gz", "records.jsonl.zst", "records.csv.gz", "records.parquet"):
        path = write_records(tmp_path / name, ["first", long_text, "third" * 1000, "fourth"])
        problems = [(r.number, r.problem) for r in read_records(collect_documents([path])[0]) if r.problem]
        assert problems == [(2, "longer than 8 MiB, the most a document may hold")], name
        texts = [r.text for r in read_records(collect_documents([path])[0]) if r.text is not None]
        assert texts == ["first", "third" * 1000, "fourth"], name
        with pytest.raises(DataError, match=rf"{name}(:| row )2: longer than 8 MiB, the most a document may hold"):
            prepare_data([path], tmp_path / "out3", ByteTokenizer(), bad_records=BadRecords("stop"), progress=False)
    csv = write_records(tmp_path / "far.csv.gz", ["first", long_text * 3])  # pyarrow needs a row within 2 blocks
    with pytest.raises(DataError, match=r"far\.csv\.gz: corrupt or unreadable CSV data \(a row longer than 8 MiB"):
        prepare_data([csv], tmp_path / "out4", ByteTokenizer(), progress=False)


def corrupt_gzip(path: Path) -> None:
    data = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(20000)))
    path.write_bytes(data[:200] + b"\x00" * 64 + data[264:])


def make_unusable(tmp_path: Path, case: str) -> tuple[Path, str]:
    """An input of the kind ``case`` names, and what the one-line error says about it."""
    if case == "parquet without the column":
        path = write_records(tmp_path / "p.parquet", ["a"], field="body")
        return path, r"p\.parquet: no column 'text' \(columns: id, body\)"
    if case == "csv.gz without the column":
        path = write_records(tmp_path / "c.csv.gz", ["a"], field="body")
        return path, r"c\.csv\.gz: no column 'text' \(columns: id, body\)"
    if case == "parquet column of numbers":
        pa_parquet.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
        return tmp_path / "n.parquet", r"n\.parquet: column 'text' holds int64, not text"
    if case == "corrupt gzip":
        corrupt_gzip(tmp_path / "x.jsonl.gz")
        return tmp_path / "x.jsonl.gz", r"x\.jsonl\.gz: corrupt gzip data"
    if case == "truncated gzip":
        write_records(tmp_path / "t.csv.gz", TEXTS)
        (tmp_path / "t.csv.gz").write_bytes((tmp_path / "t.csv.gz").read_bytes()[:-30])
        return tmp_path / "t.csv.gz", r"t\.csv\.gz: corrupt gzip data \(Compressed file ended"
    if case == "not gzip at all":
        (tmp_path / "plain.txt.gz").write_text("not compressed\n")
        return tmp_path / "plain.txt.gz", r"plain\.txt\.gz: corrupt gzip data \(Not a gzipped file"
    if case == "truncated zstd":
        write_records(tmp_path / "z.jsonl.zst", TEXTS)
        (tmp_path / "z.jsonl.zst").write_bytes((tmp_path / "z.jsonl.zst").read_bytes()[:-20])
        return tmp_path / "z.jsonl.zst", r"z\.jsonl\.zst: corrupt zstd data \(the file ends inside a zstd frame"
    if case == "not parquet":
        (tmp_path / "fake.parquet").write_bytes(b"PAR1 but not really")
        return tmp_path / "fake.parquet", r"fake\.parquet: not a readable Parquet file"
    if case == "compressed parquet":
        (tmp_path / "d.parquet.gz").write_bytes(gzip.compress(b"x"))
        return tmp_path / "d.parquet.gz", r"d\.parquet\.gz: Parquet is compressed inside already"
    if case == "unknown binary format":
        (tmp_path / "sheet.xlsx").write_bytes(b"PK\x03\x04\x00\x00binary")
        return tmp_path / "sheet.xlsx", r"sheet\.xlsx: unknown format: not text, and not one of \.jsonl"
    if case == "unreadable file in a folder":
        (tmp_path / "folder").mkdir()
        os.symlink(tmp_path / "gone.jsonl", tmp_path / "folder" / "link.jsonl")
        return tmp_path / "folder", r"link\.jsonl: cannot read it"
    if case == "JSON array":
        (tmp_path / "array.json").write_text('[{"text": "a"},\n {"text": "b"}]\n')
        return tmp_path / "array.json", r"array\.json: a JSON array, not JSON Lines .*jq -c"
    assert case == "empty CSV"
    (tmp_path / "empty.csv").write_text("")
    return tmp_path / "empty.csv", r"empty\.csv: not a readable CSV file"


@pytest.mark.parametrize("case", [
    "parquet without the column", "csv.gz without the column", "parquet column of numbers", "corrupt gzip",
    "truncated gzip", "not gzip at all", "truncated zstd", "not parquet", "compressed parquet",
    "unknown binary format", "unreadable file in a folder", "JSON array", "empty CSV"])
def test_files_it_cannot_use_are_one_line_errors_naming_them(tmp_path: Path, case: str) -> None:
    path, expected = make_unusable(tmp_path, case)
    with pytest.raises(DataError, match=expected) as error:
        prepare_data([path], tmp_path / "out", ByteTokenizer(), progress=False)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_cli_options_and_summary_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_records(tmp_path / "in" / "a.jsonl", TEXTS[:30], field="body")
    with open(tmp_path / "in" / "a.jsonl", "a") as f:
        f.write("{broken\n")
    out = tmp_path / "out"
    assert main(["prepare-data", str(tmp_path / "in"), "-o", str(out), "--text-field", "body"]) == 0
    summary, line = capsys.readouterr().out.splitlines()
    assert summary.startswith(f"Wrote {out}: 30 documents, {sum(len(t.encode()) + 1 for t in TEXTS[:30]):,} tokens")
    assert summary.endswith(", 1 bad records skipped")
    assert json.loads(line)["num_skipped_records"] == 1 and json.loads(line)["num_documents"] == 30
    assert main(["prepare-data", str(tmp_path / "in"), "-o", str(out), "--text-field", "body",
                 "--on-bad-record", "stop", "--force"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'in' / 'a.jsonl'}:31: not valid JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)) (--on-bad-record skip would skip it)")


# ---- bytes that are not UTF-8 ----------------------------------------------------------------------------------

LATIN1 = "café crème\n".encode("latin-1")  # two bytes that are not UTF-8, the first at offset 3


@pytest.mark.parametrize("name", ["notes.txt", "notes.txt.gz", "notes.jsonl", "notes.csv.zst"])
def test_bytes_that_are_not_utf8_are_a_bad_record_in_every_format(tmp_path: Path, name: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Never U+FFFD characters the model would learn: skipped and counted (bytes too), or a stop naming the offset."""
    (tmp_path / "in").mkdir()
    for i in range(3):
        (tmp_path / "in" / f"good{i}.txt").write_text(f"fine text {i}\n")
    if ".txt" in name:
        data, location = LATIN1, f"{name}: "
    elif ".jsonl" in name:
        data, location = b'{"text": "ok"}\n{"text": "' + LATIN1.strip() + b'"}\n', f"{name}:2: "
    else:
        data, location = b"text\nok\n" + LATIN1, f"{name} row 2: "
    (tmp_path / "in" / name).write_bytes(compress(data, name))
    skipped = BadRecords("skip")
    with caplog.at_level(logging.WARNING):
        prepare_data([tmp_path / "in"], tmp_path / "out", ByteTokenizer(), eval_fraction=0.5, bad_records=skipped,
                     progress=False)
    assert (skipped.num_skipped, skipped.num_not_utf8, skipped.num_invalid_bytes) == (1, 1, 2)
    assert skipped.summary() == "1 bad records skipped, 1 of them not UTF-8 (2 invalid bytes)"
    assert location + "not valid UTF-8: 2 invalid bytes, the first at byte offset" in caplog.text
    assert not any("\ufffd" in text for text in all_texts(tmp_path / "out"))
    with pytest.raises(DataError) as caught:
        prepare_data([tmp_path / "in"], tmp_path / "out2", ByteTokenizer(), bad_records=BadRecords("stop"),
                     progress=False)
    offset = 3 if ".txt" in name else (13 if ".jsonl" in name else 3)
    assert str(caught.value).startswith(f"{tmp_path / 'in' / name}{location[len(name):]}not valid UTF-8: 2 invalid "
                                        f"bytes, the first at byte offset {offset}")


def test_the_byte_offset_of_a_long_text_file_counts_from_the_start_of_the_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(readers, "MAX_DOCUMENT_BYTES", 64)
    path = tmp_path / "long.txt"
    path.write_bytes(b"a" * 40 + b"\n" + b"b" * 40 + b"\n" + b"c" * 10 + b"\xff\n")
    records = list(read_records(collect_documents([path])[0]))  # piece 2 starts at byte 41: the b and c lines
    assert [r.text for r in records] == ["a" * 40 + "\n", None] and records[1].location == f"{path} piece 2"
    assert records[1].problem.startswith("not valid UTF-8: 1 invalid byte, the first at byte offset 92")


def test_the_cli_reports_bytes_that_are_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_records(tmp_path / "in" / "a.jsonl", TEXTS[:30])
    (tmp_path / "in" / "b.txt").write_bytes(LATIN1)
    out = tmp_path / "out"
    assert main(["prepare-data", str(tmp_path / "in"), "-o", str(out)]) == 0
    summary, line = capsys.readouterr().out.splitlines()
    assert summary.endswith(", 1 bad records skipped, 1 of them not UTF-8 (2 invalid bytes)")
    assert json.loads(line)["num_not_utf8_records"] == 1 and json.loads(line)["num_invalid_utf8_bytes"] == 2
    assert main(["prepare-data", str(tmp_path / "in"), "-o", str(tmp_path / "out2"), "--on-bad-record", "stop"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'in' / 'b.txt'}: not valid UTF-8: 2 invalid bytes, the first at byte offset 3 (convert "
        "it, e.g. `iconv -f latin1 -t utf-8`) (--on-bad-record skip would skip it)")


# ---- the output folder ------------------------------------------------------------------------------------------

def test_an_existing_output_folder_is_replaced_only_with_force(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_records(tmp_path / "in" / "a.jsonl", TEXTS[:30])
    out = tmp_path / "out"
    assert main(["prepare-data", str(tmp_path / "in"), "-o", str(out)]) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    write_records(tmp_path / "in" / "a.jsonl", TEXTS[30:])
    assert main(["prepare-data", str(tmp_path / "in"), "-o", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --output: {out} exists and is not empty; give --force to replace it, or a new folder (nothing was "
        "overwritten)")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert main(["prepare-data", str(tmp_path / "in"), "-o", str(out), "--force"]) == 0
    assert {f.name: f.read_bytes() for f in out.iterdir()} != before
    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to lose
    assert main(["prepare-data", str(tmp_path / "in"), "-o", str(tmp_path / "empty")]) == 0


def test_a_killed_writers_temporary_folder_is_removed_by_the_next_write(tmp_path: Path) -> None:
    import subprocess
    import sys

    from p2p_diloco.data import shards

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    out = tmp_path / "out"
    stale = tmp_path / f".out.tmp-{int(gone.stdout)}-{shards._host()}-abcd1234"
    alive = tmp_path / f".out.tmp-{os.getpid()}-{shards._host()}-efgh5678"  # a write still under way
    elsewhere = tmp_path / f".out.tmp-{int(gone.stdout)}-otherhost-ijkl9012"  # another host's, on a shared disk
    other = tmp_path / f".other.tmp-{int(gone.stdout)}-{shards._host()}-mnop3456"  # another folder's
    for folder in (stale, alive, elsewhere, other):
        (folder / "x").mkdir(parents=True)
    write_records(tmp_path / "in" / "a.jsonl", TEXTS[:30])
    prepare_data([tmp_path / "in"], out, ByteTokenizer(), eval_fraction=0.1, progress=False)
    assert not stale.exists() and alive.exists() and elsewhere.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["in", "out", alive.name, elsewhere.name, other.name])


def test_sigterm_removes_the_temporary_folder_as_ctrl_c_does(tmp_path: Path) -> None:
    import signal

    from p2p_diloco.cli.prepare import _sigterm_as_interrupt
    from p2p_diloco.data import atomic_output_dir

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt), _sigterm_as_interrupt(), atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "part.bin").write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before  # the previous handler is back
