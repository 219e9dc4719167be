"""``p2p-diloco status --serve PORT``: the run's status as a web page (:mod:`p2p_diloco.monitoring.web`) until stopped.

A client-mode DHT node reads the run's progress records again every :data:`REFRESH_S` (each read bounded by
``--timeout``) and the page's document is replaced by the new report (``status --json``'s, with how many DHT peers
are reachable and when it was read). The eval-loss curve is kept across reads, so it reaches back further than the
evaluations a record carries. A node that cannot join, or whose process died, is started again at the next read;
the page says why it has no records meanwhile. Called by :mod:`p2p_diloco.cli.status`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time

from p2p_diloco.cli.logs import configure_logging
from p2p_diloco.cli.status_report import build_report, read_run
from p2p_diloco.config import ConfigError

logger = logging.getLogger(__name__)

REFRESH_S = 5.0  # how often the records are read again (each record is refreshed every 10 s by its writer)
MAX_CURVE_POINTS = 4096  # rounds of the eval-loss curve kept (the latest)


def serve(cfg, args: argparse.Namespace) -> int:
    """Serve the page until SIGINT or SIGTERM; exit code 0."""
    from p2p_diloco.monitoring.web import StatusPage

    if not 0 <= args.serve <= 65535:
        raise ConfigError(f"--serve: a port from 0 to 65535 (0: any free one), not {args.serve}")
    if args.json:
        raise ConfigError("--serve and --json: choose one (the page's document is at /api/status)")
    configure_logging("WARNING")
    page = StatusPage(args.serve_host, args.serve)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    watcher = Watcher(cfg, args.timeout)
    page.update(watcher.document)
    reader = threading.Thread(target=watcher.run, args=(page.update, stop), name="status-reader", daemon=True)
    reader.start()
    print(f"status of run {cfg.run.run_id}: {page.url} (Ctrl-C to stop)", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        page.close()
        watcher.close()
    return 0


class Watcher:
    """Reads the run's records again and again through one client-mode DHT node, and makes the page's document.

    Args:
        cfg: the config of ``status`` (:func:`~p2p_diloco.cli.status.status_config`).
        timeout_s: the bound of a node's start, and of each read.
    """

    def __init__(self, cfg, timeout_s: float):
        self.cfg, self.timeout_s = cfg, timeout_s
        self.dht = None
        self.curve: dict[int, float] = {}  # round -> eval loss, across reads
        self.document: dict = {"run_id": cfg.run.run_id, "peers": [], "eval_curve": [], "read_at": None,
                               "error": "joining the swarm"}

    def run(self, publish, stop: threading.Event) -> None:
        """Read, ``publish`` the document, wait; until ``stop`` is set."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.document = self.read()
            except Exception as e:  # the network is allowed to fail: say so on the page, try again
                logger.debug(f"Could not read the run's records: {e!r}")
                self.document = dict(self.document, error=f"could not read the records: {type(e).__name__}: {e}",
                                     read_at=time.time())
            if not stop.is_set():
                publish(self.document)
            stop.wait(max(1.0, REFRESH_S - (time.monotonic() - started)))

    def read(self) -> dict:
        """One read of the run: the report, or a document saying why there is none."""
        from p2p_diloco.hivemind_adapter.dht import get_dht_time
        from p2p_diloco.monitoring.nodes import PeerCounts
        from p2p_diloco.swarm import SwarmError

        run_id, deadline = self.cfg.run.run_id, time.monotonic() + self.timeout_s
        try:
            dht = self._node()
        except SwarmError as e:
            return {"run_id": run_id, "peers": [], "eval_curve": self._curve([]), "read_at": time.time(),
                    "error": f"could not join the swarm: {e}"}
        reachable = (PeerCounts(dht, timeout_s=min(2.0, self.timeout_s)).get() or (None,))[0]
        records, fragments = read_run(dht, run_id, deadline, max_attempts=1)
        report = build_report(run_id, records, get_dht_time(), num_fragments=fragments)
        report.update(eval_curve=self._curve(report["eval_curve"]), reachable=reachable, read_at=time.time(),
                      error=None if records else f"no records of run {run_id} yet ({reachable} DHT peer(s) reachable)")
        return report

    def _node(self):
        """The DHT node, started (again) if it is not running; SwarmError if it cannot join within the timeout."""
        from p2p_diloco.swarm import start_dht
        from p2p_diloco.swarm.discovery.records import run_record_validators

        if self.dht is not None and not self.dht.is_alive():
            logger.warning("The DHT node of status --serve died; starting another")
            self.dht = None
        if self.dht is None:
            self.dht = start_dht(self.cfg.dht, record_validators=run_record_validators(self.cfg.run.run_id),
                                 check_identity_free=False, ready_timeout_s=self.timeout_s)
        return self.dht

    def _curve(self, fresh: list) -> list[list]:
        """The curve of all reads so far, with this read's points (the latest values of their rounds)."""
        self.curve.update({int(r): float(loss) for r, loss in fresh})
        while len(self.curve) > MAX_CURVE_POINTS:
            del self.curve[min(self.curve)]
        return [[r, self.curve[r]] for r in sorted(self.curve)]

    def close(self) -> None:
        """Stop the node (a read in flight fails; the reader thread ends with the process)."""
        dht, self.dht = self.dht, None
        if dht is not None:
            dht.shutdown()
