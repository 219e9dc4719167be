"""benchmarks/quality.py's tokens to reach the alone row's final loss, and the speedup it reports."""

from __future__ import annotations

import importlib.util
import json
import subprocess
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


def test_tokens_to_another_runs_final_loss_on_the_seeds_mean_curve(tmp_path, capsys):
    """benchmarks/tokens_to_loss.py: the target is the target run's mean final loss; a run's seeds are averaged into
    one curve (gathered from several folders) and read as quality.py reads its tokens to alone's loss."""
    spec = importlib.util.spec_from_file_location("tokens_to_loss_bench", SCRIPT.parent / "tokens_to_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def write(folder, row, *runs):
        (tmp_path / folder).mkdir()
        results = {row: [{"name": row, "seed": seed, "curve": curve, "final": curve[-1][1]} for seed, curve in runs]}
        (tmp_path / folder / "quality.json").write_text(json.dumps({"results": results}))

    write("old", "d", (0, [[0, 5.0], [100, 4.0], [200, 3.0]]), (1, [[0, 5.0], [100, 4.0], [200, 3.0]]))
    write("new0", "d", (0, [[0, 5.0], [100, 3.5], [200, 2.5]]))
    write("new1", "d", (1, [[0, 5.0], [100, 2.5], [200, 2.0]]))
    text = module.main(["--target", f"{tmp_path / 'old'}:d", "--run", f"new={tmp_path / 'new0'},{tmp_path / 'new1'}:d"])
    # mean curve of the new run: 5.0, 3.0, 2.25 -> 3.0 (the old final) at 100 tokens: 2x, half the tokens saved
    assert "reached at 200 tokens" in text and "final 2.2500 (seeds [0, 1])" in text and "100 tokens" in text
    assert "2.000x, +50.0% tokens saved" in text
    with pytest.raises(SystemExit):
        module.main(["--target", f"{tmp_path / 'old'}:missing", "--run", f"x={tmp_path / 'new0'}:d"])
    assert "has no row 'missing'" in capsys.readouterr().err


def test_the_wan_benchmark_refuses_a_bad_override_before_starting_anything():
    """benchmarks/wan.py --set is checked as the peers would check it (at the run's H) before any host starts."""
    wan = SCRIPT.parent / "wan.py"
    for override, message in (("diloco.overlap_step=1", "unknown key"), ("diloco.overlap_steps=30", "between 1 and"),
                              ("nothing", "expected KEY=VALUE")):
        done = subprocess.run([sys.executable, str(wan), "--h", "20", "--set", override], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, (override, done.stderr)
