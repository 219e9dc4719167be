"""The heterogeneity benchmark: a swarm whose peers train at different speeds.

3 tiny peers and a bootstrap node on 127.0.0.1, real processes, the default mode; each peer is slowed to a
speed (``train.slowdown`` = 1 / speed: it sleeps after each inner step). For each speed set, two swarms:

- ``swarm`` (``diloco.round_end = swarm``, the default): a round ends when the first peer has trained its H
  steps; slower peers end it then, with the steps they trained, weighted by their tokens;
- ``steps`` (``diloco.round_end = steps``, the old rule): every peer trains H steps, so a slower peer reaches
  each round end late (missing its group, falling back, reloading);

and a homogeneous swarm (every peer at speed 1) as the reference. Eval loss of the anchor after every round
(the same held-out batches on every peer) is read against the swarm's total tokens so far: the table compares
each run's final eval loss with the homogeneous swarm's at the same total tokens (interpolated between its
rounds; the homogeneous swarm trains 2 rounds more, so that its curve covers the others), and gives the
averaged rounds, fallbacks, reloads, each peer's tokens and the swarm's wall-clock time (evaluation included).

    .venv/bin/python benchmarks/hetero.py --speeds 1,1,0.5 1,0.5,0.25 --out runs/hetero
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_bootstrap import start_bootstrap  # noqa: E402

from p2p_diloco.training.metrics import read_metrics  # noqa: E402

TINY = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "64", "--data.eval_batches", "16",
        "--train.log_every", "10", "--train.progress", "false", "--run.num_threads", "1",
        "--train.eval_every_rounds", "1", "--checkpoint.every_rounds", "0"]
AVERAGING = ["--averaging.request_timeout_s", "2", "--averaging.round_timeout_s", "15",
             "--averaging.allreduce_timeout_s", "15", "--averaging.next_chunk_timeout_s", "5"]


def run_swarm(out: Path, args, speeds: list[float], round_end: str, rounds: int) -> dict:
    """One swarm to its end; its per-round curve and per-peer summaries."""
    out.mkdir(parents=True, exist_ok=True)
    bootstrap, maddrs = start_bootstrap(out, log=open(out / "bootstrap.log", "w"), start_new_session=True, cwd=ROOT)
    names = [f"peer{i}" for i in range(len(speeds))]
    procs = []
    started = time.monotonic()
    try:
        for name, speed in zip(names, speeds):
            (out / name).mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *maddrs,
                       "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", "hetero", "--output-dir", str(out / name),
                       "--train.num_rounds", str(rounds), "--diloco.inner_steps", str(args.h),
                       "--train.wait_for_peers", str(len(speeds)), "--diloco.round_end", round_end,
                       "--train.slowdown", str(1 / speed), "--averaging.matchmaking_time_s", str(args.matchmaking_s),
                       *TINY, *AVERAGING]
            log = open(out / name / "console.log", "w")
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          cwd=ROOT))
        for proc in procs:
            proc.wait(timeout=args.timeout_s)
    finally:
        for proc in [*procs, bootstrap]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall_s = time.monotonic() - started
    failed = [name for name, proc in zip(names, procs) if proc.returncode != 0]
    if failed:
        raise SystemExit(f"{out}: peers {failed} failed; see their console.log")
    summaries = {name: json.loads((out / name / "summary-stage0.json").read_text()) for name in names}
    # per round: the swarm's total tokens so far and the eval loss of the anchor after it (peer0's; every peer holds
    # the same anchor when the rounds were averaged)
    tokens_by_round: dict[int, int] = {}
    for name in names:
        for e in read_metrics(out / name / "metrics-stage0.jsonl"):
            if e["kind"] == "round" and not e["flush"]:
                tokens_by_round[e["round_index"]] = tokens_by_round.get(e["round_index"], 0) + e["tokens"]
    evals = {e["round"]: e["eval_loss"] for e in read_metrics(out / "peer0" / "metrics-stage0.jsonl")
             if e["kind"] == "eval" and e["eval_loss"] is not None}
    curve, total = [(0, summaries["peer0"]["eval_loss_start"])], 0
    for r in range(rounds):
        total += tokens_by_round.get(r, 0)
        if r + 1 in evals:
            curve.append((total, evals[r + 1]))
    return {"speeds": speeds, "round_end": round_end, "wall_s": wall_s, "curve": curve,
            "final_tokens": sum(s["tokens"] for s in summaries.values()),
            "final_eval_loss": summaries["peer0"]["eval_loss_final"],
            "peers": {name: {k: s[k] for k in ("tokens", "averaged_rounds", "fallback_rounds", "reloads", "resyncs",
                                                "eval_loss_final")} for name, s in summaries.items()}}


def loss_at(curve: list[tuple[int, float]], tokens: float) -> float | None:
    """The eval loss of a curve at ``tokens`` (linear between its points; None outside them)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / max(t1 - t0, 1)
    return None


def report(results: list[dict], args) -> str:
    reference = next(r for r in results if all(s == 1 for s in r["speeds"]))
    lines = [f"{len(reference['speeds'])} peers, H = {args.h}, {args.rounds} rounds, tiny model, delayed mode, "
             f"matchmaking {args.matchmaking_s:g} s; eval loss of the anchor after the last round, against the "
             "homogeneous swarm's at the same total tokens", "",
             "speeds        round end  wall s  total tokens  eval loss  homogeneous at same tokens  vs homogeneous  "
             "averaged  fallbacks  reloads+resyncs  tokens per peer"]
    for r in results:
        homogeneous = loss_at(reference["curve"], r["final_tokens"])
        versus = f"{100 * (r['final_eval_loss'] / homogeneous - 1):+.2f}%" if homogeneous else "n/a"
        peers = r["peers"].values()
        per_peer = " ".join(f"{p['tokens']:,}" for p in peers)
        at_same = "n/a" if homogeneous is None else f"{homogeneous:.4f}"
        lines.append(
            f"{':'.join(f'{s:g}' for s in r['speeds']):<13} {r['round_end']:<10} {r['wall_s']:>6.0f}  "
            f"{r['final_tokens']:>12,}  "
            f"{r['final_eval_loss']:.4f}     {at_same:<26}  "
            f"{versus:>14}  {sum(p['averaged_rounds'] for p in peers):>8}  "
            f"{sum(p['fallback_rounds'] for p in peers):>9}  {sum(p['reloads'] + p['resyncs'] for p in peers):>15}  "
            f"{per_peer}")
    lines += ["", "averaged / fallbacks: applied rounds summed over the peers (every peer applies every round once)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speeds", nargs="+", default=["1,1,0.5", "1,0.5,0.25"],
                        help="speed sets, one per swarm: comma-separated speeds in (0, 1], one per peer")
    parser.add_argument("--round-ends", nargs="+", default=["swarm", "steps"], choices=["swarm", "steps"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--h", type=int, default=50, help="inner steps per round (of the fastest peer)")
    parser.add_argument("--matchmaking-s", type=float, default=5.0)
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="give up on a swarm after this long")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("hetero-%Y%m%d-%H%M%S"))
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from <out>/hetero.json (same --h, --rounds) without running swarms")
    args = parser.parse_args()
    if args.report_only:
        text = report(json.loads((args.out / "hetero.json").read_text()), args)
        (args.out / "hetero_report.txt").write_text(text + "\n")
        print(text)
        return
    speed_sets = []
    for text in args.speeds:
        try:
            speeds = [float(x) for x in text.split(",")]
        except ValueError:
            parser.error(f"--speeds: {text!r} is not a comma-separated list of numbers")
        if not all(0 < s <= 1 for s in speeds) or len(speeds) < 2:
            parser.error(f"--speeds: {text!r} needs at least 2 speeds, each in (0, 1]")
        speed_sets.append(speeds)
    num_peers = len(speed_sets[0])
    if any(len(s) != num_peers for s in speed_sets):
        parser.error("--speeds: every set needs the same number of peers")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [([1.0] * num_peers, "swarm")] + [(s, e) for s in speed_sets for e in args.round_ends]
    results = []
    for speeds, round_end in runs:
        name = f"{'-'.join(f'{s:g}' for s in speeds)}_{round_end}"
        print(f"[hetero] {name} ...", flush=True)
        # the homogeneous swarm trains 2 rounds more, so that its curve covers every other run's tokens
        rounds = args.rounds + (2 if all(s == 1 for s in speeds) else 0)
        result = run_swarm(args.out / name, args, speeds, round_end, rounds)
        print(f"[hetero] {name}: eval loss {result['final_eval_loss']:.4f} after {result['final_tokens']:,} tokens "
              f"({result['wall_s']:.0f} s)", flush=True)
        results.append(result)
        (args.out / "hetero.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "hetero_report.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
