"""Pieces shared by the commands: the config options every training command takes, building the
config from them, and stopping cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable

from p2p_diloco.config import Config, describe_config, load_config
from p2p_diloco.config.network import JOIN_MARGIN_S

logger = logging.getLogger(__name__)

CONFIG_HELP = (
    "Every config key can be set on the command line as --section.field VALUE (lists: comma-separated), "
    "for example --diloco.inner_steps 100 --inner.lr 1e-3. Keys given later win: file < shortcut options "
    "< --section.field overrides. `--help-config` lists every key with its default and meaning."
)

JOIN_BOUND_HELP = (
    "Joining the swarm is bounded: when the DHT node cannot start or reach an initial peer within "
    f"dht.startup_timeout_s (default 30) plus {JOIN_MARGIN_S:g} s, the command exits with code 1 and says which "
    "peers it could not reach."
)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="TOML",
                        help="config file (`p2p-diloco config --example peer --out peers/peer.toml` writes an "
                        "example: `p2p-diloco config` lists them; --help-config lists every key)")
    parser.add_argument("--help-config", action="store_true", help="list every config key and exit")
    dht = parser.add_argument_group("swarm (shortcuts for [dht] and [run] keys)")
    dht.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                     help="multiaddrs of running bootstrap nodes or peers, ending in /p2p/<peer id>")
    dht.add_argument("--host-maddrs", nargs="+", metavar="MADDR",
                     help="multiaddrs to listen on (default /ip4/0.0.0.0/tcp/0)")
    dht.add_argument("--announce-maddrs", nargs="+", metavar="MADDR",
                     help="multiaddrs to announce to others (public address behind port forwarding)")
    dht.add_argument("--identity-path", metavar="FILE",
                     help="private key file fixing this node's peer id (created 0600 if missing; its folder "
                     "must exist; one running node of a machine per file)")
    dht.add_argument("--run-id", metavar="NAME", help="training run to join; only peers of one run average")
    nat = parser.add_argument_group("NAT and relays (shortcuts for [dht] keys; hivemind's libp2p options)")
    nat.add_argument("--client-mode", dest="client_mode", action="store_const", const="true",
                     help="only make outgoing connections: for a node behind NAT or a firewall that nobody can "
                     "dial (it still trains and averages, but serves no DHT requests; never for a bootstrap node)")
    nat.add_argument("--no-relay", dest="use_relay", action="store_const", const="false",
                     help="turn libp2p circuit relays off (default: on, so that peers behind NAT can be reached "
                     "through relays)")
    nat.add_argument("--use-auto-relay", dest="use_auto_relay", action="store_const", const="true",
                     help="behind NAT: look for relays and become reachable through them")
    parser.set_defaults(accepts_overrides=True)


def shortcut_overrides(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The ``--initial-peers``-style shortcuts as ``(key, value)`` overrides."""
    pairs = [("initial_peers", "dht.initial_peers"), ("host_maddrs", "dht.host_maddrs"),
             ("announce_maddrs", "dht.announce_maddrs"), ("identity_path", "dht.identity_path"),
             ("run_id", "run.run_id"), ("client_mode", "dht.client_mode"), ("use_relay", "dht.use_relay"),
             ("use_auto_relay", "dht.use_auto_relay")]
    overrides = []
    for attr, key in pairs:
        value = getattr(args, attr, None)
        if value is not None:
            overrides.append((key, ",".join(value) if isinstance(value, list) else str(value)))
    return overrides


def config_from_args(args: argparse.Namespace, overrides: list[tuple[str, str]],
                     extra: list[tuple[str, str]] = ()) -> Config:
    if getattr(args, "help_config", False):
        print(describe_config())
        raise SystemExit(0)
    return load_config(args.config, shortcut_overrides(args) + list(extra) + list(overrides))


class GracefulStop:
    """First SIGINT/SIGTERM: ask ``on_stop`` to finish cleanly. Second one: exit at once."""

    def __init__(self, on_stop: Callable[[], None]):
        self.on_stop, self.signalled = on_stop, False

    def __enter__(self) -> GracefulStop:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, _frame) -> None:
        if self.signalled:
            logger.warning("Second signal: exiting now without a checkpoint")
            sys.stderr.flush()
            import os

            os._exit(130)
        self.signalled = True
        logger.warning(f"Got {signal.Signals(signum).name}: finishing the current step, then checkpointing and "
                       "exiting (send it again to exit at once)")
        self.on_stop()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
