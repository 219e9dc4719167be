"""How often the robust rule flags an honest part: calm groups of 2, 3 and 4 honest peers, of equal and unequal speed.

Each of K tiny peers trains its own inner AdamW (the inner schedule, warmup included) for the steps its speed allows
in a round that the fastest ends after H steps (``diloco.round_end = swarm``: a peer at a third of the speed ends
the round with a third of the tokens), then the pseudo-gradients are combined as the swarm combines them: weights
are the claimed tokens capped by :func:`~p2p_diloco.swarm.averaging.robust.cap_weights` (the guard names a capped
member ``capped``), the vector is cut into K slices (one per reducer, as the butterfly all-reduce cuts it) and each
slice goes through :func:`~p2p_diloco.swarm.averaging.robust.combine` (a clipped or dropped part is flagged). The
anchors take DiLoCo's outer step (Nesterov) with the combined average. A peer's part of a round counts as flagged
when it is capped or flagged in any slice. No network, no compression: this measures the rule alone.

    python benchmarks/honest_flags.py --out benchmarks/results/honest_flags     # ~10 minutes on 2 busy cores

``--live``: the same groups as real tiny peers on 127.0.0.1 (a bootstrap node, K ``p2p-diloco peer`` processes of
the defaults but for ``--h``, the slower ones with ``--train.slowdown``, all waited for), every part through the
real codecs, all-reduce and guard; a groupmate's part counts as flagged when a peer's ``round`` row names it among
its ``suspects``. ``late`` has no live row (a late peer downloads the swarm's state instead).

    python benchmarks/honest_flags.py --live --rounds 6 --h 60 --speeds equal,third,mixed --out DIR  # ~8 minutes
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from p2p_diloco.config import load_config  # noqa: E402
from p2p_diloco.data import WindowSampler, eval_batches  # noqa: E402
from p2p_diloco.model import build_stage_model, model_args_from_config  # noqa: E402
from p2p_diloco.stage_setup import load_data  # noqa: E402
from p2p_diloco.swarm.averaging.robust import RobustRule, cap_weights, combine  # noqa: E402
from p2p_diloco.training.metrics import read_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_bootstrap import start_bootstrap  # noqa: E402

LIVE_PEER = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "32", "--data.eval_batches", "2",
             "--train.progress", "false", "--run.num_threads", "1", "--checkpoint.every_rounds", "0",
             "--averaging.matchmaking_time_s", "8"]
"""A live peer: the tiny model on the batches of the simulation, one thread (K peers share 2 cores), an 8 s
matchmaking window (a slow peer on a busy machine still reaches the others' group)."""

SPEEDS = {"equal": [1.0, 1.0, 1.0, 1.0], "third": [1.0, 1.0, 1.0, 1 / 3], "mixed": [1.0, 1 / 2, 1 / 3, 1 / 4],
          "late": [1.0, 1.0, 1.0, 1.0]}
"""Relative speeds of peers; a group of K takes the last K (so a pair of ``third`` is a fast and a slow peer).
``late``: equal speeds, but the last peer starts when the others are 80% through round 0 (in the warmup)."""
LATE_START = 0.8


def lr_at(step: int, cfg, total_steps: int) -> float:
    """The inner schedule: linear warmup, then cosine down to lr * min_lr_ratio."""
    inner = cfg.inner
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    progress = min(1.0, (step - inner.warmup_steps) / max(1, total_steps - inner.warmup_steps))
    return inner.lr * (inner.min_lr_ratio + (1 - inner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def run(k: int, speeds: list[float], args, seed: int, late: bool = False) -> dict:
    cfg = load_config(None, [("model.preset", "tiny"), ("diloco.inner_steps", str(args.h))])
    data = load_data(cfg, max_seq_len=args.seq)
    model_args = model_args_from_config(cfg.model, data.train.vocab_size)
    model_args.init_seed = cfg.model.init_seed + seed
    models = [build_stage_model(model_args, [model_args.n_layers], 0) for _ in range(k)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    params = [[p for p in m.parameters() if p.requires_grad] for m in models]
    anchor = torch.cat([p.detach().reshape(-1) for p in params[0]]).clone()
    momentum = torch.zeros_like(anchor)
    optimizers = [torch.optim.AdamW(ps, lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2),
                                    weight_decay=cfg.inner.weight_decay, eps=cfg.inner.eps) for ps in params]
    samplers = [WindowSampler(data.train, args.seq, args.batch, 1000 * seed + i) for i in range(k)]
    rule = RobustRule(outlier_ratio=cfg.averaging.outlier_norm_ratio, clip_ratio=cfg.averaging.clip_ratio)
    steps_done, total_steps = [0] * k, args.rounds * args.h
    flagged_parts, flagged_rounds, reasons = 0, 0, {}
    for r in range(args.rounds):
        claims = []
        for i in range(k):
            num_steps = max(1, round(args.h * speeds[i] / max(speeds)))
            if late and r == 0 and i == k - 1:
                num_steps = max(1, round(num_steps * (1 - LATE_START)))
            for _ in range(num_steps):
                for group in optimizers[i].param_groups:
                    group["lr"] = lr_at(steps_done[i], cfg, total_steps)
                x, y = samplers[i].next_batch()
                loss = torch.nn.functional.cross_entropy(models[i](x).flatten(0, 1), y.flatten())
                optimizers[i].zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params[i], cfg.inner.grad_clip)
                optimizers[i].step()
                steps_done[i] += 1
            claims.append(float(num_steps * args.batch * args.seq))
        deltas = [anchor - torch.cat([p.detach().reshape(-1) for p in ps]) for ps in params]
        weights = cap_weights(claims, cfg.averaging.max_weight_ratio)
        flags = {i: {"capped"} for i in range(k) if weights[i] < claims[i]}
        average = []
        for s in torch.arange(anchor.numel()).tensor_split(k):
            combined = combine([d[s[0]:s[-1] + 1] for d in deltas], weights, rule, claims=claims)
            average.append(combined.average)
            for i, why in combined.flags.items():
                flags.setdefault(i, set()).add(why)
        momentum.mul_(cfg.diloco.outer_momentum).add_(torch.cat(average))
        step = torch.cat(average).add(momentum, alpha=cfg.diloco.outer_momentum) if cfg.diloco.nesterov else momentum
        anchor -= cfg.diloco.outer_lr * step
        for ps in params:
            torch.nn.utils.vector_to_parameters(anchor, ps)
        flagged_parts += len(flags)
        flagged_rounds += bool(flags)
        for why in flags.values():
            for w in why:
                reasons[w] = reasons.get(w, 0) + 1
    with torch.no_grad():  # the final anchor's eval loss (every peer holds it)
        losses = [float(torch.nn.functional.cross_entropy(models[0](x).flatten(0, 1), y.flatten()))
                  for x, y in eval_batches(data.eval, args.seq, args.batch, args.eval_batches)]
    return {"parts": k * args.rounds, "flagged_parts": flagged_parts, "rounds": args.rounds,
            "flagged_rounds": flagged_rounds, "reasons": reasons, "eval_loss": sum(losses) / len(losses)}


def run_live(k: int, speeds: list[float], args, root: Path) -> dict:
    """K real peers, the i-th at ``speeds[i]`` of the fastest; counts the groupmates' parts they flag."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "bootstrap.log", "w") as log:
        bootstrap, maddrs = start_bootstrap(root, log=log)
    procs = []
    try:
        for i, speed in enumerate(speeds):
            slowdown = ["--train.slowdown", f"{max(speeds) / speed:g}"] if speed < max(speeds) else []
            command = [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *maddrs, "--host-maddrs",
                       "/ip4/127.0.0.1/tcp/0", "--run-id", "honest-flags", "--output-dir", str(root / f"p{i}"),
                       "--train.num_rounds", str(args.rounds), "--diloco.inner_steps", str(args.h),
                       "--train.wait_for_peers", str(k), "--run.seed", str(i), *LIVE_PEER, *slowdown]
            with open(root / f"p{i}.log", "w") as log:
                procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        codes = [proc.wait(timeout=1800) for proc in procs]
    finally:
        for proc in [*procs, bootstrap]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    parts = flagged_parts = rounds = flagged_rounds = 0
    reasons: dict[str, int] = {}
    for i in range(k):
        for e in read_metrics(root / f"p{i}" / "metrics-stage0.jsonl"):
            if e["kind"] != "round" or e.get("applied_round") is None or not e.get("averaged"):
                continue
            rounds += 1
            parts += int(e["group_size"]) - 1
            named = {peer: why for peer, why in (e.get("suspects") or {}).items() if why}
            flagged_parts += len(named)
            flagged_rounds += bool(named)
            for why in named.values():
                for w in why:
                    reasons[w] = reasons.get(w, 0) + 1
    if any(codes):
        raise RuntimeError(f"a live peer in {root} exited with {codes}: see its log there")
    return {"parts": parts, "flagged_parts": flagged_parts, "rounds": rounds, "flagged_rounds": flagged_rounds,
            "reasons": reasons, "eval_loss": float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", default="2,3,4")
    parser.add_argument("--speeds", default="equal,third,mixed,late", help=f"of {', '.join(SPEEDS)}")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--h", type=int, default=20, help="inner steps per round of the fastest peer (warmup: 20)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--live", action="store_true", help="real peers on 127.0.0.1 instead of the simulation "
                        "(parts: groupmates' parts seen by each peer; rounds: each peer's averaged rounds)")
    args = parser.parse_args()
    if args.live and "late" in args.speeds.split(","):
        parser.error("--live has no 'late' row (a late peer downloads the swarm's state)")
    torch.set_num_threads(1)
    rows = []
    for speed in args.speeds.split(","):
        for k in map(int, args.groups.split(",")):
            started, totals = time.monotonic(), {"parts": 0, "flagged_parts": 0, "rounds": 0, "flagged_rounds": 0}
            reasons: dict[str, int] = {}
            losses = []
            for seed in map(int, args.seeds.split(",")):
                if args.live:
                    folder = Path(args.out or tempfile.mkdtemp(prefix="honest-flags-")) / f"live-{speed}-k{k}-s{seed}"
                    result = run_live(k, SPEEDS[speed][-k:], args, folder)
                else:
                    result = run(k, SPEEDS[speed][-k:], args, seed, late=speed == "late")
                for key in totals:
                    totals[key] += result[key]
                for why, n in result["reasons"].items():
                    reasons[why] = reasons.get(why, 0) + n
                losses.append(result["eval_loss"])
            row = {"group": k, "speeds": speed, **totals, "reasons": reasons, "eval_losses": losses,
                   "wall_s": round(time.monotonic() - started)}
            rows.append(row)
            print(f"K={k} {speed:6s} flagged parts {row['flagged_parts']}/{row['parts']}, rounds with a flagged part "
                  f"{row['flagged_rounds']}/{row['rounds']} {reasons}"
                  + ("" if args.live else f", eval loss {sum(losses) / len(losses):.4f}") + f" ({row['wall_s']} s)",
                  flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "honest_flags.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
