"""The emulated-WAN benchmark: DiLoCo's overlap modes against per-step AllReduce over rate-limited links.

Hosts are network namespaces joined by a bridge, every link shaped with tc tbf (benchmarks/netns.py); one
peer process per host plus a bootstrap node; real processes, real sockets, real p2p-diloco and hivemind.
For every link rate, side by side and with the same model, data, token budget and CPU load:
- `alone`: the same peers, each in its own swarm (no averaging at all): the compute-only throughput;
- `none`, `delayed`, `eager`: the three modes of diloco.mode;
- `allreduce`: data parallel training that all-reduces fp32 gradients every step (gloo), same global batch.
Compute utilization = tokens/s / tokens/s of `alone`. At the fastest rate every run trains the same number
of tokens, and their eval losses are compared; at slower rates the AllReduce run is cut short (its throughput
is what is measured there). Writes results.json, a table, and loss against wall-clock time (loss_vs_time.png).

    sudo .venv/bin/python benchmarks/wan.py                        # 10, 100, 1000 Mbit/s, 2 peers
    sudo .venv/bin/python benchmarks/wan.py --rates 100 --rounds 3 # a quick one
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import EmulatedWAN, measure_rate  # noqa: E402

MODEL = ["--model.preset", "small", "--model.dim", "256", "--model.n_layers", "4", "--model.n_heads", "8",
         "--model.n_kv_heads", "8", "--model.ffn_dim", "704", "--data.batch_size", "8", "--data.seq_len", "128"]
AVERAGING = ["--averaging.matchmaking_time_s", "5", "--averaging.request_timeout_s", "2",
             "--averaging.round_timeout_s", "60", "--averaging.allreduce_timeout_s", "180",
             "--averaging.next_chunk_timeout_s", "60"]
TOKENS_PER_STEP = int(MODEL[MODEL.index("--data.batch_size") + 1]) * int(MODEL[MODEL.index("--data.seq_len") + 1])
COMMON = ["--run.num_threads", "1", "--train.eval_every_rounds", "0", "--data.eval_batches", "8",
          "--train.progress", "false", "--checkpoint.every_rounds", "0", "--train.log_every", "5"]


class Bench:
    def __init__(self, wan: EmulatedWAN, args: argparse.Namespace, out: Path):
        self.wan, self.args, self.out = wan, args, out
        self.num_peers = args.peers
        self.bootstrap_host = args.peers  # the last namespace
        self.maddrs = self._start_bootstrap()

    def _start_bootstrap(self) -> list[str]:
        maddrs_file = self.out / "bootstrap.maddrs"
        self.wan.popen(self.bootstrap_host, [sys.executable, "-m", "p2p_diloco", "bootstrap", "--host-maddrs",
                                             f"/ip4/{self.wan.ip(self.bootstrap_host)}/tcp/0", "--identity-path",
                                             str(self.out / "bootstrap.id"), "--maddrs-file", str(maddrs_file)],
                       stdout=open(self.out / "bootstrap.log", "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (maddrs_file.exists() and maddrs_file.read_text().strip()):
            if time.monotonic() > deadline:
                raise RuntimeError("the bootstrap node did not start")
            time.sleep(0.2)
        return maddrs_file.read_text().split()

    def run_peers(self, rate, mode: str) -> dict:
        """One peer per host, all at once; mode 'alone' = each in its own swarm (nothing to average)."""
        folder = self.out / f"{rate}mbit" / mode
        processes = []
        for i in range(self.num_peers):
            alone = mode == "alone"
            swarm = [] if alone else ["--initial-peers", *self.maddrs]
            command = [sys.executable, "-m", "p2p_diloco", "peer", *swarm, "--host-maddrs",
                       f"/ip4/{self.wan.ip(i)}/tcp/0", "--run-id", f"wan-{rate}-{mode}{i if alone else ''}",
                       "--diloco.mode", "none" if alone else mode, "--data.seed", str(i),
                       "--train.num_rounds", str(self.args.rounds), "--diloco.inner_steps", str(self.args.h),
                       "--output-dir", str(folder / f"peer{i}"), *MODEL, *AVERAGING, *COMMON,
                       "--averaging.compression", self.args.compression]
            (folder / f"peer{i}").mkdir(parents=True, exist_ok=True)
            log = open(folder / f"peer{i}" / "console.log", "w")
            processes.append(self.wan.popen(i, command, stdout=log, stderr=subprocess.STDOUT))
        for process in processes:
            if process.wait(timeout=3600) != 0:
                raise RuntimeError(f"a peer of {mode} at {rate} Mbit/s failed; see {folder}")
        summaries = [json.loads((folder / f"peer{i}" / "summary-stage0.json").read_text())
                     for i in range(self.num_peers)]
        rounds = [e for i in range(self.num_peers) for e in _events(folder / f"peer{i}", "round")
                  if e["applied_round"] is not None and e["averaged"]]
        return {
            "tokens_per_s": statistics.mean(s["tokens"] / s["train_s"] for s in summaries),
            "eval_loss": statistics.mean(s["eval_loss_final"] for s in summaries),
            "tokens": summaries[0]["tokens"], "averaged_rounds": min(s["averaged_rounds"] for s in summaries),
            "bytes_sent_per_round": statistics.mean(s["bytes_sent"] for s in summaries) / self.args.rounds,
            "network_wait_s": statistics.mean(s["network_wait_s"] for s in summaries),
            "averaging_s_median": statistics.median(e["averaging_s"] for e in rounds) if rounds else None,
            "round_overhead_s": statistics.mean(e["round_end_s"] - e["waited_s"] for i in range(self.num_peers)
                                                for e in _events(folder / f"peer{i}", "round") if not e["flush"]),
            "num_params": summaries[0]["num_params"],
            "curve": _curve(folder / "peer0"),
        }

    def run_allreduce(self, rate, steps: int) -> dict:
        folder = self.out / f"{rate}mbit" / "allreduce"
        folder.mkdir(parents=True, exist_ok=True)
        processes = []
        for i in range(self.num_peers):
            command = [sys.executable, str(Path(__file__).parent / "allreduce_baseline.py"), "--rank", str(i),
                       "--world", str(self.num_peers), "--master-addr", self.wan.ip(0), "--ifname",
                       self.wan.interface(i), "--steps", str(steps), "--total-steps",
                       str(self.args.rounds * self.args.h), "--out", str(folder / f"worker{i}.json"), "--",
                       *MODEL, "--run.num_threads", "1", "--data.eval_batches", "8", "--data.seed", "0"]
            log = open(folder / f"worker{i}.log", "w")
            processes.append(self.wan.popen(i, command, stdout=log, stderr=subprocess.STDOUT))
        for process in processes:
            if process.wait(timeout=3600) != 0:
                raise RuntimeError(f"the AllReduce baseline at {rate} Mbit/s failed; see {folder}")
        workers = [json.loads((folder / f"worker{i}.json").read_text()) for i in range(self.num_peers)]
        return {"tokens_per_s": statistics.mean(w["tokens_per_s"] for w in workers), "steps": steps,
                "eval_loss": workers[0]["eval_loss"], "tokens": workers[0]["tokens"],
                "bytes_per_step": workers[0]["bytes_per_step"],
                "curve": [(t, loss) for t, _, loss in workers[0]["curve"]]}


def _events(folder: Path, kind: str) -> list[dict]:
    events = []
    for line in open(folder / "metrics-stage0.jsonl"):
        event = json.loads(line)
        if event["kind"] == kind:
            events.append(event)
    return events


def _curve(folder: Path) -> list[tuple[float, float]]:
    steps = _events(folder, "step")
    if not steps:
        return []
    t0 = steps[0]["time"]
    return [(e["time"] - t0, float(e["loss"])) for e in steps]


def allreduce_steps(rate: float, args, num_params: int, step_s: float) -> int:
    """All the steps at the fastest rate (equal tokens); elsewhere as many as fit in --allreduce-budget-s."""
    total = args.rounds * args.h
    if rate == max(args.rates):
        return total
    per_step = step_s + 2 * (args.peers - 1) / args.peers * 4 * num_params * 8 / (rate * 1e6)
    return int(max(10, min(total, args.allreduce_budget_s / per_step)))


def report(results: dict, args) -> str:
    lines = [f"{args.peers} peers, H = {args.h}, {args.rounds} rounds, model {results['num_params'] / 1e6:.2f}M "
             f"parameters ({results['num_params'] * 4 / 1e6:.1f} MB fp32), compression {args.compression}", "",
             "link Mbit/s (measured)  mode        tokens/s  utilization  net wait s  round end s  speedup vs AllReduce"]
    for rate in args.rates:
        r = results[str(rate)]
        alone = r["alone"]["tokens_per_s"]
        for mode in [m for m in ("alone", "none", "delayed", "eager", "allreduce") if m in r]:
            tps = r[mode]["tokens_per_s"]
            wait, overhead = r[mode].get("network_wait_s"), r[mode].get("round_overhead_s")
            wait_text = "" if wait is None else f"{wait:.1f}"
            overhead_text = "" if overhead is None else f"{overhead:.3f}"
            speed = f"{tps / r['allreduce']['tokens_per_s']:.1f}x" if "allreduce" in r and mode != "allreduce" else ""
            lines.append(f"{rate:>6} ({r['measured_mbit']:>6.1f})       {mode:<10} {tps:>9,.0f}  {tps / alone:>10.3f}"
                         f"  {wait_text:>10}  {overhead_text:>11}  {speed:>20}")
    fastest = results[str(max(args.rates))]
    lines += ["", f"convergence at {max(args.rates)} Mbit/s after {fastest['delayed']['tokens']:,} tokens per peer:"]
    base = fastest.get("allreduce", fastest["alone"])["eval_loss"]
    reference = "AllReduce" if "allreduce" in fastest else "alone"
    for mode in [m for m in ("alone", "none", "delayed", "eager", "allreduce") if m in fastest]:
        loss = fastest[mode]["eval_loss"]
        lines.append(f"  {mode:<10} eval loss {loss:.4f}  ({(loss - base) / base * 100:+.2f}% vs {reference})")
    return "\n".join(lines)


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.rates), figsize=(6 * len(args.rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], args.rates):
        for mode in [m for m in ("none", "delayed", "eager", "allreduce", "alone") if m in results[str(rate)]]:
            curve = results[str(rate)][mode]["curve"]
            if curve:
                ax.plot(*zip(*curve), label=mode, alpha=0.8, linestyle=":" if mode == "alone" else "-")
        ax.set_title(f"{rate} Mbit/s links")
        ax.set_xlabel("wall-clock time (s)")
        ax.set_ylabel("train loss")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=lambda s: [float(x) if "." in x else int(x) for x in s.split(",")],
                        default=[10, 100, 1000], help="link rates in Mbit/s, comma-separated")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--h", type=int, default=40, help="inner steps per round")
    parser.add_argument("--modes", default="none,delayed,eager,allreduce",
                        help="what to run besides 'alone' (the compute-only baseline), comma-separated")
    parser.add_argument("--compression", default="none", help="averaging.compression of the peers (default: none)")
    parser.add_argument("--allreduce-budget-s", type=float, default=90.0,
                        help="time for the AllReduce run at the slower rates (its throughput is what counts there)")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("wan-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    with EmulatedWAN(args.peers + 1, rate_mbit=None) as wan:
        bench = Bench(wan, args, args.out)
        for rate in sorted(args.rates, reverse=True):
            wan.set_rate(rate)
            r = results[str(rate)] = {"measured_mbit": measure_rate(wan, megabytes=max(2.0, rate * 0.2))}
            for mode in ["alone"] + [m for m in args.modes if m != "allreduce"]:
                r[mode] = bench.run_peers(rate, mode)
                print(f"{rate} Mbit/s {mode}: {r[mode]['tokens_per_s']:,.0f} tokens/s", flush=True)
            if "allreduce" in args.modes:
                step_s = TOKENS_PER_STEP / r["alone"]["tokens_per_s"]
                steps = allreduce_steps(rate, args, r["alone"]["num_params"], step_s)
                r["allreduce"] = bench.run_allreduce(rate, steps)
                print(f"{rate} Mbit/s allreduce: {r['allreduce']['tokens_per_s']:,.0f} tokens/s", flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    results["num_params"] = results[str(args.rates[0])]["alone"]["num_params"]
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "report.txt").write_text(text)
    print(text)
    plot(results, args, args.out / "loss_vs_time.png")
    print(f"plot: {args.out / 'loss_vs_time.png'}")


if __name__ == "__main__":
    main()
