"""Process lifetime helpers: no process of ours outlives the one that started it.

Used by the launchers (swarm, pipeline stages) and by the hivemind processes a peer forks (DHT node,
averager), so that a peer killed with SIGKILL does not leave orphans behind.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import subprocess
import time

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        pass


def name_process(name: str) -> None:
    """Name this process as ``ps``, ``top`` and ``/proc/PID/comm`` show it (Linux, at most 15 bytes; a no-op
    elsewhere): a peer's forked background processes otherwise all read as ``python``."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def freeze_before_fork() -> None:
    """Before forking a long-lived child that does not exec (an averager's process): collect the garbage, then freeze
    every object the collector tracks (``gc.freeze``), in this process and so in the child, so that neither one's
    collections write to the objects they share.

    Forked, the child shares this process's heap page by page until either writes to a page. A full collection writes
    to the header of every object it tracks: each process's first ones would copy every page that holds one, and the
    memory of a peer (its processes' PSS) would grow by about 60 MB per averager within minutes of the start, as if
    it leaked (``benchmarks/soak.py``). Frozen objects are never collected: a cycle among them that becomes garbage
    later stays, which is bounded by what was alive at the freeze (the process's long-lived state: modules, the
    model)."""
    gc.collect()
    gc.freeze()


def release_free_memory() -> None:
    """Give the pages the C heap holds free back to the system (glibc's ``malloc_trim(0)``; a no-op elsewhere).

    glibc keeps what a process frees in its arenas for reuse: untrimmed, an averager's process, whose threads
    compress and reduce a round's tensors in buffers of every size, holds 25 to 45 MB more after each round, its
    resident set creeping up by about 20 MB an hour with its heap in use flat (``P2P_DILOCO_MEMTRACE_TRIM``,
    ``benchmarks/soak.py``); ``MALLOC_ARENA_MAX=2`` does not change that. A trim takes milliseconds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def leave_signals_to_parent(own_group: bool = False) -> None:
    """Ignore SIGINT and SIGTERM in a background process of a peer (DHT node, averager): its parent stops it.

    Ctrl-C in a terminal and ``kill -- -PGID`` signal the whole process group; without this, they would take
    the averager away in the middle of the round that the peer's graceful stop is waiting for (it would then
    wait out the round's timeouts for nothing). The parent shuts these processes down when it exits, and they die
    with it if it is killed (:func:`die_with_parent`).

    With ``own_group``, the process also leaves its parent's process group, so that what it starts (the DHT
    process's p2pd daemon, a Go program that exits on SIGTERM whatever it inherited) is out of reach of signals
    to the peer's group too; p2pd still ends with the DHT process (its output pipe closes)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if own_group:
        try:
            os.setpgid(0, 0)
        except OSError:
            pass


def lower_priority(increment: int = 10) -> None:
    """Let the training process win the CPU over this one (background networking): raise its nice value."""
    try:
        os.nice(increment)
    except OSError:
        pass


def ready_or_killed(process, wait_until_ready, timeout_s: float, kill_wait_s: float = 5.0) -> bool:
    """Wait for a hivemind background process (DHT node, averager) to be ready, at most ``timeout_s``: hivemind
    itself waits without a bound. True when ready; else the process is SIGKILLed (its p2pd daemon ends with it) and
    reaped, and False."""
    try:
        wait_until_ready(timeout=timeout_s)
        return True
    except TimeoutError:
        if process.is_alive():
            process.kill()
            process.join(kill_wait_s)
        return False


def signal_group(process: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group led by ``process`` (started with ``start_new_session=True``)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every process group still running, wait up to ``grace_s``, then SIGKILL what is left (and
    always SIGKILL the groups afterwards, which removes children orphaned by a killed leader)."""
    for process in processes:
        if process.poll() is None:
            signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        signal_group(process, signal.SIGKILL)
        process.wait()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
