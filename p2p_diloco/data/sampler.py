"""Batches of training and eval windows drawn from a :class:`~p2p_diloco.data.shards.ShardDataset`.

Each peer draws its own sequence of random windows, seeded by its peer id (:func:`seed_from_peer_id`), and
can resume that sequence exactly from a checkpoint. Eval windows are fixed and evenly spaced, the same on
every peer, so eval losses are comparable across the swarm.
Who calls this: the peer's training loop (one sampler per peer, on the stage that feeds the model).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from p2p_diloco.data.errors import DataError
from p2p_diloco.data.shards import ShardDataset

Batch = tuple[torch.Tensor, torch.Tensor]
_STATE_KEYS = ("seed", "num_batches", "bit_generator")


def seed_from_peer_id(peer_id: str | bytes) -> int:
    """Return a stable 63-bit sampler seed from a peer id (the first 8 bytes of its sha256)."""
    raw = peer_id.encode("utf-8") if isinstance(peer_id, str) else bytes(peer_id)
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big") >> 1


def _check_fits(dataset: ShardDataset, seq_len: int, batch_size: int) -> None:
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
    if dataset.num_tokens < seq_len + 1:
        raise DataError(f"{dataset.path}: the {dataset.split!r} split has {dataset.num_tokens} tokens, fewer than "
                        f"one window of seq_len + 1 = {seq_len + 1}; use a shorter seq_len or more data")


def _to_batch(windows: np.ndarray) -> Batch:
    tokens = torch.from_numpy(windows)  # (B, T + 1), int64
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class WindowSampler:
    """Random windows of ``seq_len + 1`` tokens at uniform start offsets; inputs and next-token targets."""

    def __init__(self, dataset: ShardDataset, seq_len: int, batch_size: int, seed: int) -> None:
        """Make a sampler.

        Args:
            dataset: the split to sample (usually train).
            seq_len: tokens per input sequence.
            batch_size: sequences per batch.
            seed: seed of the window offsets (see :func:`seed_from_peer_id`).

        Raises:
            DataError: the split is shorter than one window.
        """
        _check_fits(dataset, seq_len, batch_size)
        self.dataset = dataset
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = int(seed)
        self.num_batches = 0
        self._rng = np.random.Generator(np.random.PCG64(self.seed))

    def next_batch(self) -> Batch:
        """Return ``(x, y)``, both int64 of shape ``(batch_size, seq_len)``, with ``y[:, t] == x[:, t + 1]``
        inside the window (y is x shifted left by one token)."""
        window_len = self.seq_len + 1
        # High bound is exclusive: the last start leaves exactly one full window.
        starts = self._rng.integers(0, self.dataset.num_tokens - window_len + 1, size=self.batch_size)
        windows = np.stack([self.dataset.window(int(s), window_len) for s in starts])  # (B, T + 1)
        self.num_batches += 1
        return _to_batch(windows)

    def state_dict(self) -> dict[str, Any]:
        """Return the sampler's position as a JSON-serialisable dict (resuming from it is O(1))."""
        return {"seed": self.seed, "num_batches": self.num_batches, "bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next batches are those the original sampler would draw.

        Raises:
            DataError: ``state`` is not a sampler state.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise DataError(f"sampler state is missing {', '.join(missing)}; it is not a WindowSampler state")
        rng = np.random.Generator(np.random.PCG64())
        try:
            rng.bit_generator.state = state["bit_generator"]
        except (TypeError, ValueError, KeyError) as exc:
            raise DataError(f"sampler state has an invalid bit_generator entry ({exc})") from exc
        self._rng = rng
        self.seed = int(state["seed"])
        self.num_batches = int(state["num_batches"])


def eval_batches(dataset: ShardDataset, seq_len: int, batch_size: int, num_batches: int) -> list[Batch]:
    """Return up to ``num_batches`` full batches of non-overlapping windows evenly spaced over ``dataset``.

    No randomness: every peer gets the same batches from the same data. Fewer batches are returned when
    the split does not hold ``num_batches * batch_size`` windows of ``seq_len + 1`` tokens.

    Raises:
        DataError: the split does not hold one full batch (and ``num_batches > 0``).
    """
    if num_batches <= 0:
        return []
    _check_fits(dataset, seq_len, batch_size)
    window_len = seq_len + 1
    num_fit = (dataset.num_tokens // window_len) // batch_size
    if num_fit == 0:
        raise DataError(f"{dataset.path}: the {dataset.split!r} split has {dataset.num_tokens} tokens, fewer than one "
                        f"eval batch of {batch_size} x {window_len}; use a smaller batch or seq_len, or more data")
    num_windows = min(num_batches, num_fit) * batch_size
    # Evenly spaced over the whole split; spacing >= window_len because num_windows * window_len <= num_tokens.
    starts = np.linspace(0, dataset.num_tokens - window_len, num_windows).round().astype(np.int64)
    windows = np.stack([dataset.window(int(s), window_len) for s in starts])  # (N, T + 1)
    return [_to_batch(windows[i:i + batch_size]) for i in range(0, num_windows, batch_size)]
