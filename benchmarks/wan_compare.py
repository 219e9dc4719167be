"""Compare several `benchmarks/wan.py` runs by time and tokens to the same eval losses (issue 32: which H wins in
time on a real link, not only per token).

Each wan.py run measures its own modes against its own targets (the worst final loss of its runs, AllReduce's).
Runs of different H, compression or link need one set of targets: this reads each run's ``results.json`` and, for
every (run, link, mode), the training seconds (evaluation time out of the clock, as wan.py counts it) and the
tokens per peer to the first evaluation at or below each target, the final eval loss, tokens/s and the network
wait. A target a run never reaches reads "-".

    python benchmarks/wan_compare.py --run "H = 10=benchmarks/results/wan-h10" \\
        --run "H = 20=benchmarks/results/wan-h20" --targets 1.85,1.80,1.75,1.70 --out benchmarks/results/wan-h
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def first_at(curve: list, target: float) -> tuple[float, int] | None:
    """(seconds, tokens) of the first evaluation of ``curve`` ([(s, tokens, loss, ...)]) at or below ``target``."""
    for point in curve:
        if point[2] <= target:
            return float(point[0]), int(point[1])
    return None


def rows_of(label: str, results: dict, targets: list[float]) -> list[dict]:
    rows = []
    for link, modes in results.items():
        if not isinstance(modes, dict) or "measured_mbit" not in modes:
            continue  # (num_params, time_to_loss)
        for mode, run in modes.items():
            if not isinstance(run, dict) or "eval_curve" not in run:
                continue
            rows.append({"run": label, "link": link, "mode": mode, "final": run["eval_loss"],
                         "tokens_per_s": run["tokens_per_s"], "net_wait_s": run.get("network_wait_s"),
                         "averaged_rounds": run.get("averaged_rounds"),
                         "bytes_per_round": run.get("bytes_sent_per_round"),
                         "reached": {str(t): first_at(run["eval_curve"], t) for t in targets}})
    return rows


def render(rows: list[dict], targets: list[float]) -> str:
    head = f"{'run':<14}{'Mbit/s':>7}  {'mode':<9}{'final':>8}{'tokens/s':>10}{'net wait s':>11}"
    head += "".join(f"{'to ' + format(t, '.2f') + ' s (Mtok)':>20}" for t in targets)
    lines = [head]
    for row in rows:
        line = (f"{row['run']:<14}{row['link']:>7}  {row['mode']:<9}{row['final']:>8.4f}{row['tokens_per_s']:>10,.0f}"
                f"{(row['net_wait_s'] or 0.0):>11.1f}")
        for t in targets:
            hit = row["reached"][str(t)]
            line += f"{'-':>20}" if hit is None else f"{f'{hit[0]:.1f} ({hit[1] / 1e6:.3f})':>20}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=DIR",
                        help="a wan.py output folder (its results.json), with the label its rows get; repeatable")
    parser.add_argument("--targets", required=True, help="eval losses, comma-separated")
    parser.add_argument("--out", type=Path, help="folder for report.txt and wan_compare.json (default: print only)")
    args = parser.parse_args(argv)
    try:
        targets = [float(t) for t in args.targets.split(",")]
    except ValueError:
        parser.error(f"--targets must be numbers separated by commas, got {args.targets!r}")
    rows = []
    for spec in args.run:
        label, sep, folder = spec.rpartition("=")
        if not sep or not label:
            parser.error(f"--run must be LABEL=DIR, got {spec!r}")
        path = Path(folder) / "results.json"
        try:
            results = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            parser.error(f"cannot read {path}: {e}")
        rows += rows_of(label, results, targets)
    if not rows:
        parser.error("no run with an evaluation curve in the given folders")
    command = "python benchmarks/wan_compare.py " + " ".join(
        [f'--run "{spec}"' for spec in args.run] + [f"--targets {args.targets}"] +
        ([f"--out {args.out}"] if args.out else []))
    report = (f"{command}\n\nTraining seconds (evaluation time out of the clock) and tokens per peer (M) to the first "
              f"evaluation at or below each target\n\n{render(rows, targets)}\n")
    print(report, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.txt").write_text(report)
        (args.out / "wan_compare.json").write_text(json.dumps({"targets": targets, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
