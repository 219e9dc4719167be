"""Tokens per worker that runs of ``benchmarks/quality.py`` need to reach a target eval loss: another run's mean
final loss (the former default's, one worker alone's). Each run's seeds are averaged into one curve and the tokens
are read off it as ``quality.py`` reads its "tokens to alone's loss" (linear between the curve's points).

    python benchmarks/tokens_to_loss.py --target benchmarks/results/quality-tiny-k4-h20:delayed/adaptive \\
        --run "merge at 1=benchmarks/results/quality-tiny-k4-h20-ov1:delayed/adaptive"

``--target DIR[,DIR...]:ROW`` and ``--run LABEL=DIR[,DIR...]:ROW`` read ``DIR/quality.json``; a row's seeds are
gathered from all its folders. Prints, per run, its mean final loss, the tokens to the target, the target run's own
tokens over them (its speedup) and the share of tokens saved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import RowResult, mean_curve, tokens_to_reach  # noqa: E402


def read_row(spec: str, parser) -> list[RowResult]:
    """``DIR[,DIR...]:ROW`` -> the row's results of every seed, from every folder."""
    folders, sep, row = spec.rpartition(":")
    if not sep or not folders or not row:
        parser.error(f"{spec!r}: expected DIR[,DIR...]:ROW")
    runs = []
    for folder in folders.split(","):
        path = Path(folder) / "quality.json"
        try:
            results = json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"cannot read {path}: {e}")
        if row not in results:
            parser.error(f"{path} has no row {row!r} (it has {', '.join(results)})")
        runs += [RowResult(**raw) for raw in results[row]]
    return runs


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, metavar="DIR[,DIR...]:ROW",
                        help="the run whose mean final eval loss is the target")
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=DIR[,DIR...]:ROW")
    args = parser.parse_args(argv)
    target_runs = read_row(args.target, parser)
    target = statistics.mean(r.final for r in target_runs)
    own = tokens_to_reach(mean_curve(target_runs), target)
    lines = [f"target: {args.target}, mean final eval loss {target:.4f} over seeds "
             f"{sorted(r.seed for r in target_runs)}, reached at {own:,.0f} tokens per worker"]
    for text in args.run:
        label, sep, spec = text.partition("=")
        if not sep:
            parser.error(f"--run {text!r}: expected LABEL=DIR[,DIR...]:ROW")
        runs = read_row(spec, parser)
        reached = tokens_to_reach(mean_curve(runs), target)
        final = statistics.mean(r.final for r in runs)
        gain = f"{own / reached:.3f}x, {1 - reached / own:+.1%} tokens saved" if reached else "never reached"
        lines.append(f"{label}: final {final:.4f} (seeds {sorted(r.seed for r in runs)}), to the target "
                     f"{f'{reached:,.0f}' if reached else '-'} tokens per worker ({gain})")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
