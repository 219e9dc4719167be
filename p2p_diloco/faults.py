"""Fault injection for tests (torchft-style): a process dies, or waits, at a named point when told to.

``P2P_DILOCO_FAULT=<point>:<n>`` makes the process exit at the n-th time it passes ``fault_point(<point>)``
(``os._exit``: no cleanup, like a power cut or SIGKILL); ``<point>:<n>:group`` kills its whole process group
with SIGKILL instead (the peer and every process of it, from its background averager for example). Unset, a
fault point costs a dictionary lookup. Points: ``checkpoint-data-written`` (a checkpoint's data file is in place,
its manifest is not), ``allreduce-group-formed`` (in the averager: a round's group has formed, its all-reduce
is about to start; the groupmates are waiting for this peer's parts).

``P2P_DILOCO_HOLD=<point>:<file>`` makes the process wait at ``hold_point(<point>)`` until ``<file>`` exists (it
writes ``<file>.held`` when it gets there): a test starts a newcomer beside the swarm, so that its imports and its
DHT's start-up overlap the others' rounds, and lets it join at the round the test wants, whatever the machine's
load. Several, comma-separated, hold at each point in turn. Points: ``start`` (a stage process, its DHT up, before it
reads the swarm's records), ``end`` (the last round ended and published, its average in flight not yet applied),
``leave`` (after the run's end was agreed, before the DHT stops: a finished peer still serves its final state).

Hostile peers (an averager that lies to its groupmates) are test code: subclasses of the averager's parts injected
through its seams, in ``tests/hostile``.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "P2P_DILOCO_FAULT"
HOLD_ENV = "P2P_DILOCO_HOLD"
FAULT_EXIT_CODE = 17
_passes: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, rest = spec.partition(":")
    if point != name:
        return
    count, _, scope = rest.partition(":")
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] >= int(count or 1):
        if scope == "group":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os._exit(FAULT_EXIT_CODE)


def hold_point(name: str, poll_s: float = 0.1) -> None:
    """Wait here until the file that ``P2P_DILOCO_HOLD=<name>:<file>`` names exists (see the module docstring)."""
    spec = os.environ.get(HOLD_ENV)
    if not spec:
        return
    for hold in spec.split(","):
        point, _, path = hold.partition(":")
        if point != name or not path:
            continue
        with open(path + ".held", "a"):
            pass
        while not os.path.exists(path):
            time.sleep(poll_s)
