"""The HTTP side of monitoring: ``GET /metrics`` (Prometheus text format) and ``GET /health`` (JSON), from
the standard library's ``http.server`` in a daemon thread. Called by :mod:`p2p_diloco.monitoring.nodes`."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from p2p_diloco.config import ConfigError, MetricsConfig
from p2p_diloco.monitoring.registry import MetricsRegistry

logger = logging.getLogger(__name__)
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsServer:
    """Serves a registry and a health report until :meth:`close`.

    Args:
        cfg: the ``[metrics]`` section (its port must be set).
        registry: what ``/metrics`` shows.
        health: returns the ``/health`` document; its ``status`` is ``"ok"`` (HTTP 200) or anything else (503).
        port_offset: added to a fixed ``metrics.port`` (stage j of a pipelined peer listens on port + j).

    Raises:
        ConfigError: the port cannot be listened on (taken, or a privileged port).
    """

    def __init__(self, cfg: MetricsConfig, registry: MetricsRegistry, health: Callable[[], dict],
                 port_offset: int = 0):
        assert cfg.port is not None
        port = cfg.port + port_offset if cfg.port else 0
        handler = type("Handler", (_Handler,), {"registry": registry, "health": staticmethod(health)})
        try:
            self._server = ThreadingHTTPServer((cfg.host, port), handler)
        except OSError as e:
            raise ConfigError(f"metrics.port: cannot serve metrics on {cfg.host}:{port} ({e.strerror or e}); "
                              "choose another port (0: any free one)") from None
        self._server.daemon_threads = True
        self.host, self.port = cfg.host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    registry: MetricsRegistry
    health: Callable[[], dict]

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, PROMETHEUS_CONTENT_TYPE, self.registry.render())
        elif path == "/health":
            report = self.health()
            self._send(200 if report.get("status") == "ok" else 503, "application/json", json.dumps(report) + "\n")
        else:
            self._send(404, "text/plain; charset=utf-8", "not found: try /metrics or /health\n")

    def _send(self, code: int, content_type: str, text: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: not worth an INFO line
        logger.debug(f"metrics http: {format % args}")
