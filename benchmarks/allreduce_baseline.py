"""Vanilla data-parallel training: every step all-reduces the fp32 gradients with torch.distributed (gloo).

The baseline the WAN benchmark compares DiLoCo against: the same model, data, inner AdamW, schedule and
clipping as a p2p-diloco peer (it reuses the peer's Stage for the optimizer step), but no local steps:
each worker's gradient is averaged over the network before every step (global batch = workers x batch).
One worker process per host; writes a JSON result: throughput, final eval loss, and two curves on a training
clock (seconds since the start of training, the time spent evaluating taken out):
- "curve": (seconds, step, train loss averaged over the workers) after every step;
- "eval_curve": (seconds, tokens per worker, eval loss) at step 0, every --eval-every steps and after the last
  step, on the same held-out batches as a peer's evaluation (data.eval_batches of them, evenly spaced); the
  seconds are those when the evaluation began. Every worker evaluates (the models are identical), so no
  worker's evaluation shows up as another's wait in the next all-reduce.

    python benchmarks/allreduce_baseline.py --rank 0 --world 2 --master-addr 10.88.0.1 --out r0.json \\
        --steps 100 --eval-every 40 -- --model.dim 256 --data.batch_size 8 ...
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, default=29611)
    parser.add_argument("--ifname", help="network interface for gloo (GLOO_SOCKET_IFNAME)")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps to run")
    parser.add_argument("--total-steps", type=int, help="length of the lr schedule (default: --steps)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every this many steps (and at step 0 and after the last step); "
                             "0: only after the last step")
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("overrides", nargs="*", help="--section.field value config overrides, after --")
    args = parser.parse_args()

    from p2p_diloco.config import load_config, split_overrides

    cfg = load_config(None, split_overrides(args.overrides))
    if args.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
    torch.set_num_threads(cfg.run.num_threads or 1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=600))
    try:
        result = train(cfg, args)
    finally:
        dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(result, f)


def train(cfg, args) -> dict:
    from p2p_diloco.data import ShardDataset, WindowSampler, eval_batches, resolve_data_path
    from p2p_diloco.model import Transformer, model_args_from_config
    from p2p_diloco.training import LocalExecutor, Stage

    path = resolve_data_path(cfg.data)
    train_split, eval_split = ShardDataset(path, "train"), ShardDataset(path, "eval")
    model = Transformer(model_args_from_config(cfg.model, train_split.vocab_size))
    seq_len = cfg.data.seq_len or model.args.max_seq_len
    stage = Stage(model, stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                  total_steps=args.total_steps or args.steps)
    executor = LocalExecutor(model, torch.device("cpu"))
    sampler = WindowSampler(train_split, seq_len, cfg.data.batch_size, seed=(cfg.data.seed or 0) + args.rank)
    held_out = eval_batches(eval_split, seq_len, cfg.data.batch_size, cfg.data.eval_batches) \
        if cfg.data.eval_batches else []
    tokens_per_step = cfg.data.batch_size * seq_len
    curve, eval_curve, train_s, eval_s = [], [], 0.0, 0.0
    started = time.monotonic()

    def evaluate(step: int) -> float | None:
        """Eval loss now, on the clock as of before the evaluation (its time is taken out of every later point)."""
        nonlocal eval_s
        if not held_out:
            return None
        clock = time.monotonic() - started - eval_s
        t0 = time.monotonic()
        loss = executor.evaluate(held_out)
        eval_s += time.monotonic() - t0
        eval_curve.append((clock, step * tokens_per_step, loss))
        return loss

    eval_loss = evaluate(0)
    for step in range(args.steps):
        t0 = time.monotonic()
        loss = executor.forward_backward(*sampler.next_batch())
        flat = torch.cat([p.grad.reshape(-1) for p in stage.params])  # (num_params,) fp32
        dist.all_reduce(flat)
        flat /= args.world
        offset = 0
        for p in stage.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        stage.inner_update(torch.linalg.vector_norm(stage.grad_norms(), 2))
        train_s += time.monotonic() - t0
        loss_tensor = torch.tensor([loss])
        dist.all_reduce(loss_tensor)
        curve.append((time.monotonic() - started - eval_s, step + 1, float(loss_tensor) / args.world))
        if step + 1 == args.steps or (args.eval_every and (step + 1) % args.eval_every == 0):
            eval_loss = evaluate(step + 1)
    tokens = args.steps * tokens_per_step
    return {"rank": args.rank, "steps": args.steps, "tokens": tokens, "train_s": train_s,
            "tokens_per_s": tokens / train_s, "eval_loss": eval_loss, "curve": curve,
            "eval_curve": eval_curve, "eval_s": eval_s,
            "bytes_per_step": 4 * sum(p.numel() for p in stage.params)}


if __name__ == "__main__":
    main()
