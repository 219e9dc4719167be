"""Tabulate the outer step against the group size on the long horizon (issue 32): per K and per outer-step setting,
every seed's final eval loss of blocking DiLoCo (``none/none``) and of the default (``delayed/adaptive``), their
mean, the share of the gap between one worker alone and per-step data parallel it closes, and the speedup to alone's
final loss (alone's tokens over the row's, on the seeds' mean curves, at equal compute per worker).

    python benchmarks/outer_long.py --out benchmarks/results/outer-long \\
        --ref 4=benchmarks/results/quality-tiny-seeds \\
        --point "4:lr 0.7=benchmarks/results/quality-tiny-seeds" \\
        --point "4:lr 1.0=benchmarks/results/quality-tiny-k4-lr1.0,benchmarks/results/quality-tiny-k4-lr1.0-s12"

A ``--ref K=DIR`` is a ``benchmarks/quality.py`` run (``DIR/quality.json``) with the ``alone`` and ``data-parallel``
rows of that K (the outer step does not touch them); a ``--point K:LABEL=DIR[,DIR...]`` is one setting, its seeds
gathered from one or more runs of the same setting (a seed found twice must agree, or the script stops). Writes
``report.txt`` and ``outer_long.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from outer_sweep import ROWS, Run  # noqa: E402
from quality import mean_curve, tokens_to_reach  # noqa: E402


def read_runs(folders: list[Path], parser) -> dict[str, dict[int, Run]]:
    """Row -> seed -> run, gathered from the folders' quality.json."""
    rows: dict[str, dict[int, Run]] = {}
    for folder in folders:
        path = folder / "quality.json"
        try:
            results = json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError) as e:
            parser.error(f"cannot read {path}: {e}")
        for row, raws in results.items():
            for raw in raws:
                run = Run(raw)
                seen = rows.setdefault(row, {}).get(run.seed)
                if seen is not None and seen.final != run.final:
                    parser.error(f"{row} seed {run.seed}: {seen.final} in one run, {run.final} in {path}")
                rows[row][run.seed] = run
    return rows


def references(ref: dict[str, dict[int, Run]], seeds: list[int]) -> tuple[float, float, float, float]:
    """Alone's and data parallel's mean final loss on ``seeds``, alone's tokens to its own final loss and data
    parallel's speedup to it: a point is measured against the references of its own seeds."""
    alone_runs, dp_runs = [ref["alone"][s] for s in seeds], [ref["data-parallel"][s] for s in seeds]
    alone = statistics.mean(r.final for r in alone_runs)
    alone_tokens = tokens_to_reach(mean_curve(alone_runs), alone)
    return (alone, statistics.mean(r.final for r in dp_runs), alone_tokens,
            alone_tokens / tokens_to_reach(mean_curve(dp_runs), alone))


def parse_point(text: str, parser) -> tuple[int, str, list[Path]]:
    try:
        where, folders = text.rsplit("=", 1)
        k, label = where.split(":", 1)
        return int(k), label.strip(), [Path(f) for f in folders.split(",") if f]
    except ValueError:
        parser.error(f"--point {text!r}: expected K:LABEL=DIR[,DIR...]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", action="append", default=[], metavar="K=DIR",
                        help="a run with the alone and data-parallel rows of K workers")
    parser.add_argument("--point", action="append", default=[], metavar="K:LABEL=DIR[,DIR...]",
                        help="one outer-step setting at K workers, its seeds from one or more runs")
    parser.add_argument("--out", type=Path, required=True, help="where report.txt and outer_long.json go")
    args = parser.parse_args()
    refs = {}
    for text in args.ref:
        k, _, folder = text.partition("=")
        if not k.isdigit() or not folder:
            parser.error(f"--ref {text!r}: expected K=DIR")
        runs = read_runs([Path(folder)], parser)
        if "alone" not in runs or "data-parallel" not in runs:
            parser.error(f"--ref {text!r}: {folder} has no alone and data-parallel rows")
        refs[int(k)] = runs
    lines = [f"# {' '.join(sys.argv)}", "# per seed: the final eval loss; mean: of the seeds; gap: (alone - row) / "
             "(alone - data-parallel); speedup: alone's tokens to its final loss over the row's (mean curves); "
             "alone and data parallel on the row's own seeds"]
    table = []
    points = [parse_point(p, parser) for p in args.point]
    for k in sorted({k for k, _, _ in points}):
        if k not in refs:
            parser.error(f"K = {k} has points but no --ref")
        lines.append(f"K = {k}: the references on the point's own seeds (alone, data parallel and its speedup)")
        for kk, label, folders in points:
            if kk != k:
                continue
            runs = read_runs(folders, parser)
            for row in ROWS:
                by_seed = runs.get(row, {})
                if not by_seed:
                    continue
                seeds = sorted(by_seed)
                missing = [s for s in seeds if s not in refs[k]["alone"] or s not in refs[k]["data-parallel"]]
                if missing:
                    parser.error(f"K = {k} {label}: the --ref run has no alone or data-parallel row of seeds {missing}")
                alone, dp, alone_tokens, dp_speedup = references(refs[k], seeds)
                final = statistics.mean(by_seed[s].final for s in seeds)
                reached = tokens_to_reach(mean_curve([by_seed[s] for s in seeds]), alone)
                speedup = alone_tokens / reached if reached else None
                gap = (alone - final) / (alone - dp)
                table.append({"K": k, "setting": label, "row": row, "seeds": seeds,
                              "finals": [by_seed[s].final for s in seeds], "mean": final, "gap_closed": gap,
                              "speedup": speedup, "alone": alone, "data_parallel": dp,
                              "data_parallel_speedup": dp_speedup})
                per_seed = " ".join(f"{by_seed[s].final:.4f}" for s in seeds)
                lines.append(f"  {label:<24} {row:<17} seeds {','.join(map(str, seeds)):<6} {per_seed:<21} "
                             f"mean {final:.4f}  gap {gap:4.0%}  speedup "
                             f"{f'{speedup:.2f}x' if speedup else '-':<6} (alone {alone:.4f}, data parallel "
                             f"{dp:.4f}, {dp_speedup:.2f}x)")
    args.out.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines) + "\n"
    (args.out / "report.txt").write_text(text)
    (args.out / "outer_long.json").write_text(json.dumps(table, indent=1))
    print(text, end="")


if __name__ == "__main__":
    main()
