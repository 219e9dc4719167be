"""Wire codecs for pseudo-gradients, as hivemind ``CompressionBase`` subclasses.

hivemind's own codecs are used where they fit (``NoCompression`` for fp32, ``Float16Compression`` for
fp16); hivemind has no CPU blockwise quantizer (its ``BlockwiseQuantization`` needs bitsandbytes), so
:class:`BlockwiseQuantization8Bit` and :class:`BlockwiseQuantization4Bit` are written here: symmetric
codes with one fp32 scale (the block's absolute maximum) per block of :data:`BLOCK` values. hivemind's
deserializer only knows its own compression types, so ours travel as ``NONE`` tensors whose ``dtype``
field names the codec (``p2p_diloco:int8``). :func:`decode_tensor` decodes what peers send: exactly what this
version sends (fp32 ``NONE``, hivemind's ``FLOAT16`` of fp32 tensors, our two codecs), and nothing through
hivemind's decoders, which trust the message's ``dtype`` field (a small ``FLOAT16`` part naming ``V40000`` made
numpy allocate 40,000 bytes per value). The declared shape (its number of dimensions, at most ``max_values``
values) and the payload's length are checked before anything is allocated, so a malformed message is a
ValueError, never garbage or a huge allocation.

Block grids start at each tensor's first value and hivemind cuts parts at multiples of 2**k values, so
quantizing a part or the whole tensor gives the same values: :func:`roundtrip` on the whole tensor is what
the wire will carry. Called by :mod:`p2p_diloco.compression.policy` and the all-reduce.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from p2p_diloco.compression import sparse
from p2p_diloco.hivemind_adapter.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    runtime_pb2,
)

BLOCK = 256  # values per scale; a power of two, so hivemind's part boundaries fall on block boundaries
MAX_DIMS = 8  # dimensions of a tensor on the wire: parts are 1-D, state tensors have their parameter's shape
MAX_EXTENT = 2**48  # the product of a wire shape's sizes, zeros counted as 1 (a model tensor holds far fewer values)
WIRE_DTYPE = "float32"  # the dtype field of fp32 and fp16 messages: the dtype of the tensor before encoding


class _Blockwise(CompressionBase):
    """Symmetric blockwise quantization with ``bits``-bit codes and an fp32 absmax scale per block."""

    bits: int
    name: str
    compression_type = runtime_pb2.NONE  # see the module docstring: the dtype field carries the codec

    @property
    def max_code(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (int8, one per value) and scales (fp32, one per block) of ``tensor``."""
        flat = tensor.detach().reshape(-1).to(dtype=torch.float32, device="cpu")
        num_blocks = math.ceil(flat.numel() / BLOCK)
        padded = torch.zeros(num_blocks * BLOCK, dtype=torch.float32)
        padded[: flat.numel()] = flat
        blocks = padded.view(num_blocks, BLOCK)
        scales = blocks.abs().amax(dim=1) / self.max_code  # (num_blocks,)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe[:, None]).clamp_(-self.max_code, self.max_code).to(torch.int8)
        return codes.reshape(-1)[: flat.numel()], scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, shape) -> torch.Tensor:
        num_values = codes.numel()
        padded = torch.zeros(scales.numel() * BLOCK, dtype=torch.float32)
        padded[:num_values] = codes.to(torch.float32)
        values = padded.view(-1, BLOCK) * scales[:, None]
        return values.reshape(-1)[:num_values].reshape(shape)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        codes, scales = self.quantize(tensor)
        payload = self._pack(codes.numpy())
        return runtime_pb2.Tensor(compression=self.compression_type, dtype=self.name, size=tensor.shape,
                                  buffer=scales.numpy().astype("<f4").tobytes() + payload,
                                  requires_grad=False)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape, num_values = wire_shape(serialized_tensor)
        num_blocks = math.ceil(num_values / BLOCK)
        expected = 4 * num_blocks + self._packed_size(num_values)
        buffer = serialized_tensor.buffer
        if len(buffer) != expected:
            raise ValueError(f"{self.name} payload of {len(buffer)} bytes does not fit shape {shape} "
                             f"({expected} bytes expected)")
        scales = torch.from_numpy(np.frombuffer(buffer, dtype="<f4", count=num_blocks).astype(np.float32))
        codes = torch.from_numpy(self._unpack(buffer[4 * num_blocks:], num_values))
        # a finite scale can still overflow: 3e38 x 127 is past float32, and the value would decode as inf
        if not torch.isfinite(scales * self.max_code).all() or (codes.to(torch.int16).abs() > self.max_code).any():
            raise ValueError(f"{self.name} payload has non-finite scales, scales whose codes decode past float32, or "
                             "codes out of range")
        return self.dequantize(codes, scales, shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # the scales (4 bytes a block) are left out on purpose: hivemind sizes its parts from this ratio, and
        # bits/32 keeps part boundaries on block boundaries
        return self.bits / 32

    def _packed_size(self, num_values: int) -> int:
        raise NotImplementedError

    def _pack(self, codes: np.ndarray) -> bytes:
        raise NotImplementedError

    def _unpack(self, data: bytes, num_values: int) -> np.ndarray:
        raise NotImplementedError


class BlockwiseQuantization8Bit(_Blockwise):
    """8-bit codes in [-127, 127], one fp32 scale per 256 values (3.9x smaller than fp32)."""

    bits, name = 8, "p2p_diloco:int8"

    def _packed_size(self, num_values: int) -> int:
        return num_values

    def _pack(self, codes: np.ndarray) -> bytes:
        return codes.astype(np.int8).tobytes()

    def _unpack(self, data: bytes, num_values: int) -> np.ndarray:
        return np.frombuffer(data, dtype=np.int8, count=num_values).copy()


class BlockwiseQuantization4Bit(_Blockwise):
    """4-bit codes in [-7, 7], two per byte, one fp32 scale per 256 values (7.5x smaller than fp32)."""

    bits, name = 4, "p2p_diloco:int4"

    def _packed_size(self, num_values: int) -> int:
        return (num_values + 1) // 2

    def _pack(self, codes: np.ndarray) -> bytes:
        nibbles = (codes.astype(np.int16) + 8).astype(np.uint8)  # 1..15
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(8))
        return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()

    def _unpack(self, data: bytes, num_values: int) -> np.ndarray:
        packed = np.frombuffer(data, dtype=np.uint8)
        nibbles = np.empty(packed.size * 2, dtype=np.int16)
        nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
        return (nibbles[:num_values] - 8).astype(np.int8)


CODECS: dict[str, CompressionBase] = {
    "fp32": NoCompression(),
    "fp16": Float16Compression(),
    "int8": BlockwiseQuantization8Bit(),
    "int4": BlockwiseQuantization4Bit(),
}
_OURS = {codec.name: codec for codec in CODECS.values() if isinstance(codec, _Blockwise)}
_SPARSE = (sparse.TOPK_NAME, sparse.AVERAGE_NAME)
_OUR_NAMES = "/".join(name.split(":")[1] for name in sorted(_OURS) + list(_SPARSE))  # int4/int8/topk2/sparse8
_AVERAGE = sparse.SparseAverage()


def codec_for(name: str) -> CompressionBase:
    """The codec a plan names: one of :data:`CODECS`, ``topk2:<k>`` (SparseLoCo's top-k of each chunk of
    :data:`~p2p_diloco.compression.sparse.CHUNK` values, 2 bits each) or ``sparse8`` (a sparse average)."""
    if name in CODECS:
        return CODECS[name]
    if name == "sparse8":
        return _AVERAGE
    kind, _, k = name.partition(":")
    if kind == "topk2" and k.isdigit():
        return sparse.TopK2Bit(int(k))
    raise ValueError(f"unknown codec {name!r}")


def result_codec(name: str) -> str:
    """The codec a reducer sends its average back with, for parts sent with ``name``: the same, but ``sparse8``
    for top-k parts (the average of several is not a top-k of 2-bit values)."""
    return "sparse8" if name.startswith("topk2:") else name


def decode_tensor(serialized: runtime_pb2.Tensor, max_values: int | None = None) -> torch.Tensor:
    """Decode a tensor from the wire: fp32, hivemind's fp16 of fp32, or one of our blockwise codecs.

    Args:
        serialized: the message, as a peer sent it.
        max_values: refuse a tensor that declares more values than this (None: no bound but the payload's length).

    Raises:
        ValueError: another compression or dtype, a malformed shape, more than ``max_values`` values, or a payload
            whose length does not fit the shape; raised before anything is allocated from the message's claims.
    """
    compression, dtype = serialized.compression, serialized.dtype
    codec = _OURS.get(dtype) if compression == runtime_pb2.NONE else None
    is_sparse = compression == runtime_pb2.NONE and dtype in _SPARSE
    if codec is None and not is_sparse and \
            not (dtype == WIRE_DTYPE and compression in (runtime_pb2.NONE, runtime_pb2.FLOAT16)):
        raise ValueError(f"a tensor of compression {_compression_name(compression)} and dtype {dtype[:40]!r} is not "
                         f"one this version sends (fp32, fp16 of fp32, p2p_diloco:{_OUR_NAMES})")
    shape, num_values = wire_shape(serialized)
    if max_values is not None and num_values > max_values:
        raise ValueError(f"a tensor of shape {list(shape)} holds {num_values} values, more than the "
                         f"{max_values} expected")
    if codec is not None:
        return codec.extract(serialized)
    if is_sparse:
        return sparse.decode(serialized, shape, num_values)
    value_bytes = 4 if compression == runtime_pb2.NONE else 2
    if len(serialized.buffer) != value_bytes * num_values:
        raise ValueError(f"{_compression_name(compression)} payload of {len(serialized.buffer)} bytes does not fit "
                         f"shape {list(shape)} ({value_bytes * num_values} bytes expected)")
    array = np.frombuffer(serialized.buffer, dtype="<f4" if value_bytes == 4 else "<f2")
    return torch.from_numpy(array.astype(np.float32)).reshape(shape)  # astype copies: the tensor is writable


def average_rounding(serialized: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
    """The most a reducer's average that decodes to ``decoded`` (from ``serialized``) can differ from the average it
    encoded, as the norm of the difference: half a step of each value's code. 0 for fp32, and for a ``topk2`` message
    (no reducer sends an average as one); fp16: 2^-10 of each value (2^-24 at least: subnormals); int8 and int4: half
    the scale of each value's block (the block's largest magnitude over the largest code); ``sparse8``: half the scale
    of its chunk for each value the chunk sends. A scale is read from the largest decoded magnitude, so a reducer that
    encoded with larger scales than its values need is allowed less, not more."""
    flat = decoded.detach().reshape(-1).float()
    if serialized.compression == runtime_pb2.FLOAT16:
        return float(torch.linalg.vector_norm(torch.clamp(flat.abs() * 2**-10, min=2**-24)))
    if serialized.compression != runtime_pb2.NONE:
        return 0.0
    codec = _OURS.get(serialized.dtype)
    if codec is not None:
        return _half_steps(flat, BLOCK, codec.max_code, None)
    if serialized.dtype == sparse.AVERAGE_NAME:
        sent = np.frombuffer(serialized.buffer, dtype="<u2", count=math.ceil(flat.numel() / sparse.CHUNK))
        return _half_steps(flat, sparse.CHUNK, 127, torch.from_numpy(sent.astype(np.float64)))
    return 0.0


def _half_steps(flat: torch.Tensor, block: int, max_code: int, counts: torch.Tensor | None) -> float:
    """sqrt(sum over blocks of count * (scale / 2)^2), a block's scale its largest magnitude over ``max_code``; count:
    the values of each block (``counts``: those it sends)."""
    padded = torch.zeros(-(-flat.numel() // block) * block, dtype=torch.float64)
    padded[: flat.numel()] = flat.double()
    if counts is None:
        counts = torch.full((padded.numel() // block,), float(block), dtype=torch.float64)
        counts[-1:] -= padded.numel() - flat.numel()
    half_scales = padded.view(-1, block).abs().amax(dim=1) / max_code / 2
    return float(torch.sqrt((counts * half_scales**2).sum()) * (1 + 1e-6))


def wire_shape(serialized: runtime_pb2.Tensor) -> tuple[tuple[int, ...], int]:
    """The shape a message declares and its number of values, of at most :data:`MAX_DIMS` dimensions."""
    if len(serialized.size) > MAX_DIMS:
        raise ValueError(f"a tensor declares {len(serialized.size)} dimensions, more than {MAX_DIMS}")
    shape = tuple(serialized.size)  # uint32 sizes: never negative
    # a zero dimension makes any shape hold no values, but torch still computes its strides from the others: sizes
    # whose product (zeros aside) passes 2**63 overflow there (a RuntimeError, not a refusal)
    if math.prod(max(d, 1) for d in shape) > MAX_EXTENT:
        raise ValueError(f"a tensor declares shape {list(shape)[:MAX_DIMS]}, whose sizes multiply past {MAX_EXTENT}")
    return shape, math.prod(shape)  # Python integers: a product of huge sizes is huge, never wrapped around


def _compression_name(compression: int) -> str:
    try:
        return runtime_pb2.CompressionType.Name(compression)
    except ValueError:  # a number no version of hivemind defines
        return str(compression)


def roundtrip(codec_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What ``tensor`` becomes after encoding and decoding with a codec (the values the wire carries)."""
    codec = codec_for(codec_name)
    if codec_name == "fp32":
        return tensor.detach().to(dtype=torch.float32, device="cpu")
    info = CompressionInfo.from_tensor(tensor)
    return decode_tensor(codec.compress(tensor.detach().cpu().float(), info)).float()


def encoded_size(codec_name: str, num_values: int, group_size: int = 1) -> int:
    """Bytes of payload for ``num_values`` values (the planner's byte estimates); for ``sparse8``, the most an
    average of ``group_size`` top-k contributions takes."""
    if codec_name.startswith("topk2:"):
        return sparse.encoded_size("topk2", num_values, int(codec_name.split(":")[1]))
    if codec_name.startswith("sparse8:"):  # sparse8:<k>: the average of top-k parts
        return sparse.encoded_size("sparse8", num_values, int(codec_name.split(":")[1]), group_size)
    if codec_name in ("fp32", "fp16"):
        return num_values * (4 if codec_name == "fp32" else 2)
    codec = CODECS[codec_name]
    return 4 * math.ceil(num_values / BLOCK) + codec._packed_size(num_values)
