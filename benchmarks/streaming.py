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
overlap; ``--h`` sets how far apart they start (H / F steps).

With ``--wan MBIT`` (root) the peers and the bootstrap node run on hosts of an emulated WAN (network namespaces, every
link shaped with tc tbf, ``benchmarks/netns.py``) and the bytes each peer puts on its link are counted **on the wire**
every 20 ms (``netns.WireCounter``). The table then adds, per run (the largest over the peers), once for the
steady state (everything before the run's last round end, where every fragment's last round ends on the run's last
step, all at once by design) and once for the whole run:

- peak burst: the most bytes of one burst of traffic on a peer's link, a burst being a stretch whose samples carry
  more than ``--idle-fraction`` of the link rate, with gaps under ``--gap-s`` joined: what one round end puts on the
  link at once (the averaging payloads, framing, the DHT and matchmaking traffic around them);
- peak 1 s: the most bytes in any 1-second window (at 10 Mbit/s the link carries 1.25 MB in one);
- saturated: the longest stretch at 80% of the link rate or more (in 0.1 s bins), the time a round end holds the
  link full;
- mean rate over the run, and utilization: the share of each peer's training time not spent waiting for the network
  (1 - network_wait_s / train_s), the lowest over the peers.

    .venv/bin/python benchmarks/streaming.py --fragments 3 --h 48 --rounds 6 --out runs/streaming
    sudo .venv/bin/python benchmarks/streaming.py --wan 10 --fragments 3 --h 96 --rounds 4 --out runs/streaming-wan
"""

from __future__ import annotations

import argparse
import contextlib
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
from netns import EmulatedWAN, WireCounter  # noqa: E402

from p2p_diloco.training.metrics import read_metrics  # noqa: E402

TINY = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "64", "--data.eval_batches", "16",
        "--train.log_every", "10", "--train.progress", "false", "--run.num_threads", "1",
        "--train.eval_every_rounds", "0", "--checkpoint.every_rounds", "0", "--microbatches", "2"]
AVERAGING = ["--averaging.matchmaking_time_s", "4", "--averaging.request_timeout_s", "3",
             "--averaging.round_timeout_s", "20", "--averaging.allreduce_timeout_s", "20",
             "--averaging.next_chunk_timeout_s", "10"]
PEERS = {"p1": ["--stages", "1"], "p2": ["--stages", "2"]}


def run_swarm(out: Path, args, streaming: bool, wan: EmulatedWAN | None = None) -> dict:
    """One swarm of the two peers to its end; the averagings of each peer (and, on an emulated WAN, the bytes on
    each peer's link over time). Peer i runs on host i, the bootstrap node on the host after them."""
    out.mkdir(parents=True, exist_ok=True)
    if wan is None:
        def launch(_host, command, **kwargs):
            return subprocess.Popen(command, start_new_session=True, cwd=ROOT, **kwargs)

        def address(_host):
            return "127.0.0.1"
    else:
        launch, address = wan.popen, wan.ip
    bootstrap, maddrs = start_bootstrap(out, host=address(len(PEERS)), log=open(out / "bootstrap.log", "w"),
                                        popen=lambda command, **kw: launch(len(PEERS), command, **kw))
    counter = WireCounter(wan, list(range(len(PEERS))), out / "wire.txt") if wan is not None else None
    procs = {}
    started = time.monotonic()
    with counter if counter is not None else contextlib.nullcontext():
        try:
            for i, (name, split) in enumerate(PEERS.items()):
                command = [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *maddrs,
                           "--host-maddrs", f"/ip4/{address(i)}/tcp/0", "--run-id", "streaming", "--output-dir",
                           str(out / name), "--train.num_rounds", str(args.rounds), "--diloco.inner_steps",
                           str(args.h), "--diloco.fragments", str(args.fragments), "--diloco.streaming",
                           str(streaming).lower(), "--train.wait_for_peers", str(len(PEERS)), "--data.seed",
                           str(args.seed + i), *split, *TINY, *AVERAGING, *args.peer_args]
                (out / name).mkdir(parents=True, exist_ok=True)
                log = open(out / name / "console.log", "w")
                procs[name] = launch(i, command, stdout=log, stderr=subprocess.STDOUT)
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
                       "bytes_sent": sum(a["bytes"] for a in averagings),
                       "utilization": 1 - summary["network_wait_s"] / max(1e-9, summary["train_s"])}
    wire = None
    if counter is not None:
        wire = {name: counter.samples()[i] for i, name in enumerate(PEERS)}
    return {"streaming": streaming, "wall_s": wall_s, "peers": peers, "wire": wire}


def bursts(samples: list[tuple[float, int]], rate_bytes_s: float, idle_fraction: float = 0.05,
           gap_s: float = 0.2) -> list[tuple[float, float, int]]:
    """The bursts of traffic in a counter's samples ``[(time, bytes so far), ...]``: stretches of intervals carrying
    more than ``idle_fraction`` of the link rate, joined across gaps shorter than ``gap_s``; ``(start, end, bytes)``
    each, the bytes of the busy intervals only."""
    found: list[list] = []
    for (t0, b0), (t1, b1) in zip(samples, samples[1:]):
        sent = b1 - b0
        if t1 <= t0 or sent <= idle_fraction * rate_bytes_s * (t1 - t0):
            continue
        if found and t0 - found[-1][1] < gap_s:
            found[-1][1] = t1
            found[-1][2] += sent
        else:
            found.append([t0, t1, sent])
    return [(start, end, sent) for start, end, sent in found]


def peak_window(samples: list[tuple[float, int]], window_s: float = 1.0) -> int:
    """The most bytes sent in any ``window_s`` of the samples."""
    peak, first = 0, 0
    for last in range(len(samples)):
        while samples[last][0] - samples[first][0] > window_s:
            first += 1
        peak = max(peak, samples[last][1] - samples[first][1])
    return peak


def longest_saturated(samples: list[tuple[float, int]], rate_bytes_s: float, fraction: float = 0.8,
                      bin_s: float = 0.1) -> float:
    """The longest stretch of consecutive ``bin_s`` bins (samples taken together, so that the jitter of single 20 ms
    samples does not cut a stretch) at ``fraction`` of the link rate or more, in seconds."""
    bins, start = [], 0
    for i in range(1, len(samples)):
        if samples[i][0] - samples[start][0] >= bin_s or i == len(samples) - 1:
            bins.append((samples[start], samples[i]))
            start = i
    longest = current = 0.0
    for (t0, b0), (t1, b1) in bins:
        if t1 > t0 and b1 - b0 >= fraction * rate_bytes_s * (t1 - t0):
            current += t1 - t0
            longest = max(longest, current)
        else:
            current = 0.0
    return longest


def wire_figures(samples: list[tuple[float, int]], rate_bytes_s: float, idle_fraction: float, gap_s: float) -> dict:
    found = bursts(samples, rate_bytes_s, idle_fraction, gap_s)
    span = samples[-1][0] - samples[0][0] if len(samples) > 1 else 0.0
    return {"peak_burst": max((b for _, _, b in found), default=0), "bursts": len(found),
            "peak_1s": peak_window(samples), "saturated_s": longest_saturated(samples, rate_bytes_s),
            "mean_rate": (samples[-1][1] - samples[0][1]) / span if span else 0.0,
            "bytes": samples[-1][1] - samples[0][1] if samples else 0}


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
    where = f"an emulated WAN at {args.wan:g} Mbit/s per link" if args.wan else "loopback"
    lines = [f"Streaming sync in real peers: a P = 1 and a P = 2 peer, tiny model, F = {args.fragments}, H = {args.h}, "
             f"{args.rounds} rounds, seeds {args.seed}, {args.seed + 1}; the default mode and compression; {where}", "",
             f"{'schedule':<12} {'peak in flight':>15} {'mean payload':>13} {'bytes sent':>11} {'averaged':>9} "
             f"{'wall':>7} {'eval loss':>10}"]
    base, wire_rows = None, []
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
        wire = None
        if result.get("wire"):
            rate = args.wan * 1e6 / 8
            # the run's last round ends on its last step for every fragment (all at once, by design: no fragment's
            # last steps are left out of the final model), so the steady state is what comes before it
            last_end = min(a["start"] for a in averagings if a["round"] == args.rounds - 1)
            per_peer, steady = [], []
            for samples in result["wire"].values():
                per_peer.append(wire_figures(samples, rate, args.idle_fraction, args.gap_s))
                steady.append(wire_figures([x for x in samples if x[0] < last_end], rate, args.idle_fraction,
                                           args.gap_s))
            wire = {key: max(f[key] for f in per_peer) for key in per_peer[0]}
            wire["steady"] = {key: max(f[key] for f in steady) for key in steady[0]}
            wire["utilization"] = min(p["utilization"] for p in result["peers"].values())
            wire_rows.append((name, wire))
        # the same before the run's last round end (every fragment's last round ends on the last step)
        steady = max(peak_in_flight([a for a in p["averagings"] if a["round"] < args.rounds - 1])
                     for p in result["peers"].values())
        lines[-1] += f"   (before the last round end: peak in flight {steady / 1e6:.3f} MB)"
        if base is None:
            base = (peak, loss, wire, steady)
        else:
            lines.append(f"staggered / all at once: peak in flight {base[0] / max(1, peak):.2f}x lower "
                         f"({base[3] / max(1, steady):.2f}x before the last round end), eval loss "
                         f"{100 * (loss - base[1]) / base[1]:+.2f}%")
            if wire is not None and base[2] is not None:
                for label, a, b in (("before the last round end", base[2]["steady"], wire["steady"]),
                                    ("whole run", base[2], wire)):
                    lines.append(f"on the wire, {label}: peak burst {a['peak_burst'] / max(1, b['peak_burst']):.2f}x "
                                 f"lower, peak 1 s {a['peak_1s'] / max(1, b['peak_1s']):.2f}x lower, longest "
                                 f"saturated stretch {a['saturated_s']:.2f} s -> {b['saturated_s']:.2f} s")
    if wire_rows:
        lines += ["", f"On the wire (bytes each peer put on its link, sampled every 20 ms; the largest over the peers; "
                      f"bursts: samples above {100 * args.idle_fraction:g}% of the link rate, gaps < {args.gap_s:g} s "
                      f"joined)",
                  f"{'schedule':<12} {'peak burst':>11} {'bursts':>7} {'peak 1 s':>9} {'saturated':>10} "
                  f"{'mean rate':>13} {'on the wire':>12} {'utilization':>12}"]
        for label, part in (("before the last round end (steady state)", "steady"), ("whole run", None)):
            lines.append(f"-- {label}")
            for name, wire in wire_rows:
                w = wire[part] if part else wire
                lines.append(f"{name:<12} {w['peak_burst'] / 1e6:>8.3f} MB {w['bursts']:>7} "
                             f"{w['peak_1s'] / 1e6:>6.3f} MB {w['saturated_s']:>8.2f} s "
                             f"{w['mean_rate'] * 8 / 1e6:>7.3f} Mbit/s {w['bytes'] / 1e6:>9.2f} MB "
                             f"{100 * wire['utilization']:>11.1f}%")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fragments", type=int, default=3, help="diloco.fragments F (>= 2)")
    parser.add_argument("--h", type=int, default=48, help="inner steps per round (>= F)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0, help="data seed of the first peer (the second: + 1)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="stop a swarm still running after this long")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("streaming-%Y%m%d-%H%M%S"))
    parser.add_argument("--wan", type=float, metavar="MBIT",
                        help="run on an emulated WAN with every link shaped to MBIT Mbit/s and count the bytes on "
                             "the wire (needs root)")
    parser.add_argument("--idle-fraction", type=float, default=0.05,
                        help="with --wan: a 20 ms sample is part of a burst above this share of the link rate")
    parser.add_argument("--gap-s", type=float, default=0.2, help="with --wan: shorter gaps do not end a burst")
    parser.add_argument("--peer-args", nargs=argparse.REMAINDER, default=[],
                        help="options given to every peer after the benchmark's own, to the end of the command line "
                             "(e.g. --peer-args --averaging.compression none)")
    parser.add_argument("--report-only", action="store_true",
                        help="print the report of the results.json already in --out, without running anything")
    args = parser.parse_args()
    if args.report_only:
        print(report(json.loads((args.out / "results.json").read_text()), args))
        return
    if args.fragments < 2 or args.h < args.fragments:
        parser.error("--fragments must be >= 2 and --h >= --fragments (one fragment per step at most)")
    if args.wan is not None and args.wan <= 0:
        parser.error("--wan must be a rate in Mbit/s above 0")
    results = []
    with EmulatedWAN(len(PEERS) + 1, args.wan) if args.wan else contextlib.nullcontext() as wan:
        for streaming in (False, True):
            print(f"running {'staggered' if streaming else 'all at once'} ...", flush=True)
            results.append(run_swarm(args.out / ("staggered" if streaming else "all-at-once"), args, streaming,
                                     wan))
            if wan is not None:
                wan.stop_processes()
    text = report(results, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.txt").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
