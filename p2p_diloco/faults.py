"""Fault injection for tests (torchft-style): a process dies at a named point when told to.

``P2P_DILOCO_FAULT=<point>:<n>`` makes the process exit at the n-th time it passes ``fault_point(<point>)``
(``os._exit``: no cleanup, like a power cut or SIGKILL). Unset, a fault point costs a dictionary lookup.
Points: ``checkpoint-data-written`` (a checkpoint's data file is in place, its manifest is not).
"""

from __future__ import annotations

import os

ENV = "P2P_DILOCO_FAULT"
FAULT_EXIT_CODE = 17
_passes: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point != name:
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] >= int(count or 1):
        os._exit(FAULT_EXIT_CODE)
