"""The HTTP side of monitoring: ``GET /metrics`` (``prometheus_client``'s WSGI app on the process's own registry)
and ``GET /health`` (JSON) on one port, from the standard library's ``wsgiref`` server in a daemon thread.
Called by :mod:`p2p_diloco.monitoring.nodes`."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from p2p_diloco.config import ConfigError, MetricsConfig
from p2p_diloco.monitoring.registry import MetricsRegistry

logger = logging.getLogger(__name__)


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
        app = _routes(make_wsgi_app(registry.registry), health)
        try:
            self._server, self._thread = start_http(cfg.host, port, app, "metrics-http")
        except OSError as e:
            raise ConfigError(f"metrics.port: cannot serve metrics on {cfg.host}:{port} ({e.strerror or e}); "
                              "choose another port (0: any free one)") from None
        self.host, self.port = cfg.host, self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """Stop serving and free the port (a scrape in progress finishes in its own daemon thread)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_http(host: str, port: int, app: Callable, name: str) -> tuple[WSGIServer, threading.Thread]:
    """Serve a WSGI app on ``host:port`` (0: any free port) from a daemon thread, each request in a daemon thread of
    its own; OSError if the port cannot be listened on. Stop it with ``shutdown()`` and ``server_close()``."""
    server = make_server(host, port, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5}, name=name, daemon=True)
    thread.start()
    return server, thread


def _routes(metrics_app: Callable, health: Callable[[], dict]) -> Callable:
    """The WSGI app of the port: /metrics to prometheus_client, /health to the report, anything else 404."""

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/health":
            try:
                report = health()
            except Exception as e:  # a probe must get an answer: a report that cannot be made is "down"
                logger.debug(f"Could not make the health report: {e!r}")
                report = {"status": "down", "error": repr(e)}
            status = "200 OK" if report.get("status") == "ok" else "503 Service Unavailable"
            return _send(start_response, status, "application/json", json.dumps(report) + "\n")
        return _send(start_response, "404 Not Found", "text/plain; charset=utf-8",
                     "not found: try /metrics or /health\n")

    return app


def _send(start_response: Callable, status: str, content_type: str, text: str) -> list[bytes]:
    body = text.encode()
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stalled scraper never holds the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # scrapes every few seconds: not worth an INFO line
        logger.debug(f"metrics http: {format % args}")
