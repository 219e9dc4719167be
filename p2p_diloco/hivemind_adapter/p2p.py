"""hivemind's P2P layer as this project uses it: the names, and two process-wide patches.

- :func:`cap_received_messages` replaces ``P2P.receive_raw_data``, for the whole process: hivemind reads an 8-byte
  length header and then buffers as many bytes as it declares, before any handler of ours sees the message; the
  copy installed here refuses a declared length above the cap before reading it (hivemind closes a stream whose read
  raises, and goes on serving the others). The cap itself, and why it is safe, is
  :mod:`~p2p_diloco.swarm.averaging.limits`' (which installs it on import). Upstream fix to suggest: a
  ``max_msg_size`` of ``P2P`` checked in ``receive_raw_data``, as the daemon's ``persistent_conn_max_msg_size`` is
  for unary calls.
- :func:`behind_nat_mode` adds a mode to ``P2P.FORCE_REACHABILITY_MAPPING``, hivemind's table of the p2p daemon's
  reachability flags (:data:`BEHIND_NAT_FLAGS`).

Both are listed in :data:`~p2p_diloco.hivemind_adapter.registry.PATCHES`.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Optional

from hivemind.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.utils.multiaddr import Multiaddr


class MessageTooLargeError(ValueError):
    """A peer declared a message larger than this process accepts."""


_cap: dict[str, Optional[int]] = {"bytes": None}


def cap_received_messages(max_bytes: int) -> None:
    """Refuse every message above ``max_bytes`` that this process's hivemind ``P2P`` receives: replaces
    ``P2P.receive_raw_data`` on the class (idempotent; a later call only changes the cap)."""
    if max_bytes < 1:
        raise ValueError(f"a message cap must be at least 1 byte, got {max_bytes}")
    _cap["bytes"] = max_bytes
    if getattr(P2P.receive_raw_data, "message_cap", False):
        return

    @functools.wraps(P2P.receive_raw_data)
    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > _cap["bytes"]:
            raise MessageTooLargeError(f"a peer declared a message of {length} bytes, more than this process accepts "
                                       f"({_cap['bytes']}): stream closed")
        return await reader.readexactly(length)

    receive_raw_data.message_cap = True
    P2P.receive_raw_data = staticmethod(receive_raw_data)


def message_cap_bytes() -> Optional[int]:
    """The largest message this process accepts (None: no cap installed)."""
    return _cap["bytes"]


BEHIND_NAT = "p2p_diloco-behind-nat"
BEHIND_NAT_FLAGS = {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
"""The p2p daemon's flags for a node behind NAT that relays make reachable (``dht.use_auto_relay``): its reachability
is private from the start (libp2p's AutoNAT never concludes for a node with private addresses only: nobody dials
those back) and its relays are the trusted ones it is given, its initial peers, without discovery (with discovery,
libp2p waits for 4 relay candidates or 3 minutes before it takes a reservation; a swarm seldom has 4 relays)."""


def behind_nat_mode() -> str:
    """The ``force_reachability`` value of hivemind's ``P2P.create`` that starts the daemon with
    :data:`BEHIND_NAT_FLAGS` (registered in hivemind's table of reachability modes on first use; call it in the process
    that starts the daemon). Pass the relays as ``trusted_relays``: the daemon refuses to start without any."""
    P2P.FORCE_REACHABILITY_MAPPING.setdefault(BEHIND_NAT, dict(BEHIND_NAT_FLAGS))
    return BEHIND_NAT


__all__ = [
    "BEHIND_NAT", "BEHIND_NAT_FLAGS", "MessageTooLargeError", "Multiaddr", "P2P", "P2PContext", "P2PDaemonError",
    "P2PHandlerError", "PeerID", "behind_nat_mode", "cap_received_messages", "message_cap_bytes",
]
