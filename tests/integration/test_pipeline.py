"""Pipeline-parallel peers (P stage processes joined by gloo) with per-stage averaging, as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from p2p_diloco.config import load_config
from p2p_diloco.model import Transformer, model_args_from_config
from p2p_diloco.process import free_port
from tests.integration.conftest import LOOPBACK, TINY_TRAINING, processes_mentioning
from tests.integration.test_swarm import FAST_AVERAGING, applied, events, summary

pytestmark = pytest.mark.timeout(420)


def pipeline_peer(tmp_path: Path, name: str, *extra: str, maddrs: list[str] = (), rounds: int = 3) -> list[str]:
    initial = ["--initial-peers", *maddrs] if maddrs else []
    return ["peer", *initial, "--host-maddrs", LOOPBACK, "--output-dir", str(tmp_path / name),
            "--train.num_rounds", str(rounds), "--diloco.inner_steps", "8", *TINY_TRAINING, *FAST_AVERAGING,
            "--microbatches", "2", *extra]


def final_anchor(folder: Path) -> dict[str, torch.Tensor]:
    """Every stage's anchor from its newest checkpoint, keyed by parameter name."""
    anchor = {}
    for stage_dir in sorted((folder / "checkpoints").iterdir()):
        newest = sorted(stage_dir.glob("step-*.safetensors"))[-1]
        anchor.update({k.split("/", 1)[1]: v for k, v in load_file(newest).items() if k.startswith("anchor/")})
    return anchor


def test_two_stages_compute_what_one_process_computes(tmp_path, processes):
    """Same seed, data and config: P=2 (GPipe and 1F1B) ends 2 rounds with the anchor of P=1 (rtol 1e-5)."""
    common = ["--data.seed", "7", "--train.num_rounds", "2"]
    runs = {"p1": ["--stages", "1"], "gpipe": ["--stages", "2", "--schedule", "gpipe"],
            "onef1b": ["--stages", "2", "--schedule", "1f1b", "--stage-layers", "3,1"]}
    for name, extra in runs.items():
        processes.start(name, *pipeline_peer(tmp_path, name, *common, *extra, rounds=2))
        assert processes.wait(name, timeout=240) == 0, processes.log(name)[-3000:]
    reference = final_anchor(tmp_path / "p1")
    assert len(reference) == 2 + 4 * 9 + 1  # embedding, 4 blocks of 9 tensors, norm, head
    for name in ("gpipe", "onef1b"):
        anchor = final_anchor(tmp_path / name)
        assert anchor.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(anchor[key], value, rtol=1e-5, atol=1e-7, msg=f"{name} {key}")
    init = Transformer(model_args_from_config(load_config().model, vocab_size=257)).state_dict()
    assert max((reference[k] - init[k]).abs().max().item() for k in reference) > 1e-2  # training moved it


def test_two_peers_of_two_stages_average_per_stage(tmp_path, processes, bootstrap):
    """2 peers x 2 stages (4 stage processes) and a bootstrap node: after every round each stage's anchor is
    identical across the two peers, the stages average separately, and the loss falls."""
    rounds = 3
    for name in ("a", "b"):
        processes.start(name, *pipeline_peer(tmp_path, name, "--stages", "2", "--train.wait_for_peers", "2",
                                             maddrs=bootstrap, rounds=rounds))
    for name in ("a", "b"):
        assert processes.wait(name, timeout=360) == 0, processes.log(name)[-3000:]
    for stage in (0, 1):
        a, b = applied(tmp_path, "a", stage), applied(tmp_path, "b", stage)
        assert [e["applied_round"] for e in a] == [e["applied_round"] for e in b] == list(range(rounds))
        for ea, eb in zip(a, b):
            assert ea["averaged"] and eb["averaged"] and ea["group_size"] == 2
            assert ea["anchor_sha256"] == eb["anchor_sha256"]
    stage0 = {e["anchor_sha256"] for e in applied(tmp_path, "a", 0)}
    stage1 = {e["anchor_sha256"] for e in applied(tmp_path, "a", 1)}
    assert not stage0 & stage1
    last = summary(tmp_path, "a", 1)
    assert last["eval_loss_final"] < last["eval_loss_start"] - 1.0 and last["last_loss"] < last["first_loss"]
    assert summary(tmp_path, "a", 0)["bytes_sent"] > 0 and summary(tmp_path, "a", 1)["bytes_sent"] > 0


def _stage_pid(launcher_pid: int, rank: int) -> int | None:
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


def test_killing_one_stage_stops_its_peer_cleanly(tmp_path, processes, bootstrap):
    """Kill stage 1 of peer b (SIGKILL): b's other stage stops, its launcher exits with a message naming the
    stage, no process of b is left; peer a keeps training to the end."""
    rounds = 6
    # after the kill, a waits out round_timeout_s for b while b's records live (two rounds)
    common = ["--stages", "2", "--train.wait_for_peers", "2", "--averaging.round_timeout_s", "8"]
    processes.start("a", *pipeline_peer(tmp_path, "a", *common, maddrs=bootstrap, rounds=rounds))
    b = processes.start("b", *pipeline_peer(tmp_path, "b", *common, maddrs=bootstrap, rounds=rounds))
    deadline = time.monotonic() + 240
    while not applied(tmp_path, "b", 1):
        assert time.monotonic() < deadline and b.poll() is None, processes.log("b")[-3000:]
        time.sleep(0.2)
    victim = _stage_pid(b.pid, rank=1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)

    assert processes.wait("b", timeout=120) == 1
    log = processes.log("b")
    assert "error: stage 1 of this peer was killed by signal 9" in log, log[-3000:]
    time.sleep(1)
    left = processes_mentioning(str(tmp_path / "b") + "/")
    assert left == [], [(Path(f"/proc/{p}/stat").read_text()[:80], Path(f"/proc/{p}/cmdline").read_bytes()[:300])
                        for p in left]  # no stage, DHT or averager process of b is left

    assert processes.wait("a", timeout=360) == 0, processes.log("a")[-3000:]
    rounds_a = applied(tmp_path, "a", 1)
    assert [e["applied_round"] for e in rounds_a] == list(range(rounds)) and rounds_a[0]["averaged"]
    assert not rounds_a[-1]["averaged"]  # b is gone: a falls back, and finishes


def test_mismatched_split_is_refused(tmp_path, processes, bootstrap):
    """A swarm of 2 stages split 3,1: a newcomer split 2,2, then a single-stage one, are refused with the key that
    differs (one running swarm for both: a peer's start costs a quarter of a minute on a busy machine)."""
    theirs = ["--stages", "2", "--stage-layers", "3,1"]
    running = processes.start("running", *pipeline_peer(tmp_path, "running", *theirs, maddrs=bootstrap, rounds=50))
    deadline = time.monotonic() + 120
    while not events(tmp_path, "running", "step", 0):
        assert time.monotonic() < deadline and running.poll() is None, processes.log("running")[-3000:]
        time.sleep(0.2)
    cases = {"layers": (["--stages", "2", "--stage-layers", "2,2"],
                        "pipeline.stage_layers is [2, 2] here but [3, 1] in the swarm"),
             "stages": (["--stages", "1"], "pipeline.stages is 1 here but 2 in the swarm")}
    for name, (mine, _) in cases.items():
        processes.start(name, *pipeline_peer(tmp_path, name, *mine, maddrs=bootstrap))
    for name, (_, expected) in cases.items():
        assert processes.wait(name, timeout=120) != 0
        log = processes.log(name)
        assert expected in log and "does not fit the swarm" in log, log[-3000:]
        assert "Traceback" not in log


def test_torchrun_launch_script(tmp_path):
    """peers/launch-torchrun.sh starts the stages through torchrun (here: one node, two stage processes); started
    again for one more round, the peer resumes from its checkpoints (the last stage alone holds the start's eval
    loss: a stage that evaluated again on resume waited for it in the pipeline forever)."""
    script = Path(__file__).resolve().parents[2] / "peers" / "launch-torchrun.sh"
    env = dict(os.environ, NPROC_PER_NODE="2", PYTHON=sys.executable, MASTER_PORT=str(free_port()))
    for rounds in (1, 2):
        result = subprocess.run([str(script), "--host-maddrs", LOOPBACK, "--output-dir", str(tmp_path / "peer"),
                                 "--train.num_rounds", str(rounds), "--diloco.inner_steps", "3",
                                 "--checkpoint.every_rounds", "1", *TINY_TRAINING],
                                env=env, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        assert summary(tmp_path, "peer", 0)["rounds_completed"] == rounds
        assert summary(tmp_path, "peer", 1)["rounds_completed"] == rounds
    assert [e["round"] for e in events(tmp_path, "peer", "resume", 1)] == [1]
    assert summary(tmp_path, "peer", 1)["eval_loss_start"] is not None
    alone = subprocess.run([str(script)], env=dict(env, NPROC_PER_NODE="1"), capture_output=True, text=True)
    assert alone.returncode == 2 and "at least 2 processes" in alone.stderr
    uneven = subprocess.run([str(script)], env=dict(env, NPROC_PER_NODE="3", REPLICAS="2"), capture_output=True,
                            text=True)  # 3 processes are not 2 replicas of whole pipelines
    assert uneven.returncode == 2 and "REPLICAS (2) must divide NNODES x NPROC_PER_NODE (3)" in uneven.stderr
