"""``p2p-diloco``: the command line. Owns the console: argument parsing and one-line errors.

Subcommands live in their own modules (``peer``, ``bootstrap``, ``swarm``, ``prepare-data``, ``plan``, ``status``,
``export``, ``generate``, ``config``); each registers its arguments and a ``run(args, overrides) -> exit code``
function. Known user mistakes (bad config, addresses, data, checkpoints, an unreachable swarm, an export folder that
exists) end with ``error: <one line>`` and exit code 2 (usage) or 1 (runtime), never a traceback. ``--version`` is
the installed package's (its metadata), so the command reads nothing from a checkout.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_parser() -> argparse.ArgumentParser:
    from p2p_diloco.cli import bootstrap, config_example, export, generate, peer, plan, prepare, status, swarm

    parser = argparse.ArgumentParser(
        prog="p2p-diloco",
        description="Peer-to-peer DiLoCoX training of language models over slow, unreliable networks, "
        "on a hivemind swarm.",
        epilog="Run `p2p-diloco COMMAND --help` for the options of a command.",
    )
    parser.add_argument("--version", action=PrintVersion)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (peer, bootstrap, swarm, prepare, plan, status, export, generate, config_example):
        module.register(subparsers)
    return parser


class PrintVersion(argparse.Action):
    """``--version``: the installed version, read from the package metadata only when asked."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the installed version (from the package metadata) and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from p2p_diloco import DISTRIBUTION, installed_version

        version = installed_version()
        print(f"{parser.prog} {version}" if version is not None else
              f"{parser.prog}: version unknown: the {DISTRIBUTION} distribution is not installed (no package "
              "metadata); `pip install .` in the checkout records it")
        parser.exit()


# the errors that mean a user's mistake, by the module that defines each: told in one line, never a traceback
USER_ERRORS = (("p2p_diloco.config.errors", "ConfigError"), ("p2p_diloco.data.errors", "DataError"),
               ("p2p_diloco.swarm.errors", "SwarmError"), ("p2p_diloco.training.state.checkpoint", "CheckpointError"),
               ("p2p_diloco.pipeline.context", "PipelineError"), ("p2p_diloco.model.export", "ExportError"),
               ("p2p_diloco.cli.status", "StatusError"))


def user_errors() -> tuple[type[BaseException], ...]:
    """The classes of USER_ERRORS whose modules are imported: an error of a module never imported cannot have been
    raised, and importing them all here (torch, hivemind) cost every early exit seconds, ``--help-config`` too."""
    return tuple(getattr(sys.modules[module], name) for module, name in USER_ERRORS if module in sys.modules)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    from p2p_diloco.config import ConfigError, split_overrides

    try:
        overrides = split_overrides(rest) if getattr(args, "accepts_overrides", False) else []
        if rest and not getattr(args, "accepts_overrides", False):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return args.run(args, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def run_main() -> None:
    """Entry point of the console script; exits the process with the command's code."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # hivemind's background processes and daemon threads can keep a finished interpreter alive
    os._exit(code) if os.environ.get("P2P_DILOCO_HARD_EXIT", "1") == "1" else sys.exit(code)
