"""Checking multiaddrs given by users before any daemon is started, so mistakes get a one-line error."""

from __future__ import annotations

from collections.abc import Sequence

from p2p_diloco.config.errors import ConfigError


def check_maddrs(maddrs: Sequence[str], key: str, require_peer_id: bool = False) -> None:
    """Raise ConfigError naming ``key`` if any multiaddr is malformed.

    Args:
        maddrs: multiaddr strings, e.g. ``/ip4/10.0.0.5/tcp/31337/p2p/12D3KooW...``.
        key: the config key they came from, for the message.
        require_peer_id: initial peers must end with ``/p2p/<peer id>`` so libp2p can authenticate them.
    """
    from p2p_diloco.hivemind_adapter.p2p import Multiaddr

    for maddr in maddrs:
        try:
            parsed = Multiaddr(maddr)
        except Exception as e:  # hivemind raises several ValueError subclasses and TypeError
            raise ConfigError(f"{key}: malformed multiaddr {maddr!r}: {e}") from None
        if require_peer_id and "p2p" not in parsed:
            raise ConfigError(
                f"{key}: {maddr!r} has no /p2p/<peer id> part; copy the full address that the node printed"
            )
