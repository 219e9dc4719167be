"""The web page of ``p2p-diloco status --serve``: one HTML file (``status.html``, a package resource whose script and
style are inline: no build step, nothing fetched from elsewhere) at ``/``, and the run's status document at
``/api/status`` (JSON), which the page reads again every few seconds.

Everything in the document comes from other peers' records. The page puts it on screen as text only (never parsed as
HTML), and its Content-Security-Policy allows no script but its own inline one (by hash), so a record that slipped
markup past the schemas still runs nothing. Served by the standard library's ``wsgiref`` in a daemon thread
(:func:`~p2p_diloco.monitoring.server.start_http`). Called by :mod:`p2p_diloco.cli.status_serve`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from importlib import resources

from p2p_diloco.config import ConfigError
from p2p_diloco.monitoring.server import start_http

logger = logging.getLogger(__name__)

PAGE = "status.html"


def page_html() -> str:
    """The page, as the package ships it."""
    return resources.files("p2p_diloco.monitoring").joinpath(PAGE).read_text(encoding="utf-8")


def content_security_policy(html: str) -> str:
    """A policy that lets the page run its own inline script and style (by their sha256) and fetch from this server,
    and nothing else."""

    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks)

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
            "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


class StatusPage:
    """Serves the page and the latest status document until :meth:`close`.

    Args:
        host: the address to listen on.
        port: the port (0: any free one; :attr:`port` tells which).

    Raises:
        ConfigError: the port cannot be listened on.
    """

    def __init__(self, host: str, port: int):
        html = page_html()
        self._page = html.encode()
        self._policy = content_security_policy(html)
        self._lock = threading.Lock()
        self._document = b"{}"
        try:
            self._server, self._thread = start_http(host, port, self._app, "status-http")
        except (OSError, OverflowError) as e:
            raise ConfigError(f"--serve: cannot serve on {host}:{port} ({getattr(e, 'strerror', None) or e}); "
                              "choose another port (0: any free one)") from None
        self.host, self.port = host, self._server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def update(self, document: dict) -> None:
        """Serve ``document`` at ``/api/status`` from now on (one that is not strict JSON is replaced by an error)."""
        try:
            body = json.dumps(document, allow_nan=False).encode()
        except (TypeError, ValueError) as e:  # our bug, not the swarm's: say so on the page
            logger.warning(f"Could not encode the status document: {e!r}")
            body = json.dumps({"error": f"the status document could not be encoded ({type(e).__name__})"}).encode()
        with self._lock:
            self._document = body

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            return _send(start_response, "405 Method Not Allowed", "text/plain; charset=utf-8", b"GET only\n",
                         method)
        if path in ("/", "/index.html"):
            return _send(start_response, "200 OK", "text/html; charset=utf-8", self._page, method,
                         [("Content-Security-Policy", self._policy)])
        if path == "/api/status":
            with self._lock:
                body = self._document
            return _send(start_response, "200 OK", "application/json", body, method,
                         [("Content-Security-Policy", "default-src 'none'")])
        return _send(start_response, "404 Not Found", "text/plain; charset=utf-8", b"not found: try / or /api/status\n",
                     method)


def _send(start_response: Callable, status: str, content_type: str, body: bytes, method: str,
          headers: Iterable[tuple[str, str]] = ()) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))),
                             ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
                             ("Referrer-Policy", "no-referrer"), *headers])
    return [] if method == "HEAD" else [body]
