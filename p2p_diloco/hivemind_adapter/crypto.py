"""hivemind's RSA keys and libp2p's key protobufs, and the one private way in: a key from its DER bytes.

hivemind's ``RSAPrivateKey`` has no constructor from existing bytes; :func:`private_key_from_der` builds one through
hivemind's own unpickling (``__setstate__`` of a state whose ``_private_key`` holds the DER-encoded key), the way a
key hivemind pickled comes back. Listed in :data:`~p2p_diloco.hivemind_adapter.registry.CALLED` and ``ATTRIBUTES``.
"""

from __future__ import annotations

from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey


def private_key_from_der(der: bytes) -> RSAPrivateKey:
    """hivemind's ``RSAPrivateKey`` holding the DER-encoded (traditional OpenSSL) private key ``der``."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


__all__ = ["RSAPrivateKey", "crypto_pb2", "private_key_from_der"]
