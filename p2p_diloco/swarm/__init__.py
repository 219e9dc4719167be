"""Everything that crosses the network, all through hivemind: DHT nodes and identities, progress
records, and the averager of pseudo-gradients."""

from p2p_diloco.swarm.averaging.averager import PseudoGradientAverager, group_prefix, round_bits
from p2p_diloco.swarm.discovery.dht import start_dht, visible_maddrs
from p2p_diloco.swarm.discovery.identity import ensure_identity
from p2p_diloco.swarm.discovery.link import SwarmLink
from p2p_diloco.swarm.discovery.maddrs import check_maddrs
from p2p_diloco.swarm.discovery.progress import (
    ProgressRecord,
    fetch_progress,
    live_group_size,
    publish_progress,
)
from p2p_diloco.swarm.errors import SwarmError

__all__ = [
    "ProgressRecord",
    "PseudoGradientAverager",
    "SwarmError",
    "SwarmLink",
    "check_maddrs",
    "ensure_identity",
    "fetch_progress",
    "group_prefix",
    "live_group_size",
    "publish_progress",
    "round_bits",
    "start_dht",
    "visible_maddrs",
]
