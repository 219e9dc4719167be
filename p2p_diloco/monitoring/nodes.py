"""What a stage process and a bootstrap node expose on ``/metrics`` and ``/health``.

A stage process: its round, inner step, throughput, loss and the counters of its training summary (averaged
and fallback rounds, reloads, resyncs, bytes), read from the trainer at scrape time. A bootstrap node: the
peers in its routing table, its connections, its uptime. Called by :mod:`p2p_diloco.stage_process` and the bootstrap
command.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from p2p_diloco.config import MetricsConfig
from p2p_diloco.monitoring.registry import MetricsRegistry
from p2p_diloco.monitoring.server import MetricsServer

logger = logging.getLogger(__name__)


async def _peer_counts(_dht, node) -> tuple:
    """Runs inside the DHT process (a module-level function, to be pickled there)."""
    from p2p_diloco.swarm.discovery.storage_budget import node_totals

    kept, refused = node_totals(node)
    return len(node.protocol.routing_table.uid_to_peer_id), len(await node.p2p.list_peers()), kept, refused


class PeerCounts:
    """(DHT nodes in the routing table, open connections, bytes of others' entries the node keeps, entries it
    refused for its storage bound; the last two None on a node without one) of a running DHT, asked at most every
    ``max_age_s``."""

    def __init__(self, dht, max_age_s: float = 2.0, timeout_s: float = 5.0):
        self.dht, self.max_age_s, self.timeout_s = dht, max_age_s, timeout_s
        self._lock = threading.Lock()
        self._value: Optional[tuple] = None
        self._at = float("-inf")

    def get(self) -> Optional[tuple]:
        """None when the DHT does not answer in time (shutting down, or overloaded)."""
        with self._lock:
            if time.monotonic() - self._at > self.max_age_s:
                try:
                    self._value = self.dht.run_coroutine(_peer_counts, return_future=True).result(self.timeout_s)
                except Exception as e:  # a report must never take the node down
                    logger.debug(f"Could not count peers: {e!r}")
                    self._value = None
                self._at = time.monotonic()
            return self._value


def _item(counts: PeerCounts, index: int) -> Optional[int]:
    value = counts.get()
    return None if value is None else value[index]


def _add_node_metrics(registry: MetricsRegistry, counts: PeerCounts, started: float) -> None:
    registry.add("p2p_diloco_peers_seen", "gauge", "DHT nodes in this node's routing table", lambda: _item(counts, 0))
    registry.add("p2p_diloco_connected_peers", "gauge", "Open libp2p connections of this node",
                 lambda: _item(counts, 1))
    registry.add("p2p_diloco_dht_kept_bytes", "gauge", "Bytes of others' DHT entries this node keeps (storage and "
                 "cache, as its storage bound charges them; at most dht.storage_limit_mb)", lambda: _item(counts, 2))
    registry.add("p2p_diloco_dht_refused_entries_total", "counter", "DHT entries this node refused to keep for its "
                 "storage bound (a class of key over its share, a sender over its part, an averager's declaration "
                 "from another node than the one it names, or a subkey its dictionary cannot order)",
                 lambda: _item(counts, 3))
    registry.add("p2p_diloco_uptime_seconds", "gauge", "Seconds since this process started serving",
                 lambda: time.monotonic() - started)


def stage_registry(trainer, dht, run_id: str, peer_name: str) -> MetricsRegistry:
    """The metrics of one stage process, read from its trainer (and the trainer's stage and summary)."""
    stage, summary = trainer.stage, trainer.summary
    registry = MetricsRegistry({"run_id": run_id, "peer": peer_name, "stage": str(stage.stage_index)})
    for name, kind, help_text, read in [
        ("p2p_diloco_round", "gauge", "Rounds this stage has finished (the round it trains is this one)",
         lambda: stage.round_index),
        ("p2p_diloco_applied_round", "gauge", "Last round whose average the anchor took (-1: none yet)",
         lambda: stage.applied_round),
        ("p2p_diloco_inner_step", "gauge", "Inner steps done", lambda: stage.inner_step),
        ("p2p_diloco_tokens_per_second", "gauge", "Training tokens per second, last measured",
         lambda: trainer.tokens_per_s),
        ("p2p_diloco_loss", "gauge", "Last training loss (last stage only)", lambda: summary.last_loss),
        ("p2p_diloco_eval_loss", "gauge", "Last eval loss of the anchor (last stage only)",
         lambda: summary.eval_loss_final),
        ("p2p_diloco_averaged_rounds_total", "counter", "Rounds averaged with other peers and applied",
         lambda: summary.averaged_rounds),
        ("p2p_diloco_fallback_rounds_total", "counter", "Rounds applied with this peer's own pseudo-gradient",
         lambda: summary.fallback_rounds),
        ("p2p_diloco_reloads_total", "counter", "States downloaded from peers to catch up", lambda: summary.reloads),
        ("p2p_diloco_resyncs_total", "counter", "Diverged anchors replaced by the swarm's", lambda: summary.resyncs),
        ("p2p_diloco_bytes_sent_total", "counter", "Bytes sent by averaging", lambda: summary.bytes_sent),
        ("p2p_diloco_bytes_received_total", "counter", "Bytes received by averaging",
         lambda: summary.bytes_received),
        ("p2p_diloco_network_wait_seconds_total", "counter", "Seconds the training loop waited for averaging",
         lambda: summary.network_wait_s),
    ]:
        registry.add(name, kind, help_text, read)
    _add_node_metrics(registry, PeerCounts(dht), time.monotonic())
    return registry


def serve_stage_metrics(cfg: MetricsConfig, trainer, dht, run_id: str, peer_name: str) -> Optional[MetricsServer]:
    """Start the metrics server of a stage process (stage j on ``metrics.port`` + j); None when it is off."""
    if cfg.port is None:
        return None
    stage, started = trainer.stage, time.monotonic()

    def health() -> dict:
        alive = dht.is_alive() and not trainer.stop_requested
        return {"status": "ok" if alive else ("stopping" if trainer.stop_requested else "down"), "role": "peer",
                "run_id": run_id, "peer": peer_name, "node": dht.peer_id.to_base58(), "stage": stage.stage_index,
                "num_stages": stage.num_stages, "round": stage.round_index, "inner_step": stage.inner_step,
                "uptime_s": round(time.monotonic() - started, 1)}

    server = MetricsServer(cfg, stage_registry(trainer, dht, run_id, peer_name), health,
                           port_offset=stage.stage_index)
    logger.info(f"Stage {stage.stage_index}: metrics at {server.url}/metrics, health at {server.url}/health")
    return server


def serve_bootstrap_metrics(cfg: MetricsConfig, dht) -> Optional[MetricsServer]:
    """Start the metrics server of a bootstrap node; None when it is off."""
    if cfg.port is None:
        return None
    started, peer_id = time.monotonic(), dht.peer_id.to_base58()
    counts = PeerCounts(dht)
    registry = MetricsRegistry({"node": peer_id})
    _add_node_metrics(registry, counts, started)

    def health() -> dict:
        return {"status": "ok" if dht.is_alive() else "down", "role": "bootstrap", "node": peer_id,
                "peers_seen": _item(counts, 0), "uptime_s": round(time.monotonic() - started, 1)}

    server = MetricsServer(cfg, registry, health)
    logger.info(f"Metrics at {server.url}/metrics, health at {server.url}/health")
    return server
