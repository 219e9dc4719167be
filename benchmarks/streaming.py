"""Streaming sync in real peers: the bytes in flight, all at once against staggered, at equal tokens.

Two peers of different pipeline splits (P = 1 and P = 2) and a bootstrap node on 127.0.0.1, real processes, a run
averaged by fragment (``diloco.fragments F``, the default mode and compression), twice with the same seeds: all at
once (``diloco.streaming false``) and staggered (``true``). From each peer's metrics: every averaging (one fragment's
round) is an interval on the wall clock, from its round end (the row of that round) to its end (``averaging_s``
later, on the row that applied it), with the bytes the peer sent for it. The table gives, per run:

- peak bytes in flight: the most bytes of averagings whose intervals overlap at one moment (the intervals are
  sampled every 10 ms; the bytes of an averaging count for its whole interval), the largest over the peers;
- mean payload per averaging and the peer's bytes over the run;
- wall time, rounds averaged / all fragment-rounds, and the final eval loss of the anchor (equal tokens: same
  rounds, steps and batch).

On loopback every averaging lasts a few seconds of matchmaking, so with short rounds the staggered averagings still
overlap; ``--h`` sets how far apart they start (H / F steps). This is not the 10 Mbit/s wire measurement
(``benchmarks/wan.py`` has no per-link byte counter over time yet).

    .venv/bin/python benchmarks/streaming.py --fragments 3 --h 48 --rounds 6 --out runs/streaming
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
        "--train.eval_every_rounds", "0", "--checkpoint.every_rounds", "0", "--microbatches", "2"]
AVERAGING = ["--averaging.matchmaking_time_s", "4", "--averaging.request_timeout_s", "3",
             "--averaging.round_timeout_s", "20", "--averaging.allreduce_timeout_s", "20",
             "--averaging.next_chunk_timeout_s", "10"]
PEERS = {"p1": ["--stages", "1"], "p2": ["--stages", "2"]}


def run_swarm(out: Path, args, streaming: bool) -> dict:
    """One swarm of the two peers to its end; the averagings of each peer."""
    out.mkdir(parents=True, exist_ok=True)
    bootstrap, maddrs = start_bootstrap(out, log=open(out / "bootstrap.log", "w"), start_new_session=True, cwd=ROOT)
    procs = {}
    started = time.monotonic()
    try:
        for i, (name, split) in enumerate(PEERS.items()):
            command = [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *maddrs,
                       "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", "streaming", "--output-dir",
                       str(out / name), "--train.num_rounds", str(args.rounds), "--diloco.inner_steps", str(args.h),
                       "--diloco.fragments", str(args.fragments), "--diloco.streaming", str(streaming).lower(),
                       "--train.wait_for_peers", str(len(PEERS)), "--data.seed", str(args.seed + i),
                       *split, *TINY, *AVERAGING]
            (out / name).mkdir(parents=True, exist_ok=True)
            log = open(out / name / "console.log", "w")
            procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           cwd=ROOT)
        for proc in procs.values():
            proc.wait(timeout=args.timeout_s)
    finally:
        for proc in [*procs.values(), bootstrap]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall_s = time.monotonic() - started
    failed = [name for name, proc in procs.items() if proc.returncode != 0]
    if failed:
        raise SystemExit(f"{out}: peers {failed} failed; see their console.log")
    peers = {}
    for name, split in PEERS.items():
        stages = int(split[1])
        rows = [e for s in range(stages) for e in read_metrics(out / name / f"metrics-stage{s}.jsonl")
                if e["kind"] == "round"]
        ends = {(e["fragment"], e["round_index"]): e["time"] for e in rows if not e["flush"]}
        averagings = []
        for e in rows:
            if e["applied_round"] is None:
                continue
            start = ends.get((e["fragment"], e["applied_round"]))
            if start is not None:
                averagings.append({"fragment": e["fragment"], "round": e["applied_round"], "start": start,
                                   "end": start + e["averaging_s"], "bytes": e["bytes_sent"],
                                   "averaged": e["averaged"]})
        summary = json.loads((out / name / f"summary-stage{stages - 1}.json").read_text())
        peers[name] = {"averagings": averagings, "eval_loss_final": summary["eval_loss_final"],
                       "bytes_sent": sum(a["bytes"] for a in averagings)}
    return {"streaming": streaming, "wall_s": wall_s, "peers": peers}


def peak_in_flight(averagings: list[dict], step_s: float = 0.01) -> int:
    """The most bytes of averagings in flight at one moment (each counted over its whole interval)."""
    if not averagings:
        return 0
    t, end, peak = min(a["start"] for a in averagings), max(a["end"] for a in averagings), 0
    while t <= end:
        peak = max(peak, sum(a["bytes"] for a in averagings if a["start"] <= t <= a["end"]))
        t += step_s
    return peak


def report(results: list[dict], args) -> str:
    lines = [f"Streaming sync in real peers: a P = 1 and a P = 2 peer, tiny model, F = {args.fragments}, H = {args.h}, "
             f"{args.rounds} rounds, seeds {args.seed}, {args.seed + 1}; the default mode and compression", "",
             f"{'schedule':<12} {'peak in flight':>15} {'mean payload':>13} {'bytes sent':>11} {'averaged':>9} "
             f"{'wall':>7} {'eval loss':>10}"]
    base = None
    for result in results:
        averagings = [a for p in result["peers"].values() for a in p["averagings"]]
        peak = max(peak_in_flight(p["averagings"]) for p in result["peers"].values())
        mean = sum(a["bytes"] for a in averagings) / max(1, len(averagings))
        sent = max(p["bytes_sent"] for p in result["peers"].values())
        done = sum(a["averaged"] for a in averagings)
        loss = result["peers"]["p1"]["eval_loss_final"]
        name = "staggered" if result["streaming"] else "all at once"
        lines.append(f"{name:<12} {peak / 1e6:>12.3f} MB {mean / 1e6:>10.3f} MB {sent / 1e6:>8.2f} MB "
                     f"{done:>4}/{len(averagings):<4} {result['wall_s']:>6.0f}s {loss:>10.4f}")
        if base is None:
            base = (peak, loss)
        else:
            lines.append(f"staggered / all at once: peak in flight {base[0] / max(1, peak):.2f}x lower, eval loss "
                         f"{100 * (loss - base[1]) / base[1]:+.2f}%")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fragments", type=int, default=3, help="diloco.fragments F (>= 2)")
    parser.add_argument("--h", type=int, default=48, help="inner steps per round (>= F)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0, help="data seed of the first peer (the second: + 1)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="stop a swarm still running after this long")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("streaming-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    if args.fragments < 2 or args.h < args.fragments:
        parser.error("--fragments must be >= 2 and --h >= --fragments (one fragment per step at most)")
    results = []
    for streaming in (False, True):
        print(f"running {'staggered' if streaming else 'all at once'} ...", flush=True)
        results.append(run_swarm(args.out / ("staggered" if streaming else "all-at-once"), args, streaming))
    text = report(results, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.txt").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
