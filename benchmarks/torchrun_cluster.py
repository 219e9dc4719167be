"""A peer whose pipeline stages run on two machines (``peers/launch-torchrun.sh``), in a swarm, over emulated hosts.

Three hosts on one bridge (:mod:`netns`, links unshaped), so that torchrun's store, gloo and hivemind meet each
other's addresses, never 127.0.0.1: host 0 runs a bootstrap node and a two-stage peer of one machine; hosts 1 and
2 are the two nodes of a torchrun peer (one stage each, gloo), started as README.md says (the same command on both
nodes but NODE_RANK; each node its own output folder and identity file, as on machines with their own disks).
The scenario, timed step by step:

1. everything starts at once; the cluster peer's first two rounds are averaged with the other peer, stage by
   stage, onto the other peer's anchors;
2. node 1's stage process is SIGKILLed: node 0's stage stops with one line saying a stage of its peer is gone,
   both nodes' torchrun exit with an error, and no process is left on either host;
3. both nodes are started again with the same commands: the peer resumes from its checkpoints (round > 0),
   catches up with the swarm, and averages with the other peer onto the same anchor again.

``tests/integration/test_torchrun_cluster.py`` runs steps 1 and 2 with the tests' settings; step 3's two more
torch start-ups per node cost a minute and a half on a busy 2-core machine, so it runs here. Needs root.

    sudo .venv/bin/python benchmarks/torchrun_cluster.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from netns import EmulatedWAN, run_prefix  # noqa: E402

from p2p_diloco.swarm.discovery.identity import ensure_identity  # noqa: E402
from p2p_diloco.training.metrics import read_metrics  # noqa: E402

SCRIPT = ROOT / "peers" / "launch-torchrun.sh"
BOOTSTRAP_PORT = 31337  # host 0's own network namespace: no other process of the machine shares it
# the tests' tiny settings (tests/integration/conftest.py), both peers running until the scenario is over: a
# resumed peer then never finds the other one finished, however long its restart takes
SETTINGS = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "32", "--data.eval_batches", "2",
            "--train.log_every", "5", "--train.progress", "false", "--run.num_threads", "1",
            "--averaging.matchmaking_time_s", "4", "--averaging.request_timeout_s", "3",
            "--averaging.round_timeout_s", "20", "--averaging.allreduce_timeout_s", "20",
            "--averaging.next_chunk_timeout_s", "10"]
PEER = ["--run-id", "cluster", "--train.num_rounds", "1000", "--diloco.inner_steps", "8", "--train.wait_for_peers",
        "2", "--checkpoint.every_rounds", "1"]
STOPPED = re.compile(r"^error: stage 0: (another stage of this peer is gone|the pipeline broke)[^\n]*", re.M)


class Cluster:
    """The scenario's processes on the hosts of ``wan``, each with its output in ``<folder>/<name>.log``."""

    def __init__(self, wan: EmulatedWAN, folder: Path, settings: list[str]):
        self.wan, self.folder, self.settings = wan, Path(folder), [*PEER, *settings]
        self.procs: dict[str, subprocess.Popen] = {}
        self.nodes: list[subprocess.Popen] = []
        self.suffix = ""  # of the nodes' log names: "-again" once restarted
        self.maddrs: list[str] = []  # the bootstrap node's

    def start(self, host: int, name: str, command: list[str], env: dict | None = None) -> subprocess.Popen:
        with open(self.folder / f"{name}.log", "w") as log:
            self.procs[name] = self.wan.popen(host, command, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def told(self) -> str:
        """The end of every process's log, for a failure's message."""
        return "\n".join(f"--- {name}\n{self.log(name)[-2500:]}" for name in self.procs)

    def start_swarm(self) -> None:
        """The bootstrap node, the peer of host 0 and both nodes of the cluster peer, all at once: the bootstrap
        node's address is known before it listens (a fixed port, an identity made here), and a peer's DHT node asks
        its initial peer again while its start-up time lasts."""
        peer_id, _ = ensure_identity(self.folder / "bootstrap.id")
        ip = self.wan.ip(0)
        self.maddrs = [f"/ip4/{ip}/tcp/{BOOTSTRAP_PORT}/p2p/{peer_id}"]
        self.start(0, "bootstrap", _cli("bootstrap", "--host-maddrs", f"/ip4/{ip}/tcp/{BOOTSTRAP_PORT}",
                                        "--identity-path", str(self.folder / "bootstrap.id")))
        self.start(0, "single", _cli("peer", "--stages", "2", "--initial-peers", *self.maddrs, "--host-maddrs",
                                     f"/ip4/{ip}/tcp/0", "--output-dir", str(self.folder / "single"), *self.settings))
        self.start_nodes("")

    def start_nodes(self, suffix: str) -> None:
        """Both nodes of the cluster peer (hosts 1 and 2), as the README starts them: the same command on each
        node but NODE_RANK, and MASTER_ADDR node 0's address."""
        self.nodes, self.suffix = [], suffix
        for rank in (0, 1):
            env = dict(os.environ, NNODES="2", NODE_RANK=str(rank), NPROC_PER_NODE="1", MASTER_ADDR=self.wan.ip(1),
                       PYTHON=sys.executable)
            command = [str(SCRIPT), "--initial-peers", *self.maddrs, "--output-dir", str(self.folder / f"node{rank}"),
                       "--identity-path", str(self.folder / f"node{rank}.id"), *self.settings]
            self.nodes.append(self.start(rank + 1, f"node{rank}{suffix}", command, env=env))

    # ---- what the peers wrote -------------------------------------------------------------------------------
    def events(self, name: str, stage: int, kind: str) -> list[dict]:
        return [e for e in read_metrics(self.folder / name / f"metrics-stage{stage}.jsonl") if e["kind"] == kind]

    def applied(self, name: str, stage: int) -> list[dict]:
        return [e for e in self.events(name, stage, "round") if e["applied_round"] is not None]

    def averaged_alike(self, since: float = 0.0) -> set[tuple[int, int]]:
        """(stage, applied round) of every round the cluster peer applied after ``since`` averaged in a group of two,
        onto the anchor the peer of host 0 holds after that round (stage j of node j)."""
        found = set()
        for stage in (0, 1):
            theirs = {e["applied_round"]: e["anchor_sha256"] for e in self.applied("single", stage)}
            for e in self.applied(f"node{stage}", stage):
                if e["time"] >= since and e["averaged"] and e["group_size"] == 2 \
                        and theirs.get(e["applied_round"]) == e["anchor_sha256"]:
                    found.add((stage, e["applied_round"]))
        return found

    def resumes(self, since: float) -> list[dict]:
        return [e for stage in (0, 1) for e in self.events(f"node{stage}", stage, "resume") if e["time"] >= since]

    def wait_until(self, condition, timeout_s: float, what: str) -> float:
        """Seconds until ``condition()`` held (AssertionError with every log after ``timeout_s``)."""
        started = time.monotonic()
        while not condition():
            assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s:.0f} s\n{self.told()}"
            time.sleep(0.2)
        return time.monotonic() - started

    # ---- the scenario's steps ----------------------------------------------------------------------------------
    def first_rounds_averaged(self, timeout_s: float = 240) -> float:
        """Step 1: seconds until rounds 0 and 1 of both stages were averaged onto the other peer's anchors (an
        applied round that fell back fails at once)."""
        def done() -> bool:
            fell_back = [e for s in (0, 1) for e in self.applied(f"node{s}", s) if not e["averaged"]]
            assert not fell_back, f"a round fell back: {fell_back}\n{self.told()}"
            return {(0, 0), (1, 0), (0, 1), (1, 1)} <= self.averaged_alike()

        return self.wait_until(done, timeout_s, "rounds 0 and 1 averaged by both stages onto the same anchors")

    def kill_node_stage(self, bound_s: float = 60) -> dict:
        """Step 2: SIGKILL node 1's stage process; both nodes must exit with an error within ``bound_s``, node 0's
        stage saying why in one line (before any traceback: torchrun's own report of a failed stage is one), and no
        process may be left on their hosts. Returns what happened."""
        victim = stage_pid(self.nodes[1].pid, rank=1)
        assert victim is not None, f"no stage process under node 1's torchrun\n{self.told()}"
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        exits: dict[int, tuple[int, float]] = {}  # rank -> (exit code, seconds after the kill)
        while len(exits) < len(self.nodes):
            for rank, node in enumerate(self.nodes):
                if rank not in exits and node.poll() is not None:
                    exits[rank] = (node.returncode, time.monotonic() - killed)
            running = [rank for rank in range(len(self.nodes)) if rank not in exits]
            assert time.monotonic() - killed < bound_s or not running, \
                f"nodes {running} still run {bound_s:.0f} s after node 1's stage was killed\n{self.told()}"
            time.sleep(0.1)
        assert all(code != 0 for code, _ in exits.values()), f"exits: {exits}\n{self.told()}"
        log = self.log("node0")
        said = STOPPED.search(log)
        assert said and "Traceback" not in log[:said.start()], f"node 0 did not say why it stopped\n{self.told()}"
        left = self.wait_until(lambda: not self.host_pids(1) and not self.host_pids(2), 30, "no process left")
        return {"exits": [exits[rank] for rank in sorted(exits)], "message": said.group(0), "left_s": left}

    def restart_and_resume(self, timeout_s: float = 240) -> dict:
        """Step 3: both nodes again, the same commands; seconds until both stages resumed from their checkpoints
        (a round > 0, "Resumed from" in the logs), then until the peer averaged with the other one onto its anchor."""
        restarted, started = time.time(), time.monotonic()
        self.start_nodes("-again")
        self.wait_until(lambda: len(self.resumes(restarted)) == 2, timeout_s, "both stages resumed")
        resumed_s = time.monotonic() - started
        rounds = [e["round"] for e in self.resumes(restarted)]
        assert all(r > 0 for r in rounds), f"resumed at rounds {rounds}\n{self.told()}"
        for rank in (0, 1):
            assert "Resumed from" in self.log(f"node{rank}-again"), self.told()
        self.wait_until(lambda: {0, 1} <= {s for s, _ in self.averaged_alike(since=restarted)}, timeout_s,
                        "averaged with the other peer again, onto its anchor")
        assert all(node.poll() is None for node in self.nodes), self.told()
        return {"resumed_rounds": rounds, "resumed_s": resumed_s, "averaged_s": time.monotonic() - started,
                "averaged": sorted(self.averaged_alike(since=restarted))}

    def cut_node_link(self, timeout_s: float) -> list[tuple[int, float]]:
        """Step 4: node 1's host loses its link (no connection is closed: a power cut, a cable); both nodes must give
        up within ``pipeline.timeout_s`` (``timeout_s``) and a margin, each saying why in one line. Returns each
        node's (exit code, seconds after the cut)."""
        subprocess.run(["ip", "-n", self.wan.host(2), "link", "set", self.wan.interface(2), "down"], check=True)
        cut, exits = time.monotonic(), {}

        def gave_up() -> bool:
            for rank, node in enumerate(self.nodes):
                if rank not in exits and node.poll() is not None:
                    exits[rank] = (node.returncode, time.monotonic() - cut)
            return len(exits) == len(self.nodes)

        self.wait_until(gave_up, timeout_s + 60, "both nodes gave up after node 1's link was cut")
        for rank in (0, 1):
            said = re.search(rf"^error: stage {rank}: (another stage of this peer is gone|the pipeline broke)",
                             self.log(f"node{rank}{self.suffix}"), re.M)
            assert said, f"node {rank} did not say why it stopped\n{self.told()}"
        return [exits[0], exits[1]]

    def host_pids(self, host: int) -> list[str]:
        return subprocess.run(["ip", "netns", "pids", self.wan.host(host)], capture_output=True,
                              text=True).stdout.split()


def stage_pid(launcher_pid: int, rank: int) -> int | None:
    """The stage process of ``rank`` that ``launcher_pid`` (torchrun, or our local launcher) started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco", *args]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="keep the logs and metrics here (default: a temporary folder)")
    parser.add_argument("--cut-link", type=float, metavar="S",
                        help="step 4: with pipeline.timeout_s S (above the round bound, 40 s here), cut node 1's link "
                             "at the end and time how long the nodes take to give up")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="torchrun-cluster-"))
    folder.mkdir(parents=True, exist_ok=True)
    with EmulatedWAN(3, None, prefix=run_prefix("c")) as wan:
        timeout = ["--pipeline.timeout_s", str(args.cut_link)] if args.cut_link else []
        cluster = Cluster(wan, folder, [*SETTINGS, *timeout])
        started = time.monotonic()
        cluster.start_swarm()
        first = cluster.first_rounds_averaged()
        print(f"1. all started at once; rounds 0 and 1 of both stages averaged onto the other peer's anchors "
              f"{first:.1f} s after the start", flush=True)
        stop = cluster.kill_node_stage()
        (code0, at0), (code1, at1) = stop["exits"]
        print(f"2. node 1's stage SIGKILLed: node 0's torchrun exited with {code0} after {at0:.1f} s, node 1's with "
              f"{code1} after {at1:.1f} s; no process left on hosts 1 and 2 {stop['left_s']:.1f} s later; node 0 "
              f"said: {stop['message'][:160]}", flush=True)
        again = cluster.restart_and_resume()
        print(f"3. both nodes started again: resumed at rounds {again['resumed_rounds']} (stage 0, stage 1) "
              f"{again['resumed_s']:.1f} s after the restart; averaged onto the other peer's anchor again (stage, "
              f"applied round: {again['averaged'][:4]}) {again['averaged_s']:.1f} s after it", flush=True)
        if args.cut_link:
            (code0, at0), (code1, at1) = cluster.cut_node_link(args.cut_link)
            print(f"4. node 1's link cut (pipeline.timeout_s {args.cut_link:g}): node 0's torchrun exited with {code0} "
                  f"after {at0:.1f} s, node 1's with {code1} after {at1:.1f} s, each saying a stage of its peer is "
                  "gone", flush=True)
        print(f"whole scenario: {time.monotonic() - started:.0f} s; logs and metrics in {folder}")


if __name__ == "__main__":
    main()
