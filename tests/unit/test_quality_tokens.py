"""benchmarks/quality.py's tokens to reach the alone row's final loss, and the speedup it reports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tokens_to_reach_interpolates_between_the_curves_points(quality):
    curve = [(0, 5.0), (100, 4.0), (200, 3.0), (300, 2.5)]
    assert quality.tokens_to_reach(curve, 3.5) == pytest.approx(150)
    assert quality.tokens_to_reach(curve, 2.5) == 300
    assert quality.tokens_to_reach(curve, 5.0) == 0
    assert quality.tokens_to_reach(curve, 2.0) is None  # never reached


def test_the_speedup_is_alones_tokens_over_the_rows_at_the_alone_rows_final_loss(quality):
    def run(row, *curve):
        return quality.RowResult(row, 0, curve=list(curve), final=curve[-1][1])

    results = {"alone": [run("alone", (0, 5.0), (100, 4.0), (200, 3.0))],
               "none/none": [run("none/none", (0, 5.0), (100, 3.0), (200, 2.0))],
               "worse": [run("worse", (0, 5.0), (100, 4.5), (200, 3.5))]}
    table = {e["row"]: e for e in quality.summarize(results)}
    assert table["alone"]["tokens_to_alone"] == 200 and table["alone"]["speedup"] == 1.0
    assert table["none/none"]["tokens_to_alone"] == 100 and table["none/none"]["speedup"] == 2.0
    assert table["worse"]["tokens_to_alone"] is None and "speedup" not in table["worse"]
