"""Logging set-up of every command: one format for our logs and hivemind's.

Its own module so that subcommands import it without importing :mod:`p2p_diloco.cli.main`, which imports them.
"""

from __future__ import annotations

import logging


def configure_logging(level: str = "INFO") -> None:
    """One format for our logs and hivemind's; hivemind's routine averaging noise only at DEBUG."""
    from p2p_diloco.hivemind_adapter.logs import use_hivemind_log_handler

    use_hivemind_log_handler("in_root_logger")
    root = logging.getLogger()
    root.setLevel(level.upper())
    debug = level.upper() == "DEBUG"
    # a failed round is reported once by our own warning; hivemind would add a traceback per peer
    for name, quiet_level in (("hivemind", logging.WARNING), ("hivemind.averaging.averager", logging.CRITICAL),
                              ("hivemind.averaging.key_manager", logging.ERROR),
                              ("hivemind.averaging.partition", logging.ERROR),
                              ("hivemind.averaging.matchmaking", logging.ERROR)):
        logging.getLogger(name).setLevel(logging.DEBUG if debug else quiet_level)
