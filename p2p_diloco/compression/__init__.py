"""Compression of pseudo-gradients: wire codecs (hivemind's fp32/fp16, our blockwise int8/int4), PowerSGD low
rank with warm-started Q, and the policy that picks rank and bits every round, identically on every peer."""

from p2p_diloco.compression.codecs import CODECS, decode_tensor, encoded_size, roundtrip
from p2p_diloco.compression.policy import SCHEMES, CompressionPolicy, RoundPlan

__all__ = ["CODECS", "SCHEMES", "CompressionPolicy", "RoundPlan", "decode_tensor", "encoded_size", "roundtrip"]
