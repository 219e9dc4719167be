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
clipping never: it only scales), but its values are no longer 2-bit: the reducer sends it back with
:class:`SparseAverage`, the indices of the chunk's non-zero values and their values as 8-bit codes with one fp32
scale per chunk (every groupmate decodes the same bytes, as for every codec of this project).

Wire layout (little-endian), after hivemind's message fields (``size`` the tensor's shape, ``dtype`` the codec's
name): ``TopK2Bit``: ``k`` (u32), then per chunk its count of kept values (u16, at most its share of k), then per
chunk its two magnitudes (f32, f32), then per chunk its kept indices within the chunk (u16, strictly increasing),
then the 2-bit codes of all kept values, four to a byte.
``SparseAverage``: per chunk its count (u16), then per chunk its scale (f32), then all indices (u16, strictly
increasing within a chunk), then all codes (i8, in [-127, 127]). Every length follows from the shape and ``k`` or
the counts; :func:`decode` checks each before it allocates anything from the message's claims.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2

CHUNK = 4096  # values per chunk: a power of two, at most 2**16 (indices are u16)
TOPK_NAME, AVERAGE_NAME = "p2p_diloco:topk2", "p2p_diloco:sparse8"


def kept_per_chunk(num_values: int, k: int) -> list[int]:
    """How many values each chunk of a tensor of ``num_values`` keeps (the last, shorter one in proportion)."""
    full, rest = divmod(num_values, CHUNK)
    return [k] * full + ([min(rest, math.ceil(k * rest / CHUNK))] if rest else [])


def _chunks(flat: torch.Tensor) -> list[torch.Tensor]:
    return list(flat.split(CHUNK))


class TopK2Bit(CompressionBase):
    """Top-k per chunk, each kept value as 2 bits (see the module's docstring).

    Args:
        k: values kept per chunk of :data:`CHUNK` (1 to CHUNK).
    """

    compression_type = runtime_pb2.NONE  # our codecs travel as NONE tensors whose dtype field names the codec
    name = TOPK_NAME

    def __init__(self, k: int):
        if not 1 <= k <= CHUNK:
            raise ValueError(f"k must be in [1, {CHUNK}], got {k}")
        self.k = k

    def sparsify(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        """(indices per chunk, the (lo, hi) magnitudes of each chunk, the 2-bit codes per chunk)."""
        flat = tensor.detach().reshape(-1).to(dtype=torch.float32, device="cpu")
        indices, scales, codes = [], [], []
        for chunk, share in zip(_chunks(flat), kept_per_chunk(flat.numel(), self.k)):
            magnitudes = chunk.abs()
            kept = min(share, int(torch.count_nonzero(magnitudes)))
            # ties broken by position (stable sort): the same input gives the same bytes on every machine
            order = torch.sort(magnitudes, descending=True, stable=True).indices[:kept]
            index = torch.sort(order).values
            values = chunk[index]
            size = values.abs().double()
            lo = hi = 0.0
            high = torch.zeros(kept, dtype=torch.bool)
            if kept:
                high = size > (size.min() + size.max()) / 2
                lo = float(size[~high].mean())
                hi = float(size[high].mean()) if bool(high.any()) else lo
            indices.append(index)
            scales.append((lo, hi))
            codes.append((values < 0).to(torch.uint8) | (high.to(torch.uint8) << 1))
        return indices, torch.tensor(scales, dtype=torch.float32).reshape(-1, 2), codes

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        indices, scales, codes = self.sparsify(tensor)
        all_codes = torch.cat(codes).numpy() if codes else np.zeros(0, dtype=np.uint8)
        counts = np.asarray([index.numel() for index in indices], dtype="<u2")
        buffer = (np.uint32(self.k).tobytes() + counts.tobytes() + scales.numpy().astype("<f4").tobytes()
                  + (torch.cat(indices).numpy().astype("<u2").tobytes() if indices else b"")
                  + _pack2(all_codes))
        return runtime_pb2.Tensor(compression=self.compression_type, dtype=self.name, size=tensor.shape,
                                  buffer=buffer, requires_grad=False)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 2 / 32  # hivemind's parts are then 2**21 values: whole chunks (see the module docstring)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        return decode(serialized_tensor, shape, math.prod(shape))


class SparseAverage(CompressionBase):
    """A sparse average: its non-zero values' indices and 8-bit codes, one fp32 scale per chunk."""

    compression_type = runtime_pb2.NONE
    name = AVERAGE_NAME

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        flat = tensor.detach().reshape(-1).to(dtype=torch.float32, device="cpu")
        counts, scales, indices, codes = [], [], [], []
        for chunk in _chunks(flat):
            index = torch.nonzero(chunk).reshape(-1)
            values = chunk[index]
            scale = float(values.abs().max()) / 127 if values.numel() else 0.0
            counts.append(index.numel())
            scales.append(scale)
            indices.append(index)
            codes.append(torch.round(values / scale).clamp_(-127, 127).to(torch.int8) if scale > 0
                         else torch.zeros(index.numel(), dtype=torch.int8))
        buffer = (np.asarray(counts, dtype="<u2").tobytes() + np.asarray(scales, dtype="<f4").tobytes()
                  + (torch.cat(indices).numpy().astype("<u2").tobytes() if indices else b"")
                  + (torch.cat(codes).numpy().tobytes() if codes else b""))
        return runtime_pb2.Tensor(compression=self.compression_type, dtype=self.name, size=tensor.shape,
                                  buffer=buffer, requires_grad=False)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 2 / 32  # as TopK2Bit's: the same parts

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        return decode(serialized_tensor, shape, math.prod(shape))


def decode(serialized: runtime_pb2.Tensor, shape: tuple[int, ...], num_values: int) -> torch.Tensor:
    """The dense tensor a sparse message carries (its shape and number of values already checked by the caller).

    Raises:
        ValueError: a length that does not fit, an index out of its chunk or out of order, a code out of range, a
            non-finite or negative scale.
    """
    buffer, num_chunks = serialized.buffer, math.ceil(num_values / CHUNK)
    header = 4 + 10 * num_chunks if serialized.dtype == TOPK_NAME else 6 * num_chunks
    if len(buffer) < header:  # before anything of the size of the shape is made: the header holds every chunk
        raise ValueError(f"{serialized.dtype[:40]} payload of {len(buffer)} bytes is shorter than its {header}-byte "
                         f"header for shape {list(shape)[:8]}")
    lengths = [CHUNK] * (num_values // CHUNK) + ([num_values % CHUNK] if num_values % CHUNK else [])
    if serialized.dtype == TOPK_NAME:
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
    elif serialized.dtype == AVERAGE_NAME:
        head = 6 * num_chunks
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
        counts = counts.tolist()
        values = codes.astype(np.float32) * np.repeat(scales, counts)
    else:
        raise ValueError(f"{serialized.dtype[:40]!r} is not a sparse codec")
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise ValueError(f"{serialized.dtype} has non-finite or negative scales")
    dense = np.zeros(num_values, dtype=np.float32)
    start = 0
    for chunk_index, (count, length) in enumerate(zip(counts, lengths)):
        index = indices[start:start + count].astype(np.int64)
        if count and (index[-1] >= length or (count > 1 and (np.diff(index) <= 0).any())):
            raise ValueError(f"{serialized.dtype} indices of chunk {chunk_index} are out of the chunk or out of order")
        dense[chunk_index * CHUNK + index] = values[start:start + count]
        start += count
    return torch.from_numpy(dense).reshape(shape)


def encoded_size(codec_name: str, num_values: int, k: int, group_size: int = 1) -> int:
    """Bytes of payload for ``num_values`` values: a contribution (``topk2``), or an average of ``group_size``
    contributions with disjoint supports, the most it can hold (``sparse8``)."""
    num_chunks, kept = math.ceil(num_values / CHUNK), sum(kept_per_chunk(num_values, k))
    if codec_name == "topk2":
        return 4 + 10 * num_chunks + 2 * kept + (kept + 3) // 4
    kept = min(num_values, group_size * kept)
    return 6 * num_chunks + 3 * kept


def _pack2(codes: np.ndarray) -> bytes:
    padded = np.zeros(4 * math.ceil(codes.size / 4), dtype=np.uint8)
    padded[: codes.size] = codes
    quads = padded.reshape(-1, 4)
    return (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).astype(np.uint8).tobytes()


def _unpack2(data: bytes, count: int) -> np.ndarray:
    packed = np.frombuffer(data, dtype=np.uint8)
    codes = np.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], axis=1).reshape(-1)
    return codes[:count]
