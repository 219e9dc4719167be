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


def refusals(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Invocations that must stop at their arguments, started together (each imports torch first: seconds on a busy
    machine, one after the other)."""
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *SETTING, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


def test_a_second_seed_is_added_to_an_earlier_table_without_running_the_first_again(tmp_path):
    first = quality("--rows", "alone,none/none,delayed/none~2,delayed/none", "--seeds", "0",
                    "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    finals = {r: e[0]["final"] for r, e in json.loads((tmp_path / "a" / "quality.json").read_text())["results"].items()}
    # streaming sync of 2 fragments (every worker's fragment anchors checked identical after each averaging): one
    # fragment at a time on the wire, the largest of the tiny model's 2 about half of the model
    streamed = json.loads((tmp_path / "a" / "quality.json").read_text())["results"]["delayed/none~2"][0]
    whole = json.loads((tmp_path / "a" / "quality.json").read_text())["results"]["none/none"][0]
    assert whole["peak_bytes"] == whole["bytes_per_round"] > 0
    assert 0 < streamed["peak_bytes"] < 0.6 * whole["peak_bytes"]
    assert "delayed/none~2" in first.stdout and "peak/averaging" in first.stdout
    # a delayed row's point for round 0 is taken when its average lands in the anchor, a step into round 1 (3 steps
    # of 16 tokens), not at the round's end as blocking's; both end on the run's last step
    curves = {row: [tokens for tokens, _ in json.loads((tmp_path / "a" / "quality.json").read_text())["results"][row]
                    [0]["curve"]] for row in ("none/none", "delayed/none")}
    assert curves == {"none/none": [0, 32, 64], "delayed/none": [0, 48, 64]}, curves
    # F >= 1, and F <= H (2 here); a resumed table of another setting; a resumed folder that is not there
    bad_f0, bad_f3, other, missing = refusals(
        ["--rows", "none/none~0", "--out", str(tmp_path / "z")],
        ["--rows", "none/none~3", "--out", str(tmp_path / "y")],
        ["--rows", "alone", "--h", "3", "--resume-from", str(tmp_path / "a"), "--out", str(tmp_path / "c")],
        ["--rows", "alone", "--resume-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "d")])
    assert bad_f0.returncode == 2 and bad_f3.returncode == 2, (bad_f0.stderr[-500:], bad_f3.stderr[-500:])
    assert other.returncode == 2 and "another setting (h 2 there, 3 here)" in other.stderr
    assert missing.returncode == 2 and "cannot read" in missing.stderr

    more = quality("--rows", "alone,none/none", "--seeds", "0,1", "--resume-from", str(tmp_path / "a"),
                   "--out", str(tmp_path / "b"))
    assert more.returncode == 0, more.stderr[-3000:]
    assert "taken from" in more.stdout and "4 results" in more.stdout  # all of the first run's
    ran = [line for line in more.stdout.splitlines() if line.startswith("seed ")]
    assert sorted(line.split()[1] for line in ran) == ["1", "1"]  # only seed 1 ran
    results = json.loads((tmp_path / "b" / "quality.json").read_text())["results"]
    for row, entries in results.items():
        assert sorted(e["seed"] for e in entries) == [0, 1]
        assert [e["final"] for e in entries if e["seed"] == 0] == [finals[row]]
    report = (tmp_path / "b" / "quality_report.txt").read_text()
    assert "seeds [0, 1]" in report and "none/none" in report

