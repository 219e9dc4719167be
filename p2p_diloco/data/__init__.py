"""Data: tokenizers, the on-disk token shard format, corpus preparation (including the built-in corpus) and
the window samplers that feed training and evaluation.

Typical use on a peer::

    path = resolve_data_path(cfg.data)
    sampler = WindowSampler(ShardDataset(path, "train"), seq_len, batch_size, seed_from_peer_id(peer_id))
    x, y = sampler.next_batch()
"""

from p2p_diloco.data.errors import DataError
from p2p_diloco.data.prepare import builtin_corpus, prepare_data, resolve_data_path
from p2p_diloco.data.readers import BadRecords, read_records
from p2p_diloco.data.sampler import WindowSampler, eval_batches, seed_from_peer_id
from p2p_diloco.data.shards import ShardDataset, ShardWriter, atomic_output_dir, dtype_for_vocab, read_meta, write_meta
from p2p_diloco.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer, shards_tokenizer

__all__ = [
    "BadRecords",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "ShardDataset",
    "ShardWriter",
    "Tokenizer",
    "WindowSampler",
    "atomic_output_dir",
    "builtin_corpus",
    "dtype_for_vocab",
    "eval_batches",
    "load_tokenizer",
    "shards_tokenizer",
    "prepare_data",
    "read_meta",
    "read_records",
    "resolve_data_path",
    "seed_from_peer_id",
    "write_meta",
]
