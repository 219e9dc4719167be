"""The registry of wire codecs: every codec this version sends, by the name a plan gives it and by the fields that
name it in a message. The rest of the package asks here, never parses a codec's name itself.

A plan names a codec ``<family>`` or ``<family>:<parameter>`` (``int8``, ``topk2:64``); :func:`codec_for` finds the
family in :data:`REGISTERED` and lets its class parse the parameter. :func:`decode_tensor` decodes what peers send:
the codec whose ``(compression, dtype)`` pair the message carries, and nothing through hivemind's decoders, which
trust the message's ``dtype`` field. The declared shape (its number of dimensions, at most ``max_values`` values) is
checked before the codec reads the payload, and the codec checks the payload's length before anything is allocated,
so a malformed message is a ValueError, never garbage or a huge allocation.

Adding a codec: a :class:`~p2p_diloco.compression.base.Codec` subclass in its own module, and its class in
:data:`REGISTERED`. Called by :mod:`p2p_diloco.compression.policy`, the all-reduce and the simulator.
"""

from __future__ import annotations

import torch

from p2p_diloco.compression.base import Codec, wire_shape
from p2p_diloco.compression.blockwise import Int4, Int8
from p2p_diloco.compression.floating import Fp16, Fp32
from p2p_diloco.compression.sparse import SparseAverage, TopK2Bit
from p2p_diloco.hivemind_adapter.compression import runtime_pb2

REGISTERED: tuple[type[Codec], ...] = (Fp32, Fp16, Int8, Int4, TopK2Bit, SparseAverage)
"""Every codec this version sends and decodes."""
_BY_FAMILY: dict[str, type[Codec]] = {codec.family: codec for codec in REGISTERED}
_BY_WIRE: dict[tuple[int, str], type[Codec]] = {(codec.compression_type, codec.wire_dtype): codec
                                                for codec in REGISTERED}
assert len(_BY_FAMILY) == len(_BY_WIRE) == len(REGISTERED), "two codecs share a name or a wire (compression, dtype)"
CODECS: dict[str, Codec] = {codec.family: codec() for codec in REGISTERED if codec.parameter is None}
"""The codecs that take no parameter, by name (their name alone is a plan's codec)."""


def codec_for(name: str) -> Codec:
    """The codec a plan names: ``<family>`` or ``<family>:<parameter>`` of a codec in :data:`REGISTERED`.

    Raises:
        ValueError: a family no codec registers, or a parameter its codec refuses.
    """
    family, colon, parameter = name.partition(":")
    codec = _BY_FAMILY.get(family)
    if codec is None:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(_BY_FAMILY)})")
    return codec.parse(parameter if colon else None)


def result_codec(name: str) -> str:
    """The name of the codec a reducer sends its average back with, for parts sent with codec ``name``."""
    return codec_for(name).result_codec().name


def roundtrip(codec_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What ``tensor`` becomes after encoding and decoding with a codec (the values the wire carries)."""
    return codec_for(codec_name).roundtrip(tensor)


def decode_tensor(serialized: runtime_pb2.Tensor, max_values: int | None = None) -> torch.Tensor:
    """Decode a tensor from the wire with the registered codec its ``(compression, dtype)`` pair names.

    Args:
        serialized: the message, as a peer sent it.
        max_values: refuse a tensor that declares more values than this (None: no bound but the payload's length).

    Raises:
        ValueError: a pair no registered codec sends, a malformed shape, more than ``max_values`` values, or a payload
            the codec refuses (one whose length does not fit the shape first); raised before anything is allocated
            from the message's claims.
    """
    codec = _BY_WIRE.get((serialized.compression, serialized.dtype))
    if codec is None:
        raise ValueError(f"a tensor of compression {_compression_name(serialized.compression)} and dtype "
                         f"{serialized.dtype[:40]!r} is not one this version sends ({', '.join(_BY_FAMILY)})")
    shape, num_values = wire_shape(serialized)
    if max_values is not None and num_values > max_values:
        raise ValueError(f"a tensor of shape {list(shape)} holds {num_values} values, more than the "
                         f"{max_values} expected")
    return codec.decode(serialized, shape, num_values)


def average_rounding(serialized: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
    """The most a reducer's average that decodes to ``decoded`` (from ``serialized``, which
    :func:`decode_tensor` accepted) can differ from the average it encoded, as the norm of the difference
    (:meth:`Codec.average_rounding <p2p_diloco.compression.base.Codec.average_rounding>` of its codec)."""
    codec = _BY_WIRE.get((serialized.compression, serialized.dtype))
    return 0.0 if codec is None else codec.average_rounding(serialized, decoded)


def _compression_name(compression: int) -> str:
    try:
        return runtime_pb2.CompressionType.Name(compression)
    except ValueError:  # a number no version of hivemind defines
        return str(compression)
