"""benchmarks/wan_compare.py: several wan.py runs against one set of targets."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "wan_compare.py"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("wan_compare_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def results(curve):
    run = {"tokens_per_s": 1000.0, "eval_loss": curve[-1][2], "network_wait_s": 1.5, "eval_curve": curve}
    return {"10": {"measured_mbit": 9.7, "delayed": run, "alone": dict(run, eval_curve=curve[:2])},
            "num_params": 3, "time_to_loss": {}}


def test_the_first_evaluation_at_or_below_each_target_in_seconds_and_tokens(compare, tmp_path, capsys):
    folder = tmp_path / "h20"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(results([[0, 0, 5.0], [10.0, 100, 2.0], [25.0, 200, 1.7]])))
    assert compare.main(["--run", f"H = 20={folder}", "--targets", "2.0,1.8,1.5", "--out", str(tmp_path / "o")]) == 0
    rows = json.loads((tmp_path / "o" / "wan_compare.json").read_text())["rows"]
    delayed = next(r for r in rows if r["mode"] == "delayed")
    assert delayed["reached"] == {"2.0": [10.0, 100], "1.8": [25.0, 200], "1.5": None}
    alone = next(r for r in rows if r["mode"] == "alone")
    assert alone["reached"]["1.8"] is None
    report = (tmp_path / "o" / "report.txt").read_text()
    assert "H = 20" in report and "25.0 (0.000)" in report and report == capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--run", "nolabel", "--targets", "1.0"], "LABEL=DIR"),
    (["--run", "x={missing}", "--targets", "1.0"], "cannot read"),
    (["--run", "x={empty}", "--targets", "a,b"], "--targets must be numbers"),
])
def test_bad_input_names_the_problem(compare, tmp_path, capsys, args, message):
    (tmp_path / "empty").mkdir()
    args = [a.format(missing=tmp_path / "missing", empty=tmp_path / "empty") for a in args]
    with pytest.raises(SystemExit):
        compare.main(args)
    assert message in capsys.readouterr().err
