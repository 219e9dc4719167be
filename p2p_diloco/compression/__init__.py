"""Compression of pseudo-gradients: wire codecs behind one interface (``base.py``) and their registry
(``codecs.py``), PowerSGD low rank with warm-started Q, and the policy that picks rank, bits and k every round,
identically on every peer.

The package imports its modules (torch, hivemind) only when one of their names is first asked for: the scheme list
(the config's, :data:`~p2p_diloco.config.network.COMPRESSIONS`) is had without either.
"""

import importlib

from p2p_diloco.config.network import COMPRESSIONS as SCHEMES

_HOMES = {"CODECS": "codecs", "REGISTERED": "codecs", "codec_for": "codecs", "decode_tensor": "codecs",
          "roundtrip": "codecs", "Codec": "base", "CompressionPolicy": "policy", "RoundPlan": "policy"}

__all__ = ["CODECS", "REGISTERED", "SCHEMES", "Codec", "CompressionPolicy", "RoundPlan", "codec_for", "decode_tensor",
           "roundtrip"]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
