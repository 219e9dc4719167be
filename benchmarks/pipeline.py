"""Pipeline-parallel peer against a single-process peer: throughput and per-stage memory, side by side.

Runs real `p2p-diloco peer` processes, alone in their swarms, with the same model, batch, data and H:
P=1, then P=2 (GPipe and 1F1B), alternating, and reports
- tokens/s of each (on CPU this is informational: the stages share the same 2 cores);
- per stage process: bytes of parameters + inner AdamW state + outer state (anchor, momentum), against P=1
  (target: about 1/P each), and the peak RSS of each process.

    python benchmarks/pipeline.py                       # small preset
    python benchmarks/pipeline.py --preset tiny --steps 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 1e6


def run_peer(workdir: Path, name: str, args: argparse.Namespace, extra: list[str]) -> dict:
    out = workdir / name
    cmd = [sys.executable, "-m", "p2p_diloco", "peer", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--output-dir",
           str(out), "--run-id", name, "--model.preset", args.preset, "--data.batch_size", str(args.batch_size),
           "--data.seq_len", str(args.seq_len), "--diloco.inner_steps", str(args.steps), "--train.num_rounds", "1",
           "--train.log_every", str(args.warmup), "--train.eval_every_rounds", "0", "--data.eval_batches", "0",
           "--train.progress", "false", "--microbatches", str(args.microbatches), "--data.seed", "1", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stages = sorted(out.glob("summary-stage*.json"))
    summaries = [json.loads(p.read_text()) for p in stages]
    last_metrics = [json.loads(line) for line in open(out / f"metrics-stage{len(stages) - 1}.jsonl")]
    warm = next(e for e in last_metrics if e["kind"] == "step" and e["inner_step"] == args.warmup)
    end = next(e for e in last_metrics if e["kind"] == "round")
    tokens_per_s = (args.steps - args.warmup) * args.batch_size * args.seq_len / (end["time"] - warm["time"])
    return {"tokens_per_s": tokens_per_s, "stages": summaries}


def state_mb(summary: dict) -> float:
    return sum(summary["state_bytes"].values()) / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    configs = {"P=1": ["--stages", "1"], "P=2 gpipe": ["--stages", "2", "--schedule", "gpipe"],
               "P=2 1f1b": ["--stages", "2", "--schedule", "1f1b"]}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, extra in configs.items():
                tag = name.replace("=", "").replace(" ", "-")
                results[name].append(run_peer(Path(tmp), f"{tag}-{repeat}", args, extra))
                print(f"repeat {repeat} {name}: {results[name][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)

    base_tps = statistics.median(r["tokens_per_s"] for r in results["P=1"])
    base_state = state_mb(results["P=1"][0]["stages"][0])
    print(f"\npreset={args.preset} batch={args.batch_size}x{args.seq_len} microbatches={args.microbatches} "
          f"H={args.steps}")
    print(f"{'config':<10} {'tokens/s':>10} {'vs P=1':>7}   per stage: params+optimizer state (vs P=1), peak RSS")
    for name, runs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        stages = ", ".join(f"stage{s['stage']} {state_mb(s):,.1f} MB ({state_mb(s) / base_state:.2f}), "
                           f"RSS {s['max_rss_mb']:,.0f} MB" for s in runs[0]["stages"])
        print(f"{name:<10} {tps:>10,.0f} {tps / base_tps:>7.2f}   {stages}")


if __name__ == "__main__":
    main()
