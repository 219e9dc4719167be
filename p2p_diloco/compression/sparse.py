"""SparseLoCo's wire codecs (arXiv 2508.15706): chunk-wise top-k with 2-bit values, and the sparse average.

A tensor is cut into chunks of :data:`CHUNK` values from its first value (64 x 64, as the paper and DeMo chunk;
hivemind cuts parts at multiples of 2**21 values for these codecs, so a part's chunks are the tensor's). In each
chunk :class:`TopK2Bit` keeps the k non-zero values of largest magnitude (a shorter last chunk keeps
``ceil(k * length / CHUNK)``), and sends each as 2 bits: its sign, and whether its magnitude is above the middle of
the kept ones' range; the chunk's two magnitudes are the means (in float64) of the magnitudes below and above it. A
tensor it has already encoded encodes to the same bytes (the averager encodes what the reducer's codec already
carries, and its error feedback must be what the wire lost). What it drops or rounds is the sender's error feedback
(the averager returns it as the residual).

The average of K such contributions is sparse too (at most K k values per chunk, more with the robust rule's
clipping never: it only scales), but its values are not 2-bit ones: the reducer sends it back with
:class:`SparseAverage`, the indices of the chunk's non-zero values and their values as 8-bit codes with one fp32
scale per chunk (every groupmate decodes the same bytes, as for every codec of this project).

Wire layout (little-endian), after hivemind's message fields (``size`` the tensor's shape, ``dtype`` the codec's
name): ``TopK2Bit``: ``k`` (u32), then per chunk its count of kept values (u16, at most its share of k), then per
chunk its two magnitudes (f32, f32), then per chunk its kept indices within the chunk (u16, strictly increasing),
then the 2-bit codes of all kept values, four to a byte.
``SparseAverage``: per chunk its count (u16), then per chunk its scale (f32, at most :data:`MAX_AVERAGE_SCALE`),
then all indices (u16, strictly increasing within a chunk), then all codes (i8, in [-127, 127]). Every length
follows from the shape and ``k`` or the counts; each class's ``decode`` checks every one before it allocates
anything from the message's claims.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from p2p_diloco.compression.base import Codec, half_steps
from p2p_diloco.hivemind_adapter.compression import CompressionInfo, runtime_pb2

CHUNK = 4096  # values per chunk: a power of two, at most 2**16 (indices are u16)
TOPK_NAME, AVERAGE_NAME = "p2p_diloco:topk2", "p2p_diloco:sparse8"
MAX_AVERAGE_SCALE = float(np.finfo(np.float32).max) / 127
"""The largest ``sparse8`` scale: any code in [-127, 127] times it is finite in float32 (an honest scale is a finite
value's magnitude over 127)."""


def kept_per_chunk(num_values: int, k: int) -> list[int]:
    """How many values each chunk of a tensor of ``num_values`` keeps (the last, shorter one in proportion)."""
    full, rest = divmod(num_values, CHUNK)
    return [k] * full + ([min(rest, math.ceil(k * rest / CHUNK))] if rest else [])


def _blocks(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as rows of :data:`CHUNK` (fp32, CPU; the last row padded with zeros, which no codec
    keeps)."""
    flat = tensor.detach().reshape(-1).to(dtype=torch.float32, device="cpu")
    padded = torch.zeros(-(-flat.numel() // CHUNK) * CHUNK, dtype=torch.float32)
    padded[: flat.numel()] = flat
    return padded.view(-1, CHUNK)


class TopK2Bit(Codec):
    """Top-k per chunk, each kept value as 2 bits (see the module's docstring); a plan names it ``topk2:<k>``.

    Args:
        k: values kept per chunk of :data:`CHUNK` (1 to CHUNK).
    """

    family, wire_dtype, parameter = "topk2", TOPK_NAME, "k"
    compression_type = runtime_pb2.NONE  # our codecs travel as NONE tensors whose dtype field names the codec

    def __init__(self, k: int):
        if not 1 <= k <= CHUNK:
            raise ValueError(f"k must be in [1, {CHUNK}], got {k}")
        self.k = k

    @classmethod
    def parse(cls, parameter: str | None) -> TopK2Bit:
        if parameter is None or not parameter.isdigit():
            raise ValueError(f"codec 'topk2' takes k, an integer, as 'topk2:<k>'; got {parameter!r}")
        return cls(int(parameter))

    @property
    def name(self) -> str:
        return f"{self.family}:{self.k}"

    def sparsify(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kept values per chunk, their indices within their chunk in chunk order, each chunk's (lo, hi)
        magnitudes, the 2-bit codes), all chunks at once."""
        blocks, shares = _blocks(tensor), torch.tensor(kept_per_chunk(tensor.numel(), self.k))
        width = int(shares.max()) if shares.numel() else 0
        # which of equal magnitudes at the k-th place is kept is torch's choice: only the sender encodes its own
        # contribution, and a tensor this codec encoded has at most its share non-zero in each chunk (all kept)
        order = torch.topk(blocks.abs(), width, dim=1, sorted=False).indices
        values = blocks.gather(1, order)
        kept = (torch.arange(width)[None, :] < shares[:, None]) & (values != 0)
        by_index = torch.where(kept, order, order + CHUNK).argsort(dim=1)  # kept ones first, by index
        order, values, kept = (t.gather(1, by_index) for t in (order, values, kept))
        size = values.abs().double()
        inf = torch.tensor(float("inf"), dtype=torch.float64)
        middle = (torch.where(kept, size, inf).amin(1) + torch.where(kept, size, -inf).amax(1)) / 2
        high = kept & (size > middle[:, None])
        low = kept & ~high
        lo = torch.where(low, size, 0.0).sum(1) / low.sum(1).clamp(min=1)
        hi = torch.where(high.any(1), torch.where(high, size, 0.0).sum(1) / high.sum(1).clamp(min=1), lo)
        codes = (values < 0).to(torch.uint8) | (high.to(torch.uint8) << 1)
        return order, kept, torch.stack([lo, hi], dim=1).float(), codes

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        order, kept, scales, codes = self.sparsify(tensor)
        buffer = (np.uint32(self.k).tobytes() + kept.sum(1).numpy().astype("<u2").tobytes()
                  + scales.numpy().astype("<f4").tobytes() + order[kept].numpy().astype("<u2").tobytes()
                  + _pack2(codes[kept].numpy()))
        return runtime_pb2.Tensor(compression=self.compression_type, dtype=self.wire_dtype, size=tensor.shape,
                                  buffer=buffer, requires_grad=False)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 2 / 32  # hivemind's parts are then 2**21 values: whole chunks (see the module docstring)

    @classmethod
    def decode(cls, serialized: runtime_pb2.Tensor, shape: tuple[int, ...], num_values: int) -> torch.Tensor:
        """Any k in [1, CHUNK] is read from the message (see :class:`~p2p_diloco.compression.base.Codec`)."""
        buffer, num_chunks = serialized.buffer, math.ceil(num_values / CHUNK)
        _check_header(serialized, shape, 4 + 10 * num_chunks)
        k = int(np.frombuffer(buffer, dtype="<u4", count=1)[0])
        if not 1 <= k <= CHUNK:
            raise ValueError(f"{TOPK_NAME} keeps {k} values per chunk, not in [1, {CHUNK}]")
        counts = np.frombuffer(buffer, dtype="<u2", count=num_chunks, offset=4).astype(np.int64)
        if (counts > np.asarray(kept_per_chunk(num_values, k), dtype=np.int64)).any():
            raise ValueError(f"{TOPK_NAME} declares more values in a chunk than its share of k = {k}")
        counts = counts.tolist()
        total = sum(counts)
        expected = 4 + 10 * num_chunks + 2 * total + (total + 3) // 4
        if len(buffer) != expected:
            raise ValueError(f"{TOPK_NAME} payload of {len(buffer)} bytes does not fit shape {list(shape)} with k = "
                             f"{k} ({expected} bytes expected)")
        scales = np.frombuffer(buffer, dtype="<f4", count=2 * num_chunks, offset=4 + 2 * num_chunks).reshape(-1, 2)
        index_at = 4 + 10 * num_chunks
        indices = np.frombuffer(buffer, dtype="<u2", count=total, offset=index_at)
        codes = _unpack2(buffer[index_at + 2 * total:], total)
        magnitudes = np.where(codes & 2, np.repeat(scales[:, 1], counts), np.repeat(scales[:, 0], counts))
        values = np.where(codes & 1, -magnitudes, magnitudes)
        return _scatter(serialized, shape, num_values, scales, counts, indices, values)

    def encoded_size(self, num_values: int) -> int:
        kept = sum(kept_per_chunk(num_values, self.k))
        return 4 + 10 * math.ceil(num_values / CHUNK) + 2 * kept + (kept + 3) // 4

    def result_codec(self) -> SparseAverage:
        return SparseAverage()  # the average of several top-k parts is not a top-k of 2-bit values

    def average_size(self, num_values: int, group_size: int) -> int:
        """The most an average of ``group_size`` contributions with disjoint supports takes as ``sparse8``."""
        kept = min(num_values, group_size * sum(kept_per_chunk(num_values, self.k)))
        return 6 * math.ceil(num_values / CHUNK) + 3 * kept

    @classmethod
    def average_rounding(cls, serialized: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
        return 0.0  # no reducer sends an average as a top-k contribution


class SparseAverage(Codec):
    """A sparse average: its non-zero values' indices and 8-bit codes, one fp32 scale per chunk."""

    family, wire_dtype = "sparse8", AVERAGE_NAME
    compression_type = runtime_pb2.NONE

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        blocks = _blocks(tensor)
        nonzero = blocks != 0
        scales = blocks.abs().amax(1) / 127 if blocks.numel() else torch.zeros(0)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        columns = torch.arange(CHUNK).expand_as(blocks)
        buffer = (nonzero.sum(1).numpy().astype("<u2").tobytes() + scales.numpy().astype("<f4").tobytes()
                  + columns[nonzero].numpy().astype("<u2").tobytes() + codes[nonzero].numpy().tobytes())
        return runtime_pb2.Tensor(compression=self.compression_type, dtype=self.wire_dtype, size=tensor.shape,
                                  buffer=buffer, requires_grad=False)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 2 / 32  # as TopK2Bit's: the same parts

    @classmethod
    def decode(cls, serialized: runtime_pb2.Tensor, shape: tuple[int, ...], num_values: int) -> torch.Tensor:
        buffer, num_chunks = serialized.buffer, math.ceil(num_values / CHUNK)
        head = 6 * num_chunks
        _check_header(serialized, shape, head)
        lengths = _chunk_lengths(num_values)
        counts = np.frombuffer(buffer, dtype="<u2", count=num_chunks).astype(np.int64)
        if (counts > np.asarray(lengths, dtype=np.int64)).any():
            raise ValueError(f"{AVERAGE_NAME} declares more values in a chunk than the chunk holds")
        scales = np.frombuffer(buffer, dtype="<f4", count=num_chunks, offset=2 * num_chunks)
        total = int(counts.sum())
        if len(buffer) != head + 3 * total:
            raise ValueError(f"{AVERAGE_NAME} payload of {len(buffer)} bytes does not fit its {total} values "
                             f"({head + 3 * total} bytes expected)")
        indices = np.frombuffer(buffer, dtype="<u2", count=total, offset=head)
        codes = np.frombuffer(buffer, dtype=np.int8, count=total, offset=head + 2 * total)
        if (codes == -128).any():
            raise ValueError(f"{AVERAGE_NAME} has codes out of [-127, 127]")
        if not (scales <= MAX_AVERAGE_SCALE).all():  # NaN too; checked again in _scatter with the sign
            raise ValueError(f"{AVERAGE_NAME} has non-finite scales or scales above {MAX_AVERAGE_SCALE:.4g} (a code "
                             "of 127 would decode past float32)")
        counts = counts.tolist()
        values = codes.astype(np.float32) * np.repeat(scales, counts)
        return _scatter(serialized, shape, num_values, scales, counts, indices, values)

    def encoded_size(self, num_values: int) -> int:
        """The most an average takes: every value non-zero (:meth:`TopK2Bit.average_size` bounds it by k)."""
        return 6 * math.ceil(num_values / CHUNK) + 3 * num_values

    @classmethod
    def average_rounding(cls, serialized: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
        """Half the scale of its chunk for each value the chunk sends."""
        flat = decoded.detach().reshape(-1).float()
        sent = np.frombuffer(serialized.buffer, dtype="<u2", count=math.ceil(flat.numel() / CHUNK))
        return half_steps(flat, CHUNK, 127, torch.from_numpy(sent.astype(np.float64)))


def _chunk_lengths(num_values: int) -> list[int]:
    return [CHUNK] * (num_values // CHUNK) + ([num_values % CHUNK] if num_values % CHUNK else [])


def _check_header(serialized: runtime_pb2.Tensor, shape: tuple[int, ...], header: int) -> None:
    """Refuse a payload shorter than its header, before anything of the size of the shape is made: the header holds
    every chunk."""
    if len(serialized.buffer) < header:
        raise ValueError(f"{serialized.dtype[:40]} payload of {len(serialized.buffer)} bytes is shorter than its "
                         f"{header}-byte header for shape {list(shape)[:8]}")


def _scatter(serialized: runtime_pb2.Tensor, shape: tuple[int, ...], num_values: int, scales: np.ndarray,
             counts: list[int], indices: np.ndarray, values: np.ndarray) -> torch.Tensor:
    """The dense tensor of a sparse message's values, after the checks both codecs share: scales finite and >= 0,
    each index inside its chunk and strictly increasing within it."""
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise ValueError(f"{serialized.dtype} has non-finite or negative scales")
    chunk_of = np.repeat(np.arange(len(counts)), counts)  # each sent value's chunk, all chunks at once
    index = indices.astype(np.int64)
    same_chunk = chunk_of[1:] == chunk_of[:-1]
    lengths = np.asarray(_chunk_lengths(num_values), dtype=np.int64)
    if (index >= lengths[chunk_of]).any() or (np.diff(index)[same_chunk] <= 0).any():
        raise ValueError(f"{serialized.dtype} indices are out of their chunk or out of order within it")
    dense = np.zeros(num_values, dtype=np.float32)
    dense[chunk_of * CHUNK + index] = values
    return torch.from_numpy(dense).reshape(shape)


def _pack2(codes: np.ndarray) -> bytes:
    padded = np.zeros(4 * math.ceil(codes.size / 4), dtype=np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    return (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).astype(np.uint8).tobytes()


def _unpack2(data: bytes, count: int) -> np.ndarray:
    packed = np.frombuffer(data, dtype=np.uint8)
    codes = np.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], axis=1).reshape(-1)
    return codes[:count]
