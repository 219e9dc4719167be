"""Compression of pseudo-gradients: bytes on the wire, codec speed, and convergence, measured side by side.

1. bytes: real peers (2, on 127.0.0.1) average the `small` preset's pseudo-gradients for a few rounds with
   every `averaging.compression` scheme; the bytes each peer sent per round (counted on the wire, protobuf
   messages) against the fp32 run, and against a per-step fp32 ring AllReduce over H = 100 steps.
2. speed: encode + decode throughput (MB/s of fp32 input) of each codec, and of one low-rank round trip,
   on the `small` preset's tensors, in this process.
3. convergence: 4 peers, H = 50, `adaptive` against `none`: eval loss after the same tokens, plotted against
   tokens and against bytes sent (convergence.png).

    python benchmarks/compression.py                 # all three
    python benchmarks/compression.py --only speed
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_bootstrap import start_bootstrap  # noqa: E402

from p2p_diloco.compression import SCHEMES  # noqa: E402

FAST = ["--averaging.matchmaking_time_s", "5", "--averaging.request_timeout_s", "2",
        "--averaging.round_timeout_s", "60", "--averaging.allreduce_timeout_s", "120",
        "--train.progress", "false", "--checkpoint.every_rounds", "0"]


def run_swarm(workdir: Path, name: str, num_peers: int, args: list[str]) -> list[Path]:
    """A bootstrap node and ``num_peers`` peers on loopback; returns the peers' folders once all have finished."""
    root = workdir / name
    root.mkdir(parents=True)
    boot, maddrs = start_bootstrap(root, start_new_session=True)
    try:
        folders, procs = [], []
        for i in range(num_peers):
            folders.append(root / f"peer{i}")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *maddrs, "--host-maddrs",
                 "/ip4/127.0.0.1/tcp/0", "--run-id", name, "--output-dir", str(folders[-1]), "--data.seed", str(i),
                 "--averaging.target_group_size", str(num_peers), *FAST, *args],
                stdout=subprocess.DEVNULL, stderr=open(root / f"peer{i}.log", "w")))
        for i, proc in enumerate(procs):
            if proc.wait() != 0:
                raise RuntimeError(f"{name}: peer {i} failed, see {root / f'peer{i}.log'}")
        return folders
    finally:
        boot.terminate()
        boot.wait()


def events(folder: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, open(folder / "metrics-stage0.jsonl")) if e["kind"] == kind]


def bytes_benchmark(workdir: Path, preset: str, rounds: int, schemes: list[str]) -> dict:
    results = {}
    common = ["--model.preset", preset, "--data.batch_size", "4", "--data.seq_len", "64", "--run.num_threads", "1",
              "--train.num_rounds", str(rounds), "--diloco.inner_steps", "4", "--diloco.mode", "none",
              "--data.eval_batches", "0", "--train.eval_every_rounds", "0"]
    for scheme in schemes:
        folders = run_swarm(workdir, f"bytes-{scheme}", 2, common + ["--averaging.compression", scheme])
        applied = [e for f in folders for e in events(f, "round") if e["averaged"]]
        summary = json.loads((folders[0] / "summary-stage0.json").read_text())
        results[scheme] = {
            "bytes_sent_per_round": statistics.mean(e["bytes_sent"] for e in applied),
            "ranks": sorted({e["compression"].get("rank", 0) for e in applied}),
            "error": statistics.mean(e["compression"].get("compression_error", 0.0) for e in applied),
            "num_params": summary["num_params"],
        }
        print(f"bytes {scheme}: {results[scheme]['bytes_sent_per_round'] / 1e6:.2f} MB per round", flush=True)
    return results


def speed_benchmark(preset: str) -> dict:
    import torch

    from p2p_diloco.compression import roundtrip
    from p2p_diloco.compression.lowrank import orthonormalize, reconstruct, seeded_q
    from p2p_diloco.config import load_config
    from p2p_diloco.model import Transformer, model_args_from_config

    torch.set_num_threads(1)
    model = Transformer(model_args_from_config(load_config(None, [("model.preset", preset)]).model, 257))
    tensors = [p.detach().clone() for p in model.parameters()]
    total_mb = sum(t.numel() for t in tensors) * 4 / 1e6
    speeds = {}
    for codec in ("fp16", "int8", "int4"):
        start = time.perf_counter()
        for t in tensors:
            roundtrip(codec, t)
        speeds[codec] = total_mb / (time.perf_counter() - start)
    matrices = [t for t in tensors if t.dim() == 2]
    for rank in (8, 32):
        start = time.perf_counter()
        for m in matrices:
            p = orthonormalize(m @ seeded_q(m.shape[1], rank, "s"))
            reconstruct(p, roundtrip("int8", m.t() @ p))
        speeds[f"lowrank r={rank}"] = sum(m.numel() for m in matrices) * 4 / 1e6 / (time.perf_counter() - start)
    return {"MB_per_s": speeds, "input_MB": total_mb}


def convergence_benchmark(workdir: Path, rounds: int, schemes: list[str], extra: list[str]) -> dict:
    common = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "128", "--run.num_threads", "1",
              "--train.num_rounds", str(rounds), "--diloco.inner_steps", "50", "--data.eval_batches", "8",
              "--train.eval_every_rounds", "1", *extra]
    results = {}
    for scheme in schemes:
        folders = run_swarm(workdir, f"conv-{scheme}", 4, common + ["--averaging.compression", scheme])
        curves = []
        for f in folders:
            rounds_seen = events(f, "round")
            sent = {e["round_index"] + 1: 0 for e in rounds_seen}
            cumulative = 0
            for e in rounds_seen:
                cumulative += e["bytes_sent"]
                sent[e["round_index"] + 1] = cumulative
            tokens_per_step = 8 * 128
            curves.append([(e["inner_step"] * tokens_per_step, sent.get(e["round"], 0), float(e["eval_loss"]))
                           for e in events(f, "eval") if e["eval_loss"] is not None])
        summaries = [json.loads((f / "summary-stage0.json").read_text()) for f in folders]
        final = statistics.mean(x["eval_loss_final"] for x in summaries)
        counts = {k: sum(x.get(k, 0) for x in summaries) for k in ("averaged_rounds", "fallback_rounds", "reloads",
                                                                   "resyncs")}
        ranks = [(e["compression"].get("rank", 0), round(e["compression"].get("compression_error", 0.0), 3))
                 for e in events(folders[0], "round") if e["averaged"]]
        results[scheme] = {"eval_loss_final": final, "curve": curves[0], "ranks_errors": ranks, **counts}
        print(f"convergence {scheme}: eval loss {final:.4f}, (rank, error) by round {ranks}; over the 4 peers: "
              f"{counts}", flush=True)
    return results


def _counts(r: dict) -> str:
    return (f"(4 peers: {r.get('averaged_rounds', '?')} averaged, {r.get('fallback_rounds', '?')} fallback rounds, "
            f"{r.get('reloads', '?')} reloads, {r.get('resyncs', '?')} resyncs)")


def report(results: dict) -> str:
    lines = []
    if "bytes" in results:
        b = results["bytes"]
        fp32 = b["none"]["bytes_sent_per_round"]
        params = b["none"]["num_params"]
        allreduce_100 = 100 * 2 * (2 - 1) / 2 * 4 * params  # per-step fp32 ring AllReduce, 2 peers, 100 steps
        lines += [f"bytes sent per peer per round, small preset ({params / 1e6:.1f}M parameters), 2 peers:",
                  "scheme      MB/round   vs fp32   vs per-step fp32 AllReduce over H=100   ranks   rel. error"]
        for scheme in [s for s in SCHEMES if s in b]:
            r = b[scheme]
            sent = r["bytes_sent_per_round"]
            lines.append(f"{scheme:<10} {sent / 1e6:>9.2f}  {fp32 / sent:>7.1f}x   {allreduce_100 / sent:>30,.0f}x   "
                         f"{str(r['ranks']):<7} {r['error']:.3f}")
    if "speed" in results:
        lines += ["", f"encode + decode throughput, one thread, {results['speed']['input_MB']:.0f} MB of fp32 input:"]
        lines += [f"  {codec:<14} {speed:>8,.0f} MB/s" for codec, speed in results["speed"]["MB_per_s"].items()]
    if "convergence" in results:
        c = results["convergence"]
        gap = (c["adaptive"]["eval_loss_final"] - c["none"]["eval_loss_final"]) / c["none"]["eval_loss_final"]
        lines += ["", "convergence, 4 peers, H = 50, same tokens:",
                  f"  none      eval loss {c['none']['eval_loss_final']:.4f}  {_counts(c['none'])}",
                  f"  adaptive  eval loss {c['adaptive']['eval_loss_final']:.4f}  {_counts(c['adaptive'])}  "
                  f"({gap:+.2%}; target within 1%)"]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for scheme, r in results["convergence"].items():
        tokens, sent, loss = zip(*r["curve"])
        by_tokens.plot(tokens, loss, "o-", label=scheme)
        by_bytes.plot([max(s, 1) / 1e6 for s in sent], loss, "o-", label=scheme)
    by_tokens.set(xlabel="tokens per peer", ylabel="eval loss of the anchor", title="against tokens")
    by_bytes.set(xlabel="MB sent by a peer", ylabel="eval loss of the anchor", title="against bytes sent", xscale="log")
    for ax in (by_tokens, by_bytes):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("bytes", "speed", "convergence"))
    parser.add_argument("--bytes-rounds", type=int, default=3)
    parser.add_argument("--convergence-rounds", type=int, default=8)
    parser.add_argument("--schemes", default="none,adaptive", help="schemes compared for convergence")
    parser.add_argument("--bytes-schemes", default=",".join(SCHEMES),
                        help="schemes whose bytes on the wire are counted (none, the fp32 reference, always)")
    parser.add_argument("--peer-args", default="", help="extra peer arguments, e.g. '--averaging.rank 16'")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("compression-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "speed"):
            results["speed"] = speed_benchmark("small")
        if args.only in (None, "bytes"):
            schemes = ["none"] + [s for s in args.bytes_schemes.split(",") if s != "none"]
            results["bytes"] = bytes_benchmark(Path(tmp), "small", args.bytes_rounds, schemes)
        if args.only in (None, "convergence"):
            results["convergence"] = convergence_benchmark(Path(tmp), args.convergence_rounds, args.schemes.split(","),
                                                           args.peer_args.split())
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results)
    (args.out / "report.txt").write_text(text)
    print(text)
    if "convergence" in results:
        plot(results, args.out / "convergence.png")
        print(f"plot: {args.out / 'convergence.png'}")


if __name__ == "__main__":
    main()
