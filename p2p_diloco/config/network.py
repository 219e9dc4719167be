"""Configuration sections of the network: averaging rounds with other peers (``[averaging]``) and the DHT node
(``[dht]``). As in :mod:`p2p_diloco.config.sections`, every field has a docstring under it and ``validate()`` raises
:class:`ConfigError` naming the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from p2p_diloco.config.checks import non_negative, positive, require
from p2p_diloco.config.errors import ConfigError

COMPRESSIONS = ("none", "fp16", "int8", "lowrank", "adaptive", "sparseloco")
"""The values of ``averaging.compression``, each a rule of :class:`~p2p_diloco.compression.policy.CompressionPolicy`
for which codecs a round's plan names (``p2p_diloco.compression.SCHEMES`` is this list)."""


@dataclass
class AveragingConfig:
    compression: str = "adaptive"
    """How pseudo-gradients cross the wire: 'none' (fp32), 'fp16', 'int8' (blockwise; 4-bit with quant_bits = 4),
    'lowrank' (large matrices through PowerSGD at a fixed rank, factors quantized, the rest quantized) or
    'adaptive' (the least lossy of int8, int4 and lowrank whose rank and bits follow the spectrum, that fits the
    bandwidth budget) or 'sparseloco' (SparseLoCo,
    arXiv 2508.15706: the sparse_topk largest values of each chunk of 4096, 2 bits each; its error feedback decays by
    sparse_feedback_decay and plays the outer momentum, so set diloco.outer_momentum = 0 as the paper does). Errors
    are fed back."""
    quant_bits: int = 8
    """Bits per value of quantized tensors and low-rank factors: 8 or 4 ('adaptive': the most it sends with)."""
    rank: int = 8
    """Low rank of the first round (all rounds for 'lowrank')."""
    min_rank: int = 1
    """Smallest rank 'adaptive' may choose."""
    max_rank: int = 32
    """Largest rank 'adaptive' may choose."""
    lowrank_min_size: int = 65536
    """2-D tensors with at least this many values go through low rank (while the rank keeps them under half their
    size); smaller ones are quantized: low rank saves little there and loses much."""
    sparse_topk: int = 64
    """'sparseloco': values kept in each chunk of 4096 (64: 1.6%, the paper's density; a shorter last chunk keeps
    its share)."""
    sparse_feedback_decay: float = 0.95
    """'sparseloco': the error feedback is multiplied by this before each round's pseudo-gradient is added (the
    paper's beta)."""
    target_error: float = 0.5
    """'adaptive' doubles the rank while the group's relative compression error is above this."""
    bandwidth_budget: float = 0.5
    """'adaptive' keeps the expected transfer of a round within this fraction of a round of compute (it sends whole
    tensors at 8 or 4 bits where they fit, low rank where they do not)."""
    assumed_bandwidth_mbit: float = 100.0
    """Link rate assumed for the bandwidth budget until the first round has measured one."""
    target_group_size: Optional[int] = None
    """Groups of at most this many peers, assembled as soon as this many joined; default: the live peers of the stage
    (read from the records; until known, wait the whole matchmaking time)."""
    min_group_size: int = 2
    """Smallest group worth averaging with; a round with fewer peers falls back to the local delta."""
    matchmaking_time_s: float = 5.0
    """How long a leader waits for peers to join its group."""
    request_timeout_s: float = 3.0
    """Timeout of one matchmaking request (must be below matchmaking_time_s)."""
    round_timeout_s: float = 30.0
    """Give up looking for a group after this long and fall back to the local delta."""
    allreduce_timeout_s: float = 60.0
    """Give up an all-reduce that has not finished after this long."""
    next_chunk_timeout_s: float = 10.0
    """A groupmate that sends nothing for this long is dropped from the all-reduce."""
    outlier_norm_ratio: float = 10.0
    """With 3 or more parts, a groupmate's part of a pseudo-gradient whose norm per claimed token is above this
    multiple of the median (non-finite parts too) is left out of the average and counts as an offence; with only 2
    parts there is no majority, and a part is scaled down to 3 times the other's norm (this multiple if lower) at
    equal weights, up to 12 times for a member with more tokens (robust.pair_ceiling), no offence. 0 disables (not
    recommended)."""
    clip_ratio: float = 2.0
    """CenteredClip radius, as a multiple of the median distance of the group's parts to their coordinate-wise
    median: parts farther from the average are clipped to it (bounded influence, reported, no offence). Honest parts
    rarely are, and then the average is the plain weighted mean, bit for bit. 0 disables."""
    max_weight_ratio: float = 2.0
    """A groupmate's claimed tokens (its weight in the average) are capped at this multiple of the group's median
    claim; in a pair (no majority claim, and honest peers of unequal speed claim tokens in the ratio of their
    speeds), at its cube times the smaller claim. 0 disables."""
    ban_after: int = 3
    """Rounds with an offence (non-finite, far too large or malformed parts, a wrong round, malformed metadata sent
    directly, an implausible average returned as a reducer) after which this peer stops grouping with that peer (until
    this peer restarts); a leader that forged this peer's own record is banned at once, and a groupmate that stalls
    the exchange after stalls in 2 x ban_after of the last 20 rounds. 0: never ban."""
    allowlist: list[str] = field(default_factory=list)
    """A private swarm: the peer ids (base58) of its members, one for each stage process of each peer (see
    --identity-path). Join requests, groups, state requests and state donors outside it are refused. Empty: public."""
    state_streams: int = 4
    """State downloads this peer serves at once, one per peer (each holds a copy of this stage's anchor and outer
    momentum until its reader is done). With all taken, a new request takes the slot of the slowest stream served
    for 2 s or more; its reader asks its next donor."""
    state_min_mbit: float = 1.0
    """Slowest state download this peer keeps serving: a stream whose reader has taken less than this on average
    since its start (after a head start of state_stall_s) is ended and its peer refused state for state_cooldown_s.
    A state of S bytes is thus served within state_stall_s + S / state_min_mbit. Keep it below the slowest link a
    newcomer may have and below this peer's upload rate / state_streams (streams share it); the default is a tenth
    of a 10 Mbit/s home link."""
    state_stall_s: float = 15.0
    """A state stream whose reader takes no 64 KiB chunk for this long is ended and its peer cooled down."""
    state_cooldown_s: float = 300.0
    """How long a peer whose state stream stalled or fell below state_min_mbit is refused state."""

    def validate(self) -> None:
        require(self.compression in COMPRESSIONS, "averaging.compression",
                 f"must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        require(self.quant_bits in (4, 8), "averaging.quant_bits", f"must be 8 or 4, got {self.quant_bits!r}")
        require(1 <= self.min_rank <= self.rank <= self.max_rank, "averaging.rank",
                 f"must satisfy 1 <= min_rank ({self.min_rank}) <= rank ({self.rank}) <= max_rank ({self.max_rank})")
        require(isinstance(self.sparse_topk, int) and 1 <= self.sparse_topk <= 4096, "averaging.sparse_topk",
                 f"must be an integer in [1, 4096], got {self.sparse_topk!r}")
        require(0 <= self.sparse_feedback_decay <= 1, "averaging.sparse_feedback_decay",
                 f"must be in [0, 1], got {self.sparse_feedback_decay!r}")
        require(self.lowrank_min_size >= 1, "averaging.lowrank_min_size",
                 f"must be a positive integer, got {self.lowrank_min_size!r}")
        require(0 < self.bandwidth_budget <= 1, "averaging.bandwidth_budget",
                 f"must be in (0, 1], got {self.bandwidth_budget!r}")
        positive(self.assumed_bandwidth_mbit, "averaging.assumed_bandwidth_mbit")
        require(0 < self.target_error < 1, "averaging.target_error", f"must be in (0, 1), got {self.target_error!r}")
        require(self.target_group_size is None or self.target_group_size >= 2, "averaging.target_group_size",
                 f"must be >= 2, got {self.target_group_size!r}")
        require(self.min_group_size >= 1, "averaging.min_group_size", f"must be >= 1, got {self.min_group_size!r}")
        for name in ("matchmaking_time_s", "request_timeout_s", "round_timeout_s", "allreduce_timeout_s",
                     "next_chunk_timeout_s"):
            positive(getattr(self, name), f"averaging.{name}")
        require(self.request_timeout_s < self.matchmaking_time_s, "averaging.request_timeout_s",
                 f"must be below averaging.matchmaking_time_s ({self.matchmaking_time_s}), "
                 f"got {self.request_timeout_s}")
        require(self.round_timeout_s > self.matchmaking_time_s, "averaging.round_timeout_s",
                 f"must be above averaging.matchmaking_time_s ({self.matchmaking_time_s}), got {self.round_timeout_s}")
        for name in ("outlier_norm_ratio", "clip_ratio", "max_weight_ratio"):
            value = getattr(self, name)
            require(math.isfinite(value) and (value == 0 or value >= 1), f"averaging.{name}",
                     f"must be 0 (off) or a number >= 1, got {value!r}")
        require(self.ban_after >= 0, "averaging.ban_after", f"must be >= 0, got {self.ban_after!r}")
        require(isinstance(self.state_streams, int) and self.state_streams >= 1, "averaging.state_streams",
                 f"must be an integer >= 1, got {self.state_streams!r}")
        for name in ("state_min_mbit", "state_stall_s"):
            positive(getattr(self, name), f"averaging.{name}")
        non_negative(self.state_cooldown_s, "averaging.state_cooldown_s")
        _check_peer_ids(self.allowlist, "averaging.allowlist")


def _check_peer_ids(peer_ids: list[str], key: str) -> None:
    from p2p_diloco.hivemind_adapter.p2p import PeerID  # local import: config stays free of hivemind at import

    for peer_id in peer_ids:
        try:
            multihash = PeerID.from_base58(peer_id).to_bytes()
        except ValueError:
            multihash = b""
        # a peer id is a multihash: sha2-256 (0x12) or identity (0x00), then the digest length, then the digest
        if len(multihash) < 3 or multihash[0] not in (0x00, 0x12) or multihash[1] != len(multihash) - 2:
            raise ConfigError(f"{key}: {peer_id!r} is not a peer id (base58, like 12D3KooW... or Qm...)")


JOIN_MARGIN_S = 10.0
"""How much longer than ``dht.startup_timeout_s`` a DHT node's start may take before it is given up: hivemind bounds
the daemon's start and each ping, not the process's start or the rest of the bootstrap."""


@dataclass
class DHTConfig:
    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of running swarm members (bootstrap nodes or peers); empty: start a new swarm."""
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    """Multiaddrs to listen on (port 0: any free port)."""
    announce_maddrs: list[str] = field(default_factory=list)
    """Multiaddrs others should use to reach this node (e.g. a public IP behind port forwarding)."""
    identity_path: Optional[str] = None
    """Private key file that fixes this node's peer id; created (mode 0600) if it does not exist."""
    client_mode: bool = False
    """Only make outgoing connections (for nodes that cannot accept incoming ones)."""
    use_relay: bool = True
    """Allow reaching peers behind NAT through libp2p circuit relays."""
    use_auto_relay: bool = False
    """Behind NAT: become reachable through relays, the initial peers (a slot is reserved on them at start-up)."""
    reachability_check: bool = True
    """Before training, a peer (not in client mode) asks an initial peer to dial it back at its announced addresses,
    and stops with an error naming what to set if none accepts (a peer nobody can dial makes its groups' rounds time
    out). false: skip the check."""
    startup_timeout_s: float = 30.0
    """Give up if the DHT cannot start or reach the initial peers within this many seconds (the node's whole start
    is given up JOIN_MARGIN_S = 10 s later at most, with exit code 1)."""
    storage_limit_mb: float = 256.0
    """The most memory (MiB) this node's DHT keeps for entries others store on it, or it caches: half for the run's
    signed records, a quarter each for the run's averagers' keys and for any other key; an entry over its share is
    refused, so a stranger's flood cannot exhaust the node's memory or crowd out the run's records. A swarm of a
    thousand peers needs a few MiB."""

    def validate(self) -> None:
        from p2p_diloco.swarm.discovery.maddrs import (
            check_maddrs,  # local import: config stays free of hivemind at import
        )

        check_maddrs(self.initial_peers, "dht.initial_peers", require_peer_id=True)
        check_maddrs(self.host_maddrs, "dht.host_maddrs")
        check_maddrs(self.announce_maddrs, "dht.announce_maddrs")
        positive(self.startup_timeout_s, "dht.startup_timeout_s")
        positive(self.storage_limit_mb, "dht.storage_limit_mb")
