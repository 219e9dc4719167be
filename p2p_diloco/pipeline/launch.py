"""The local launcher of a P-stage peer: ``p2p-diloco peer --stages P`` on one machine.

Starts P stage processes (``p2p-diloco peer`` again, with the torchrun-style environment that makes each
one a stage), watches them, and stops them together: when one stage dies, the others are stopped with a
message saying which and why, and every process group is killed at the end, so no process of the peer is
left behind. Across the nodes of a cluster, ``torchrun`` plays this role instead (see
``peers/launch-torchrun.sh``). At the end it prints the summary of the peer as a whole.

The stages meet through a ``FileStore`` in a private temporary directory, not torch's ``TCPStore`` (which listens
on all interfaces, unauthenticated, while the stages unpickle what their object collectives receive), and their
gloo and NCCL sockets are bound to the loopback interface: nothing of a local peer's pipeline is reachable from
another machine (see :mod:`p2p_diloco.pipeline.context`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from p2p_diloco.config import Config, dump_config
from p2p_diloco.pipeline.context import STORE_FILE
from p2p_diloco.process import die_with_parent, signal_group, stop_groups

logger = logging.getLogger(__name__)
LAUNCHED_BY_US = "P2P_DILOCO_STAGE_LAUNCHER"
GRACE_S = 30.0


def run_local_stages(cfg: Config) -> int:
    """Run the P stages of this peer as local processes until they all finish; returns the exit code."""
    num_stages, world = cfg.pipeline.stages, cfg.pipeline.stages * cfg.pipeline.replicas
    output_dir = Path(cfg.run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config_path = output_dir / "stages.toml"
    config_path.write_text(dump_config(cfg))
    threads = cfg.run.num_threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory(prefix="p2p-diloco-stages-") as store_dir:  # mode 0700, removed at the end
        processes = [_start_stage(stage_environment(rank, world, Path(store_dir) / "store"), config_path, threads)
                     for rank in range(world)]
        failed = _run_stages(processes)
    if failed is not None:
        rank, code = failed
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        which = f"stage {rank % num_stages}" + (f" of replica {rank // num_stages}" if world > num_stages else "")
        print(f"error: {which} of this peer {how}; stopped its other processes (no process is left running)",
              file=sys.stderr, flush=True)
        return 1
    _print_peer_summary(output_dir, num_stages)
    return 0


def stage_environment(index: int, num_stages: int, store_path: Path) -> dict[str, str]:
    """The environment of process ``index`` of a local peer's ``num_stages`` (stages x replicas): torchrun's ranks,
    the peer's private store (in place of MASTER_ADDR and MASTER_PORT), and gloo's and NCCL's sockets on the loopback
    interface."""
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(RANK=str(index), WORLD_SIZE=str(num_stages), LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(num_stages),
               **{STORE_FILE: str(store_path), LAUNCHED_BY_US: "1"})
    loopback = loopback_interface()
    if loopback is not None:
        env.update(GLOO_SOCKET_IFNAME=loopback, NCCL_SOCKET_IFNAME=loopback)
    return env


def loopback_interface() -> Optional[str]:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS), if it has one."""
    names = {name for _index, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _run_stages(processes: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Watch the stages, forwarding SIGINT and SIGTERM to them; returns what :func:`_watch` does."""
    stop_requested = []

    def forward(signum, _frame) -> None:
        if stop_requested:  # second signal: stop at once
            for process in processes:
                signal_group(process, signal.SIGKILL)
        stop_requested.append(signum)
        for process in processes:
            signal_group(process, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch(processes)
    finally:
        stop_groups(processes, GRACE_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _start_stage(env: dict[str, str], config_path: Path, threads: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "p2p_diloco", "peer", "--config", str(config_path),
               "--run.num_threads", str(threads)]
    return subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_parent)


def _watch(processes: list[subprocess.Popen]) -> tuple[int, int] | None:
    """Wait until every stage exits; returns (stage, exit code) of the first that failed, if any."""
    while True:
        codes = [process.poll() for process in processes]
        if any(code not in (None, 0) for code in codes):
            # when one stage dies, its neighbours fail right after ("the pipeline broke"): give them a moment,
            # then blame a stage killed by a signal before one that exited because of it
            time.sleep(0.5)
            codes = [process.poll() for process in processes]
            failed = [(index, code) for index, code in enumerate(codes) if code not in (None, 0)]
            index, code = min(failed, key=lambda item: (item[1] >= 0, item[0]))
            logger.error(f"Stage {index} stopped (exit code {code}); stopping the peer's other stages")
            return index, code
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)


def _print_peer_summary(output_dir: Path, num_stages: int) -> None:
    stages = []
    for j in range(num_stages):
        path = output_dir / f"summary-stage{j}.json"
        if path.exists():
            stages.append(json.loads(path.read_text()))
    if len(stages) != num_stages:
        return
    last = stages[-1]
    summary = {
        "peer": last["peer"], "run_id": last["run_id"], "num_stages": num_stages,
        "rounds_completed": last["rounds_completed"], "inner_steps": last["inner_steps"], "tokens": last["tokens"],
        "first_loss": last["first_loss"], "last_loss": last["last_loss"],
        "eval_loss_start": last["eval_loss_start"], "eval_loss_final": last["eval_loss_final"],
        "bytes_sent": sum(s["bytes_sent"] for s in stages), "bytes_received": sum(s["bytes_received"] for s in stages),
        "allreduce_bytes_equivalent": sum(s["allreduce_bytes_equivalent"] for s in stages),
        "averaged_rounds_by_stage": [s["averaged_rounds"] for s in stages],
        "anchor_sha256_by_stage": [s["anchor_sha256"] for s in stages],
    }
    print(json.dumps({"summary": summary}), flush=True)
