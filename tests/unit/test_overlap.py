"""``delayed`` mode: when round r's average is applied in round r+1, and what the working params become.

The average is applied at the first inner step of round r+1 at which it has arrived, at the latest
``diloco.overlap_steps`` into the round (waiting for it there); the working params become the new anchor minus
the progress made since round r+1 began, and round r+1's pseudo-gradient is its whole progress.
"""

from __future__ import annotations

import torch
from torch import nn

from p2p_diloco.config import load_config
from p2p_diloco.config.sections import DiLoCoConfig, default_overlap_steps
from p2p_diloco.training import Stage
from p2p_diloco.training.simulate import ExactGroup

H = 10


class Vector(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))


def make_group(k: int, arrival_steps: int, overlap_steps: int | None = None) -> list[Stage]:
    overrides = [("diloco.mode", "delayed"), ("diloco.inner_steps", str(H)), ("diloco.outer_lr", "1.0"),
                 ("diloco.outer_momentum", "0"), ("averaging.compression", "none")]
    if overlap_steps is not None:
        overrides.append(("diloco.overlap_steps", str(overlap_steps)))
    cfg = load_config(None, overrides)
    group = ExactGroup(k, [(4,)], cfg.averaging, arrival_steps=arrival_steps)
    return [Stage(Vector(), stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                  total_steps=100, averager=group.view(i)) for i in range(k)]


def step(stage: Stage, amount: float) -> None:
    """One hand-written inner step: move every coordinate by -amount."""
    with torch.no_grad():
        stage.params[0].sub_(amount)
    stage.inner_step += 1


def run_round_zero(stages: list[Stage]) -> None:
    for i, stage in enumerate(stages):
        for _ in range(H):
            step(stage, 0.1 * (i + 1))  # worker i's round-0 progress: (i + 1) everywhere
        stage.end_round(tokens=100, expected_group_size=len(stages))


def test_the_average_is_applied_at_the_step_it_arrives():
    stages = run_round_zero_and_return(arrival_steps=3)
    mean = 1.5  # progress of workers 0 and 1: 1 and 2
    stage = stages[0]
    merged_at = None
    for offset in range(1, H + 1):
        step(stage, 0.01)
        if stage.merge_due:
            stage.merge()
            merged_at = offset
            # new anchor minus this round's progress so far
            torch.testing.assert_close(stage.params[0].detach(), torch.full((4,), -mean - 0.01 * offset))
            break
    assert merged_at == 3
    for _ in range(H - merged_at):
        step(stage, 0.01)
    report = stage.end_round(tokens=100, expected_group_size=2)
    assert report.applied_round == 0 and report.outcome.averaged  # the round end reports the merge of its round
    torch.testing.assert_close(stage.pending.contribution[0], torch.full((4,), 0.01 * H))  # the whole round
    torch.testing.assert_close(stage.anchor[0], torch.full((4,), -mean))


def run_round_zero_and_return(arrival_steps: int, overlap_steps: int | None = H) -> list[Stage]:
    """Round 0 done; ``overlap_steps`` H unless given (None: the default)."""
    stages = make_group(2, arrival_steps, overlap_steps)
    run_round_zero(stages)
    return stages


def test_a_late_average_is_waited_for_at_overlap_steps():
    stage = run_round_zero_and_return(arrival_steps=10**6, overlap_steps=4)[0]
    due = []
    for _ in range(4):
        step(stage, 0.0)
        due.append(stage.merge_due)
    assert due == [False, False, False, True]


def test_the_default_merge_step_is_a_twentieth_of_the_round():
    # each step before the merge is stale (about 1% of eval loss at H = 20, BENCHMARKS.md): H // 20, at least 1
    assert [default_overlap_steps(h) for h in (1, 10, 20, 39, 40, 50, 100, 500)] == [1, 1, 1, 1, 2, 2, 5, 25]
    assert DiLoCoConfig(inner_steps=40).merge_step == 2
    assert DiLoCoConfig(inner_steps=40, overlap_steps=7).merge_step == 7
    stage = run_round_zero_and_return(arrival_steps=10**6, overlap_steps=None)[0]  # the default at H = 10: 1 step
    step(stage, 0.0)
    assert stage.merge_due


def test_with_no_arrival_signal_the_whole_round_is_overlapped():
    """With overlap_steps = H, an average that never signals its arrival is applied at the end of the next round,
    as DiLoCoX's one-step delay."""
    stage = run_round_zero_and_return(arrival_steps=10**6)[0]
    for _ in range(H - 1):
        step(stage, 0.0)
        assert not stage.merge_due
    step(stage, 0.0)
    assert stage.merge_due


def test_every_groupmate_sees_the_arrival_also_after_another_took_the_average():
    """The simulated group: worker 0 takes round 0's average at its step 3; worker 1, stepping after it, must see
    the same arrival at its own step 3 (the simulation once showed it only to the first taker, and every other
    worker merged at the end of the round: quality.py's rows ``@N`` measured the whole-round delay)."""
    stages = run_round_zero_and_return(arrival_steps=3)
    for stage in stages:
        merged_at = None
        for offset in range(1, H + 1):
            step(stage, 0.01)
            if stage.merge_due:
                stage.merge()
                merged_at = offset
                break
        assert merged_at == 3


def test_round_end_merge_and_evaluation_make_no_new_copy_of_the_weights():
    """What a peer holds (design.md 1.4): phi0 is rewritten in its own buffers at the round end and the merge, the
    applied round's report keeps no tensor, and evaluating the anchor points the parameters at the anchor's storage
    and gives them back unchanged."""
    stages = run_round_zero_and_return(arrival_steps=1)
    stage = stages[0]
    phi0 = [t.data_ptr() for t in stage.round_start]
    step(stage, 0.01)
    assert stage.merge_due
    stage.merge()
    assert [t.data_ptr() for t in stage.round_start] == phi0
    own = stage.params[0].detach().clone()
    with stage.anchor_weights():
        assert stage.params[0].data_ptr() == stage.anchor[0].data_ptr()
    assert torch.equal(stage.params[0].detach(), own) and stage.params[0].data_ptr() != stage.anchor[0].data_ptr()
    for _ in range(H - 1):
        step(stage, 0.01)
    report = stage.end_round(tokens=100, expected_group_size=2)
    assert report.outcome.averaged and report.outcome.average is None and report.outcome.residual is None
    assert [t.data_ptr() for t in stage.round_start] == phi0
