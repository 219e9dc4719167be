"""The memory estimate (p2p_diloco/memory.py): what each setting adds, where it goes on CUDA, the plan's table, and
the start-up check that stops a peer that cannot fit (pure arithmetic; the measured side is benchmarks/sizes.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from p2p_diloco.cli.main import main
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.memory import (
    GB,
    INNER_BYTES,
    TRAINING_BASE,
    RunShape,
    activation_bytes,
    outer_bytes,
    peer_memory,
    stage_processes,
)
from p2p_diloco.model import ModelArgs, balanced_split
from p2p_diloco.model.presets import PRESETS, estimate_num_params
from p2p_diloco.model.split import stage_shapes

MEDIUM = ModelArgs(**PRESETS["medium"], vocab_size=257)
RUN = RunShape(batch_size=2, seq_len=128)


def test_the_stages_hold_the_whole_model_once():
    for stages in (1, 2, 4):
        shapes = stage_shapes(MEDIUM, balanced_split(MEDIUM, stages))
        assert sum(s.num_params for s in shapes) == estimate_num_params(MEDIUM)
        assert [s.has_head for s in shapes] == [False] * (stages - 1) + [True]


def test_each_copy_of_the_outer_state_is_named_by_mode_and_compression():
    assert set(outer_bytes(RunShape(2, 128, mode="none", compressing=False))) == {
        "anchor", "outer momentum", "round contribution"}
    assert set(outer_bytes(RUN)) == {"anchor", "outer momentum", "round contribution", "round start phi0",
                                     "error feedback"}
    assert sum(outer_bytes(RunShape(2, 128, mode="eager")).values()) == sum(outer_bytes(RUN).values()) + 8


def test_the_peer_costs_the_bare_loop_plus_its_outer_state_and_averager():
    memory = peer_memory(stage_shapes(MEDIUM, [16]), RUN)
    n = estimate_num_params(MEDIUM)
    training = memory.stages[0][0]
    inner = TRAINING_BASE + INNER_BYTES * n + activation_bytes(stage_shapes(MEDIUM, [16])[0], RUN, 0, 1)
    assert training.host - inner == pytest.approx(sum(outer_bytes(RUN).values()) * n + 4 * n)
    assert memory.host > memory.bare_host
    # the figures the benchmark measured (BENCHMARKS.md): bare 4.27 GB, the peer 10.58 GB, within 15%
    assert memory.bare_host == pytest.approx(4.27 * GB, rel=0.15)
    assert memory.host == pytest.approx(10.58 * GB, rel=0.15)


def test_on_cuda_the_inner_loop_is_device_memory_and_the_outer_state_host_memory():
    shape = stage_shapes(MEDIUM, [16])[0]
    cpu, cuda = stage_processes(shape, RUN)[0], stage_processes(shape, RunShape(2, 128, device="cuda"))[0]
    assert cpu.device == 0 and cuda.device >= INNER_BYTES * shape.num_params
    assert cuda.host == pytest.approx(cpu.host - INNER_BYTES * shape.num_params - activation_bytes(shape, RUN, 0, 1))


def test_activations_follow_the_batch_and_the_schedule():
    shapes = stage_shapes(MEDIUM, balanced_split(MEDIUM, 4))
    one = activation_bytes(shapes[0], RunShape(8, 128), 0, 1)
    assert activation_bytes(shapes[0], RunShape(16, 128), 0, 1) == pytest.approx(2 * one)
    gpipe = RunShape(8, 128, microbatches=8)
    assert activation_bytes(shapes[0], RunShape(8, 128, microbatches=8, schedule="1f1b"), 0, 4) == \
        pytest.approx(activation_bytes(shapes[0], gpipe, 0, 4) / 2)  # 4 of 8 microbatches in flight on stage 0
    assert activation_bytes(shapes[3], gpipe, 3, 4) > activation_bytes(shapes[2], gpipe, 2, 4)  # the logits


@pytest.fixture
def plan_cli(capsys):
    def run(*args: str) -> SimpleNamespace:
        code = main(["plan", *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
    return run


def test_plan_prints_each_process_and_the_bare_loop(plan_cli):
    result = plan_cli("--preset", "medium", "--batch-size", "2", "--seq-len", "128", "--stages", "2")
    assert result.returncode == 0, result.stderr
    for text in ("Memory per process", "stage 0 training", "stage 1 averager", "the peer", "bare loop", "anchor"):
        assert text in result.stdout
    out = json.loads(plan_cli("--preset", "medium", "--device", "cuda", "--json").stdout)
    memory = out["memory"]
    assert len(memory["stages"]) == 1 and [p["role"] for p in memory["stages"][0]] == [
        "training", "averager", "dht", "p2pd"]
    assert memory["device_bytes"] > 0 and memory["bare_device_bytes"] > 0
    assert "memory" not in json.loads(plan_cli("--params", "1e9", "--json").stdout)  # no shape, no activations


def test_plan_refuses_a_batch_its_microbatches_do_not_divide(plan_cli):
    result = plan_cli("--preset", "tiny", "--batch-size", "6", "--microbatches", "4")
    assert result.returncode == 2 and result.stderr.startswith("error: --microbatches: must divide")


def test_a_peer_that_cannot_fit_stops_before_anything_is_built(monkeypatch):
    from p2p_diloco import stage_process

    cfg = load_config(None, [("model.preset", "medium"), ("data.batch_size", "2"), ("data.seq_len", "128")])
    import torch

    split = [16]
    monkeypatch.setattr(stage_process, "available_host_memory", lambda: 4 * GB)
    with pytest.raises(ConfigError) as e:
        stage_process.check_memory(cfg, MEDIUM, split, 0, torch.device("cpu"), 128)
    message = str(e.value)
    assert message.startswith("run.check_memory: this peer needs about 11.") and "4.00 GB available" in message
    for advice in ("--pipeline.stages 2", "--data.batch_size", "--run.device cuda", "--run.check_memory false"):
        assert advice in message
    monkeypatch.setattr(stage_process, "available_host_memory", lambda: 64 * GB)
    stage_process.check_memory(cfg, MEDIUM, split, 0, torch.device("cpu"), 128)  # fits: no error


def test_under_torchrun_a_machine_checks_the_stages_it_runs(monkeypatch):
    from p2p_diloco import stage_process

    cfg = load_config(None, [("model.preset", "medium"), ("data.batch_size", "2"), ("data.seq_len", "128"),
                             ("pipeline.stages", "4")])
    import torch

    split = balanced_split(MEDIUM, 4)
    memory = peer_memory(stage_shapes(MEDIUM, split), RUN)
    largest = max(memory.stage_host(j) for j in range(4))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("P2P_DILOCO_STAGE_LAUNCHER", raising=False)
    monkeypatch.setattr(stage_process, "available_host_memory", lambda: largest * 1.01)
    stage_process.check_memory(cfg, MEDIUM, split, 0, torch.device("cpu"), 128)  # one stage per machine fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="2 stage\\(s\\) of this peer on this machine"):
        stage_process.check_memory(cfg, MEDIUM, split, 0, torch.device("cpu"), 128)
