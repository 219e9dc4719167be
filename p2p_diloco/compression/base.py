"""The interface every wire codec implements, and what all of them share: the check of a message's declared shape,
and the rounding bound of an average sent with one scale per block.

A codec is a hivemind ``CompressionBase`` (hivemind's averager calls its ``compress`` and sizes its parts from its
``estimate_compression_ratio``) with what this project adds: a plan's name for it (``int8``, ``topk2:64``) and its
parse, the ``(compression, dtype)`` pair that names it in a message, a decoder that checks every length before it
allocates, its payload size for the planner, the codec its average comes back with, and the rounding of that
average. :mod:`p2p_diloco.compression.codecs` registers every codec and is what the rest of the package calls.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import ClassVar

import torch

from p2p_diloco.hivemind_adapter.compression import CompressionBase, CompressionInfo, runtime_pb2

MAX_DIMS = 8  # dimensions of a tensor on the wire: parts are 1-D, state tensors have their parameter's shape
MAX_EXTENT = 2**48  # the product of a wire shape's sizes, zeros counted as 1 (a model tensor holds far fewer values)


class Codec(CompressionBase):
    """One way a tensor crosses the wire. Subclasses set the class attributes and implement the abstract methods; a
    codec holds nothing but its parameter, so every peer that parses a plan's name encodes alike."""

    family: ClassVar[str]
    """The plan's name for the codec, before any ``:<parameter>`` (``int8``, ``topk2``)."""
    compression_type: ClassVar[int]
    """hivemind's ``compression`` field of its messages (``NONE`` for this project's own codecs)."""
    wire_dtype: ClassVar[str]
    """The ``dtype`` field of its messages: the codec's own name (``p2p_diloco:int8``) where hivemind's compression
    type does not tell it (ours travel as ``NONE`` tensors), else the dtype the tensor had before encoding."""
    parameter: ClassVar[str | None] = None
    """What the plan's name carries after ``:`` (``k`` for ``topk2:<k>``); None: the family alone names the codec."""

    @classmethod
    def parse(cls, parameter: str | None) -> Codec:
        """The codec a plan names with ``parameter`` (the text after ``:``; None: no colon).

        Raises:
            ValueError: a parameter this codec does not take, or a malformed one.
        """
        if parameter is not None:
            raise ValueError(f"codec {cls.family!r} takes no parameter, got {parameter!r}")
        return cls()

    @property
    def name(self) -> str:
        """The plan's name for this codec; :meth:`parse` of its parameter gives it back."""
        return self.family

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @classmethod
    @abstractmethod
    def decode(cls, serialized: runtime_pb2.Tensor, shape: tuple[int, ...], num_values: int) -> torch.Tensor:
        """The fp32 tensor a message of this codec carries, of ``shape`` (``num_values`` values, both already
        checked by :func:`wire_shape`). Whatever a parameter of the codec is, it is read from the message.

        Raises:
            ValueError: a payload that does not fit the shape, or values the codec never sends; raised before
                anything is allocated from the message's claims.
        """

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape, num_values = wire_shape(serialized_tensor)
        return self.decode(serialized_tensor, shape, num_values)

    @abstractmethod
    def encoded_size(self, num_values: int) -> int:
        """Bytes of payload for a tensor of ``num_values`` values (the planner's byte estimates); for a codec whose
        size depends on the values, the most it takes."""

    def result_codec(self) -> Codec:
        """The codec a reducer sends its average back with, for parts sent with this one (itself, but where an
        average cannot be a message of this codec)."""
        return self

    def average_size(self, num_values: int, group_size: int) -> int:
        """Bytes of the average a reducer sends back for ``group_size`` contributions of ``num_values`` values."""
        return self.result_codec().encoded_size(num_values)

    @classmethod
    @abstractmethod
    def average_rounding(cls, serialized: runtime_pb2.Tensor, decoded: torch.Tensor) -> float:
        """The most a reducer's average that decodes to ``decoded`` (from ``serialized``) can differ from the
        average it encoded, as the norm of the difference. A scale is read from the largest decoded magnitude, so a
        reducer that encoded with larger scales than its values need is allowed less, not more."""

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What ``tensor`` becomes after encoding and decoding (the values the wire carries), fp32 on the CPU."""
        message = self.compress(tensor.detach().cpu().float(), CompressionInfo.from_tensor(tensor))
        shape, num_values = wire_shape(message)
        return self.decode(message, shape, num_values).float()


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


def half_steps(flat: torch.Tensor, block: int, max_code: int, counts: torch.Tensor | None) -> float:
    """The rounding bound of an average sent by a codec with one scale per block: sqrt(sum over blocks of count *
    (scale / 2)^2), a block's scale its largest magnitude over ``max_code``; count: the values of each block
    (``counts``: those it sends)."""
    padded = torch.zeros(-(-flat.numel() // block) * block, dtype=torch.float64)
    padded[: flat.numel()] = flat.double()
    if counts is None:
        counts = torch.full((padded.numel() // block,), float(block), dtype=torch.float64)
        counts[-1:] -= padded.numel() - flat.numel()
    half_scales = padded.view(-1, block).abs().amax(dim=1) / max_code / 2
    return float(torch.sqrt((counts * half_scales**2).sum()) * (1 + 1e-6))
