"""Small builders shared by the tests: a synthetic shards folder and a tiny model shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from p2p_diloco.data import ShardWriter, atomic_output_dir, write_meta

TINY_ARGS = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=61, max_seq_len=16)


def make_shards(path: Path, num_tokens: int = 20_000, vocab_size: int = 61, seed: int = 0,
                with_eval: bool = False) -> Path:
    """A shards folder of uniformly random tokens (train, and eval if asked)."""
    rng = np.random.default_rng(seed)
    with atomic_output_dir(path) as tmp:
        splits = {}
        for split in ("train", "eval") if with_eval else ("train",):
            with ShardWriter(tmp, split, "uint16", 4096) as writer:
                writer.append(rng.integers(0, vocab_size, size=num_tokens))
            splits[split] = writer.close()
        write_meta(tmp, "uint16", vocab_size, "test", splits)
    return path
