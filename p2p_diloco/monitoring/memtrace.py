"""A diagnostic of memory growth: what a process allocated between two reports, and in what.

Off unless ``P2P_DILOCO_MEMTRACE=N`` is set in a peer's environment: then the training process of every stage (at
every Nth round end) and every averager process (at every Nth averaging step) log, at WARNING, one report of

- the process's RSS, and glibc's view of its heap (``mallinfo2``: bytes in use against bytes held free in the
  arenas): a heap whose free bytes grow while the bytes in use stay flat is allocator growth (fragmentation, its
  arenas per thread), not a leak; with ``P2P_DILOCO_MEMTRACE_TRIM=1`` it calls ``malloc_trim(0)`` first and says
  what that gave back;
- the object counts by type that grew since the previous report (``gc``), and the tensors alive (count and bytes:
  torch's storage is outside Python's allocator, so tracemalloc does not see it);
- tracemalloc's top growth by line since the previous report (Python's allocations only).

tracemalloc slows allocations down several-fold: a diagnostic for soak runs (``benchmarks/soak.py --env
P2P_DILOCO_MEMTRACE=20``), never for training. Called by the training ledger and the averager's server.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import logging
import os
import tracemalloc
from typing import Optional

import torch

logger = logging.getLogger(__name__)

ENV = "P2P_DILOCO_MEMTRACE"
TRIM_ENV = "P2P_DILOCO_MEMTRACE_TRIM"
TOP = 12
TRACE_FRAMES = 1  # the allocating line (the report groups by line)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: no heap figures
        return None


def heap_mb() -> Optional[dict]:
    """glibc's heap: MB in use (``uordblks`` + mmapped blocks) and held free in the arenas (``fordblks``)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"in_use": (info.uordblks + info.hblkhd) / 2**20, "free": info.fordblks / 2**20}


def rss_mb() -> float:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return float("nan")


def count_objects() -> tuple[collections.Counter, int, int]:
    """Objects tracked by gc by type name, and the tensors among them (count, bytes of their storages, each
    storage once). Objects frozen before a fork (``process.freeze_before_fork``) are not among them: they were alive
    then, and what grows is allocated later."""
    counts: collections.Counter = collections.Counter()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        counts[type(obj).__name__] += 1
        if issubclass(type(obj), torch.Tensor):  # (not isinstance: it reads __class__, and some proxies warn)
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a tensor without storage (meta, sparse)
                pass
    return counts, counts.get("Tensor", 0) + counts.get("Parameter", 0), sum(storages.values())


class MemoryTrace:
    """Reports of a process's memory every ``every`` ticks (default: from :data:`ENV`; None or 0: off).

    Args:
        where: the process's name in the reports (``training stage 0``, ``averager <prefix>``).
        every: ticks between two reports.
    """

    def __init__(self, where: str, every: Optional[int] = None):
        if every is None:
            try:
                every = int(os.environ.get(ENV, "0"))
            except ValueError:
                logger.warning(f"{ENV} is not a number of rounds: memory reports are off")
                every = 0
        self.where, self.every = where, max(0, every)
        self.ticks = 0
        self._pid: Optional[int] = None  # the process whose reports these are (a fork starts afresh)
        self._snapshot: Optional[tracemalloc.Snapshot] = None
        self._counts: collections.Counter = collections.Counter()

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def tick(self) -> Optional[str]:
        """Count one round (or step); every ``every``-th, log a report and return it."""
        if not self.enabled:
            return None
        if self._pid != os.getpid():  # first tick in this process (a forked averager inherits its parent's state)
            self._pid, self.ticks, self._snapshot, self._counts = os.getpid(), 0, None, collections.Counter()
            if not tracemalloc.is_tracing():
                tracemalloc.start(TRACE_FRAMES)
        self.ticks += 1
        if self.ticks % self.every:
            return None
        text = self.report()
        logger.warning(text)
        return text

    def report(self) -> str:
        gc.collect()
        lines = [f"memtrace {self.where} (pid {os.getpid()}, tick {self.ticks}): RSS {rss_mb():.1f} MB"]
        if os.environ.get(TRIM_ENV) == "1" and _libc() is not None:
            before = rss_mb()
            _libc().malloc_trim(0)
            lines[0] += f", {rss_mb():.1f} MB after malloc_trim ({before - rss_mb():+.1f})"
        heap = heap_mb()
        if heap is not None:
            lines[0] += f"; heap {heap['in_use']:.1f} MB in use, {heap['free']:.1f} MB free in arenas"
        counts, tensors, tensor_bytes = count_objects()
        lines[0] += (f"; {tensors} tensors holding {tensor_bytes / 2**20:.1f} MB; {sum(counts.values())} gc objects"
                     f" (and {gc.get_freeze_count()} frozen before a fork, not counted)")
        grown = [(name, n - self._counts.get(name, 0)) for name, n in counts.items()]
        grown = sorted([g for g in grown if g[1] > 0], key=lambda g: -g[1])[:TOP]
        if self._counts:
            lines.append("  objects grown: " + ", ".join(f"{name} +{n}" for name, n in grown))
        self._counts = counts
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        if self._snapshot is not None:
            for stat in snapshot.compare_to(self._snapshot, "lineno")[:TOP]:
                if stat.size_diff > 0:
                    frame = stat.traceback[0]
                    lines.append(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  "
                                 f"{frame.filename}:{frame.lineno}")
        self._snapshot = snapshot
        return "\n".join(lines)
