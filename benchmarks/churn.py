"""The churn benchmark: a swarm whose peers are killed with SIGKILL and restarted all the time.

Part 1 (`churn`, loopback): 4 peers and a bootstrap node, real processes. Once per round a random peer is killed
with SIGKILL at a random moment of the round and restarted at once on its output folder (it resumes from its
last checkpoint, and reloads the swarm's state if it fell behind). Side by side, the same swarm with no churn
and the same rounds. Reported:
- the round ends of the survivors that followed each kill: completed out of attempted, averaged or fallen back,
  and how long they took (the swarm must not stall on a vanished peer);
- for every restart, the round ends the peer needed to hold the others' anchor again (bit-identical digest);
- eval loss of the final anchors against the churn-free run, with the tokens each run trained;
- memory: resident set (all processes of a peer: trainer, DHT, averager, p2pd) of the longest-lived peer
  incarnation, first against last sample, over the rounds it lived.

Part 2 (`download`, needs root): hosts in network namespaces with links shaped by tc tbf
(benchmarks/netns.py). A peer trains alone on one host; a newcomer on another host joins and downloads the
stage's state through hivemind's state sharing. Reported: download time against state bytes / link rate
(target: at most 1.5x).

    .venv/bin/python benchmarks/churn.py --only churn
    sudo .venv/bin/python benchmarks/churn.py --only download --rates 20,50
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_bootstrap import start_bootstrap  # noqa: E402

from p2p_diloco.training.metrics import read_metrics  # noqa: E402

TINY = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "64", "--data.eval_batches", "8",
        "--train.log_every", "10", "--train.progress", "false", "--run.num_threads", "1",
        "--train.eval_every_rounds", "0"]
AVERAGING = ["--averaging.request_timeout_s", "2", "--averaging.round_timeout_s", "15",
             "--averaging.allreduce_timeout_s", "15", "--averaging.next_chunk_timeout_s", "5"]


def _events(folder: Path, kind: str) -> list[dict]:
    path = folder / "metrics-stage0.jsonl"
    return [e for e in read_metrics(path) if e["kind"] == kind] if path.exists() else []


def _rss_mb(pgid: int) -> float:
    """Resident set of every process of a process group (the peer and its DHT/averager/p2pd children)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields after the command: state ppid pgrp ...
                continue
            with open(f"/proc/{entry}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return total / 1024


class Swarm:
    """A bootstrap node and peers as process groups of their own (so that a kill takes all of a peer)."""

    def __init__(self, out: Path, args):
        self.out, self.args = out, args
        out.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.bootstrap, self.maddrs = start_bootstrap(out, log=open(out / "bootstrap.log", "w"),
                                                      start_new_session=True, cwd=ROOT)

    def command(self, name: str, run_id: str) -> list[str]:
        a = self.args
        return [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *self.maddrs,
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", run_id, "--output-dir", str(self.out / name),
                "--train.num_rounds", str(a.rounds), "--diloco.inner_steps", str(a.h),
                "--checkpoint.every_rounds", "1", "--train.wait_for_peers", str(a.peers), *TINY, *AVERAGING,
                "--averaging.matchmaking_time_s", str(a.matchmaking_s)]

    def start(self, name: str, run_id: str) -> subprocess.Popen:
        (self.out / name).mkdir(parents=True, exist_ok=True)
        log = open(self.out / name / "console.log", "a")
        proc = subprocess.Popen(self.command(name, run_id), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=ROOT)
        self.procs[name] = proc
        return proc

    def close(self) -> None:
        for proc in [*self.procs.values(), self.bootstrap]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_swarm(out: Path, args, churn: bool) -> dict:
    swarm = Swarm(out, args)
    names = [f"peer{i}" for i in range(args.peers)]
    rng = random.Random(args.seed)
    kills, restarts, rss = [], [], collections.defaultdict(list)  # rss: incarnation -> [(round, MB)]
    incarnation = {name: 0 for name in names}
    try:
        for name in names:
            swarm.start(name, "churn" if churn else "calm")
        next_sample, last_kill_round = 0.0, 0
        while any(p.poll() is None for p in swarm.procs.values()):
            time.sleep(0.2)
            swarm_round = max((e["round_index"] for n in names for e in _events(out / n, "round")), default=-1) + 1
            if time.monotonic() >= next_sample:
                next_sample = time.monotonic() + 2.0
                for name, proc in swarm.procs.items():
                    if proc.poll() is None:
                        rss[f"{name}#{incarnation[name]}"].append((swarm_round, _rss_mb(proc.pid)))
            if churn and 1 <= swarm_round < args.rounds - 1 and swarm_round > last_kill_round:
                last_kill_round = swarm_round
                time.sleep(rng.uniform(0.0, args.kill_window_s))  # somewhere in the round: training or averaging
                alive = [n for n in names if swarm.procs[n].poll() is None]
                if not alive:
                    continue
                victim = rng.choice(alive)
                os.killpg(swarm.procs[victim].pid, signal.SIGKILL)
                swarm.procs[victim].wait()
                killed_at = time.time()
                kills.append({"peer": victim, "time": killed_at, "swarm_round": swarm_round})
                print(f"  round {swarm_round}: killed {victim} (SIGKILL), restarting it", flush=True)
                incarnation[victim] += 1
                swarm.start(victim, "churn")
                restarts.append({"peer": victim, "time": time.time()})
        codes = {name: proc.returncode for name, proc in swarm.procs.items()}
    finally:
        swarm.close()
    return analyse(out, args, names, kills, restarts, rss, codes)


def analyse(out: Path, args, names, kills, restarts, rss, codes) -> dict:
    rounds = {n: _events(out / n, "round") for n in names}
    syncs = {n: _events(out / n, "sync") for n in names}
    summaries = {n: json.loads((out / n / "summary-stage0.json").read_text())
                 for n in names if (out / n / "summary-stage0.json").exists()}
    # the swarm's anchor after each applied round: the digest most peers reported
    votes = collections.defaultdict(collections.Counter)
    for n in names:
        for e in rounds[n]:
            if e["anchor_applied_round"] >= 0:
                votes[e["anchor_applied_round"]][e["anchor_sha256"]] += 1
    reference = {r: c.most_common(1)[0][0] for r, c in votes.items()}

    # survivors: the next round end of every other peer after each kill that applies a round (attempted: every
    # survivor that had not ended its last round yet; completed: those that applied a round after the kill; one that
    # never did, because it hung or died, counts as attempted and not completed). The first round end of an overlap
    # mode applies nothing (its round's average lands a round later): it cannot count as averaged or as not.
    attempted = completed = averaged = 0
    delays = []
    for kill in kills:
        for n in names:
            if n == kill["peer"]:
                continue
            if any(e["round_index"] >= args.rounds - 1 for e in rounds[n] if e["time"] <= kill["time"]):
                continue  # it had finished its rounds
            attempted += 1
            later = [e for e in rounds[n] if e["time"] > kill["time"] and e["applied_round"] is not None]
            if not later:
                continue
            first = later[0]
            completed += 1
            averaged += bool(first["averaged"])
            delays.append(first["time"] - kill["time"])

    # restarted peers: round ends until they hold the swarm's anchor again
    to_sync = []
    for restart in restarts:
        n = restart["peer"]
        nxt = [r["time"] for r in restarts if r["peer"] == n and r["time"] > restart["time"]]
        until = min(nxt) if nxt else float("inf")
        timeline = sorted([e for e in rounds[n] + syncs[n] if restart["time"] <= e["time"] < until],
                          key=lambda e: e["time"])
        count, found = 0, None
        for e in timeline:
            count += e["kind"] == "round"
            applied = e["anchor_applied_round"] if e["kind"] == "round" else e["applied_round"]
            if reference.get(applied) == e["anchor_sha256"]:
                found = count
                break
        round_ends = sum(e["kind"] == "round" for e in timeline)
        # None: it never held the swarm's anchor before it was killed again (or the run ended)
        to_sync.append({"peer": n, "rounds": found, "round_ends_before_next_kill": round_ends,
                        "killed_again": bool(nxt)})

    growth = []
    for key, samples in rss.items():  # from two rounds after the incarnation started (start-up excluded)
        settled = [x for x in samples if x[0] >= samples[0][0] + 2]
        if len(settled) >= 4 and settled[-1][0] - settled[0][0] >= 3:
            growth.append({"incarnation": key, "rounds": settled[-1][0] - settled[0][0],
                           "first_mb": settled[0][1], "last_mb": settled[-1][1],
                           "max_mb": max(mb for _, mb in settled)})
    longest = max(growth, key=lambda g: g["rounds"], default=None)
    s = list(summaries.values())
    return {
        "exit_codes": codes, "kills": len(kills),
        "survivor_round_ends": {"attempted": attempted, "completed": completed, "averaged": averaged,
                                "median_s_after_kill": statistics.median(delays) if delays else None,
                                "max_s_after_kill": max(delays) if delays else None},
        "rounds_to_resync": to_sync,
        "eval_loss": statistics.mean(x["eval_loss_final"] for x in s) if s else None,
        "eval_losses": {n: x["eval_loss_final"] for n, x in summaries.items()},
        "tokens": sum(x["tokens"] for x in s), "averaged_rounds": sum(x["averaged_rounds"] for x in s),
        "fallback_rounds": sum(x["fallback_rounds"] for x in s), "reloads": sum(x.get("reloads", 0) for x in s),
        "resyncs": sum(x.get("resyncs", 0) for x in s), "joins": sum(x.get("joins", 0) for x in s),
        "leaves": sum(x.get("leaves", 0) for x in s),
        "memory": longest, "peak_rss_mb": max((mb for v in rss.values() for _, mb in v), default=None),
        "rss_samples": dict(rss), "kill_log": kills,
    }


def run_download(out: Path, args) -> dict:
    """A donor alone on host 0; a newcomer on host 1 joins after round 2 and downloads the state."""
    from netns import EmulatedWAN, measure_rate

    results = {}
    with EmulatedWAN(3, rate_mbit=None) as wan:
        for rate in args.rates:
            wan.set_rate(rate)
            measured = measure_rate(wan, megabytes=max(2.0, rate * 0.1))
            folder = out / f"{rate}mbit"
            folder.mkdir(parents=True, exist_ok=True)
            _, maddrs = start_bootstrap(folder, host=wan.ip(2), log=open(folder / "bootstrap.log", "w"),
                                        popen=lambda command, **kw: wan.popen(2, command, **kw), cwd=ROOT)

            def peer(host: int, name: str, rounds: int, folder=folder, maddrs=maddrs, rate=rate):
                command = [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers",
                           *maddrs, "--host-maddrs", f"/ip4/{wan.ip(host)}/tcp/0",
                           "--run-id", f"dl{rate}", "--output-dir", str(folder / name),
                           "--train.num_rounds", str(rounds), "--diloco.inner_steps", str(args.h),
                           "--train.state_timeout_s", "600", *args.model, *TINY_COMMON, *AVERAGING,
                           "--averaging.matchmaking_time_s", str(args.matchmaking_s)]
                (folder / name).mkdir(parents=True, exist_ok=True)
                return wan.popen(host, command, stdout=open(folder / name / "console.log", "w"),
                                 stderr=subprocess.STDOUT, cwd=ROOT)

            donor = peer(0, "donor", 1000)
            while len(_events(folder / "donor", "round")) < 2:
                if donor.poll() is not None:
                    raise RuntimeError(f"the donor exited; see {folder / 'donor'}")
                time.sleep(0.5)
            newcomer = peer(1, "newcomer", 1000)  # stopped once it has downloaded the state
            while not _events(folder / "newcomer", "sync"):
                if newcomer.poll() is not None:
                    raise RuntimeError(f"the newcomer exited without a state download; see {folder / 'newcomer'}")
                time.sleep(0.5)
            event = _events(folder / "newcomer", "sync")[0]
            wan.stop_processes()
            ideal = event["state_bytes"] * 8 / (rate * 1e6)
            results[str(rate)] = {"measured_mbit": measured, "state_bytes": event["state_bytes"],
                                  "download_s": event["download_s"], "ideal_s": ideal,
                                  "ratio": event["download_s"] / ideal}
            print(f"{rate} Mbit/s: state {event['state_bytes'] / 1e6:.1f} MB downloaded in "
                  f"{event['download_s']:.1f} s; bytes / rate = {ideal:.1f} s; ratio {event['download_s'] / ideal:.2f}",
                  flush=True)
    return results


TINY_COMMON = ["--data.eval_batches", "2", "--train.log_every", "10", "--train.progress", "false",
               "--run.num_threads", "1", "--train.eval_every_rounds", "0", "--checkpoint.every_rounds", "0"]


def _resync_text(entry: dict) -> str:
    if entry["rounds"] is not None:
        return str(entry["rounds"])
    return f"killed again after {entry['round_ends_before_next_kill']}" if entry["killed_again"] else "never"


def report(results: dict, args) -> str:
    lines = []
    if "churn" in results:
        calm, churn = results["calm"], results["churn"]
        s = churn["survivor_round_ends"]
        lines += [f"{args.peers} peers, H = {args.h}, {args.rounds} rounds; one random peer killed (SIGKILL) and "
                  f"restarted every round: {churn['kills']} kills",
                  f"survivors' next round end after a kill: {s['completed']}/{s['attempted']} completed, "
                  f"{s['averaged']} of them averaged; median {s['median_s_after_kill']:.1f} s after the kill, "
                  f"max {s['max_s_after_kill']:.1f} s",
                  "round ends a restarted peer needed to hold the swarm's anchor again: "
                  + ", ".join(_resync_text(x) for x in churn["rounds_to_resync"]),
                  "",
                  "run     eval loss  tokens     averaged  fallback  reloads  resyncs  joins  leaves",
                  ]
        for name, r in (("calm", calm), ("churn", churn)):
            lines.append(f"{name:<7} {r['eval_loss']:.4f}     {r['tokens']:<9,}  {r['averaged_rounds']:>8}  "
                         f"{r['fallback_rounds']:>8}  {r['reloads']:>7}  {r['resyncs']:>7}  {r['joins']:>5}  "
                         f"{r['leaves']:>6}")
        gap = (churn["eval_loss"] - calm["eval_loss"]) / calm["eval_loss"]
        lines.append(f"eval loss with churn vs without: {gap:+.2%}")
        m = churn["memory"]
        if m:
            lines.append(f"memory (RSS of all its processes) of the longest-lived peer ({m['incarnation']}, "
                         f"{m['rounds']} rounds after start-up): {m['first_mb']:.0f} MB -> {m['last_mb']:.0f} MB "
                         f"({(m['last_mb'] - m['first_mb']) / m['rounds']:+.1f} MB per round), "
                         f"max {m['max_mb']:.0f} MB")
    if "download" in results:
        lines += ["", "link Mbit/s (measured)  state MB  download s  bytes/rate s  ratio"]
        for rate, r in results["download"].items():
            lines.append(f"{rate:>11} ({r['measured_mbit']:6.1f})  {r['state_bytes'] / 1e6:8.1f}  "
                         f"{r['download_s']:10.1f}  {r['ideal_s']:12.1f}  {r['ratio']:5.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["churn", "download"], help="run one part (default: both)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--h", type=int, default=100, help="inner steps per round")
    parser.add_argument("--kill-window-s", type=float, default=4.0,
                        help="a kill happens this many seconds at most after a new round starts")
    parser.add_argument("--matchmaking-s", type=float, default=6.0,
                        help="averaging.matchmaking_time_s of the peers: in `delayed` mode matchmaking overlaps "
                             "the next round, so it can wait for peers whose round ends a few seconds later (4 "
                             "peers on 2 cores drift that far apart; at 3 s a calm swarm kept splitting into pairs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rates", type=lambda s: [int(x) for x in s.split(",")], default=[20, 50],
                        help="link rates (Mbit/s) of the download part, comma-separated")
    parser.add_argument("--model", nargs="*", default=[
        "--model.preset", "small", "--model.dim", "256", "--model.n_layers", "4", "--model.n_heads", "8",
        "--model.n_kv_heads", "8", "--model.ffn_dim", "704", "--data.batch_size", "8", "--data.seq_len", "128"],
        help="model arguments of the download part (default: the WAN benchmark's 3.35M-parameter model)")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("churn-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    if args.only in (None, "churn"):
        print("churn-free run ...", flush=True)
        results["calm"] = run_swarm(args.out / "calm", args, churn=False)
        print("run with churn ...", flush=True)
        results["churn"] = run_swarm(args.out / "churn", args, churn=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    if args.only in (None, "download"):
        results["download"] = run_download(args.out / "download", args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "report.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
