"""``p2p-diloco bootstrap``: a long-lived DHT-only node that peers use to find each other."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

from p2p_diloco.cli.common import CONFIG_HELP, add_config_arguments, config_from_args

logger = logging.getLogger(__name__)
DEFAULT_IDENTITY = "bootstrap.id"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bootstrap", help="run a DHT-only bootstrap node", allow_abbrev=False,
        description="Run a DHT node that trains nothing: peers pass its multiaddrs as --initial-peers to find "
        f"each other. Its identity (private key) is created on first run ({DEFAULT_IDENTITY} unless "
        "--identity-path says otherwise, permissions 0600) and reused after, so its peer id and addresses stay "
        "the same across restarts. Runs until SIGINT or SIGTERM.",
        epilog=CONFIG_HELP,
    )
    add_config_arguments(parser)
    parser.add_argument("--maddrs-file", metavar="FILE",
                        help="also write the visible multiaddrs to FILE, one per line (for scripts)")
    parser.add_argument("--liveness-every", type=float, default=60.0, metavar="SECONDS",
                        help="log a one-line liveness report this often (default 60)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
    from p2p_diloco.cli.main import configure_logging
    from p2p_diloco.swarm import start_dht, visible_maddrs
    from p2p_diloco.swarm.records import run_record_validators

    extra = [] if args.identity_path or any(k == "dht.identity_path" for k, _ in overrides) \
        else [("dht.identity_path", DEFAULT_IDENTITY)]
    cfg = config_from_args(args, overrides, extra=extra)
    configure_logging(cfg.run.log_level)
    dht = start_dht(cfg.dht, record_validators=run_record_validators(cfg.run.run_id))  # signatures: any run
    # handlers go in after the DHT process is forked: a child must keep the default (die on SIGTERM)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        maddrs = visible_maddrs(dht)
        print(f"Bootstrap node {dht.peer_id.to_base58()} is up. Peers join with:", flush=True)
        print("  --initial-peers " + " ".join(maddrs), flush=True)
        if args.maddrs_file:
            _write_atomically(Path(args.maddrs_file), "\n".join(maddrs) + "\n")
        started = time.monotonic()
        while not stop.wait(timeout=args.liveness_every):
            logger.info(f"alive: uptime {time.monotonic() - started:.0f} s, {_count_peers(dht)} peer(s) connected")
        logger.info("Stopping the bootstrap node")
    finally:
        dht.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


async def _list_peers(_dht, node) -> int:
    """Runs inside the DHT process (so it must be a module-level function, to be pickled there)."""
    return len(await node.p2p.list_peers())


def _count_peers(dht) -> int:
    try:
        return dht.run_coroutine(_list_peers)
    except Exception:  # a liveness line must never kill the node
        return -1


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
