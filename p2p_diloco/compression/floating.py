"""The two dense float codecs, ``fp32`` and ``fp16``: hivemind's ``NoCompression`` and ``Float16Compression``
encoders, with this project's decoder.

hivemind's decoders trust the message's ``dtype`` field (a small ``FLOAT16`` part naming ``V40000`` would make numpy
allocate 40,000 bytes per value), so these read only what this version sends, fp32 values or the fp16 of fp32
values (``dtype`` ``float32`` for both), and check the payload's length against the shape before reading it.
"""

from __future__ import annotations

import numpy as np
import torch

from p2p_diloco.compression.base import Codec
from p2p_diloco.hivemind_adapter.compression import Float16Compression, NoCompression, runtime_pb2

WIRE_DTYPE = "float32"  # the dtype field of fp32 and fp16 messages: the dtype of the tensor before encoding


def _decode_floats(serialized: runtime_pb2.Tensor, shape: tuple[int, ...], num_values: int,
                   value_bytes: int) -> torch.Tensor:
    if len(serialized.buffer) != value_bytes * num_values:
        compression = runtime_pb2.CompressionType.Name(serialized.compression)
        raise ValueError(f"{compression} payload of {len(serialized.buffer)} bytes does not fit "
                         f"shape {list(shape)} ({value_bytes * num_values} bytes expected)")
    array = np.frombuffer(serialized.buffer, dtype="<f4" if value_bytes == 4 else "<f2")
    return torch.from_numpy(array.astype(np.float32)).reshape(shape)  # astype copies: the tensor is writable


class Fp32(Codec, NoCompression):
    """fp32 values as they are (4 bytes a value)."""

    family, wire_dtype = "fp32", WIRE_DTYPE

    @classmethod
    def decode(cls, serialized: runtime_pb2.Tensor, shape: tuple[int, ...], num_values: int) -> torch.Tensor:
        return _decode_floats(serialized, shape, num_values, 4)

    def encoded_size(self, num_values: int) -> int:
        return 4 * num_values

    @classmethod
    def average_rounding(cls, serialized: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
        return 0.0

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(dtype=torch.float32, device="cpu")  # the wire carries the values unchanged


class Fp16(Codec, Float16Compression):
    """fp32 values rounded to fp16 (2 bytes a value; hivemind clamps them to fp16's range first)."""

    family, wire_dtype = "fp16", WIRE_DTYPE

    @classmethod
    def decode(cls, serialized: runtime_pb2.Tensor, shape: tuple[int, ...], num_values: int) -> torch.Tensor:
        return _decode_floats(serialized, shape, num_values, 2)

    def encoded_size(self, num_values: int) -> int:
        return 2 * num_values

    @classmethod
    def average_rounding(cls, serialized: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
        """2^-10 of each value (2^-24 at least: subnormals)."""
        flat = decoded.detach().reshape(-1).float()
        return float(torch.linalg.vector_norm(torch.clamp(flat.abs() * 2**-10, min=2**-24)))
