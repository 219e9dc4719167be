"""Persistent libp2p identities: a private key file that fixes a node's peer id across restarts.

hivemind writes new identity files read-only (0400) and says nothing about a garbled one; we create
them 0600 (the owner may rotate them) and check existing ones before a daemon is started, so a user
gets a one-line error instead of a failed daemon start. A missing folder is an error, not created: a
mistyped path would otherwise give the node a new peer id without a word. While a node runs, it holds a
lock on its identity (:class:`IdentityLock`), so a second node of this machine cannot start on it.
Called by :mod:`p2p_diloco.swarm.discovery.dht`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from p2p_diloco.swarm.errors import SwarmError


def _generate_key_bytes() -> bytes:
    from p2p_diloco.hivemind_adapter.crypto import RSAPrivateKey, crypto_pb2

    private_key = RSAPrivateKey()
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=private_key.to_bytes()).SerializeToString()


def _peer_id_of(data: bytes, path: Path) -> str:
    from p2p_diloco.hivemind_adapter.p2p import PeerID

    try:
        return PeerID.from_identity(data).to_base58()
    except Exception:
        raise SwarmError(f"identity file {path} does not hold a libp2p private key (garbled?)") from None


def load_signing_key(path: str | Path):
    """The RSA private key of an identity file, as hivemind's ``RSAPrivateKey``: the key the node's DHT records are
    signed with, so that a record's writer is the node's libp2p identity (see ``swarm.discovery.records``)."""
    from p2p_diloco.hivemind_adapter.crypto import crypto_pb2, private_key_from_der

    path = Path(path).expanduser()
    try:
        private = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    except Exception:
        raise SwarmError(f"identity file {path} does not hold a libp2p private key (garbled?)") from None
    if private.key_type != crypto_pb2.KeyType.RSA:
        raise SwarmError(f"identity file {path} holds a {crypto_pb2.KeyType.Name(private.key_type)} key; this "
                         "version signs its records with RSA identities only: remove the file to have one created")
    return private_key_from_der(private.data)


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
        raise SwarmError(f"identity file {path}: the folder {path.parent} does not exist; create it "
                         f"(mkdir -p {path.parent}) or fix the path")
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


class IdentityLock:
    """An exclusive lock on an identity, held for a node's lifetime: ``flock`` on ``<identity>.lock``.

    hivemind's ``check_if_identity_free`` only asks the swarm, so it misses a second node of this machine that
    has not met the first one (two bootstrap nodes, say). The kernel drops the lock when the process dies, so
    a killed node leaves no stale lock behind. Processes forked while it is held share it; :meth:`release`
    frees it for all of them.

    Raises:
        SwarmError: a running node of this machine holds the identity.
    """

    def __init__(self, identity_path: str | Path):
        self.path = Path(f"{Path(identity_path).expanduser()}.lock")
        try:  # never through a link: one planted at the lock's name would have this node truncate its target
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise SwarmError(f"identity lock {self.path} is a symbolic link; remove it (a node makes its own)") \
                from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise SwarmError(
                f"identity file {identity_path} is in use by another running node on this machine (pid {holder}, "
                f"lock {self.path}): stop that node first, or give each node its own --identity-path"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
