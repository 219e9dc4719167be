"""``p2p-diloco bootstrap``: a long-lived DHT-only node that peers use to find each other."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from p2p_diloco.cli.common import CONFIG_HELP, JOIN_BOUND_HELP, add_config_arguments, config_from_args
from p2p_diloco.cli.logs import configure_logging

logger = logging.getLogger(__name__)
DEFAULT_IDENTITY = "bootstrap.id"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bootstrap", help="run a DHT-only bootstrap node", allow_abbrev=False,
        description="Run a DHT node that trains nothing: peers pass its multiaddrs as --initial-peers to find "
        f"each other. Its identity (private key) is created on first run ({DEFAULT_IDENTITY} unless "
        "--identity-path says otherwise, permissions 0600) and reused after, so its peer id and addresses stay "
        "the same across restarts; a second node of this machine on the same identity is refused. Several "
        "bootstrap nodes of one swarm know each other through --initial-peers. With --metrics.port N it serves "
        "/health and /metrics (Prometheus) over HTTP. Runs until SIGINT or SIGTERM (exit code 0). " + JOIN_BOUND_HELP,
        epilog=CONFIG_HELP,
    )
    add_config_arguments(parser)
    parser.add_argument("--maddrs-file", metavar="FILE",
                        help="also write the visible multiaddrs to FILE, one per line (for scripts)")
    parser.add_argument("--liveness-every", type=float, default=60.0, metavar="SECONDS",
                        help="log a one-line liveness report (peers in the routing table, connections, uptime) "
                        "this often (default 60)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
    from p2p_diloco.config import ConfigError
    from p2p_diloco.monitoring import serve_bootstrap_metrics
    from p2p_diloco.monitoring.nodes import PeerCounts
    from p2p_diloco.swarm import start_dht, visible_maddrs
    from p2p_diloco.swarm.discovery.records import swarm_validators

    extra = [] if args.identity_path or any(k == "dht.identity_path" for k, _ in overrides) \
        else [("dht.identity_path", DEFAULT_IDENTITY)]
    cfg = config_from_args(args, overrides, extra=extra)
    if not args.liveness_every > 0:
        raise ConfigError(f"--liveness-every: must be a positive number of seconds, got {args.liveness_every}")
    if cfg.dht.client_mode:
        raise ConfigError("dht.client_mode: a bootstrap node must accept incoming connections; drop --client-mode")
    configure_logging(cfg.run.log_level)
    # signatures: any run; schemas and the averagers' keys: the run of its config (its stages or fragments)
    dht = start_dht(cfg.dht, record_validators=swarm_validators(cfg.run.run_id, cfg.pipeline.stages,
                                                                cfg.diloco.fragments))
    server = None
    # handlers go in after the DHT process is forked: a child must keep the default (die on SIGTERM)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        maddrs = visible_maddrs(dht)
        print(f"Bootstrap node {dht.peer_id.to_base58()} is up. Peers join with:", flush=True)
        print("  --initial-peers " + " ".join(maddrs), flush=True)
        server = serve_bootstrap_metrics(cfg.metrics, dht)
        if args.maddrs_file:
            _write_atomically(Path(args.maddrs_file), "\n".join(maddrs) + "\n")
        started, counts = time.monotonic(), PeerCounts(dht, max_age_s=0.0)
        while not stop.wait(timeout=args.liveness_every):
            seen, connected, kept, refused = counts.get() or ("?", "?", None, None)
            kept_text = "" if kept is None else \
                f", keeps {kept / 2**20:.1f} MiB of others' DHT entries ({refused} refused)"
            logger.info(f"alive: {seen} peer(s) in the routing table, {connected} connected, "
                        f"uptime {time.monotonic() - started:.0f} s{kept_text}")
        logger.info("Stopping the bootstrap node")
    finally:
        if server is not None:
            server.close()
        dht.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fresh file of an unpredictable name in its folder (created exclusively,
    never through a link someone planted at a fixed temporary name), renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
