"""Compression of pseudo-gradients: wire codecs behind one interface (``base.py``) and their registry
(``codecs.py``), PowerSGD low rank with warm-started Q, and the policy that picks rank, bits and k every round,
identically on every peer.

Only the scheme list is imported with the package; the rest (torch, hivemind) when first asked for, so that the
config, which checks ``averaging.compression`` against :data:`SCHEMES`, stays free of both.
"""

import importlib

from p2p_diloco.compression.schemes import SCHEMES

_HOMES = {"CODECS": "codecs", "REGISTERED": "codecs", "codec_for": "codecs", "decode_tensor": "codecs",
          "roundtrip": "codecs", "Codec": "base", "CompressionPolicy": "policy", "RoundPlan": "policy"}

__all__ = ["CODECS", "REGISTERED", "SCHEMES", "Codec", "CompressionPolicy", "RoundPlan", "codec_for", "decode_tensor",
           "roundtrip"]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
