"""PowerSGD-style low rank for pseudo-gradient matrices, and the adaptive choice of its rank.

One round of two-phase averaging for a matrix M (m x n) of every groupmate, with Q (n x r) shared:
``P = M Q`` is averaged and orthogonalized (the same on every peer), then ``Q = M^T P`` is averaged; the
group's matrix is approximated by ``P Q^T``. Q is warm-started from the previous round's averaged Q, so
the approximation improves round after round like a power iteration. With P orthonormal, the singular
values of ``P Q^T`` are those of Q: every groupmate sees the same spectrum and picks the same next rank,
with no message of its own. Called by :mod:`p2p_diloco.compression.policy` and the averager.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["orthonormalize", "reconstruct", "seeded_q", "fit_q", "desired_rank", "lowrank_size"]


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of P's columns (m x r), the same on every peer that holds the same P.

    Householder QR in float64, columns signed so that R's diagonal is non-negative, rounded to fp32: robust to
    rank-deficient P (where hivemind's in-place Gram-Schmidt loses orthogonality) and to the last-bit
    differences of float64 arithmetic between machines.
    """
    q, r = torch.linalg.qr(p.double())
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(torch.float64)
    return (q * signs).float()


def reconstruct(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P Q^T, computed in float64 and rounded once (so that peers agree to the last bit)."""
    return (p.double() @ q.double().t()).float()


def seeded_q(num_columns: int, rank: int, seed: str) -> torch.Tensor:
    """A random (num_columns, rank) starting Q that every peer derives from the same ``seed`` string."""
    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little")
                                              >> 1)
    return torch.randn(num_columns, rank, generator=generator)


def fit_q(warm: torch.Tensor | None, num_columns: int, rank: int, seed: str) -> torch.Tensor:
    """The starting Q of a round: the warm one cut or extended (with seeded columns) to ``rank`` columns."""
    if warm is None:
        return seeded_q(num_columns, rank, seed)
    if warm.shape[1] >= rank:
        return warm[:, :rank].clone()
    extra = seeded_q(num_columns, rank - warm.shape[1], seed + ":extend")
    return torch.cat([warm, extra], dim=1)


def desired_rank(q_avg: torch.Tensor, rank: int, min_rank: int, max_rank: int,
                 grow_ratio: float = 0.25, shrink_energy: float = 0.99) -> int:
    """The rank this matrix asks for next round, from the spectrum of the group's averaged Q.

    A flat spectrum (smallest captured singular value at least ``grow_ratio`` of the largest) means energy is
    probably left beyond rank r: double it. If the first half of the captured directions hold
    ``shrink_energy`` of the captured energy, halve it. Else keep it.
    """
    singular = torch.linalg.svdvals(q_avg.double())  # (r,), descending
    if singular.numel() == 0 or singular[0] <= 0:
        return max(min_rank, min(rank, max_rank))
    energy = singular.pow(2)
    half = max(1, (rank + 1) // 2)
    if singular[-1] / singular[0] >= grow_ratio:
        want = rank * 2
    elif energy[:half].sum() / energy.sum() >= shrink_energy:
        want = half
    else:
        want = rank
    return max(min_rank, min(want, max_rank))


def lowrank_size(shape: tuple[int, int], rank: int) -> int:
    """Values sent for one matrix at ``rank``: P (m x r) and Q (n x r)."""
    return (shape[0] + shape[1]) * rank
