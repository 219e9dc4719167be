"""Tabulate the outer-step sweep of issue 32 (``benchmarks/outer_sweep.sh``): per group size K and
per (outer lr, outer momentum), the final eval loss of blocking DiLoCo (``none/none``) and of the default
(``delayed/adaptive``), the share of the gap between one worker alone and per-step data parallel that each closes,
and the speedup to alone's final loss (alone's tokens over the row's, at equal compute per worker).

    python benchmarks/outer_sweep.py runs/outer-sweep            # prints the tables, writes sweep.json beside them

Every point is one ``benchmarks/quality.py`` run (``K<k>-lr<lr>-m<m>/quality.json``), the references one run per K
(``K<k>-ref``: alone and data parallel, which the outer step does not touch).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import mean_curve, tokens_to_reach  # noqa: E402

ROWS = ("none/none", "delayed/adaptive")


class Run:
    """One seed of one row, as quality.json keeps it."""

    def __init__(self, raw: dict):
        self.curve, self.final = [tuple(p) for p in raw["curve"]], raw["final"]
        self.seed = int(raw.get("seed", 0))


def load(folder: Path) -> tuple[dict, dict]:
    refs, points = {}, {}
    for path in sorted(folder.glob("K*/quality.json")):
        results = {row: [Run(r) for r in runs] for row, runs in json.loads(path.read_text())["results"].items()}
        name = path.parent.name
        if m := re.fullmatch(r"K(\d+)-ref", name):
            refs[int(m[1])] = results
        elif m := re.fullmatch(r"K(\d+)-lr([\d.]+)-m([\d.]+)", name):
            points[(int(m[1]), float(m[2]), float(m[3]))] = results
    return refs, points


def table(refs: dict, points: dict) -> tuple[str, list[dict]]:
    lines, rows = [], []
    for k in sorted({k for k, _, _ in points}):
        if k not in refs:
            continue
        alone_runs, dp_runs = refs[k]["alone"], refs[k]["data-parallel"]
        alone, dp = statistics.mean(r.final for r in alone_runs), statistics.mean(r.final for r in dp_runs)
        alone_tokens = tokens_to_reach(mean_curve(alone_runs), alone)
        lines.append(f"K = {k}: alone {alone:.4f}, data parallel {dp:.4f} "
                     f"(speedup {alone_tokens / tokens_to_reach(mean_curve(dp_runs), alone):.2f}x)")
        header = "  ".join(f"{row + ' (gap, speedup)':>36}" for row in ROWS)
        lines.append(f"  {'outer lr':>8} {'momentum':>8}  {header}")
        for (kk, lr, m), results in sorted(points.items()):
            if kk != k:
                continue
            cells = []
            for row in ROWS:
                runs = results.get(row)
                if not runs:
                    cells.append(f"{'-':>36}")
                    continue
                final = statistics.mean(r.final for r in runs)
                reached = tokens_to_reach(mean_curve(runs), alone)
                speedup = alone_tokens / reached if reached else None
                gap = (alone - final) / (alone - dp)
                rows.append({"K": k, "outer_lr": lr, "outer_momentum": m, "row": row, "final": final,
                             "gap_closed": gap, "speedup": speedup, "alone": alone, "data_parallel": dp})
                cells.append(f"{final:>12.4f} ({gap:>5.0%}, {f'{speedup:.2f}x' if speedup else '-':>6})      ")
            lines.append(f"  {lr:>8} {m:>8}  " + "  ".join(cells))
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the sweep's output folder (sweep.sh's OUT)")
    args = parser.parse_args()
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    text, rows = table(*load(args.folder))
    print(text)
    (args.folder / "sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
