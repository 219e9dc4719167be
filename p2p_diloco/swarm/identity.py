"""Persistent libp2p identities: a private key file that fixes a node's peer id across restarts.

hivemind writes new identity files read-only (0400) and says nothing about a garbled one; we create
them 0600 (the owner may rotate them) and check existing ones before a daemon is started, so a user
gets a one-line error instead of a failed daemon start. Called by :mod:`p2p_diloco.swarm.dht`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from p2p_diloco.swarm.errors import SwarmError


def _generate_key_bytes() -> bytes:
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    private_key = RSAPrivateKey()
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=private_key.to_bytes()).SerializeToString()


def _peer_id_of(data: bytes, path: Path) -> str:
    from hivemind.p2p import PeerID

    try:
        return PeerID.from_identity(data).to_base58()
    except Exception:
        raise SwarmError(f"identity file {path} does not hold a libp2p private key (garbled?)") from None


def ensure_identity(path: str | Path) -> tuple[str, bool]:
    """Create the identity file if it is missing, else check it.

    Args:
        path: where the private key lives.

    Returns:
        (peer id in base58, whether the file was created now).

    Raises:
        SwarmError: the folder is missing, the file is not a regular file, is readable by other users, or garbled.
    """
    path = Path(path).expanduser()
    if not path.parent.is_dir():
        raise SwarmError(f"identity file {path}: the folder {path.parent} does not exist")
    if not path.exists():
        data = _generate_key_bytes()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process created it meanwhile: use theirs
            return ensure_identity(path)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return _peer_id_of(data, path), True
    if not path.is_file():
        raise SwarmError(f"identity file {path} is not a regular file")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise SwarmError(
            f"identity file {path} is accessible by other users (mode {mode:04o}); it holds a private key: "
            f"run `chmod 600 {path}`"
        )
    try:
        data = path.read_bytes()
    except PermissionError:
        raise SwarmError(f"identity file {path} cannot be read (permission denied)") from None
    return _peer_id_of(data, path), False
