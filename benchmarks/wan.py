"""The emulated-WAN benchmark: DiLoCo's overlap modes against per-step AllReduce over rate-limited links.

Hosts are network namespaces joined by a bridge, every link shaped with tc tbf (benchmarks/netns.py); one
peer process per host plus a bootstrap node; real processes, real sockets, real p2p-diloco and hivemind.
For every link rate, side by side and with the same model, data, token budget and CPU load:
- `alone`: the same peers, each in its own swarm (no averaging at all): the compute-only throughput;
- `none`, `delayed`, `eager`: the three modes of diloco.mode;
- `allreduce`: data parallel training that all-reduces fp32 gradients every step (gloo), same global batch.

Every run is evaluated on the same held-out batches (8) at the start, every --eval-every-rounds rounds (the
peers' anchor; the AllReduce model every as many inner steps) and at the end. Outputs, in --out:
- throughput: tokens/s per peer, compute utilization (= tokens/s / tokens/s of `alone`), the speedup against
  AllReduce, and the final eval losses at the fastest rate;
- time to loss: for every rate and mode, the training seconds until the first evaluation at or below a
  target eval loss, and AllReduce's time / the mode's time (> 1: faster than AllReduce). Two targets:
  A = AllReduce's final eval loss at the fastest rate; B (easier) = the worst final eval loss of all complete
  runs, which every complete run reaches. The clock starts when training starts (after the initial
  evaluation) and the time spent in later evaluations is taken out of it;
- report.txt (both tables), results.json (everything, curves included), loss_vs_time.png (train loss, and
  eval loss with the targets, against the training clock, one column per rate).
By default the AllReduce run trains all the steps at every rate, so that its time to loss is measured; that is
slow on slow links (fp32 gradients every step), and --allreduce-budget-s cuts it at the slower rates when
only its throughput is wanted (its time to loss then reads "not reached (run cut)").

    sudo .venv/bin/python benchmarks/wan.py                        # 10, 100, 1000 Mbit/s, 2 peers
    sudo .venv/bin/python benchmarks/wan.py --rates 100 --rounds 3 # a quick one
    sudo .venv/bin/python benchmarks/wan.py --allreduce-budget-s 90  # throughput only at the slower rates
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

from p2p_diloco.config import ConfigError, load_config, split_overrides  # noqa: E402

MODEL = ["--model.preset", "small", "--model.dim", "256", "--model.n_layers", "4", "--model.n_heads", "8",
         "--model.n_kv_heads", "8", "--model.ffn_dim", "704", "--data.batch_size", "8", "--data.seq_len", "128"]
AVERAGING = ["--averaging.matchmaking_time_s", "5", "--averaging.request_timeout_s", "2",
             "--averaging.round_timeout_s", "60", "--averaging.allreduce_timeout_s", "180",
             "--averaging.next_chunk_timeout_s", "60"]
TOKENS_PER_STEP = int(MODEL[MODEL.index("--data.batch_size") + 1]) * int(MODEL[MODEL.index("--data.seq_len") + 1])
EVAL_BATCHES = "8"  # the same held-out batches for the peers and the AllReduce baseline
COMMON = ["--run.num_threads", "1", "--data.eval_batches", EVAL_BATCHES, "--train.progress", "false",
          "--checkpoint.every_rounds", "0", "--train.log_every", "5"]
MODES = ("alone", "none", "delayed", "eager", "allreduce")


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
                       "--train.eval_every_rounds", str(self.args.eval_every_rounds),
                       "--averaging.compression", self.args.compression,
                       *[arg for key, value in self.args.set for arg in (f"--{key}", value)]]
            (folder / f"peer{i}").mkdir(parents=True, exist_ok=True)
            log = open(folder / f"peer{i}" / "console.log", "w")
            processes.append(self.wan.popen(i, command, stdout=log, stderr=subprocess.STDOUT))
        for process in processes:
            if process.wait(timeout=4 * 3600) != 0:
                raise RuntimeError(f"a peer of {mode} at {rate} Mbit/s failed; see {folder}")
        summaries = [json.loads((folder / f"peer{i}" / "summary-stage0.json").read_text())
                     for i in range(self.num_peers)]
        clocks = [_training_clock(folder / f"peer{i}") for i in range(self.num_peers)]
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
            "curve": clocks[0]["curve"],  # peer 0's train loss
            "eval_curve": _mean_eval_curve([c["eval_curve"] for c in clocks]),
            "eval_s_per_eval": statistics.mean(c["eval_s_per_eval"] for c in clocks),
            "cut": False,
        }

    def run_allreduce(self, rate, steps: int) -> dict:
        folder = self.out / f"{rate}mbit" / "allreduce"
        folder.mkdir(parents=True, exist_ok=True)
        processes = []
        for i in range(self.num_peers):
            command = [sys.executable, str(Path(__file__).parent / "allreduce_baseline.py"), "--rank", str(i),
                       "--world", str(self.num_peers), "--master-addr", self.wan.ip(0), "--ifname",
                       self.wan.interface(i), "--steps", str(steps), "--total-steps",
                       str(self.args.rounds * self.args.h), "--eval-every",
                       str(self.args.eval_every_rounds * self.args.h), "--out", str(folder / f"worker{i}.json"),
                       "--", *MODEL, "--run.num_threads", "1", "--data.eval_batches", EVAL_BATCHES,
                       "--data.seed", "0"]
            log = open(folder / f"worker{i}.log", "w")
            processes.append(self.wan.popen(i, command, stdout=log, stderr=subprocess.STDOUT))
        for process in processes:
            if process.wait(timeout=24 * 3600) != 0:  # full runs on slow links take long
                raise RuntimeError(f"the AllReduce baseline at {rate} Mbit/s failed; see {folder}")
        workers = [json.loads((folder / f"worker{i}.json").read_text()) for i in range(self.num_peers)]
        evals = max(len(workers[0]["eval_curve"]), 1)  # the initial evaluation included, as in eval_s
        return {"tokens_per_s": statistics.mean(w["tokens_per_s"] for w in workers), "steps": steps,
                "total_steps": allreduce_total_steps(self.args), "cut": steps < allreduce_total_steps(self.args),
                "eval_loss": workers[0]["eval_loss"], "tokens": workers[0]["tokens"],
                "bytes_per_step": workers[0]["bytes_per_step"],
                "curve": [(t, loss) for t, _, loss in workers[0]["curve"]],
                "eval_curve": [tuple(point) for point in workers[0]["eval_curve"]],
                "eval_s_per_eval": workers[0]["eval_s"] / evals}


def _all_events(folder: Path) -> list[dict]:
    """The events of a peer's metrics file (p2p_diloco.training.metrics: one JSON object per line, with "kind"
    and "time", the wall-clock seconds when it was written)."""
    events = []
    for line in open(folder / "metrics-stage0.jsonl"):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line
            continue
    return events


def _events(folder: Path, kind: str) -> list[dict]:
    return [e for e in _all_events(folder) if e["kind"] == kind]


def _training_clock(folder: Path) -> dict:
    """A peer's train and eval curves on its training clock: seconds since its training started (the end of the
    initial evaluation, metrics event "eval" of round 0), the time of the later evaluations taken out.

    The metrics file has no start time per evaluation, only the time each event was written; an evaluation is
    written right after the round it follows (event "round"), so the gap between an "eval" and the event before
    it is what that evaluation took. Every evaluation does the same work (the same batches, the same model), so
    the median gap is taken out per evaluation (robust to what else sits in a gap, e.g. the end-of-run flush).
    Returns {"curve": [(s, train loss)], "eval_curve": [(s, tokens, eval loss, round)], "eval_s_per_eval": s}.
    """
    events = [e for e in _all_events(folder) if e["kind"] in ("step", "round", "eval")]
    evals = [i for i, e in enumerate(events) if e["kind"] == "eval"]
    if not evals:
        return {"curve": [], "eval_curve": [], "eval_s_per_eval": 0.0}
    gaps = [events[i]["time"] - events[i - 1]["time"] for i in evals[1:] if i > 0]
    per_eval = statistics.median(gaps) if gaps else 0.0
    t0, done, curve, eval_curve = events[evals[0]]["time"], 0, [], []
    for event in events[evals[0]:]:
        if event["kind"] == "eval":
            if eval_curve:  # a later evaluation: its time ends at this event; the initial one ends at t0
                done += 1
            loss = float(event["eval_loss"]) if event["eval_loss"] is not None else float("nan")
            clock = max(event["time"] - t0 - done * per_eval, 0.0)  # when it began, on the training clock
            eval_curve.append((clock, event["inner_step"] * TOKENS_PER_STEP, loss, event["round"]))
        elif event["kind"] == "step":
            curve.append((event["time"] - t0 - done * per_eval, float(event["loss"])))
    return {"curve": curve, "eval_curve": eval_curve, "eval_s_per_eval": per_eval}


def _mean_eval_curve(curves: list[list[tuple]]) -> list[tuple[float, int, float]]:
    """The peers' eval curves, one point per evaluated round that every peer has: mean clock, mean loss.

    The peers of a swarm evaluate the same anchor (identical losses, clocks a little apart); for `alone` the mean
    loss is that of a typical lone peer.
    """
    by_round: dict[int, list[tuple]] = {}
    for curve in curves:
        for point in curve:
            by_round.setdefault(point[3], []).append(point)
    return [(statistics.mean(p[0] for p in points), points[0][1], statistics.mean(p[2] for p in points))
            for _, points in sorted(by_round.items()) if len(points) == len(curves)]


def time_to_target(curve: list, target: float) -> float | None:
    """Seconds of the first point (seconds, tokens, eval loss) with eval loss <= target; None if none is."""
    for point in curve:
        if point[2] <= target:  # a NaN loss never is
            return point[0]
    return None


def time_to_loss(results: dict, args) -> dict:
    """The two targets and every run's time to them (see the module docstring)."""
    rates = [str(rate) for rate in args.rates]
    fastest = results[str(max(args.rates))]
    targets = {}
    if "allreduce" in fastest and fastest["allreduce"]["eval_curve"]:
        targets["A"] = {"loss": fastest["allreduce"]["eval_curve"][-1][2],
                        "what": f"AllReduce's final eval loss at {max(args.rates)} Mbit/s"}
    finals = [results[rate][mode]["eval_curve"][-1][2] for rate in rates for mode in MODES
              if mode in results[rate] and results[rate][mode]["eval_curve"] and not results[rate][mode]["cut"]]
    if finals:
        targets["B"] = {"loss": max(finals), "what": "the worst final eval loss of all complete runs"}
    table: dict = {}
    for rate in rates:
        r = results[rate]
        table[rate] = {}
        for mode in [m for m in MODES if m in r]:
            entry = table[rate][mode] = {}
            for name, target in targets.items():
                seconds = time_to_target(r[mode]["eval_curve"], target["loss"])
                entry[name] = {"s": seconds, "cut": seconds is None and r[mode]["cut"]}
        for entry in table[rate].values():
            for name in targets:
                base = table[rate].get("allreduce", {}).get(name, {}).get("s")
                seconds = entry[name]["s"]
                entry[name]["vs_allreduce"] = base / seconds if base is not None and seconds else None
    return {"targets": targets, "rates": table}


def allreduce_total_steps(args) -> int:
    """The AllReduce run's steps: --allreduce-rounds' worth, by default all of --rounds (equal tokens)."""
    return (args.allreduce_rounds or args.rounds) * args.h


def allreduce_steps(rate: float, args, num_params: int, step_s: float) -> int:
    """allreduce_total_steps; with --allreduce-budget-s, at the slower rates as many as fit in it."""
    total = allreduce_total_steps(args)
    if rate == max(args.rates) or args.allreduce_budget_s is None:
        return total
    per_step = step_s + 2 * (args.peers - 1) / args.peers * 4 * num_params * 8 / (rate * 1e6)
    return int(max(10, min(total, args.allreduce_budget_s / per_step)))


def report(results: dict, args) -> str:
    lines = [f"{args.peers} peers, H = {args.h}, {args.rounds} rounds, model {results['num_params'] / 1e6:.2f}M "
             f"parameters ({results['num_params'] * 4 / 1e6:.1f} MB fp32), compression {args.compression}"
             + "".join(f", {key} = {value}" for key, value in args.set), "",
             "link Mbit/s (measured)  mode        tokens/s  utilization  net wait s  round end s  speedup vs AllReduce"]
    for rate in args.rates:
        r = results[str(rate)]
        alone = r["alone"]["tokens_per_s"]
        for mode in [m for m in MODES if m in r]:
            tps = r[mode]["tokens_per_s"]
            wait, overhead = r[mode].get("network_wait_s"), r[mode].get("round_overhead_s")
            wait_text = "" if wait is None else f"{wait:.1f}"
            overhead_text = "" if overhead is None else f"{overhead:.3f}"
            speed = f"{tps / r['allreduce']['tokens_per_s']:.1f}x" if "allreduce" in r and mode != "allreduce" else ""
            lines.append(f"{rate:>6} ({r['measured_mbit']:>6.1f})       {mode:<10} {tps:>9,.0f}  {tps / alone:>10.3f}"
                         f"  {wait_text:>10}  {overhead_text:>11}  {speed:>20}")
    fastest = results[str(max(args.rates))]
    lines += ["", f"convergence at {max(args.rates)} Mbit/s after {fastest['alone']['tokens']:,} tokens per peer:"]
    base = fastest.get("allreduce", fastest["alone"])["eval_loss"]
    reference = "AllReduce" if "allreduce" in fastest else "alone"
    for mode in [m for m in MODES if m in fastest]:
        loss = fastest[mode]["eval_loss"]
        lines.append(f"  {mode:<10} eval loss {loss:.4f}  ({(loss - base) / base * 100:+.2f}% vs {reference})")
    if "allreduce" in fastest and fastest["allreduce"]["tokens"] != fastest["alone"]["tokens"]:
        tokens = fastest["allreduce"]["tokens"]
        lines += ["", f"AllReduce trained {tokens:,} tokens per peer (--allreduce-rounds); at those tokens:"]
        for mode in [m for m in MODES if m in fastest and m != "allreduce"]:
            at = [point[2] for point in fastest[mode]["eval_curve"] if point[1] == tokens]
            loss = f"{at[0]:.4f}  ({(at[0] - base) / base * 100:+.2f}% vs AllReduce)" if at else "not evaluated"
            lines.append(f"  {mode:<10} eval loss {loss}")
    return "\n".join(lines + [""] + report_time_to_loss(results, args))


def report_time_to_loss(results: dict, args) -> list[str]:
    ttl, rates = results["time_to_loss"], [str(rate) for rate in args.rates]
    runs = [results[rate][mode] for rate in rates for mode in MODES if mode in results[rate]]
    peer_eval = [run["eval_s_per_eval"] for run in runs if "averaged_rounds" in run]
    allreduce_eval = [run["eval_s_per_eval"] for run in runs if "bytes_per_step" in run]
    lines = [
        "time to loss: training seconds from the start of training (after the initial evaluation) to the first",
        f"evaluation (every {args.eval_every_rounds} round(s) = {args.eval_every_rounds * args.h} inner steps, and "
        "at the end) at or below the target. Evaluation time is taken",
        "out of the clock (peers: estimated from their metrics, "
        f"{statistics.mean(peer_eval) if peer_eval else 0:.2f} s per evaluation; AllReduce: measured, "
        f"{statistics.mean(allreduce_eval) if allreduce_eval else 0:.2f} s); in",
        "delayed/eager a round's averaging goes on during the evaluation after it (that much network time per round",
        "for free). x AllReduce = AllReduce's time / the mode's time (> 1: faster than AllReduce).",
    ]
    if not args.eval_every_rounds:
        lines.append("--eval-every-rounds 0: evaluated only at the start and the end, so time to loss is coarse.")
    for name, target in ttl["targets"].items():
        lines.append(f"  target {name}: eval loss <= {target['loss']:.4f}, {target['what']}")
    if "A" not in ttl["targets"]:
        lines.append("  (no target A: no AllReduce run at the fastest rate)")
    names = list(ttl["targets"])
    header = "link Mbit/s  mode        final loss" + "".join(f"  {'to ' + n + ' s':>21}  {'x AllReduce':>11}"
                                                              for n in names)
    lines += ["", header]
    for rate in rates:
        for mode, entry in ttl["rates"][rate].items():
            curve = results[rate][mode]["eval_curve"]
            final = f"{curve[-1][2]:.4f}" if curve else "-"
            cells = ""
            for name in names:
                cell = entry[name]
                if cell["s"] is not None:
                    seconds = f"{cell['s']:.1f}"
                else:
                    seconds = "not reached (run cut)" if cell["cut"] else "not reached"
                ratio = f"{cell['vs_allreduce']:.2f}x" if cell["vs_allreduce"] is not None else "-"
                cells += f"  {seconds:>21}  {ratio:>11}"
            lines.append(f"{rate:>11}  {mode:<10} {final:>10}{cells}")
    cut = [rate for rate in rates if results[rate].get("allreduce", {}).get("cut")]
    if cut:
        lines.append(f"AllReduce cut short by --allreduce-budget-s at {', '.join(cut)} Mbit/s: "
                     "its time to loss there is not measured.")
    return lines


def plot(results: dict, args, path: Path) -> None:
    """Train loss (top) and eval loss with the targets (bottom) against the training clock, a column per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(args.rates), figsize=(6 * len(args.rates), 9), squeeze=False)
    targets = results.get("time_to_loss", {}).get("targets", {})
    for column, rate in enumerate(args.rates):
        r = results[str(rate)]
        top, bottom = axes[0][column], axes[1][column]
        for mode in [m for m in ("none", "delayed", "eager", "allreduce", "alone") if m in r]:
            style = {"label": mode, "alpha": 0.8, "linestyle": ":" if mode == "alone" else "-"}
            if r[mode]["curve"]:
                top.plot(*zip(*r[mode]["curve"]), **style)
            if r[mode]["eval_curve"]:
                seconds, _, losses = zip(*[point[:3] for point in r[mode]["eval_curve"]])
                bottom.plot(seconds, losses, marker="o", markersize=3, **style)
        for (name, target), color in zip(targets.items(), ("black", "gray")):
            bottom.axhline(target["loss"], color=color, linestyle="--", linewidth=0.8,
                           label=f"target {name} ({target['loss']:.3f})")
        top.set_title(f"{rate} Mbit/s links")
        top.set_ylabel("train loss")
        bottom.set_ylabel(f"eval loss ({EVAL_BATCHES} held-out batches)")
        for ax in (top, bottom):
            ax.set_xlabel("training wall-clock time (s), evaluations excluded")
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
    parser.add_argument("--eval-every-rounds", type=int, default=1,
                        help="evaluate every this many rounds (the AllReduce run every as many times H steps), "
                             "besides at the start and the end: the resolution of time to loss (default: 1)")
    parser.add_argument("--allreduce-budget-s", type=float, default=None,
                        help="cut the AllReduce run at the rates below the fastest to about this many seconds, "
                             "when only its throughput is wanted there (its time to loss then reads 'not reached "
                             "(run cut)'); default: all the steps at every rate, which takes long on slow links")
    parser.add_argument("--allreduce-rounds", type=int, default=None,
                        help="train the AllReduce run for as many rounds' steps (default: --rounds, equal tokens); "
                             "fewer, with more --rounds, lets the DiLoCo modes run on past AllReduce's tokens so "
                             "that their time to AllReduce's final loss (target A) can be measured")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every peer of every mode (e.g. diloco.overlap_steps=1)")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("wan-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    bad = [item for item in args.set if "=" not in item]
    if bad:
        parser.error(f"--set {bad[0]!r}: expected KEY=VALUE")
    try:  # a bad key or value is refused here, before the hosts and peers start, as the peers would refuse it
        args.set = split_overrides([f"--{item}" for item in args.set])
        load_config(None, [("diloco.inner_steps", str(args.h)), *args.set])
    except ConfigError as e:
        parser.error(f"--set: {e}")
    if args.allreduce_rounds is not None and not 1 <= args.allreduce_rounds <= args.rounds:
        parser.error(f"--allreduce-rounds must be between 1 and --rounds ({args.rounds}), got {args.allreduce_rounds}")
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
                estimate = steps * (step_s + 4 * r["alone"]["num_params"] * 8 / (rate * 1e6))
                print(f"{rate} Mbit/s allreduce: {steps} steps, about {estimate:,.0f} s", flush=True)
                r["allreduce"] = bench.run_allreduce(rate, steps)
                print(f"{rate} Mbit/s allreduce: {r['allreduce']['tokens_per_s']:,.0f} tokens/s", flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    results["num_params"] = results[str(args.rates[0])]["alone"]["num_params"]
    results["time_to_loss"] = time_to_loss(results, args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "report.txt").write_text(text)
    print(text)
    plot(results, args, args.out / "loss_vs_time.png")
    print(f"plot: {args.out / 'loss_vs_time.png'}")


if __name__ == "__main__":
    main()
