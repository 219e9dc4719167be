"""hivemind's logging as this project uses it: its handler mode, and one traceback of the DHT's loop filtered out.

:func:`quiet_vanished_senders` filters, on the logger of ``hivemind.dht.dht``, the traceback hivemind's ``DHT._run``
logs when the pipe of a request's sender could not be read (listed in
:data:`~p2p_diloco.hivemind_adapter.registry.PATCHES`).
"""

from __future__ import annotations

import logging

from hivemind.utils.logging import use_hivemind_log_handler

DHT_LOGGER = "hivemind.dht.dht"
"""The logger of hivemind's DHT process (``hivemind.dht.dht``'s module logger)."""


def _not_a_vanished_sender(record: logging.LogRecord) -> bool:
    """Drops the traceback hivemind logs when a process that sent this DHT a request (an averager shutting down
    with its periodic store in flight) is gone before the request could be read (the pipe's resources went with
    it): harmless, the DHT carries on, but it would print a traceback above the one-line error of a peer that
    stops early."""
    return not (record.funcName == "_run" and record.exc_info and isinstance(record.exc_info[1], OSError))


def quiet_vanished_senders() -> None:
    """Filter, in this process, the traceback hivemind's DHT loop logs for a request whose sender vanished
    (idempotent)."""
    logging.getLogger(DHT_LOGGER).addFilter(_not_a_vanished_sender)


__all__ = ["DHT_LOGGER", "quiet_vanished_senders", "use_hivemind_log_handler"]
