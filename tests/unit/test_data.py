"""Unit tests of p2p_diloco.data: tokenizers, shard format and its validation, preparation, samplers."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_diloco.config.sections import DataConfig
from p2p_diloco.data import (
    BadRecords,
    ByteTokenizer,
    DataError,
    HFTokenizer,
    ShardDataset,
    ShardWriter,
    WindowSampler,
    atomic_output_dir,
    builtin_corpus,
    eval_batches,
    load_tokenizer,
    prepare_data,
    resolve_data_path,
    seed_from_peer_id,
    write_meta,
)
from p2p_diloco.data import prepare as prepare_module
from p2p_diloco.data.prepare import BUILTIN_MAX_BYTES, STDLIB_EXCLUDED_DIRS, stdlib_documents

DOCS = {
    "a.txt": "hello world\n",
    "b.txt": "héllo wörld ✓ 😀 — non-ASCII\n",
    "sub/c.txt": "def f(x):\n    return x + 1\n",
    "sub/deeper/d.txt": "",
    **{f"many/doc_{i:02d}.txt": f"document number {i}\n" * (i + 1) for i in range(40)},
}


def write_docs(folder: Path, docs: dict[str, str]) -> Path:
    for rel, text in docs.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text, encoding="utf-8")
    return folder


def write_shards(out_dir: Path, splits: dict[str, np.ndarray], vocab_size: int, dtype: str = "uint16",
                 tokens_per_shard: int = 1000) -> Path:
    with atomic_output_dir(out_dir) as tmp_dir:
        entries = {}
        for split, tokens in splits.items():
            with ShardWriter(tmp_dir, split, dtype, tokens_per_shard) as writer:
                writer.append(tokens)
            entries[split] = writer.close()
        write_meta(tmp_dir, dtype, vocab_size, "test", entries)
    return out_dir


def split_documents(tokens: np.ndarray, eot_id: int) -> list[np.ndarray]:
    assert tokens[-1] == eot_id
    ends = np.flatnonzero(tokens == eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e] for s, e in zip(starts, ends, strict=True)]


def all_tokens(dataset: ShardDataset) -> np.ndarray:
    return dataset.window(0, dataset.num_tokens)


def decoded_documents(path: Path, split: str) -> list[str]:
    tokenizer = ByteTokenizer()
    return [tokenizer.decode(doc.tolist()) for doc in split_documents(all_tokens(ShardDataset(path, split)), 256)]


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tokenizer = ByteTokenizer()
    text = "plain ASCII, héllo wörld, ✓, 😀, 中文"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids) and tokenizer.vocab_size == 257 and tokenizer.eot_id == 256
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eot_id]) == text
    assert tokenizer.decode([0xFF, ord("a")]) == "\ufffda"  # invalid UTF-8 is replaced, not raised
    assert load_tokenizer("byte").name == "byte"


def make_hf_tokenizer_json(path: Path, special_tokens: list[str]) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=special_tokens, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(DOCS.values()) * 3, trainer)
    tokenizer.save(str(path))
    return path


def test_hf_tokenizer_round_trip_and_prepare(tmp_path: Path) -> None:
    path = make_hf_tokenizer_json(tmp_path / "tokenizer.json", ["<|endoftext|>"])
    tokenizer = load_tokenizer(str(path))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.name == "hf:tokenizer.json"
    assert load_tokenizer(str(tmp_path)).vocab_size == tokenizer.vocab_size  # a folder holding tokenizer.json
    assert tokenizer.eot_id == tokenizer._tokenizer.token_to_id("<|endoftext|>")
    text = "héllo wörld ✓ def f(x): return x"
    assert tokenizer.decode(tokenizer.encode(text)) == text

    out = tmp_path / "shards"
    meta = prepare_data([write_docs(tmp_path / "docs", DOCS)], out, tokenizer, eval_fraction=0.1, progress=False)
    assert meta["tokenizer"] == "hf:tokenizer.json" and meta["vocab_size"] == tokenizer.vocab_size
    texts = []
    for split in ("train", "eval"):
        docs = split_documents(all_tokens(ShardDataset(out, split)), tokenizer.eot_id)
        texts += [tokenizer.decode(doc.tolist()) for doc in docs]
    assert sorted(texts) == sorted(DOCS.values())


def test_prepare_puts_the_tokenizers_bos_before_each_document_unless_turned_off(tmp_path: Path) -> None:
    """A Llama-style tokenizer.json, whose post-processor puts <s> before every text (as transformers feeds the model
    in pretraining): each document is <s>, its text, </s>; bos=False (--no-bos) leaves <s> out; meta.json says which."""
    tokenizers = pytest.importorskip("tokenizers")
    path = make_hf_tokenizer_json(tmp_path / "tokenizer.json", ["<s>", "</s>"])
    llama = tokenizers.Tokenizer.from_file(str(path))
    bos, eos = llama.token_to_id("<s>"), llama.token_to_id("</s>")
    llama.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    llama.save(str(path))
    tokenizer = HFTokenizer(path)
    assert (tokenizer.bos_id, tokenizer.eot_id) == (bos, eos)
    docs = write_docs(tmp_path / "docs", {"a.txt": "hello world\n", "b.txt": "def f(x): return x\n", "c.txt": "z\n"})
    meta = prepare_data([docs], tmp_path / "with", tokenizer, eval_fraction=0.3, progress=False)
    assert meta["documents"] == {"bos_id": bos, "eot_id": eos}
    for split in ("train", "eval"):
        for doc in split_documents(all_tokens(ShardDataset(tmp_path / "with", split)), eos):
            assert doc[0] == bos and bos not in doc[1:]
    meta = prepare_data([docs], tmp_path / "without", tokenizer, eval_fraction=0.3, progress=False, bos=False)
    assert meta["documents"] == {"bos_id": None, "eot_id": eos}
    assert bos not in all_tokens(ShardDataset(tmp_path / "without", "train"))
    assert json.loads((tmp_path / "without" / "meta.json").read_text())["documents"]["bos_id"] is None
    from p2p_diloco.cli.main import main

    for flags, expected in (([], bos), (["--no-bos"], None)):
        out = tmp_path / f"cli{len(flags)}"
        assert main(["prepare-data", str(docs), "-o", str(out), "--tokenizer", str(path), "--eval-fraction", "0.3",
                     *flags]) == 0
        assert json.loads((out / "meta.json").read_text())["documents"] == {"bos_id": expected, "eot_id": eos}
    # A tokenizer that adds nothing before a text (GPT-2, and the byte tokenizer) gets no BOS.
    assert HFTokenizer(make_hf_tokenizer_json(tmp_path / "gpt2.json", ["<|endoftext|>"])).bos_id is None
    assert ByteTokenizer().bos_id is None
    meta = prepare_data([docs], tmp_path / "bytes", ByteTokenizer(), eval_fraction=0.3, progress=False)
    assert meta["documents"] == {"bos_id": None, "eot_id": 256}


def test_hf_tokenizer_without_eot_token(tmp_path: Path) -> None:
    tokenizer = HFTokenizer(make_hf_tokenizer_json(tmp_path / "tok.json", ["<pad>"]))
    assert tokenizer.eot_id is None and tokenizer.name == "hf:tok.json"


def test_hf_tokenizer_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(DataError, match="missing.json: tokenizer file not found"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(DataError, match="garbage.json: not a readable tokenizer.json"):
        load_tokenizer(str(tmp_path / "garbage.json"))
    (tmp_path / "wrong.json").write_text('{"model": 3}')
    with pytest.raises(DataError, match="wrong.json: not a valid HF tokenizer.json"):
        load_tokenizer(str(tmp_path / "wrong.json"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(DataError, match="needs the 'tokenizers' package"):
        load_tokenizer(str(tmp_path / "wrong.json"))


# ---------------------------------------------------------------- prepare and the shard format


def test_prepare_round_trip_with_disjoint_eval_documents(tmp_path: Path) -> None:
    inputs = write_docs(tmp_path / "docs", DOCS)
    out = tmp_path / "shards"
    meta = prepare_data([inputs], out, ByteTokenizer(), eval_fraction=0.1, tokens_per_shard=64, progress=False)
    assert meta["format"] == "p2p-diloco-shards" and meta["dtype"] == "uint16" and meta["tokenizer"] == "byte"
    assert json.loads((out / "meta.json").read_text()) == meta
    assert len(meta["splits"]["train"]["files"]) > 1  # rolled over to new files
    train, held_out = decoded_documents(out, "train"), decoded_documents(out, "eval")
    assert sorted(train + held_out) == sorted(DOCS.values())
    assert round(0.1 * len(DOCS)) == len(held_out) == meta["splits"]["eval"]["num_documents"]
    assert not set(held_out) & set(train)  # every document text in DOCS is distinct
    # Deterministic: the same inputs give the same split, byte for byte.
    again = prepare_data([inputs], tmp_path / "again", ByteTokenizer(), eval_fraction=0.1, tokens_per_shard=64,
                         progress=False)
    assert again == meta
    for name in meta["splits"]["eval"]["files"]:
        assert (out / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_prepare_filters_extensions_and_skips_binary_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    inputs = write_docs(tmp_path / "docs", {"one.py": "x = 1\n", "two.py": "y = 2\n", "three.py": "w = 3\n",
                                            "four.py": "v = 4\n", "notes.md": "# notes\n"})
    (inputs / "blob.py").write_bytes(b"\x00\x01binary\x00")
    (inputs / "latin1.py").write_bytes("z = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8: a bad record
    bad_records = BadRecords()
    with caplog.at_level(logging.WARNING):
        prepare_data([inputs], tmp_path / "out", ByteTokenizer(), eval_fraction=0.3, extensions=(".py",),
                     progress=False, bad_records=bad_records)
    assert "blob.py: looks like a binary file" in caplog.text
    assert "latin1.py: not valid UTF-8: 1 invalid byte, the first at byte offset 8" in caplog.text
    assert (bad_records.num_skipped, bad_records.num_not_utf8, bad_records.num_invalid_bytes) == (1, 1, 1)
    texts = decoded_documents(tmp_path / "out", "train") + decoded_documents(tmp_path / "out", "eval")
    assert sorted(texts) == sorted(["x = 1\n", "y = 2\n", "w = 3\n", "v = 4\n"])  # no U+FFFD anywhere


def test_prepare_single_file_holds_out_its_tail(tmp_path: Path) -> None:
    text = "to be or not to be\n" * 50
    (tmp_path / "book.txt").write_text(text)
    prepare_data([tmp_path / "book.txt"], tmp_path / "out", ByteTokenizer(), eval_fraction=0.1, progress=False)
    train, held_out = (all_tokens(ShardDataset(tmp_path / "out", split)) for split in ("train", "eval"))
    assert ByteTokenizer().decode(np.concatenate([train, held_out]).tolist()) == text
    assert len(held_out) == round(0.1 * (len(text) + 1))


def test_prepare_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no input files found in .*empty"):
        prepare_data([tmp_path / "empty"], tmp_path / "out", ByteTokenizer(), progress=False)
    with pytest.raises(DataError, match="nowhere: input does not exist"):
        prepare_data([tmp_path / "nowhere"], tmp_path / "out", ByteTokenizer(), progress=False)
    write_docs(tmp_path / "only_md", {"a.md": "text"})
    with pytest.raises(DataError, match=r"no input files with extension \.py found"):
        prepare_data([tmp_path / "only_md"], tmp_path / "out", ByteTokenizer(), extensions=(".py",), progress=False)
    with pytest.raises(DataError, match="eval_fraction"):
        prepare_data([tmp_path / "only_md"], tmp_path / "out", ByteTokenizer(), eval_fraction=0, progress=False)
    assert not (tmp_path / "out").exists()


class FailingTokenizer(ByteTokenizer):
    """Fails on its third document, i.e. in the middle of writing the shards."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("tokenizer crashed")
        return super().encode(text)


def test_failed_prepare_keeps_existing_shards(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    inputs = write_docs(tmp_path / "docs", DOCS)
    meta = prepare_data([inputs], out, ByteTokenizer(), progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError):
        prepare_data([tmp_path / "empty"], out, ByteTokenizer(), progress=False)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        prepare_data([inputs], out, FailingTokenizer(), progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "empty", "shards"]  # no temporary folder left
    ShardDataset(out, "train")
    # A successful prepare does replace it.
    new_meta = prepare_data([inputs / "many"], out, ByteTokenizer(), progress=False)
    assert new_meta != meta and ShardDataset(out, "train").num_tokens == new_meta["splits"]["train"]["num_tokens"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs", "empty", "shards"]


def test_prepare_refuses_to_replace_a_folder_that_is_not_shards(tmp_path: Path) -> None:
    inputs = write_docs(tmp_path / "docs", DOCS)
    precious = write_docs(tmp_path / "precious", {"thesis.tex": "years of work"})
    with pytest.raises(DataError, match="precious: exists, is not empty and has no meta.json"):
        prepare_data([inputs], precious, ByteTokenizer(), progress=False)
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_uint32_shards_for_large_vocab(tmp_path: Path) -> None:
    tokens = np.array([0, 1, 65535, 65536, 70000, 99_999] * 10)
    write_shards(tmp_path / "big", {"train": tokens, "eval": tokens[:6]}, vocab_size=100_000, dtype="uint32",
                 tokens_per_shard=16)
    dataset = ShardDataset(tmp_path / "big", "train")
    assert dataset.dtype == np.dtype("<u4") and dataset.vocab_size == 100_000
    assert (tmp_path / "big" / "train_000000.bin").stat().st_size == 16 * 4
    np.testing.assert_array_equal(all_tokens(dataset), tokens)
    with pytest.raises(DataError, match="token ids must be in"):
        ShardWriter(tmp_path, "x", "uint16").append(np.array([65536]))


def test_windows_cross_shard_boundaries(tmp_path: Path) -> None:
    tokens = np.arange(1000)
    write_shards(tmp_path / "s", {"train": tokens, "eval": tokens}, vocab_size=1000, tokens_per_shard=7)
    dataset = ShardDataset(tmp_path / "s", "train")
    assert len(dataset.files) == 143 and dataset.num_tokens == 1000
    for start, length in [(0, 7), (5, 3), (6, 2), (6, 9), (13, 30), (0, 1000), (993, 7), (999, 1), (500, 0)]:
        np.testing.assert_array_equal(dataset.window(start, length), tokens[start:start + length])
    assert dataset.window(3, 4).dtype == np.int64
    with pytest.raises(IndexError):
        dataset.window(995, 6)


def edit_meta(path: Path, **changes: object) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


def truncate(file: Path, num_bytes: int) -> None:
    file.write_bytes(file.read_bytes()[:-num_bytes])


CORRUPTIONS = {
    "missing folder": (lambda p: p.rename(p.with_name("moved")), "shards folder does not exist"),
    "missing meta": (lambda p: (p / "meta.json").unlink(), "no meta.json; not a shards folder"),
    "garbage meta": (lambda p: (p / "meta.json").write_text("{oops"), "meta.json: not valid JSON"),
    "meta not an object": (lambda p: (p / "meta.json").write_text("[1, 2]"), "meta.json: unknown format 'list'"),
    "unknown format": (lambda p: edit_meta(p, format="other"), "unknown format 'other'"),
    "unknown version": (lambda p: edit_meta(p, version=2), "unsupported format version 2"),
    "unknown dtype": (lambda p: edit_meta(p, dtype="int8"), "unknown dtype 'int8'"),
    "vocab too big for dtype": (lambda p: edit_meta(p, vocab_size=70_000), "vocab_size 70000 is not"),
    "missing split": (lambda p: edit_meta(p, splits={"eval": {"files": ["eval_000000.bin"], "num_tokens": 100}}),
                      "no split 'train' \\(it has: eval\\)"),
    "empty split": (lambda p: edit_meta(p, splits={"train": {"files": [], "num_tokens": 0}}),
                    "split 'train' is empty"),
    "path in file list": (lambda p: edit_meta(p, splits={"train": {"files": ["../x.bin"], "num_tokens": 1}}),
                          "must list plain"),
    "listed file missing": (lambda p: (p / "train_000001.bin").unlink(), "train_000001.bin: listed in meta.json"),
    "truncated by one byte": (lambda p: truncate(p / "train_000001.bin", 1),
                              "train_000001.bin: size 79 bytes is not a positive multiple of 2"),
    "truncated by one token": (lambda p: truncate(p / "train_000002.bin", 2),
                               "files hold 99 tokens but meta.json says 100"),
    "token id out of range": (lambda p: edit_meta(p, vocab_size=57),
                              "train_000001.bin: token id 57 at position 17 is not below vocab_size 57"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_shards_raise_data_error(tmp_path: Path, corruption: str) -> None:
    path = write_shards(tmp_path / "shards", {"train": np.arange(100), "eval": np.arange(100)}, vocab_size=100,
                        tokens_per_shard=40)
    ShardDataset(path, "train")  # valid before the corruption
    corrupt, message = CORRUPTIONS[corruption]
    corrupt(path)
    with pytest.raises(DataError, match=message):
        ShardDataset(path, "train")


def test_resolve_data_path(tmp_path: Path) -> None:
    path = write_shards(tmp_path / "shards", {"train": np.arange(10), "eval": np.arange(10)}, vocab_size=10)
    assert resolve_data_path(DataConfig(path=str(path))) == path
    with pytest.raises(DataError, match="does not exist; make a shards folder .* `p2p-diloco prepare-data`"):
        resolve_data_path(DataConfig(path=str(tmp_path / "nowhere")))
    with pytest.raises(DataError, match="has no meta.json"):
        resolve_data_path(DataConfig(path=str(tmp_path)))


# ---------------------------------------------------------------- samplers


@pytest.fixture
def counting_dataset(tmp_path: Path) -> ShardDataset:
    """A train split whose token at position i is i, spread over several files."""
    tokens = np.arange(5000)
    write_shards(tmp_path / "counting", {"train": tokens, "eval": tokens[:1000]}, vocab_size=5000,
                 tokens_per_shard=333)
    return ShardDataset(tmp_path / "counting", "train")


def draw(sampler: WindowSampler, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [sampler.next_batch() for _ in range(num_batches)]


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_sampler_batches_are_shifted_windows(counting_dataset: ShardDataset) -> None:
    sampler = WindowSampler(counting_dataset, seq_len=16, batch_size=8, seed=0)
    starts = set()
    for x, y in draw(sampler, 50):
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
        # Token i is i: every row is a run of consecutive positions, and y is x shifted by one.
        assert torch.equal(x, x[:, :1] + torch.arange(16)) and torch.equal(y, x + 1)
        assert int(y.max()) < counting_dataset.num_tokens
        starts.update(x[:, 0].tolist())
    assert min(starts) < 500 and max(starts) > 4400  # spread over the whole split
    assert sampler.num_batches == 50


def test_sampler_seeds(counting_dataset: ShardDataset) -> None:
    batches = draw(WindowSampler(counting_dataset, 16, 4, seed=7), 3)
    assert_same_batches(batches, draw(WindowSampler(counting_dataset, 16, 4, seed=7), 3))
    other = draw(WindowSampler(counting_dataset, 16, 4, seed=8), 3)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(batches, other, strict=True))


def test_sampler_resumes_exactly(counting_dataset: ShardDataset) -> None:
    original = WindowSampler(counting_dataset, 16, 4, seed=seed_from_peer_id("peer-A"))
    draw(original, 3)
    state = original.state_dict()
    state_json = json.loads(json.dumps(state))
    expected = draw(original, 5)
    for saved in (state, state_json):
        resumed = WindowSampler(counting_dataset, 16, 4, seed=123)
        resumed.load_state_dict(saved)
        assert resumed.num_batches == 3 and resumed.seed == original.seed
        assert_same_batches(draw(resumed, 5), expected)
    with pytest.raises(DataError, match="missing bit_generator"):
        resumed.load_state_dict({"seed": 1, "num_batches": 0})
    with pytest.raises(DataError, match="invalid bit_generator"):
        resumed.load_state_dict({"seed": 1, "num_batches": 0, "bit_generator": {"bit_generator": "MT19937"}})


def test_sampler_needs_one_window(tmp_path: Path) -> None:
    write_shards(tmp_path / "tiny", {"train": np.arange(10), "eval": np.arange(10)}, vocab_size=10)
    dataset = ShardDataset(tmp_path / "tiny", "train")
    WindowSampler(dataset, seq_len=9, batch_size=2, seed=0).next_batch()  # exactly one window fits
    with pytest.raises(DataError, match="has 10 tokens, fewer than one window of seq_len \\+ 1 = 11"):
        WindowSampler(dataset, seq_len=10, batch_size=2, seed=0)


def test_seed_from_peer_id() -> None:
    expected = int.from_bytes(hashlib.sha256(b"QmPeer").digest()[:8], "big") >> 1
    assert seed_from_peer_id("QmPeer") == seed_from_peer_id(b"QmPeer") == expected
    seeds = {seed_from_peer_id(f"peer-{i}") for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)


def test_eval_batches_are_fixed_and_evenly_spaced(tmp_path: Path) -> None:
    write_shards(tmp_path / "e", {"train": np.arange(100), "eval": np.arange(1000)}, vocab_size=1000,
                 tokens_per_shard=64)
    batches = eval_batches(ShardDataset(tmp_path / "e", "eval"), seq_len=9, batch_size=4, num_batches=3)
    assert_same_batches(batches, eval_batches(ShardDataset(tmp_path / "e", "eval"), 9, 4, 3))
    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert len(batches) == 3 and starts[0] == 0 and starts[-1] == 990
    gaps = np.diff(starts)
    assert gaps.min() >= 10 and gaps.max() - gaps.min() <= 1  # non-overlapping, evenly spaced
    for x, y in batches:
        assert x.shape == (4, 9) and torch.equal(y, x + 1)
    # At most as many full batches as fit: 1000 // 10 = 100 windows = 25 batches of 4.
    assert len(eval_batches(ShardDataset(tmp_path / "e", "eval"), 9, 4, 1000)) == 25
    assert eval_batches(ShardDataset(tmp_path / "e", "eval"), 9, 4, 0) == []
    with pytest.raises(DataError, match="fewer than one eval batch"):
        eval_batches(ShardDataset(tmp_path / "e", "train"), 9, 16, 1)


# ---------------------------------------------------------------- the built-in corpus


def test_stdlib_documents_respect_exclusions_and_cap() -> None:
    documents = stdlib_documents()
    assert len(documents) > 100
    assert all(doc.key.endswith(".py") for doc in documents)
    assert not any(set(doc.key.split("/")[:-1]) & STDLIB_EXCLUDED_DIRS for doc in documents)
    assert sum(doc.path.stat().st_size for doc in documents) <= BUILTIN_MAX_BYTES
    assert [doc.key for doc in documents] == sorted(doc.key for doc in documents)


def _call_builtin_corpus(cache_dir: str, barrier: multiprocessing.synchronize.Barrier) -> None:
    barrier.wait(timeout=30)
    builtin_corpus(cache_dir)


def test_builtin_corpus_is_prepared_once_by_concurrent_processes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    preparations = tmp_path / "preparations.log"
    original_write_corpus = prepare_module.write_corpus

    def counting_write_corpus(*args, **kwargs):
        with open(preparations, "a") as f:
            f.write("prepared\n")
        return original_write_corpus(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "write_corpus", counting_write_corpus)
    ctx = multiprocessing.get_context("fork")  # the children inherit the counting patch
    barrier = ctx.Barrier(3)
    workers = [ctx.Process(target=_call_builtin_corpus, args=("~/cache", barrier)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    assert preparations.read_text() == "prepared\n"

    started = time.monotonic()
    path = builtin_corpus("~/cache")
    assert time.monotonic() - started < 1.0
    assert path == tmp_path / "cache" / "builtin-stdlib-byte-v1"
    assert preparations.read_text() == "prepared\n"
    assert resolve_data_path(DataConfig(path="builtin", cache_dir="~/cache")) == path
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".builtin-stdlib-byte-v1.lock",
                                                                     "builtin-stdlib-byte-v1"]
    train, held_out = ShardDataset(path, "train"), ShardDataset(path, "eval")
    assert train.vocab_size == 257 and train.tokenizer_name == "byte"
    assert train.num_tokens > 1_000_000 and held_out.num_tokens > 10_000
    assert "import" in ByteTokenizer().decode(train.window(0, 10_000).tolist())
