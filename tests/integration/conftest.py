"""Fixtures of the integration tests: real processes on 127.0.0.1, always shut down and reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# timeouts small enough that a failed round is over in seconds, large enough for a loaded 2-core machine. The
# request timeout is the product's default (3 s): it is also a follower's grace for the leader's "begin" after its
# own matchmaking window, and at 2 s, under two busy loops, a follower gave up on a leader that then assembled the
# group with it: the other two waited 20 s for its parts and the round fell back for all three (hivemind's
# leader/follower race; seen in the fresh-clone busy CI)
FAST_AVERAGING = [
    "--averaging.matchmaking_time_s", "4", "--averaging.request_timeout_s", "3",
    "--averaging.round_timeout_s", "20", "--averaging.allreduce_timeout_s", "20",
    "--averaging.next_chunk_timeout_s", "10",
]
# (sequences of 32 tokens: a step costs half of one of 64 (36 against 65 ms on one idle core), and the rounds of
# the swarm tests are their steps; the mixed-split test keeps 64, its timing measured over many busy runs)
TINY_TRAINING = [
    "--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "32", "--data.eval_batches", "2",
    "--train.log_every", "5", "--train.progress", "false", "--run.num_threads", "1",
]


REPO = Path(__file__).resolve().parents[2]  # the repository root: tests.hostile is importable from there


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco", *args]


def _descendants(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            children.append(int(entry.name))
    return children + [d for c in children for d in _descendants(c)]


def processes_mentioning(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (e.g. a peer's output folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.fixture(autouse=True)
def reap_children():
    """Kill whatever a test left behind (peers, bootstrap nodes, p2pd daemons), but not torch's shared-memory
    manager: this process still frees shared tensors through it, and aborts if it is gone."""
    before = set(_descendants(os.getpid()))
    yield
    for pid in _descendants(os.getpid()):
        if pid in before or _command_name(pid) == "torch_shm_manager":
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Processes:
    """Starts CLI processes with their output in log files; stops them all at teardown."""

    def __init__(self, root: Path):
        self.root, self.procs = root, {}

    def start(self, name: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        return self._popen(name, cli(*args), env)

    def start_hostile(self, name: str, kind: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        """A hostile peer of ``kind`` (``<kind>[:<value>]``, :mod:`tests.hostile`); ``args`` as for :meth:`start`."""
        return self._popen(name, [sys.executable, "-m", "tests.hostile.peer", kind, "--", *args], env, cwd=REPO)

    def _popen(self, name: str, command: list[str], env: dict | None, cwd: Path | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                                cwd=cwd)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not finish within {timeout} s; log:\n{self.log(name)[-3000:]}") from None

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        assert proc.poll() is None, f"process exited with {proc.returncode} before writing {path}"
        time.sleep(0.2)
    raise AssertionError(f"{path} did not appear within {timeout} s")


@pytest.fixture
def bootstrap(processes, tmp_path) -> list[str]:
    """A running bootstrap node; returns its multiaddrs."""
    proc = processes.start("bootstrap", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path",
                           str(tmp_path / "bootstrap.id"), "--maddrs-file", str(tmp_path / "bootstrap.maddrs"))
    return wait_for_file(tmp_path / "bootstrap.maddrs", proc).split()
