"""Monitoring over HTTP: ``/metrics`` in the Prometheus text format and ``/health`` as JSON, served by peers'
stage processes and bootstrap nodes when ``metrics.port`` is set. Off by default; the JSONL metrics files are
written either way."""

from p2p_diloco.monitoring.nodes import serve_bootstrap_metrics, serve_stage_metrics
from p2p_diloco.monitoring.registry import MetricsRegistry
from p2p_diloco.monitoring.server import MetricsServer

__all__ = ["MetricsRegistry", "MetricsServer", "serve_bootstrap_metrics", "serve_stage_metrics"]
