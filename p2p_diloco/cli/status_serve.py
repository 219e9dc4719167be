"""``p2p-diloco status --serve PORT``: the run's status as a web page (:mod:`p2p_diloco.monitoring.web`) until stopped.

A client-mode DHT node reads the run's progress records again every :data:`REFRESH_S` (each read bounded by
``--timeout``) and the page's document is replaced by the new report (``status --json``'s, with how many DHT peers
are reachable and when it was read). The eval-loss curve and each stage process's train-loss curve are kept across
reads, so they reach back further than a record carries, and so are the stage processes whose records are gone
(:class:`SwarmMemory`: shown as left, or finished, for a while). A node that cannot join, or whose process died, is
started again at the next read; the page says why it has no records meanwhile. Called by :mod:`p2p_diloco.cli.status`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time

from p2p_diloco.cli.logs import configure_logging
from p2p_diloco.cli.status_report import build_report, read_run, swarm_groups
from p2p_diloco.config import ConfigError

logger = logging.getLogger(__name__)

REFRESH_S = 5.0  # how often the records are read again (each record is refreshed every 10 s by its writer)
MAX_CURVE_POINTS = 4096  # rounds of the eval-loss curve kept (the latest)
MAX_PEER_CURVE_POINTS = 512  # rounds of each stage process's train-loss curve kept (the latest)
KEEP_GONE_S = 1800.0  # how long a stage process whose record is gone is still shown
MAX_GONE_ROWS = 64  # stage processes gone still shown (those last seen latest)


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
        self.memory = SwarmMemory()
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
        peers = self.memory.update(report["peers"], get_dht_time())
        report.update(peers=peers, groups=swarm_groups(peers), eval_curve=self._curve(report["eval_curve"]),
                      reachable=reachable, read_at=time.time(),
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
        return merge_curve(self.curve, fresh, MAX_CURVE_POINTS)

    def close(self) -> None:
        """Stop the node (a read in flight fails; the reader thread ends with the process)."""
        dht, self.dht = self.dht, None
        if dht is not None:
            dht.shutdown()


class SwarmMemory:
    """What ``status --serve`` remembers of the report's rows across reads (no network, no clock of its own).

    Each stage process (a row, by its ``node``) keeps its train-loss curve of all reads (the latest
    :data:`MAX_PEER_CURVE_POINTS` rounds), and a stage process whose record is gone (it left, or its record expired
    120 s after it stopped) is still shown, with its last row and state ``left`` (``finished`` if its last record said
    so), for :data:`KEEP_GONE_S` after it was last seen, at most :data:`MAX_GONE_ROWS` of them.
    """

    def __init__(self):
        self.last: dict[str, tuple[float, dict]] = {}  # node -> (when last seen, its row) of the latest read
        self.gone: dict[str, tuple[float, dict]] = {}  # node -> (when last seen, its last row): records gone
        self.curves: dict[str, dict[int, float]] = {}  # node -> round -> train loss, across reads

    def update(self, rows: list[dict], now: float) -> list[dict]:
        """The rows to show after a read at ``now`` (the records' clock) that found ``rows``: these, each with its
        curve of all reads, then those gone, the last seen first."""
        present = {row["node"] for row in rows}
        self.gone.update({node: seen for node, seen in self.last.items() if node not in present})
        self.last = {row["node"]: (now - row["last_seen_s"], row) for row in rows}
        kept = sorted(((seen_at, node) for node, (seen_at, _) in self.gone.items()
                       if node not in present and now - seen_at <= KEEP_GONE_S), reverse=True)[:MAX_GONE_ROWS]
        self.gone = {node: self.gone[node] for _, node in kept}
        for row in rows:
            merge_curve(self.curves.setdefault(row["node"], {}), row["train_losses"], MAX_PEER_CURVE_POINTS)
        self.curves = {node: curve for node, curve in self.curves.items() if node in present or node in self.gone}
        shown = [dict(row, train_losses=self._curve(row["node"])) for row in rows]
        for node, (seen_at, row) in self.gone.items():
            shown.append(dict(row, state="finished" if row["state"] == "finished" else "left",
                              last_seen_s=round(max(0.0, now - seen_at), 1), train_losses=self._curve(node)))
        return shown

    def _curve(self, node: str) -> list[list]:
        return merge_curve(self.curves.get(node, {}), [], MAX_PEER_CURVE_POINTS)


def merge_curve(curve: dict[int, float], fresh, limit: int) -> list[list]:
    """``curve`` (round -> loss, kept across reads) with a read's ``fresh`` (round, loss) points in (the latest value
    of a round wins), cut to its latest ``limit`` rounds; the curve as sorted [round, loss] points."""
    curve.update({int(r): float(loss) for r, loss in fresh})
    for r in sorted(curve)[:max(0, len(curve) - limit)]:
        del curve[r]
    return [[r, curve[r]] for r in sorted(curve)]
