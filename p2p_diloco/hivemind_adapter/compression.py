"""hivemind's compression API, which our codecs implement (:mod:`p2p_diloco.compression`): public names only."""

from __future__ import annotations

from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from hivemind.proto import runtime_pb2

__all__ = [
    "CompressionBase", "CompressionInfo", "Float16Compression", "NoCompression", "PerTensorCompression",
    "deserialize_torch_tensor", "runtime_pb2", "serialize_torch_tensor",
]
