"""Overhead of a p2p-diloco peer against a bare PyTorch training loop of the same model and batch.

Side by side in one run, alternating A/B/A/B so that the noise of a shared machine hits both:
- bare: a plain loop (sampler -> forward -> loss -> backward -> clip_grad_norm_ -> AdamW step), nothing else;
- peer: a real `p2p-diloco peer` process, alone in its swarm, with one round of large H: DHT node, averager
  process, metrics, progress records, the pseudo-gradient, the outer step and a checkpoint are all live.
Both run in their own process with the same number of torch threads. Throughput is measured after a warm-up
of W steps up to the end of training (for the peer: including the end of the round and its outer step).

    python benchmarks/overhead.py                  # tiny preset, 3 repeats
    python benchmarks/overhead.py --preset small --steps 150
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def bare_loop(args: argparse.Namespace) -> float:
    """Tokens/s of the bare loop (runs in a child process)."""
    import torch

    from p2p_diloco.config import load_config
    from p2p_diloco.data import ShardDataset, WindowSampler, resolve_data_path
    from p2p_diloco.model import Transformer, loss_fn, model_args_from_config

    torch.set_num_threads(args.threads)
    cfg = load_config(None, [("model.preset", args.preset)])
    dataset = ShardDataset(resolve_data_path(cfg.data), "train")
    model_args = model_args_from_config(cfg.model, dataset.vocab_size)
    model = Transformer(model_args)
    seq_len = args.seq_len or model_args.max_seq_len
    sampler = WindowSampler(dataset, seq_len, args.batch_size, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    start = None
    for step in range(args.steps):
        if step == args.warmup:
            start = time.perf_counter()
        x, y = sampler.next_batch()
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    return (args.steps - args.warmup) * args.batch_size * seq_len / elapsed


def peer_run(args: argparse.Namespace, workdir: Path, index: int) -> float:
    """Tokens/s of a real peer process, from its metrics file (warm-up excluded, round end included)."""
    out = workdir / f"peer{index}"
    seq_len = args.seq_len or _preset_seq_len(args.preset)
    cmd = [sys.executable, "-m", "p2p_diloco", "peer", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
           "--output-dir", str(out), "--run-id", f"overhead{index}", "--model.preset", args.preset,
           "--data.batch_size", str(args.batch_size), "--data.seq_len", str(seq_len),
           "--diloco.inner_steps", str(args.steps), "--train.num_rounds", "1", "--train.log_every", str(args.warmup),
           "--train.eval_every_rounds", "0", "--data.eval_batches", "0", "--train.progress", "false",
           "--run.num_threads", str(args.threads), "--checkpoint.every_rounds", "1"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    events = [json.loads(line) for line in open(out / "metrics-stage0.jsonl")]
    warm = next(e for e in events if e["kind"] == "step" and e["inner_step"] == args.warmup)
    round_end = next(e for e in events if e["kind"] == "round")
    return (args.steps - args.warmup) * args.batch_size * seq_len / (round_end["time"] - warm["time"])


def _preset_seq_len(preset: str) -> int:
    from p2p_diloco.model import PRESETS

    return PRESETS[preset]["max_seq_len"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=400, help="inner steps per run (= H of the peer's one round)")
    parser.add_argument("--warmup", type=int, default=20, help="steps excluded from the measurement")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the preset's max_seq_len")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        print(json.dumps({"tokens_per_s": bare_loop(args)}))
        return

    bare, peer = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            result = subprocess.run([sys.executable, __file__, "--bare", *sys.argv[1:]], check=True,
                                    capture_output=True, text=True)
            bare.append(json.loads(result.stdout.strip().splitlines()[-1])["tokens_per_s"])
            peer.append(peer_run(args, Path(tmp), i))
            print(f"repeat {i}: bare {bare[-1]:,.0f} tok/s, peer {peer[-1]:,.0f} tok/s, "
                  f"ratio {peer[-1] / bare[-1]:.3f}", flush=True)
    pair_ratio = statistics.median(p / b for p, b in zip(peer, bare))
    print(f"preset={args.preset} batch={args.batch_size} steps={args.steps} threads={args.threads}")
    print(f"median bare loop: {statistics.median(bare):,.0f} tokens/s")
    print(f"median peer:      {statistics.median(peer):,.0f} tokens/s")
    print(f"peer / bare:      {statistics.median(peer) / statistics.median(bare):.3f} (ratio of medians), "
          f"{pair_ratio:.3f} (median of the {args.repeats} side-by-side pairs)  (target >= 0.97)")


if __name__ == "__main__":
    main()
