"""Watching a run with the usual tools: ``/metrics`` (Prometheus, by ``prometheus_client``) and ``/health`` (JSON)
over HTTP, served by peers' stage processes and bootstrap nodes when ``metrics.port`` is set, and TensorBoard and
Weights & Biases sinks of the training metrics when ``metrics.tensorboard_dir`` or ``metrics.wandb_project`` is.
All off by default; the JSONL metrics files are written either way."""

from p2p_diloco.monitoring.nodes import serve_bootstrap_metrics, serve_stage_metrics
from p2p_diloco.monitoring.registry import MetricsRegistry
from p2p_diloco.monitoring.server import MetricsServer
from p2p_diloco.monitoring.sinks import TensorBoardSink, WandbSink, check_sinks, open_sinks

__all__ = ["MetricsRegistry", "MetricsServer", "TensorBoardSink", "WandbSink", "check_sinks", "open_sinks",
           "serve_bootstrap_metrics", "serve_stage_metrics"]
