"""What ``benchmarks/scale.py`` measured in each swarm, read back from the peers' files: the per-N figures, the
table, and the plot with ``p2p-diloco plan``'s predictions beside them. Pure reading and arithmetic."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from p2p_diloco.plan import allreduce_bytes
from p2p_diloco.training.metrics import read_metrics

KINDS = ("training", "dht", "averager", "p2pd")


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _quantile(values, q: float):
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def summarize(folder: Path, run: dict, num_rounds: int) -> dict:
    """The figures of one swarm (``run``: what scale.py recorded while it ran)."""
    n = run["num_peers"]
    rows, summaries, reads = [], [], []
    for i in range(n):
        peer = folder / f"peer{i}"
        if not (peer / "summary-stage0.json").exists():
            continue
        summaries.append(json.loads((peer / "summary-stage0.json").read_text()))
        applied = [e for e in read_metrics(peer / "metrics-stage0.jsonl")
                   if e["kind"] == "round" and e.get("applied_round") is not None]
        rows += applied
        if applied:
            reads.append(applied[-1].get("record_reads", 0) / num_rounds)
    averaged = [e for e in rows if e["averaged"]]
    stats = [e.get("compression") or {} for e in averaged]
    sizes = Counter(e["group_size"] for e in averaged)
    payload = _median([s.get("payload_bytes") for s in stats])
    num_params = summaries[0]["num_params"] if summaries else 0
    memory = {kind: _median([peer.get(kind, {}).get("pss_mb") for peer in run.get("memory", {}).values()])
              for kind in KINDS}
    memory_rss = {kind: _median([peer.get(kind, {}).get("rss_mb") for peer in run.get("memory", {}).values()])
                  for kind in KINDS}
    return {
        "where": run["where"], "num_peers": n, "rate_mbit": run.get("rate_mbit"), "timeouts": run.get("timeouts"),
        "exit_code": run.get("exit_code"), "wall_s": run.get("wall_s"), "load_before": run.get("load_before"),
        "load_after": run.get("load_after"), "finished_peers": len(summaries),
        "round_ends": n * num_rounds, "averaged_round_ends": len(averaged),
        "averaged_share": len(averaged) / (n * num_rounds),
        "group_sizes": dict(sorted(sizes.items())),
        "one_group_share": sizes.get(n, 0) / (n * num_rounds),
        "matchmaking_s_median": _median([s.get("matched_s") for s in stats]),
        "matchmaking_s_p90": _quantile([s.get("matched_s") for s in stats], 0.9),
        "allreduce_s_median": _median([s.get("reduce_s") for s in stats]),
        "allreduce_s_p90": _quantile([s.get("reduce_s") for s in stats], 0.9),
        "round_end_wait_s_median": _median([e["waited_s"] for e in rows]),
        "round_end_wait_s_p90": _quantile([e["waited_s"] for e in rows], 0.9),
        "bytes_sent_per_round_median": _median([e["bytes_sent"] for e in averaged]),
        "payload_bytes": payload, "num_params": num_params,
        "bits_per_param": 8 * payload / num_params if payload and num_params else None,
        "memory_pss_mb": memory, "memory_rss_mb": memory_rss,
        "record_reads_per_round": _median(reads),
        "final_models": len({s["anchor_sha256"] for s in summaries}),
        "resyncs": sum(s["resyncs"] for s in summaries), "reloads": sum(s["reloads"] for s in summaries),
        "eval_loss_final": _median([s.get("eval_loss_final") for s in summaries]),
    }


def plan_bytes(result: dict) -> float | None:
    """``p2p-diloco plan``'s bytes one peer sends per round in a group of N, at the codec's measured bits."""
    if not result["bits_per_param"]:
        return None
    return allreduce_bytes(result["num_params"], result["num_peers"], result["bits_per_param"])


def plan_transfer_s(result: dict, rate_mbit: float) -> float | None:
    """The plan's transfer time of those bytes at ``rate_mbit`` (its latency left out: matchmaking is measured)."""
    sent = plan_bytes(result)
    return None if sent is None else sent * 8 / (rate_mbit * 1e6)


def matchmaking_fit(results: dict, where: str = "loopback") -> tuple[float, float] | None:
    """Least squares ``matchmaking_s = base + per_peer * N`` over the swarms of ``where``: (base, per_peer)."""
    points = [(r["num_peers"], r["matchmaking_s_median"]) for r in results.values()
              if r["where"] == where and r["matchmaking_s_median"] is not None]
    if len(points) < 2:
        return None
    mean_n = statistics.mean(n for n, _ in points)
    mean_t = statistics.mean(t for _, t in points)
    spread = sum((n - mean_n) ** 2 for n, _ in points)
    per_peer = sum((n - mean_n) * (t - mean_t) for n, t in points) / spread if spread else 0.0
    return mean_t - per_peer * mean_n, per_peer


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def report_text(results: dict, args) -> str:
    lines = [f"Scale: swarms of N peers, tiny model, batch 2 x 32, H = 20, {args.rounds} rounds, train.slowdown "
             f"{args.slowdown:g}, one thread a peer; timeouts: demo (matchmaking 10 s, request 3 s, round 60 s) "
             f"below N = {args.crowded}, crowded (15, 6, 90 s) from it", ""]
    header = (f"{'run':<12}{'avg':>7}{'one grp':>8}  {'groups':<22}{'match s':>8}{'p90':>6}{'reduce s':>9}"
              f"{'wait s':>7}{'sent/rnd':>10}{'plan':>9}{'train':>7}{'dht':>6}{'avgr':>6}{'p2pd':>6}{'reads/r':>8}"
              f"{'models':>7}{'wall s':>7}{'load':>6}")
    lines += [header, "-" * len(header)]
    for key, r in sorted(results.items(), key=lambda kv: (kv[1]["where"], kv[1]["num_peers"])):
        mem = r["memory_pss_mb"]
        groups = ",".join(f"{size}x{count}" for size, count in r["group_sizes"].items())
        planned = plan_bytes(r)
        lines.append(
            f"{key:<12}{r['averaged_round_ends']:>3}/{r['round_ends']:<3}{r['one_group_share']:>8.0%}  {groups:<22}"
            f"{_fmt(r['matchmaking_s_median']):>8}{_fmt(r['matchmaking_s_p90'], '.1f'):>6}"
            f"{_fmt(r['allreduce_s_median']):>9}{_fmt(r['round_end_wait_s_median']):>7}"
            f"{_fmt(r['bytes_sent_per_round_median'] and r['bytes_sent_per_round_median'] / 1e6, '.2f'):>8}MB"
            f"{_fmt(planned and planned / 1e6, '.2f'):>7}MB"
            + "".join(f"{_fmt(mem.get(kind), '.0f'):>{7 if kind == 'training' else 6}}" for kind in KINDS) +
            f"{_fmt(r['record_reads_per_round'], '.0f'):>8}{r['final_models']:>7}{_fmt(r['wall_s'], '.0f'):>7}"
            f"{_fmt(r['load_before'] and r['load_before'][0], '.1f'):>6}")
    fit = matchmaking_fit(results)
    lines += ["", "avg: round ends that applied a group's average, of N x rounds; one grp: of them in one group",
              "of all N; groups: size x round ends; match s: median time from the averaging step's start to its",
              "group (p90); reduce s: the all-reduce; wait s: the training loop's wait at a round end; sent/rnd: bytes",
              "one peer sent per round (median) against the plan's 2 (N-1)/N x params x measured bits;",
              "train/dht/avgr/p2pd: peak proportional set size of each process of a peer, MB (median over peers);",
              "reads/r: DHT record reads per peer per round; models: distinct final anchors; load: 1-minute load",
              "average at the start."]
    if fit is not None:
        lines.append(f"matchmaking fit (loopback): {fit[0]:.2f} s + {fit[1]:.3f} s x N "
                     f"(p2p-diloco plan --latency-s {max(fit[0], 0):.2f} --latency-per-peer-s {fit[1]:.3f})")
    netns = [r for r in results.values() if r["where"] == "netns"]
    for r in sorted(netns, key=lambda r: r["num_peers"]):
        lines.append(f"netns-{r['num_peers']}: all-reduce {_fmt(r['allreduce_s_median'])} s against the plan's "
                     f"transfer {_fmt(plan_transfer_s(r, r['rate_mbit']))} s at {r['rate_mbit']:g} Mbit/s")
    return "\n".join(lines) + "\n"


def write_plot(results: dict, path: Path, rate_mbit: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    series = {where: sorted((r for r in results.values() if r["where"] == where), key=lambda r: r["num_peers"])
              for where in ("loopback", "netns")}
    style = {"loopback": dict(marker="o", color="C0"), "netns": dict(marker="s", color="C1")}

    def curve(ax, key, title, scale=1.0, label_suffix="", linestyle="-"):
        for where, rows in series.items():
            points = [(r["num_peers"], r[key] * scale) for r in rows if r[key] is not None]
            if points:
                ax.plot(*zip(*points), label=f"{where}{label_suffix}", linestyle=linestyle, **style[where])
        ax.set_title(title)
        ax.set_xlabel("peers N")
        ax.grid(alpha=0.3)

    curve(axes[0, 0], "averaged_share", "share of round ends averaged")
    curve(axes[0, 0], "one_group_share", "", label_suffix=": in one group of all N", linestyle=":")
    axes[0, 0].set_title("round ends averaged (and in one group of N)")
    axes[0, 0].set_ylim(0, 1.05)
    curve(axes[0, 1], "matchmaking_s_median", "matchmaking time, median (s)")
    fit = matchmaking_fit(results)
    if fit is not None:
        ns = [r["num_peers"] for r in series["loopback"]]
        axes[0, 1].plot(ns, [fit[0] + fit[1] * n for n in ns], "--", color="gray", label="fit (plan latency)")
    curve(axes[0, 2], "allreduce_s_median", "all-reduce time, median (s)")
    ns = sorted({r["num_peers"] for r in results.values()})
    transfer = [(r["num_peers"], plan_transfer_s(r, rate_mbit)) for r in series["netns"] or series["loopback"]]
    transfer = [p for p in transfer if p[1] is not None]
    if transfer:
        axes[0, 2].plot(*zip(*transfer), "--", color="gray", label=f"plan: transfer at {rate_mbit:g} Mbit/s")
    curve(axes[0, 3], "round_end_wait_s_median", "round-end wait, median (s)")
    curve(axes[1, 0], "bytes_sent_per_round_median", "MB sent per peer per round", scale=1e-6)
    planned = [(r["num_peers"], plan_bytes(r) / 1e6) for r in series["loopback"] if plan_bytes(r)]
    if planned:
        axes[1, 0].plot(*zip(*planned), "--", color="gray", label="plan: 2 (N-1)/N x params x bits")
    ax = axes[1, 1]
    for i, kind in enumerate(("training", "dht", "averager", "p2pd")):
        for where, rows in series.items():
            points = [(r["num_peers"], r["memory_pss_mb"].get(kind)) for r in rows
                      if r["memory_pss_mb"].get(kind) is not None]
            if points:
                ax.plot(*zip(*points), marker=style[where]["marker"], color=f"C{i + 2}",
                        linestyle="-" if where == "loopback" else ":", label=f"{kind} ({where})")
    ax.set_title("peak memory per process of a peer (PSS, MB)")
    ax.set_xlabel("peers N")
    ax.grid(alpha=0.3)
    curve(axes[1, 2], "record_reads_per_round", "DHT record reads per peer per round")
    curve(axes[1, 3], "final_models", "distinct final models at the end")
    axes[1, 3].set_ylim(0, max(2, max((r["final_models"] for r in results.values()), default=1)) + 0.5)
    for ax in axes.flat:
        ax.set_xticks(ns)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
