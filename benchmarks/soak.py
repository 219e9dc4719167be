"""The soak benchmark: a swarm run for an hour, with churn, watching every process for what grows.

A bootstrap node and ``--peers`` peers on 127.0.0.1, real processes: peer0 with 2 pipeline stages, the others with
one; the run averaged by fragment with streaming sync on (``diloco.fragments`` 3, ``diloco.streaming`` true), the
tiny model, short rounds, a checkpoint every round (``checkpoint.keep`` bounds them). Every ``--kill-every``
minutes one peer other than peer0 (in turn) is killed with SIGKILL and restarted at once on its folder (it resumes
from its checkpoint); peer0 lives through the run, so its processes show a whole run's growth.

Sampled every ``--sample-s`` seconds, for every process of every peer and of the bootstrap node (the tree of
descendants of each launched process; the averager and DHT processes name themselves ``diloco-avg`` and
``diloco-dht``, the daemons are ``p2pd``): resident set (RSS) and proportional set (PSS, from
``/proc/PID/smaps_rollup``: shared pages split among their users, so the sum over processes is the swarm's memory),
open file descriptors, threads; the disk used by each peer's checkpoints and by its logs and metrics; and the DHT
records readers see (a client node of this script reads the run's progress, config and state-sharing keys).

Reported, per process that lived past the warm-up (``--warmup`` minutes after its start): PSS and RSS at the end of
the warm-up and at its last sample, growth in %, and its rate in MB/hour; descriptors and threads, first against
last. Targets (the issue's): RSS growth after the warm-up at most 5% per process, descriptors and threads flat,
checkpoint disk bounded by ``checkpoint.keep``, no round failing in the calm stretches (rounds that end more than
``--calm-after`` minutes after a kill and restart; peers still starting up excluded). A JSON report with every
sample is written next to the text report.

    .venv/bin/python benchmarks/soak.py --minutes 60 --peers 3 --kill-every 10 --out runs/soak
    .venv/bin/python benchmarks/soak.py --minutes 12 --kill-every 0 --env MALLOC_ARENA_MAX=2   # a diagnostic run

``P2P_DILOCO_MEMTRACE=N`` in ``--env`` makes the training and averager processes log tracemalloc's top growth and
the gc object counts that grew every N rounds (:mod:`p2p_diloco.monitoring.memtrace`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_bootstrap import start_bootstrap  # noqa: E402

from p2p_diloco.training.metrics import read_metrics  # noqa: E402

RUN_ID = "soak"
TINY = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "64", "--data.eval_batches", "2",
        "--train.log_every", "10", "--train.progress", "false", "--run.num_threads", "1",
        "--train.eval_every_rounds", "0"]
AVERAGING = ["--averaging.matchmaking_time_s", "4", "--averaging.request_timeout_s", "3",
             "--averaging.round_timeout_s", "20", "--averaging.allreduce_timeout_s", "20",
             "--averaging.next_chunk_timeout_s", "10"]
GROWTH_TARGET = 0.05


# ---- sampling /proc ------------------------------------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def process_tree(root_pid: int, children: dict[int, list[int]]) -> dict[int, str]:
    """pid -> role of ``root_pid`` and its descendants: ``main``, then each child by its name under its parent's
    (``main/diloco-dht/p2pd``), numbered among same-named siblings in pid order; python children of ``main`` are the
    stage processes of a pipelined peer (``main/stage1``)."""
    roles: dict[int, str] = {}

    def walk(pid: int, role: str) -> None:
        roles[pid] = role
        named = []
        for child in sorted(children.get(pid, [])):
            try:
                name = _comm(child)
            except OSError:
                continue
            named.append((child, "stage" if name.startswith("python") and role == "main" else name))
        totals = collections.Counter(name for _child, name in named)
        seen: collections.Counter = collections.Counter()
        for child, name in named:
            seen[name] += 1
            walk(child, f"{role}/{name}{seen[name]}" if totals[name] > 1 or name == "stage" else f"{role}/{name}")

    walk(root_pid, "main")
    return roles


def sample_process(pid: int) -> dict | None:
    """RSS (and its anonymous and shared-memory parts), PSS (KB), open descriptors (and those of shared memory:
    torch's tensors shared between processes each hold one) and threads of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/smaps_rollup") as f:
            rollup = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[-1] == "kB"}
        fds = shm_fds = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            fds += 1
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            shm_fds += target.startswith(("/dev/shm/", "/memfd:"))
    except (OSError, ValueError):
        return None

    def kb(field: str) -> int:
        return int(status.get(field, "0 kB").split()[0])

    return {"rss_kb": kb("VmRSS"), "pss_kb": rollup.get("Pss"), "fds": fds, "threads": kb("Threads"),
            "anon_kb": kb("RssAnon"), "shmem_kb": kb("RssShmem"), "shm_fds": shm_fds,
            "pss_anon_kb": rollup.get("Pss_Anon"), "private_kb": rollup.get("Private_Dirty")}


SAMPLE_FIELDS = ("rss_kb", "pss_kb", "fds", "threads", "anon_kb", "shmem_kb", "shm_fds", "pss_anon_kb", "private_kb")
"""The columns of a process's samples, after the minute."""


def folder_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total / 2**20


class DHTCounter:
    """A client DHT node that counts the records of the run readers see: progress entries (one per live stage
    process and fragment), config entries, state-sharing declarations of the averagers."""

    def __init__(self, maddrs: list[str], fragments: int):
        from p2p_diloco.config.network import DHTConfig
        from p2p_diloco.swarm import start_dht
        from p2p_diloco.swarm.discovery.averager_keys import averager_prefixes
        from p2p_diloco.swarm.discovery.progress import progress_key, records_run
        from p2p_diloco.swarm.discovery.records import run_record_validators

        self.dht = start_dht(DHTConfig(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True),
                             record_validators=run_record_validators(RUN_ID), check_identity_free=False)
        runs = [records_run(RUN_ID, (f, fragments)) for f in range(fragments)] or [RUN_ID]
        self.keys = {"progress": [progress_key(run) for run in runs], "config": [f"{RUN_ID}_config"],
                     "all_averagers": [f"{p}.all_averagers" for p in averager_prefixes(RUN_ID, 1, fragments)]}

    def count(self) -> dict:
        counts = {}
        for kind, keys in self.keys.items():
            total = 0
            for key in keys:
                try:
                    found = self.dht.get(key, latest=True)
                except Exception:  # noqa: BLE001 (a count is a sample: a failed read counts as none)
                    found = None
                if found is not None and isinstance(found.value, dict):
                    total += len(found.value)
            counts[kind] = total
        return counts

    def close(self) -> None:
        self.dht.shutdown()


# ---- the swarm -----------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, args):
        self.args, self.out = args, args.out
        self.env = dict(os.environ, **dict(item.split("=", 1) for item in args.env))
        self.names = [f"peer{i}" for i in range(args.peers)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.incarnation = {name: 0 for name in self.names}
        self.started_at: dict[str, float] = {}
        self.samples: dict[str, list] = {}  # "peer#incarnation/role" -> [[minute, *SAMPLE_FIELDS], ...]
        self.disk: list = []  # [minute, checkpoints MB, logs MB]
        self.records: list = []  # [minute, counts]
        self.kills: list = []  # [minute of the kill, peer]
        self.t0 = time.monotonic()
        self.bootstrap, self.maddrs = start_bootstrap(self.out, log=open(self.out / "bootstrap.log", "w"),
                                                      start_new_session=True, cwd=ROOT, env=self.env)
        self.started_at["bootstrap"] = 0.0

    def minute(self) -> float:
        return (time.monotonic() - self.t0) / 60

    def start(self, name: str) -> None:
        a = self.args
        split = ["--stages", "2"] if name == "peer0" else ["--stages", "1"]
        command = [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *self.maddrs, "--host-maddrs",
                   "/ip4/127.0.0.1/tcp/0", "--run-id", RUN_ID, "--output-dir", str(self.out / name),
                   "--train.num_rounds", "100000", "--diloco.inner_steps", str(a.h), "--diloco.fragments",
                   str(a.fragments), "--diloco.streaming", "true", "--checkpoint.every_rounds", "1",
                   "--checkpoint.keep", str(a.keep), "--train.wait_for_peers", str(a.peers),
                   "--data.seed", str(self.names.index(name)), *split, *TINY, *AVERAGING, *a.peer_args]
        (self.out / name).mkdir(parents=True, exist_ok=True)
        log = open(self.out / name / "console.log", "a")
        env = dict(self.env, **dict(item.split(":", 1)[1].split("=", 1) for item in a.peer_env
                                    if item.split(":", 1)[0] == name))
        self.procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            cwd=ROOT, env=env)
        self.started_at[f"{name}#{self.incarnation[name]}"] = self.minute()

    def kill_and_restart(self, name: str) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.kills.append([round(self.minute(), 2), name])
        print(f"  minute {self.minute():.1f}: killed {name} (SIGKILL), restarting it", flush=True)
        self.incarnation[name] += 1
        self.start(name)

    def sample(self) -> None:
        minute = round(self.minute(), 2)
        children = _children_map()
        roots = {f"{n}#{self.incarnation[n]}": p.pid for n, p in self.procs.items() if p.poll() is None}
        roots["bootstrap"] = self.bootstrap.pid
        for key, pid in roots.items():
            for child, role in process_tree(pid, children).items():
                found = sample_process(child)
                if found is not None:
                    self.samples.setdefault(f"{key}/{role}", []).append(
                        [minute, *(found[field] for field in SAMPLE_FIELDS)])
        checkpoints = sum(folder_mb(self.out / n / "checkpoints") for n in self.names)
        total = sum(folder_mb(self.out / n) for n in self.names)
        self.disk.append([minute, round(checkpoints, 2), round(total - checkpoints, 2)])

    def run(self) -> None:
        a = self.args
        counter = None
        try:
            for name in self.names:
                self.start(name)
            victims = self.names[1:] or self.names
            next_kill = a.kill_every if a.kill_every > 0 else float("inf")
            next_sample = next_records = 0.0
            while self.minute() < a.minutes:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        print(f"  minute {self.minute():.1f}: {name} exited with code {proc.returncode}; "
                              "restarting it", flush=True)
                        self.kills.append([round(self.minute(), 2), f"{name} (exited {proc.returncode})"])
                        self.incarnation[name] += 1
                        self.start(name)
                if self.minute() >= next_kill:
                    self.kill_and_restart(victims[(len(self.kills)) % len(victims)])
                    next_kill += a.kill_every
                if self.minute() >= next_sample:
                    next_sample = self.minute() + a.sample_s / 60
                    self.sample()
                if self.minute() >= next_records and self.minute() >= 2:
                    next_records = self.minute() + 1
                    if counter is None:
                        counter = DHTCounter(self.maddrs, a.fragments)
                    self.records.append([round(self.minute(), 2), counter.count()])
                time.sleep(1.0)
            self.sample()
        finally:
            if counter is not None:
                counter.close()
            for proc in [*self.procs.values(), self.bootstrap]:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


# ---- analysis ------------------------------------------------------------------------------------------------
def _mean(samples: list, field: str) -> float:
    column = SAMPLE_FIELDS.index(field) + 1
    values = [s[column] for s in samples if s[column] is not None]
    return sum(values) / len(values) if values else float("nan")


def growth_table(soak: Soak, warmup: float) -> list[dict]:
    """Per process that lived past its warm-up: memory (MB), descriptors and threads at the warm-up's end and at its
    last sample (each the mean of 3 samples, as a round end moves memory by a few MB), and their growth."""
    rows = []
    for key, samples in soak.samples.items():
        born = soak.started_at.get(key.split("/", 1)[0], 0.0)
        settled = [s for s in samples if s[0] >= born + warmup]
        if len(settled) < 6 or settled[-1][0] - settled[0][0] < 1:
            continue
        first, last = settled[:3], settled[-3:]
        hours = (last[-1][0] - first[0][0]) / 60

        def pair(field: str, scale: float = 1 / 1024, first=first, last=last) -> list:
            return [round(_mean(first, field) * scale, 1), round(_mean(last, field) * scale, 1)]

        row = {"process": key, "from_min": first[0][0], "to_min": last[-1][0], "rss_mb": pair("rss_kb"),
               "pss_mb": pair("pss_kb"), "pss_anon_mb": pair("pss_anon_kb"), "private_mb": pair("private_kb"),
               "anon_mb": pair("anon_kb"), "fds": pair("fds", 1), "shm_fds": pair("shm_fds", 1),
               "threads": pair("threads", 1), "fds_max": max(s[3] for s in settled),
               "threads_max": max(s[4] for s in settled)}
        row["rss_growth"] = round(row["rss_mb"][1] / row["rss_mb"][0] - 1, 4)
        row["pss_anon_mb_per_hour"] = round((row["pss_anon_mb"][1] - row["pss_anon_mb"][0]) / hours, 1)
        rows.append(row)
    return sorted(rows, key=lambda r: r["process"])


def _flat(pair: list) -> bool:
    """No growth beyond noise: the end's mean within 4 (or 5%) of the start's."""
    return pair[1] <= pair[0] + max(4.0, 0.05 * pair[0])


def rounds_in_calm(soak: Soak, calm_after: float) -> dict:
    """Round ends (averagings applied) of every peer, and those that fell back, outside the stretches after a kill
    (a peer's start-up included: the minutes after each incarnation started)."""
    t0 = time.time() - soak.minute() * 60
    unsettled = [m for m, _ in soak.kills] + [m for m in soak.started_at.values()]
    calm = averaged = 0
    failures = []
    for name in soak.names:
        for path in sorted((soak.out / name).glob("metrics-stage*.jsonl")):
            for e in read_metrics(path):
                if e["kind"] != "round" or e.get("applied_round") is None or e.get("flush"):
                    continue
                minute = (e["time"] - t0) / 60
                if any(0 <= minute - m < calm_after for m in unsettled) or minute < calm_after:
                    continue
                calm += 1
                averaged += bool(e.get("averaged"))
                if not e.get("averaged"):
                    failures.append({"peer": name, "minute": round(minute, 1), "fragment": e.get("fragment"),
                                     "round": e.get("applied_round"), "reason": e.get("fallback_reason")})
    return {"calm_round_ends": calm, "averaged": averaged, "failures": failures}


def analyse(soak: Soak) -> dict:
    a = soak.args
    table = growth_table(soak, a.warmup)
    long_lived = [r for r in table if r["to_min"] - r["from_min"] >= a.judge_min]
    swarm_pss: dict = {}  # minute -> [PSS, PSS anon] of every process sampled then (KB)
    for samples in soak.samples.values():
        for s in samples:
            total = swarm_pss.setdefault(s[0], [0, 0])
            total[0] += s[2] or 0
            total[1] += s[8] or 0
    checkpoints_max = max((d[1] for d in soak.disk), default=0.0)
    return {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "growth": table, "kills": soak.kills,
        "targets": {
            "rss_growth_max": max((r["rss_growth"] for r in long_lived), default=None),
            "rss_grew": [r["process"] for r in long_lived if r["rss_growth"] > GROWTH_TARGET],
            "fds_grew": [r["process"] for r in long_lived if not _flat(r["fds"])],
            "threads_grew": [r["process"] for r in long_lived if not _flat(r["threads"])],
            "checkpoints_mb_max": checkpoints_max,
            "checkpoints_mb_last": soak.disk[-1][1] if soak.disk else None,
            "logs_mb_last": soak.disk[-1][2] if soak.disk else None,
        },
        "rounds": rounds_in_calm(soak, a.calm_after),
        "swarm_pss_mb": [[m, round(kb / 1024, 1), round(anon / 1024, 1)]
                         for m, (kb, anon) in sorted(swarm_pss.items())],
        "disk": soak.disk, "dht_records": soak.records, "samples": soak.samples,
    }


def report(results: dict) -> str:
    a, t = results["args"], results["targets"]
    lines = [f"{a['peers']} peers (peer0: 2 stages), fragments {a['fragments']} streaming, H = {a['h']}, "
             f"{a['minutes']:g} min; kill + restart every {a['kill_every']:g} min ({len(results['kills'])} kills); "
             f"growth counted after {a['warmup']:g} min of each process's life; env {' '.join(a['env']) or '-'}",
             "",
             f"{'process':<40} {'minutes':>11}  {'RSS MB':>13}  {'RSS %':>6}  {'PSS MB':>13}  {'PSS anon MB':>13}  "
             f"{'anon MB/h':>9}  {'fds':>9}  {'shm fds':>9}  {'threads':>7}"]

    def pair(values: list, width: int = 6, digits: int = 1) -> str:
        return f"{values[0]:>{width}.{digits}f}>{values[1]:<{width}.{digits}f}"

    for r in results["growth"]:
        lines.append(f"{r['process']:<40} {r['from_min']:>5.1f}-{r['to_min']:<5.1f}  {pair(r['rss_mb'])}  "
                     f"{100 * r['rss_growth']:>+5.1f}%  {pair(r['pss_mb'])}  {pair(r['pss_anon_mb'])}  "
                     f"{r['pss_anon_mb_per_hour']:>+9.1f}  {pair(r['fds'], 4, 0)}  {pair(r['shm_fds'], 4, 0)}  "
                     f"{pair(r['threads'], 3, 0)}")
    pss = results["swarm_pss_mb"]
    if pss:
        after = [p for p in pss if p[0] >= a["warmup"]] or pss
        lines.append(f"\nswarm PSS (all processes; anonymous memory in brackets): {after[0][1]:.0f} "
                     f"({after[0][2]:.0f}) MB at minute {after[0][0]:.1f}, {after[-1][1]:.0f} ({after[-1][2]:.0f}) "
                     f"MB at minute {after[-1][0]:.1f}, max {max(p[1] for p in pss):.0f} "
                     f"({max(p[2] for p in pss):.0f}) MB")
    r = results["rounds"]
    lines += [f"rounds in calm stretches: {r['averaged']}/{r['calm_round_ends']} averaged"
              + (f"; fell back: {r['failures'][:6]}" if r["failures"] else ""),
              f"disk: checkpoints max {t['checkpoints_mb_max']:.1f} MB (last {t['checkpoints_mb_last']:.1f}); "
              f"logs and metrics {t['logs_mb_last']:.1f} MB at the end"]
    if results["dht_records"]:
        first, last = results["dht_records"][0], results["dht_records"][-1]
        most = {k: max(c[1][k] for c in results["dht_records"]) for k in last[1]}
        lines.append(f"DHT records read: {first[1]} at minute {first[0]:.0f}, {last[1]} at minute {last[0]:.0f}, "
                     f"max {most}")
    def verdict(grew: list) -> str:
        return "ok" if not grew else f"NOT MET ({', '.join(grew)})"

    lines += [f"targets, over the processes sampled {a['judge_min']:g}+ min after their warm-up: RSS growth <= "
              f"{GROWTH_TARGET:.0%}: {verdict(t['rss_grew'])} (max {100 * (t['rss_growth_max'] or 0):+.1f}%); "
              f"descriptors flat: {verdict(t['fds_grew'])}; threads flat: {verdict(t['threads_grew'])}; "
              f"no calm round failing: {'ok' if not r['failures'] else 'NOT MET'}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="how long the swarm runs")
    parser.add_argument("--peers", type=int, default=3, help="peers (peer0 with 2 stages)")
    parser.add_argument("--kill-every", type=float, default=10.0,
                        help="minutes between two kills (SIGKILL and restart) of a peer other than peer0; 0: none")
    parser.add_argument("--warmup", type=float, default=10.0,
                        help="minutes of a process's life before its growth is counted")
    parser.add_argument("--judge-min", type=float, default=5.0,
                        help="the targets judge processes sampled at least this many minutes after their warm-up")
    parser.add_argument("--calm-after", type=float, default=3.0,
                        help="minutes after a kill or a start during which a failing round does not count")
    parser.add_argument("--sample-s", type=float, default=20.0, help="seconds between two samples")
    parser.add_argument("--h", type=int, default=20, help="inner steps per round")
    parser.add_argument("--fragments", type=int, default=3, help="diloco.fragments F (>= 2: streaming sync)")
    parser.add_argument("--keep", type=int, default=3, help="checkpoint.keep of the peers")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment of every process of the swarm (e.g. MALLOC_ARENA_MAX=2, "
                             "P2P_DILOCO_MEMTRACE=20); repeat for several")
    parser.add_argument("--peer-env", action="append", default=[], metavar="PEER:KEY=VALUE",
                        help="environment of one peer only (A/B within one swarm: peer2:MALLOC_ARENA_MAX=2)")
    parser.add_argument("--peer-args", nargs=argparse.REMAINDER, default=[],
                        help="extra arguments of every peer (last on the command line)")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    if args.peers < 1 or args.minutes <= 0:
        parser.error("--peers must be at least 1 and --minutes positive")
    if any("=" not in item for item in args.env):
        parser.error("--env takes KEY=VALUE")
    if any(":" not in item or "=" not in item.split(":", 1)[1] for item in args.peer_env):
        parser.error("--peer-env takes PEER:KEY=VALUE")
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    soak = Soak(args)
    try:
        soak.run()
    except KeyboardInterrupt:
        print("interrupted: reporting what was sampled", flush=True)
    results = analyse(soak)
    (args.out / "results.json").write_text(json.dumps(results))
    text = report(results)
    (args.out / "report.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
