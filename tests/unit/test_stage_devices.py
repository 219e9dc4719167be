"""Stages of one peer on GPUs: NCCL needs one GPU per stage process (pure logic, the GPU count faked)."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import ConfigError
from p2p_diloco.pipeline.context import check_one_gpu_per_stage


@pytest.fixture
def gpus(monkeypatch):
    def visible(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    return visible


def test_two_stages_on_one_gpu_are_refused_with_what_to_change(gpus):
    gpus(1)
    with pytest.raises(ConfigError, match=r"run.device: 2 stages of this peer on this machine need one GPU each "
                                          r"\(NCCL\), but 1 visible"):
        check_one_gpu_per_stage(torch.device("cuda", 0), "cuda", 2)


def test_an_explicit_gpu_for_every_stage_is_refused(gpus):
    gpus(4)
    with pytest.raises(ConfigError, match="run.device = 'cuda:1' puts them all on one"):
        check_one_gpu_per_stage(torch.device("cuda", 1), "cuda:1", 2)


def test_a_gpu_per_stage_one_stage_or_the_cpu_pass(gpus):
    gpus(2)
    check_one_gpu_per_stage(torch.device("cuda", 1), "cuda", 2)
    check_one_gpu_per_stage(torch.device("cuda", 0), "cuda:0", 1)
    check_one_gpu_per_stage(torch.device("cpu"), "cpu", 4)
    gpus(0)
    check_one_gpu_per_stage(torch.device("cpu"), "auto", 2)
