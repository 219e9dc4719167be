"""benchmarks/quality.py as a user runs it: a tiny table, adding a seed to it with --resume-from, and a clear
error when the folder holds another setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
SETTING = ["--h", "2", "--rounds", "2", "--batch", "1", "--seq", "16", "--eval-batches", "1", "--eval-every", "1",
           "--workers", "2"]


def quality(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *SETTING, *args], capture_output=True, text=True,
                          timeout=240)


def test_a_second_seed_is_added_to_an_earlier_table_without_running_the_first_again(tmp_path):
    first = quality("--rows", "alone,none/none,delayed/none~2", "--seeds", "0", "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    finals = {r: e[0]["final"] for r, e in json.loads((tmp_path / "a" / "quality.json").read_text())["results"].items()}
    # streaming sync of 2 fragments (every worker's fragment anchors checked identical after each averaging): one
    # fragment at a time on the wire, the largest of the tiny model's 2 about half of the model
    streamed = json.loads((tmp_path / "a" / "quality.json").read_text())["results"]["delayed/none~2"][0]
    whole = json.loads((tmp_path / "a" / "quality.json").read_text())["results"]["none/none"][0]
    assert whole["peak_bytes"] == whole["bytes_per_round"] > 0
    assert 0 < streamed["peak_bytes"] < 0.6 * whole["peak_bytes"]
    assert "delayed/none~2" in first.stdout and "peak/averaging" in first.stdout
    for bad in ("none/none~0", "none/none~3"):  # F >= 1, and F <= H (2 here)
        assert quality("--rows", bad, "--out", str(tmp_path / "z")).returncode == 2

    more = quality("--rows", "alone,none/none", "--seeds", "0,1", "--resume-from", str(tmp_path / "a"),
                   "--out", str(tmp_path / "b"))
    assert more.returncode == 0, more.stderr[-3000:]
    assert "taken from" in more.stdout and "3 results" in more.stdout  # all of the first run's
    ran = [line for line in more.stdout.splitlines() if line.startswith("seed ")]
    assert sorted(line.split()[1] for line in ran) == ["1", "1"]  # only seed 1 ran
    results = json.loads((tmp_path / "b" / "quality.json").read_text())["results"]
    for row, entries in results.items():
        assert sorted(e["seed"] for e in entries) == [0, 1]
        assert [e["final"] for e in entries if e["seed"] == 0] == [finals[row]]
    report = (tmp_path / "b" / "quality_report.txt").read_text()
    assert "seeds [0, 1]" in report and "none/none" in report

    other = quality("--rows", "alone", "--h", "3", "--resume-from", str(tmp_path / "a"), "--out",
                    str(tmp_path / "c"))
    assert other.returncode == 2 and "another setting (h 2 there, 3 here)" in other.stderr
    missing = quality("--rows", "alone", "--resume-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "d"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
