"""How many fragment-rounds a newcomer's arrival fails, with streaming sync on and off (issue 33, part 5).

Runs the mixed-split test (``tests/integration/test_fragments.py``: a P = 1, a P = 2 and a P = 3 peer averaging by
fragment, F = 3, then a newcomer of a fourth split that downloads the state and joins) ``--runs`` times per setting,
the settings taking turns so that the machine's load falls on each alike, and counts from every peer's metrics:

- round ends of the three first peers before and after the newcomer's arrival (its first metrics record), and those
  that fell back (not averaged), with their reasons;
- fragment-rounds failed: (fragment, round) pairs that at least one peer ended without an average;
- whether the test passed (its assertions: calm rounds all averaged with identical anchors, the newcomer's reload
  bit-identical, one final model on all four peers), and its wall time.

    .venv/bin/python benchmarks/newcomer_rounds.py --runs 10 --out benchmarks/results/newcomer-rounds
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.training.metrics import read_metrics  # noqa: E402

TEST = "tests/integration/test_fragments.py::test_peers_of_three_splits_average_every_fragment_together"
SETTINGS = {"streaming": "--diloco.streaming true", "all-at-once": "--diloco.streaming false"}
FIRST = ("p1", "p2", "p3")


def records(folder: Path) -> list[dict]:
    out = []
    for path in sorted(folder.glob("metrics-stage*.jsonl")):
        out += read_metrics(path)
    return out


def count(test_dir: Path) -> dict:
    """The round ends of one run's first three peers, before and after the newcomer's first record."""
    new = records(test_dir / "new")
    arrival = min((e["time"] for e in new), default=float("inf"))
    result = {"arrival_found": bool(new), "before": [0, 0], "after": [0, 0], "reasons": collections.Counter(),
              "failed_fragment_rounds": set(), "newcomer_averaged": 0, "newcomer_rounds": 0}
    for name in FIRST:
        for e in records(test_dir / name):
            if e.get("kind") != "round":
                continue
            # a row tells the outcome of the round it applies (in delayed mode the previous one; round 0's row
            # of a delayed peer applies nothing and is no outcome), or of a round that fell back (its reason)
            if e.get("applied_round") is None and not e.get("fallback_reason"):
                continue
            part = result["before" if e["time"] < arrival else "after"]
            part[0] += 1
            if not e.get("averaged") or e.get("fallback_reason"):
                part[1] += 1
                result["reasons"][(e.get("fallback_reason") or "not averaged")[:90]] += 1
                result["failed_fragment_rounds"].add((e.get("fragment"), e.get("applied_round", e.get("round_index"))))
    for e in new:
        if e.get("kind") == "round" and (e.get("applied_round") is not None or e.get("fallback_reason")):
            result["newcomer_rounds"] += 1
            result["newcomer_averaged"] += bool(e.get("averaged")) and not e.get("fallback_reason")
    result["failed_fragment_rounds"] = len(result["failed_fragment_rounds"])
    result["reasons"] = dict(result["reasons"])
    return result


def run_once(setting: str, index: int, out: Path, timeout_s: float) -> dict:
    base = out / "runs" / f"{setting}-{index}"
    base.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, P2P_DILOCO_TEST_PEER_ARGS=SETTINGS[setting])
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--basetemp",
                           str(base), TEST], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - started
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    dirs = sorted(base.glob("test_peers_of_three_splits*"))
    row = {"setting": setting, "index": index, "passed": proc.returncode == 0, "wall_s": round(wall, 1),
           "pytest": tail[0][:200]}
    if proc.returncode != 0:
        failure = [line for line in proc.stdout.splitlines() if line.startswith("E ")][:3]
        row["failure"] = [line[:300] for line in failure]
    if dirs:
        row.update(count(dirs[0]))
    return row


def report(rows: list[dict], command: str) -> str:
    lines = [f"# {command}", "",
             f"{'setting':<12} {'runs':>4} {'passed':>6} {'round ends before':>17} {'fell back':>9} "
             f"{'round ends after':>16} {'fell back':>9} {'fragment-rounds failed':>22} {'runs with a failure':>19} "
             f"{'newcomer averaged':>17} {'wall s (median)':>15}"]
    for setting in SETTINGS:
        mine = [r for r in rows if r["setting"] == setting and "before" in r]
        if not mine:
            continue
        walls = sorted(r["wall_s"] for r in mine)
        lines.append(
            f"{setting:<12} {len(mine):>4} {sum(r['passed'] for r in mine):>6} "
            f"{sum(r['before'][0] for r in mine):>17} {sum(r['before'][1] for r in mine):>9} "
            f"{sum(r['after'][0] for r in mine):>16} {sum(r['after'][1] for r in mine):>9} "
            f"{sum(r['failed_fragment_rounds'] for r in mine):>22} "
            f"{sum(r['failed_fragment_rounds'] > 0 for r in mine):>19} "
            f"{sum(r['newcomer_averaged'] for r in mine):>8}/{sum(r['newcomer_rounds'] for r in mine):<8} "
            f"{walls[len(walls) // 2]:>15.0f}")
    lines += ["", "per run:"]
    for r in rows:
        lines.append(f"  {r['setting']:<12} #{r['index']} passed={r['passed']} wall={r['wall_s']}s "
                     f"before={r.get('before')} after={r.get('after')} failed={r.get('failed_fragment_rounds')} "
                     f"reasons={r.get('reasons')} {r.get('failure', '')}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="runs per setting (default 10)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    parser.add_argument("--timeout-s", type=float, default=900, help="one run's limit (default 900)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "newcomer-rounds")
    parser.add_argument("--recount", action="store_true",
                        help="count again from the runs kept under --out (its results.json), running nothing")
    args = parser.parse_args()
    if args.recount:
        saved = json.loads((args.out / "results.json").read_text())
        rows = []
        for row in saved["rows"]:
            dirs = sorted((args.out / "runs" / f"{row['setting']}-{row['index']}").glob("test_peers_of_three_splits*"))
            rows.append({**row, **count(dirs[0])} if dirs else row)
        (args.out / "results.json").write_text(json.dumps({"command": saved["command"], "rows": rows}, indent=1))
        text = report(rows, saved["command"])
        (args.out / "report.txt").write_text(text)
        print(text)
        return
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or args.runs < 1:
        parser.error(f"unknown settings {unknown}" if unknown else "--runs must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/newcomer_rounds.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    rows = []
    for index in range(args.runs):
        for setting in settings:  # in turns: the machine's load falls on both alike
            try:
                row = run_once(setting, index, args.out, args.timeout_s)
            except subprocess.TimeoutExpired:
                row = {"setting": setting, "index": index, "passed": False, "wall_s": args.timeout_s,
                       "failure": ["timed out"]}
            rows.append(row)
            print(f"[{len(rows)}/{args.runs * len(settings)}] {setting} #{index}: passed={row['passed']} "
                  f"{row['wall_s']:.0f} s, after arrival {row.get('after')} (round ends, fell back), "
                  f"fragment-rounds failed {row.get('failed_fragment_rounds')}", flush=True)
            (args.out / "results.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    text = report(rows, command)
    (args.out / "report.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
