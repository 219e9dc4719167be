"""Memory and speed of a peer against a bare PyTorch loop of the same model, at the sizes users train.

For each preset, side by side in one run:
- bare: the project's own ``Transformer`` with AdamW, the same batch, sequence length and torch threads, in a process
  of its own: forward, loss, backward, clip, step (``benchmarks/overhead.py``'s loop);
- swarm: ``p2p-diloco swarm --peers K`` (a bootstrap node and K real peers on 127.0.0.1) for a few rounds, every
  process of every peer sampled.
Memory is the proportional set size (PSS, /proc/PID/smaps_rollup: a page shared by n processes counts 1/n in each),
sampled every ``--every`` seconds. A peer's figure is the largest sum over its processes at one instant (its
training process, averager, DHT node and p2p daemon); each process's own peak is shown too. Tokens/s is measured
over the inner steps after the first round (the bare loop's after a warm-up of the same length), round ends included
for the peer.

    python benchmarks/sizes.py --presets tiny,small
    python benchmarks/sizes.py --presets medium --peers 2 --seq-len 128 --batch-size 2 --inner-steps 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROLES = ("training", "averager", "dht", "p2pd")


def pss_bytes(pid: int) -> int:
    """PSS of one process in bytes, 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def role(pid: int) -> str:
    """training (a peer's launcher or stage process), averager, dht or p2pd, from the process's name."""
    try:
        comm = open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return "gone"
    if comm == "p2pd":
        return "p2pd"
    if comm.startswith("diloco-avg"):
        return "averager"
    if comm.startswith("diloco-dht") or comm.startswith("DHT"):
        return "dht"
    return "training"


class Sampler:
    """Samples the PSS of process trees every ``every_s`` seconds in a thread, keeping peaks: for each tree (a
    peer) the largest sum at one instant, and for each process its own largest, by role."""

    def __init__(self, every_s: float):
        self.every_s = every_s
        self.roots: dict[str, int] = {}
        self.peak_total: dict[str, int] = {}
        self.peak_by_role: dict[str, dict[str, int]] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, root in list(self.roots.items()):
                total = 0
                for pid in descendants(root):
                    size = pss_bytes(pid)
                    total += size
                    by_role = self.peak_by_role.setdefault(name, {})
                    kind = role(pid)
                    by_role[kind] = max(by_role.get(kind, 0), size)
                self.peak_total[name] = max(self.peak_total.get(name, 0), total)
            self.samples += 1
            self._stop.wait(self.every_s)


def bare(args: argparse.Namespace, preset: str) -> dict:
    """Peak PSS and tokens/s of the bare loop of ``preset``, in a process of its own."""
    code = ("import argparse, json, sys; sys.path.insert(0, 'benchmarks'); from overhead import bare_loop; "
            f"a = argparse.Namespace(preset={preset!r}, seq_len={args.seq_len}, batch_size={args.batch_size}, "
            f"steps={2 * args.inner_steps * 2}, warmup={args.inner_steps}, threads={args.threads}); "
            "print(json.dumps({'tokens_per_s': bare_loop(a)}))")
    sampler = Sampler(args.every)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    sampler.roots["bare"] = proc.pid
    sampler.start()
    out, _ = proc.communicate()
    sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"the bare loop of {preset} failed (exit code {proc.returncode})")
    return {"peak_pss": sampler.peak_total["bare"], **json.loads(out.strip().splitlines()[-1])}


def swarm(args: argparse.Namespace, preset: str, workdir: Path) -> dict:
    """Peaks per peer and per process role, tokens/s, rounds averaged and whether the anchors are identical."""
    out = workdir / f"swarm-{preset}"
    cmd = [sys.executable, "-m", "p2p_diloco", "swarm", "--peers", str(args.peers), "--stages", str(args.stages),
           "--output-dir", str(out), "--sample-tokens", "0", "--model.preset", preset,
           "--data.seq_len", str(args.seq_len), "--data.batch_size", str(args.batch_size),
           "--diloco.inner_steps", str(args.inner_steps), "--train.num_rounds", str(args.rounds),
           "--data.eval_batches", "2", "--train.eval_every_rounds", "1", "--checkpoint.every_rounds", "1",
           "--averaging.matchmaking_time_s", "30", "--averaging.round_timeout_s", "900",
           "--averaging.allreduce_timeout_s", "600", "--averaging.request_timeout_s", "20",
           "--averaging.next_chunk_timeout_s", "120"]
    sampler = Sampler(args.every)
    log = open(workdir / f"swarm-{preset}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    sampler.start()
    newcomer = None
    try:
        while proc.poll() is None:  # the peers' launchers, as they start
            if args.newcomer and newcomer is None and _averaged_a_round(out / "peer0"):
                newcomer = _start_newcomer(out)
                sampler.roots["newcomer"] = newcomer.pid
            for pid in children(proc.pid):
                try:
                    cmdline = open(f"/proc/{pid}/cmdline").read().split("\0")
                except OSError:
                    continue
                if "peer" in cmdline and "--output-dir" in cmdline:
                    name = Path(cmdline[cmdline.index("--output-dir") + 1]).name
                    sampler.roots.setdefault(name, pid)
            time.sleep(0.5)
        if newcomer is not None:  # it joined late: once the swarm is done, it has a minute to finish, then stops
            try:
                newcomer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                newcomer.terminate()
                newcomer.wait(timeout=60)
    finally:
        sampler.stop()
        if proc.poll() is None:
            proc.kill()
        if newcomer is not None and newcomer.poll() is None:
            newcomer.kill()
    summary = json.loads((out / "swarm-summary.json").read_text())
    downloads = []
    if newcomer is not None:
        downloads = [json.loads(line) for line in open(out / "newcomer" / "metrics-stage0.jsonl")]
        downloads = [e for e in downloads if e["kind"] == "sync" and e.get("download_s") is not None]
    round_end_s, compute_s, checkpoints = [], [], []
    for i in range(args.peers):
        for stage in range(args.stages):
            events = [json.loads(line) for line in open(out / f"peer{i}" / f"metrics-stage{stage}.jsonl")]
            steps = [e for e in events if e["kind"] == "step"]
            for e in events:
                if e["kind"] == "round" and not e.get("flush"):
                    round_end_s.append(e["round_end_s"])
            rates = [e["tokens_per_s"] for e in steps[1:] if e.get("tokens_per_s")]
            if rates:
                compute_s.append(args.inner_steps * args.batch_size * args.seq_len / max(rates))
        for line in (out / f"peer{i}" / "console.log").read_text().splitlines():
            m = re.search(r"Saved checkpoint .*\(([\d.]+) MB in ([\d.]+) s\)", line)
            if m:
                checkpoints.append((float(m.group(1)), float(m.group(2))))
    tokens_per_s = []
    for i in range(args.peers):
        events = [json.loads(line) for line in open(out / f"peer{i}" / "metrics-stage0.jsonl")]
        rounds = [e for e in events if e["kind"] == "round"]
        if len(rounds) >= 2:
            steps = (len(rounds) - 1) * args.inner_steps
            tokens_per_s.append(steps * args.batch_size * args.seq_len / (rounds[-1]["time"] - rounds[0]["time"]))
    peers = [name for name in sampler.peak_total if name.startswith("peer")]
    return {"peak_pss_per_peer": {name: sampler.peak_total[name] for name in peers},
            "peak_pss_by_role": {name: sampler.peak_by_role.get(name, {}) for name in peers},
            "tokens_per_s": sum(tokens_per_s) / len(tokens_per_s) if tokens_per_s else None,
            "round_end_s": sorted(round_end_s)[len(round_end_s) // 2] if round_end_s else None,
            "round_compute_s": sorted(compute_s)[len(compute_s) // 2] if compute_s else None,
            "checkpoint_mb": max((c[0] for c in checkpoints), default=None),
            "checkpoint_s": sorted(c[1] for c in checkpoints)[len(checkpoints) // 2] if checkpoints else None,
            "newcomer_peak_pss": sampler.peak_total.get("newcomer"),
            "newcomer_by_role": sampler.peak_by_role.get("newcomer", {}),
            "download_s": downloads[0]["download_s"] if downloads else None,
            "download_bytes": downloads[0]["state_bytes"] if downloads else None,
            "newcomer_exit": newcomer.returncode if newcomer is not None else None,
            "anchors_identical": summary["anchors_identical"], "ok": summary["ok"],
            "averaged_rounds": [r.get("averaged_rounds") for r in summary["peers"]]}


def _averaged_a_round(peer_dir: Path) -> bool:
    try:
        lines = (peer_dir / "metrics-stage0.jsonl").read_text().splitlines()
    except OSError:
        return False
    return any('"applied_round": 0' in line and '"kind": "round"' in line for line in lines)


def _start_newcomer(out: Path) -> subprocess.Popen:
    """A peer that joins the swarm after its first averaged round: it downloads the swarm's state."""
    maddrs = (out / "bootstrap.maddrs").read_text().split()
    log = open(out / "newcomer.log", "w")
    return subprocess.Popen([sys.executable, "-m", "p2p_diloco", "peer", "--config", str(out / "swarm.toml"),
                             "--initial-peers", *maddrs, "--output-dir", str(out / "newcomer"),
                             "--run.num_threads", "1"], stdout=log, stderr=subprocess.STDOUT)


def num_params(preset: str) -> int:

    from p2p_diloco.config import load_config
    from p2p_diloco.data import ShardDataset, resolve_data_path
    from p2p_diloco.model import Transformer, model_args_from_config

    cfg = load_config(None, [("model.preset", preset)])
    vocab = ShardDataset(resolve_data_path(cfg.data), "train").vocab_size
    model = Transformer(model_args_from_config(cfg.model, vocab), device="meta")
    return sum(p.numel() for p in model.parameters())


def planned(args: argparse.Namespace, preset: str) -> dict:
    """What ``p2p-diloco plan`` (p2p_diloco.memory) says the peer and the bare loop need, in bytes."""
    from p2p_diloco.config import load_config
    from p2p_diloco.data import ShardDataset, resolve_data_path
    from p2p_diloco.memory import peer_memory
    from p2p_diloco.model import balanced_split, model_args_from_config
    from p2p_diloco.model.split import stage_shapes
    from p2p_diloco.stage_process import run_shape

    cfg = load_config(None, [("model.preset", preset), ("data.batch_size", str(args.batch_size)),
                             ("data.seq_len", str(args.seq_len))])
    model_args = model_args_from_config(cfg.model, ShardDataset(resolve_data_path(cfg.data), "train").vocab_size)
    memory = peer_memory(stage_shapes(model_args, balanced_split(model_args, args.stages)),
                         run_shape(cfg, args.seq_len, "cpu"))
    roles = {}
    for stage in memory.stages:
        for process in stage:
            roles[process.role] = max(roles.get(process.role, 0), process.host)
    return {"peer": memory.host, "bare": memory.bare_host, **roles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the bare loop (the swarm divides "
                        "the cores among its peers)")
    parser.add_argument("--every", type=float, default=0.2, help="seconds between memory samples")
    parser.add_argument("--newcomer", action="store_true",
                        help="start one more peer after the swarm's first averaged round: it downloads the swarm's "
                        "state; its peak memory and the download's time are reported beside the others'")
    parser.add_argument("--out", default="runs/sizes")
    args = parser.parse_args()
    workdir = Path(args.out)
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for preset in args.presets.split(","):
        n = num_params(preset)
        print(f"{preset}: {n / 1e6:.1f}M parameters; bare loop...", flush=True)
        b = bare(args, preset)
        print(f"{preset}: swarm of {args.peers} peer(s) x {args.stages} stage(s)...", flush=True)
        s = swarm(args, preset, workdir)
        results[preset] = {"num_params": n, "bare": b, "swarm": s, "plan": planned(args, preset)}
        (workdir / "sizes.json").write_text(json.dumps(results, indent=2))
    gb = 1e9
    print(f"\nbatch {args.batch_size} x seq {args.seq_len}, H = {args.inner_steps}, {args.rounds} rounds, "
          f"{args.peers} peer(s) x {args.stages} stage(s); PSS peaks, bytes per parameter (B/p)")
    print(f"{'preset':<8} {'params':>8} {'bare GB':>8} {'B/p':>5} {'peer GB':>8} {'B/p':>5} {'x bare':>7} "
          f"{'training':>9} {'averager':>9} {'dht':>6} {'p2pd':>6} {'tok/s bare':>10} {'peer':>7} {'avg rounds':>10} "
          f"{'anchors':>8}")
    for preset, r in results.items():
        n, b, s = r["num_params"], r["bare"], r["swarm"]
        peer = max(s["peak_pss_per_peer"].values(), default=0)
        roles = {k: max((by.get(k, 0) for by in s["peak_pss_by_role"].values()), default=0) for k in ROLES}
        tok = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] else "-"
        print(f"{preset:<8} {n / 1e6:>7.1f}M {b['peak_pss'] / gb:>8.2f} {b['peak_pss'] / n:>5.1f} {peer / gb:>8.2f} "
              f"{peer / n:>5.1f} {peer / b['peak_pss']:>6.2f}x {roles['training'] / gb:>9.2f} "
              f"{roles['averager'] / gb:>9.2f} {roles['dht'] / gb:>6.2f} {roles['p2pd'] / gb:>6.2f} "
              f"{b['tokens_per_s']:>10.0f} {tok:>7} {str(s['averaged_rounds']):>10} "
              f"{'same' if s['anchors_identical'] else 'DIFFER':>8}")

    print("\nthe planner's figures (p2p-diloco plan, p2p_diloco/memory.py) against the measured peaks, and the "
          "round end and checkpoint (medians over every round end and write of every peer)")
    print(f"{'preset':<8} {'plan peer':>9} {'measured':>9} {'plan/meas':>9} {'plan bare':>9} {'measured':>9} "
          f"{'plan/meas':>9} {'round end s':>11} {'compute s':>9} {'ckpt MB':>8} {'ckpt s':>7}")
    for preset, r in results.items():
        p, b, s = r["plan"], r["bare"], r["swarm"]
        peer = max(s["peak_pss_per_peer"].values(), default=0)

        def num(value, fmt):
            return "-" if value is None else format(value, fmt)

        print(f"{preset:<8} {p['peer'] / gb:>9.2f} {peer / gb:>9.2f} {p['peer'] / peer:>8.2f}x "
              f"{p['bare'] / gb:>9.2f} {b['peak_pss'] / gb:>9.2f} {p['bare'] / b['peak_pss']:>8.2f}x "
              f"{num(s['round_end_s'], '11.2f')} {num(s['round_compute_s'], '9.2f')} "
              f"{num(s['checkpoint_mb'], '8.1f')} {num(s['checkpoint_s'], '7.2f')}")

    if args.newcomer:
        print("\na newcomer that joined after the first averaged round and downloaded the swarm's state")
        print(f"{'preset':<8} {'peer GB':>8} {'newcomer GB':>11} {'ratio':>6} {'training':>9} {'averager':>9} "
              f"{'state MB':>9} {'download s':>10} {'exit':>5}")
        for preset, r in results.items():
            s = r["swarm"]
            peer = max(s["peak_pss_per_peer"].values(), default=0)
            new = s["newcomer_peak_pss"] or 0
            roles = s["newcomer_by_role"]
            state = s["download_bytes"]
            print(f"{preset:<8} {peer / gb:>8.2f} {new / gb:>11.2f} {new / max(peer, 1):>5.2f}x "
                  f"{roles.get('training', 0) / gb:>9.2f} {roles.get('averager', 0) / gb:>9.2f} "
                  f"{'-' if state is None else format(state / 1e6, '9.1f'):>9} "
                  f"{'-' if s['download_s'] is None else format(s['download_s'], '10.2f'):>10} "
                  f"{str(s['newcomer_exit']):>5}")


if __name__ == "__main__":
    main()
