"""The memory diagnostic (P2P_DILOCO_MEMTRACE): off by default, and a report every N ticks naming what grew."""

from __future__ import annotations

import tracemalloc

from p2p_diloco.monitoring.memtrace import ENV, MemoryTrace


class Retained:
    """What a leaking structure would hold."""


def test_off_unless_the_environment_asks(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not MemoryTrace("training").enabled
    monkeypatch.setenv(ENV, "not a number")
    assert not MemoryTrace("training").enabled
    monkeypatch.setenv(ENV, "3")
    assert MemoryTrace("training").every == 3


def test_every_nth_tick_reports_the_objects_and_the_lines_that_grew():
    was_tracing = tracemalloc.is_tracing()
    trace, kept = MemoryTrace("test", every=2), []
    try:
        assert trace.tick() is None
        first = trace.tick()
        assert first.startswith("memtrace test") and "tensors holding" in first and "objects grown" not in first
        kept.extend(Retained() for _ in range(5000))
        assert trace.tick() is None
        second = trace.tick()
        assert "Retained +5000" in second  # gc's count by type
        assert f"{__file__}:" in second  # tracemalloc's line of the allocation
    finally:
        if not was_tracing:
            tracemalloc.stop()
