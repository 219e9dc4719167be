"""How a swarm's cost grows with its size: swarms of N peers of the tiny model, each run to its end.

Loopback: ``p2p-diloco swarm --peers N`` for every N of --peers (default 2 4 8 12 16), all processes on this
machine. Emulated WAN (root only, ``--netns 2 4 8``): one peer per network namespace with links shaped to --rate
Mbit/s (``benchmarks/netns.py``'s EmulatedWAN), plus the bootstrap node in its own. The setting: the tiny
model, H = 20, 4 rounds, one thread a peer, the default mode (delayed, adaptive compression: int8 on the tiny
model). So that 16 peers fit 2 cores, every peer's compute is slowed (``train.slowdown`` = --slowdown, 16 by
default: a peer sleeps 15 times its step's time after each step, so N peers ask N/16 of a core for training,
whatever N) and its steps are shorter than 4 x 64 tokens: 2 x 32 (with 4 x 64 and the slowdown, a step takes
3-6 s on 2 busy cores, too coarse for the matchmaking window); the swarms of --crowded peers or more
(12 by default) get the timeouts of the crowded tests (matchmaking 15 s, requests 6 s, rounds and all-reduces
90 s, a silent sender 20 s) against CPU starvation, the others the demo's (10, 3, 60, 60, 10 s).

Per N: the share of the N x rounds round ends that applied a group's average, the group sizes formed (and the share
of round ends in one group of all N), matchmaking time (from the averaging step's start to the group that averaged:
``compression.matched_s`` of the round rows), all-reduce time (``compression.reduce_s``), the training loop's wait
at round ends, bytes sent per peer per round, peak memory of each process of a peer (training, DHT, averager,
p2pd: proportional set size, so that pages the forked processes share count once), DHT record reads per peer per
round, and how many final models the run ended on. Beside them, ``p2p-diloco plan``'s bytes per round and transfer
time at --rate for the codec's measured bits, and a line fitted to the matchmaking times (the plan's
``--latency-per-peer-s``). Outputs in --out: results.json (everything), report.txt (the table), scale.png (each
curve against N).

    .venv/bin/python benchmarks/scale.py --out benchmarks/results/scale             # loopback, N = 2..16
    sudo .venv/bin/python benchmarks/scale.py --peers --netns 2 4 8 --out ...       # the emulated WAN only
    .venv/bin/python benchmarks/scale.py --report-only --out benchmarks/results/scale
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_report import report_text, summarize, write_plot  # noqa: E402

SETTING = ["--model.preset", "tiny", "--data.batch_size", "2", "--data.seq_len", "32", "--diloco.inner_steps", "20",
           "--train.num_rounds", "4", "--data.eval_batches", "4", "--checkpoint.every_rounds", "0",
           "--train.log_every", "5", "--train.progress", "false", "--train.anchor_digest", "true"]
DEMO_TIMEOUTS = ["--averaging.matchmaking_time_s", "10", "--averaging.request_timeout_s", "3",
                 "--averaging.round_timeout_s", "60", "--averaging.allreduce_timeout_s", "60",
                 "--averaging.next_chunk_timeout_s", "10"]
CROWDED_TIMEOUTS = ["--averaging.matchmaking_time_s", "15", "--averaging.request_timeout_s", "6",
                    "--averaging.round_timeout_s", "90", "--averaging.allreduce_timeout_s", "90",
                    "--averaging.next_chunk_timeout_s", "20"]


def overrides(args, num_peers: int) -> list[str]:
    timeouts = CROWDED_TIMEOUTS if num_peers >= args.crowded else DEMO_TIMEOUTS
    return [*SETTING, "--train.num_rounds", str(args.rounds), "--train.slowdown", str(args.slowdown), *timeouts]


class MemorySampler:
    """Peak memory of each process of each peer under ``root`` (a peer's training process is the one started with
    ``--output-dir <root>/peer<i>``; its children are its DHT process, which runs the p2p daemon, and its averager),
    read from /proc every ``period_s``: proportional set size (``Pss`` of smaps_rollup) and resident set size."""

    def __init__(self, root: Path, period_s: float = 2.0):
        self.root, self.period_s = str(root), period_s
        self.peaks: dict[str, dict[str, dict[str, float]]] = {}  # peer -> kind -> {"pss_mb", "rss_mb"}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except OSError:  # a process left between two reads
                continue

    def sample(self) -> None:
        processes = _processes()
        for pid, (_, cmdline) in processes.items():
            marker = f"{self.root}/peer"
            if " peer " not in f" {cmdline} " or marker not in cmdline:
                continue
            peer = cmdline.split(marker, 1)[1].split()[0].split("/")[0]
            kinds = {pid: "training"}
            for child, (parent, child_cmd) in processes.items():
                if parent != pid:
                    continue
                has_daemon = any(p == child and "p2pd" in c for p, c in processes.values())
                kinds[child] = "p2pd" if "p2pd" in child_cmd else "dht" if has_daemon else "averager"
                for grandchild, (grandparent, grand_cmd) in processes.items():
                    if grandparent == child and "p2pd" in grand_cmd:
                        kinds[grandchild] = "p2pd"
            for member, kind in kinds.items():
                usage = _memory_mb(member)
                if usage is None:
                    continue
                peak = self.peaks.setdefault(f"peer{peer}", {}).setdefault(kind, {"pss_mb": 0.0, "rss_mb": 0.0})
                for key, value in usage.items():
                    peak[key] = max(peak[key], value)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    return found


def _memory_mb(pid: int) -> dict[str, float] | None:
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    pss = next((int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")), 0)
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return {"pss_mb": pss / 1024, "rss_mb": rss / 1024}


def run_loopback(args, num_peers: int) -> dict:
    """``p2p-diloco swarm --peers N``; what it measured, with the memory sampled meanwhile."""
    root = args.out / f"loopback-{num_peers}"
    command = [sys.executable, "-m", "p2p_diloco", "swarm", "--peers", str(num_peers), "--output-dir", str(root),
               "--sample-tokens", "0", "--peer-timeout", str(args.peer_timeout), "--run.run_id",
               f"scale-{num_peers}", *overrides(args, num_peers)]
    root.mkdir(parents=True, exist_ok=True)
    started, load = time.monotonic(), os.getloadavg()
    with MemorySampler(root) as memory, open(root / "swarm-console.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT))).returncode
    return {"where": "loopback", "num_peers": num_peers, "exit_code": code, "wall_s": time.monotonic() - started,
            "load_before": load, "load_after": os.getloadavg(), "memory": memory.peaks,
            "timeouts": "crowded" if num_peers >= args.crowded else "demo", "command": command[2:]}


def run_netns(args, num_peers: int) -> dict:
    """One peer per namespace, links shaped to ``args.rate``; the bootstrap node in a namespace of its own."""
    from namespaces import existing_namespaces
    from netns import PREFIX, EmulatedWAN

    from p2p_diloco.config import dump_config, load_config

    if existing_namespaces(PREFIX):
        raise SystemExit(f"emulated-WAN namespaces exist already ({existing_namespaces(PREFIX)}): another run is using "
                         "them, and EmulatedWAN would remove them")
    root = args.out / f"netns-{num_peers}"
    root.mkdir(parents=True, exist_ok=True)
    pairs = overrides(args, num_peers)
    cfg = load_config(None, [(pairs[i].removeprefix("--"), pairs[i + 1]) for i in range(0, len(pairs), 2)] +
                      [("run.run_id", f"scale-netns-{num_peers}"), ("averaging.target_group_size", str(num_peers)),
                       ("train.wait_for_peers", str(num_peers))])
    (root / "swarm.toml").write_text(dump_config(cfg))
    started, load = time.monotonic(), os.getloadavg()
    with EmulatedWAN(num_peers + 1, rate_mbit=args.rate) as wan, MemorySampler(root) as memory:
        maddrs = _start_netns_bootstrap(wan, num_peers, root)
        peers = []
        for i in range(num_peers):
            folder = root / f"peer{i}"
            folder.mkdir(exist_ok=True)
            command = [sys.executable, "-m", "p2p_diloco", "peer", "--config", str(root / "swarm.toml"),
                       "--initial-peers", *maddrs, "--host-maddrs", f"/ip4/{wan.ip(i)}/tcp/0", "--output-dir",
                       str(folder), "--run.num_threads", "1", "--data.seed", str(i)]
            peers.append(wan.popen(i, command, stdout=open(folder / "console.log", "w"), stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONPATH=str(ROOT))))
        codes = [peer.wait(timeout=args.peer_timeout) for peer in peers]
    return {"where": "netns", "num_peers": num_peers, "rate_mbit": args.rate, "exit_code": max(codes),
            "wall_s": time.monotonic() - started, "load_before": load, "load_after": os.getloadavg(),
            "memory": memory.peaks, "timeouts": "crowded" if num_peers >= args.crowded else "demo"}


def _start_netns_bootstrap(wan, host: int, root: Path) -> list[str]:
    maddrs_file = root / "bootstrap.maddrs"
    wan.popen(host, [sys.executable, "-m", "p2p_diloco", "bootstrap", "--host-maddrs", f"/ip4/{wan.ip(host)}/tcp/0",
                     "--identity-path", str(root / "bootstrap.id"), "--maddrs-file", str(maddrs_file)],
              stdout=open(root / "bootstrap.log", "w"), stderr=subprocess.STDOUT,
              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.monotonic() + 120
    while not (maddrs_file.exists() and maddrs_file.read_text().strip()):
        if time.monotonic() > deadline:
            raise RuntimeError("the bootstrap node did not start")
        time.sleep(0.2)
    return maddrs_file.read_text().split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="*", default=[2, 4, 8, 12, 16], help="loopback swarm sizes")
    parser.add_argument("--netns", type=int, nargs="*", default=[], help="emulated-WAN swarm sizes (root)")
    parser.add_argument("--rate", type=float, default=20.0, help="emulated link rate, Mbit/s (default 20)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--slowdown", type=float, default=16.0, help="train.slowdown of every peer (default 16)")
    parser.add_argument("--crowded", type=int, default=12, help="from this N on, the crowded timeouts (default 12)")
    parser.add_argument("--peer-timeout", type=float, default=1500.0, help="stop a swarm after this long")
    parser.add_argument("--out", type=Path, default=Path("runs/scale"))
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from --out's runs")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    runs_path = args.out / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    if not args.report_only:
        for where, sizes, run in (("loopback", args.peers, run_loopback), ("netns", args.netns, run_netns)):
            for num_peers in sizes:
                print(f"{where}: {num_peers} peers (load {os.getloadavg()[0]:.1f})...", flush=True)
                runs[f"{where}-{num_peers}"] = run(args, num_peers)
                runs_path.write_text(json.dumps(runs, indent=1))
                print(f"  done in {runs[f'{where}-{num_peers}']['wall_s']:.0f} s", flush=True)
    results = {key: summarize(args.out / key, run, args.rounds) for key, run in sorted(runs.items())}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report_text(results, args)
    (args.out / "report.txt").write_text(text)
    write_plot(results, args.out / "scale.png", args.rate)
    print(text)


if __name__ == "__main__":
    main()
