"""Blockwise quantization, ``int8`` and ``int4``: symmetric codes with one fp32 scale (the block's absolute maximum
over the largest code) per block of :data:`BLOCK` values.

hivemind has no CPU blockwise quantizer (its ``BlockwiseQuantization`` needs bitsandbytes), hence these. hivemind's
deserializer only knows its own compression types, so they travel as ``NONE`` tensors whose ``dtype`` field names
the codec (``p2p_diloco:int8``). Block grids start at each tensor's first value and hivemind cuts parts at multiples
of 2**k values, so quantizing a part or the whole tensor gives the same values: a roundtrip of the whole tensor is
what the wire will carry.

Wire layout (little-endian), after hivemind's message fields: the scale of every block (f32), then the codes (int8:
one byte each; int4: two to a byte, the first in the low nibble, each stored plus 8).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from p2p_diloco.compression.base import Codec, half_steps
from p2p_diloco.hivemind_adapter.compression import CompressionInfo, runtime_pb2

BLOCK = 256  # values per scale; a power of two, so hivemind's part boundaries fall on block boundaries


class Blockwise(Codec):
    """Symmetric blockwise quantization with ``bits``-bit codes and an fp32 absmax scale per block."""

    bits: ClassVar[int]
    compression_type = runtime_pb2.NONE  # see the module docstring: the dtype field carries the codec

    @classmethod
    def max_code(cls) -> int:
        return 2 ** (cls.bits - 1) - 1

    def quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (int8, one per value) and scales (fp32, one per block) of ``tensor``."""
        flat = tensor.detach().reshape(-1).to(dtype=torch.float32, device="cpu")
        num_blocks = math.ceil(flat.numel() / BLOCK)
        padded = torch.zeros(num_blocks * BLOCK, dtype=torch.float32)
        padded[: flat.numel()] = flat
        blocks = padded.view(num_blocks, BLOCK)
        scales = blocks.abs().amax(dim=1) / self.max_code()  # (num_blocks,)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe[:, None]).clamp_(-self.max_code(), self.max_code()).to(torch.int8)
        return codes.reshape(-1)[: flat.numel()], scales

    @staticmethod
    def dequantize(codes: torch.Tensor, scales: torch.Tensor, shape) -> torch.Tensor:
        num_values = codes.numel()
        padded = torch.zeros(scales.numel() * BLOCK, dtype=torch.float32)
        padded[:num_values] = codes.to(torch.float32)
        values = padded.view(-1, BLOCK) * scales[:, None]
        return values.reshape(-1)[:num_values].reshape(shape)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        codes, scales = self.quantize(tensor)
        payload = self._pack(codes.numpy())
        return runtime_pb2.Tensor(compression=self.compression_type, dtype=self.wire_dtype, size=tensor.shape,
                                  buffer=scales.numpy().astype("<f4").tobytes() + payload,
                                  requires_grad=False)

    @classmethod
    def decode(cls, serialized: runtime_pb2.Tensor, shape: tuple[int, ...], num_values: int) -> torch.Tensor:
        num_blocks = math.ceil(num_values / BLOCK)
        expected = 4 * num_blocks + cls._packed_size(num_values)
        buffer = serialized.buffer
        if len(buffer) != expected:
            raise ValueError(f"{cls.wire_dtype} payload of {len(buffer)} bytes does not fit shape {shape} "
                             f"({expected} bytes expected)")
        scales = torch.from_numpy(np.frombuffer(buffer, dtype="<f4", count=num_blocks).astype(np.float32))
        codes = torch.from_numpy(cls._unpack(buffer[4 * num_blocks:], num_values))
        # a finite scale can still overflow: 3e38 x 127 is past float32, and the value would decode as inf
        if not torch.isfinite(scales * cls.max_code()).all() or \
                (codes.to(torch.int16).abs() > cls.max_code()).any():
            raise ValueError(f"{cls.wire_dtype} payload has non-finite scales, scales whose codes decode past "
                             "float32, or codes out of range")
        return cls.dequantize(codes, scales, shape)

    def encoded_size(self, num_values: int) -> int:
        return 4 * math.ceil(num_values / BLOCK) + self._packed_size(num_values)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # the scales (4 bytes a block) are left out on purpose: hivemind sizes its parts from this ratio, and
        # bits/32 keeps part boundaries on block boundaries
        return self.bits / 32

    @classmethod
    def average_rounding(cls, serialized: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
        """Half the scale of each value's block (the block's largest magnitude over the largest code)."""
        return half_steps(decoded.detach().reshape(-1).float(), BLOCK, cls.max_code(), None)

    @classmethod
    def _packed_size(cls, num_values: int) -> int:
        raise NotImplementedError

    @staticmethod
    def _pack(codes: np.ndarray) -> bytes:
        raise NotImplementedError

    @staticmethod
    def _unpack(data: bytes, num_values: int) -> np.ndarray:
        raise NotImplementedError


class Int8(Blockwise):
    """8-bit codes in [-127, 127], one fp32 scale per 256 values (3.9x smaller than fp32)."""

    family, wire_dtype, bits = "int8", "p2p_diloco:int8", 8

    @classmethod
    def _packed_size(cls, num_values: int) -> int:
        return num_values

    @staticmethod
    def _pack(codes: np.ndarray) -> bytes:
        return codes.astype(np.int8).tobytes()

    @staticmethod
    def _unpack(data: bytes, num_values: int) -> np.ndarray:
        return np.frombuffer(data, dtype=np.int8, count=num_values).copy()


class Int4(Blockwise):
    """4-bit codes in [-7, 7], two per byte, one fp32 scale per 256 values (7.8x smaller than fp32)."""

    family, wire_dtype, bits = "int4", "p2p_diloco:int4", 4

    @classmethod
    def _packed_size(cls, num_values: int) -> int:
        return (num_values + 1) // 2

    @staticmethod
    def _pack(codes: np.ndarray) -> bytes:
        nibbles = (codes.astype(np.int16) + 8).astype(np.uint8)  # 1..15
        if nibbles.size % 2:
            nibbles = np.append(nibbles, np.uint8(8))
        return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()

    @staticmethod
    def _unpack(data: bytes, num_values: int) -> np.ndarray:
        packed = np.frombuffer(data, dtype=np.uint8)
        nibbles = np.empty(packed.size * 2, dtype=np.int16)
        nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
        return (nibbles[:num_values] - 8).astype(np.int8)

