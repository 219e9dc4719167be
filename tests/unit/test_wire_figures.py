"""benchmarks/streaming.py's figures on the wire: bursts of traffic, the busiest window and the longest saturated
stretch, from a byte counter's samples (20 ms apart, as netns.WireCounter takes them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RATE = 1.25e6  # 10 Mbit/s in bytes per second


def load_streaming():
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("streaming_bench", BENCHMARKS / "streaming.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def counter(rates: list[float], period: float = 0.02) -> list[tuple[float, int]]:
    """Samples of a counter whose i-th interval carries rates[i] bytes per second."""
    samples, total = [(0.0, 0)], 0
    for i, rate in enumerate(rates):
        total += int(rate * period)
        samples.append(((i + 1) * period, total))
    return samples


def test_one_burst_all_at_once_against_three_staggered():
    bench = load_streaming()
    chatter = [0.01 * RATE] * 50  # DHT traffic: under the idle share, never a burst
    full = [RATE] * 36  # 0.72 s at the link rate: 0.9 MB
    all_at_once = counter(chatter + full + chatter)
    third = [RATE] * 12
    staggered = counter(chatter + third + chatter + third + chatter + third + chatter)
    one = bench.wire_figures(all_at_once, RATE, 0.05, 0.2)
    three = bench.wire_figures(staggered, RATE, 0.05, 0.2)
    assert one["bursts"] == 1 and three["bursts"] == 3
    assert one["peak_burst"] == 36 * int(RATE * 0.02)
    assert three["peak_burst"] == 12 * int(RATE * 0.02)
    # saturation is judged in 0.1 s bins, which need not line up with a burst's edges
    assert 0.6 <= one["saturated_s"] <= 0.72 + 1e-6 and 0.1 <= three["saturated_s"] <= 0.24 + 1e-6
    # the 1 s window holds the whole all-at-once burst, but only one staggered burst and some chatter
    assert one["peak_1s"] >= 36 * int(RATE * 0.02)
    assert three["peak_1s"] < 0.5 * one["peak_1s"]


def test_short_gaps_join_a_burst_and_long_ones_split_it():
    bench = load_streaming()
    gap = [0.0] * 5  # 0.1 s of silence
    samples = counter([RATE] * 10 + gap + [RATE] * 10)
    assert len(bench.bursts(samples, RATE, 0.05, gap_s=0.2)) == 1
    assert len(bench.bursts(samples, RATE, 0.05, gap_s=0.05)) == 2
    assert bench.bursts(counter([0.0] * 20), RATE) == []
    assert bench.peak_window([(0.0, 0)]) == 0
