"""``eager`` mode against the equations of arXiv 2502.12996, not against the code's own earlier wording.

Each worker keeps its own copy of the outer state and steps it at the end of round r with
``avg(r-1) - s(r-1) c(r-1) + s(r) c(r)``: every contribution is applied exactly once. So with one worker, or
with every round failing, eager is blocking DiLoCo (``none``) exactly; with outer momentum 0 and outer lr eta
the working params after round r are ``theta0 - eta (sum of avg(tau < r) + s(r) c(r))``. The stages here are
driven round by round with an exact in-process averager; the "inner steps" are written by hand (each round's
progress lies mostly on its own coordinate, plus a part that depends on where the worker stands, so that
diverging trajectories would show).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from p2p_diloco.config import load_config
from p2p_diloco.round.outcome import RoundOutcome
from p2p_diloco.training import Stage
from p2p_diloco.training.simulate import ExactGroup

ROUNDS = 5


class Vector(nn.Module):
    def __init__(self, size: int = ROUNDS + 1):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))


def make_stage(mode: str, averager=None, lr: float = 0.7, momentum: float = 0.9) -> Stage:
    """A stage whose outer step is ``lr`` for any group (the formulas below take a fixed eta; the step that grows with
    the group is checked against the plain-PyTorch reference in test_diloco_reference.py)."""
    cfg = load_config(None, [("diloco.mode", mode), ("diloco.outer_lr", str(lr)),
                             ("diloco.outer_momentum", str(momentum)), ("diloco.outer_lr_group_exponent", "0"),
                             ("averaging.compression", "none")])
    return Stage(Vector(), stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                 total_steps=100, averager=averager)


def train(stage: Stage, round_index: int, worker: int = 0) -> None:
    """This round's local progress: (worker + 1) on coordinate ``round_index``, plus 10% of where it stands."""
    with torch.no_grad():
        step = torch.zeros_like(stage.params[0])
        step[round_index] = worker + 1.0
        stage.params[0].sub_(step + 0.1 * stage.params[0])


class FailingAverager:
    """Every round fails (nobody to average with, a dead group, a timeout)."""

    compresses, round_settled = False, False

    def __init__(self):
        self.round = None

    def set_expected_group_size(self, size): ...

    def start_round(self, contribution, round_index, weight, compute_s=0.0, budget_s=0.0):
        self.round = round_index

    def finish_round(self, timeout=None, hopeless=None, feedback=None):
        return RoundOutcome(fallback_reason="simulated failure")


def run_alone(mode: str, averager=None, expected: int = 1, **outer) -> tuple[list, Stage]:
    stage = make_stage(mode, averager, **outer)
    params = []
    for r in range(ROUNDS):
        train(stage, r)
        stage.end_round(tokens=100, expected_group_size=expected)
        params.append(stage.params[0].detach().clone())
    stage.flush()
    return params, stage


@pytest.mark.parametrize("case", ["alone", "every round failing"])
def test_eager_is_blocking_diloco_when_nothing_is_averaged(case):
    averager, expected = (None, 1) if case == "alone" else (FailingAverager(), 3)
    eager_params, eager = run_alone("eager", averager, expected)
    none_params, none = run_alone("none", FailingAverager() if averager else None, expected)
    delayed_params, _ = run_alone("delayed", FailingAverager() if averager else None, expected)
    for r, (e, n) in enumerate(zip(eager_params, none_params)):
        torch.testing.assert_close(e, n, rtol=0, atol=1e-6, msg=f"working params after round {r}")
    torch.testing.assert_close(eager.anchor[0], none.anchor[0], rtol=0, atol=1e-6)  # once the last round is in
    torch.testing.assert_close(eager.params[0].detach(), none.params[0].detach(), rtol=0, atol=1e-6)
    # not trivially true: the delayed rule differs on the same inputs
    assert max((d - n).abs().max().item() for d, n in zip(delayed_params, none_params)) > 1e-2


def test_issue_check_each_round_on_its_own_coordinate():
    """lr 1, momentum 0, one worker, pure per-coordinate progress: after rounds 1-4 the working params hold every
    round's progress once (the old rule lost the previous round's and got it back a round later)."""
    stage = make_stage("eager", lr=1.0, momentum=0.0)
    for r in range(ROUNDS - 1):
        with torch.no_grad():
            stage.params[0][r] -= 1.0
        stage.end_round(tokens=100, expected_group_size=1)
        expected = torch.zeros(ROUNDS + 1)
        expected[: r + 1] = -1.0
        assert torch.equal(stage.params[0].detach(), expected), r


def run_group(mode: str, k: int, lr: float, momentum: float, reload_at: int | None = None):
    """K workers, rounds ended one worker after another (overlap modes need no threads); returns the working
    params of every worker after every round, each round's contributions, the stages, and the anchor worker 0
    reloaded (at the start of round ``reload_at``, from worker 1)."""
    cfg = load_config(None, [("averaging.compression", "none")])
    group = ExactGroup(k, [(ROUNDS + 1,)], cfg.averaging)
    stages = [make_stage(mode, group.view(i), lr, momentum) for i in range(k)]
    params, contributions, reloaded = [], [], None
    for r in range(ROUNDS):
        if r == reload_at:
            meta, tensors = stages[1].shareable_state("run")
            stages[0].adopt(meta, tensors, "reload")
            reloaded = stages[0].anchor[0].clone()
        round_contributions = []
        for i, stage in enumerate(stages):
            start = stage.round_start[0].clone()
            train(stage, r, worker=i)
            round_contributions.append(start - stage.params[0].detach())
            stage.end_round(tokens=100, expected_group_size=k)
        params.append([s.params[0].detach().clone() for s in stages])
        contributions.append(round_contributions)
    return params, contributions, stages, reloaded


def test_eager_working_params_follow_the_paper_with_momentum_zero():
    """theta_k(r) = theta0 - eta (sum_{tau<r} avg(tau) + s(r) c_k(r)), s = 1 in round 0 (no group known yet),
    then the worker's share in its last group (1/K with equal tokens)."""
    k, eta = 3, 0.8
    params, contributions, stages, _ = run_group("eager", k, lr=eta, momentum=0.0)
    applied = torch.zeros(ROUNDS + 1)
    for r in range(ROUNDS):
        share = 1.0 if r == 0 else 1.0 / k
        for i in range(k):
            expected = -eta * (applied + share * contributions[r][i])
            torch.testing.assert_close(params[r][i], expected, rtol=0, atol=1e-6, msg=f"worker {i} round {r}")
        applied += torch.stack(contributions[r]).mean(dim=0)
    for stage in stages:  # the shared anchor is the plain delayed one: every average but the last one applied
        torch.testing.assert_close(stage.anchor[0], -eta * (applied - torch.stack(contributions[-1]).mean(dim=0)),
                                   rtol=0, atol=1e-6)


def test_the_rounds_after_a_reload_follow_the_same_rule():
    """A reloaded worker's eager state is the donor's anchor A (and momentum); its next round adds its whole fresh
    contribution (s = 1: no group known yet), as round 0 does; the round after takes that back out and adds the
    average and its share of the fresh contribution, as every round does."""
    k, eta = 3, 0.5
    params, contributions, stages, reloaded = run_group("eager", k, lr=eta, momentum=0.0, reload_at=3)
    torch.testing.assert_close(params[3][0], reloaded - eta * contributions[3][0], rtol=0, atol=1e-6)
    average = torch.stack(contributions[3]).mean(dim=0)
    torch.testing.assert_close(params[4][0], reloaded - eta * (average + contributions[4][0] / k), rtol=0, atol=1e-6)


def test_threads_end_blocking_rounds_together():
    """The exact group in blocking mode: K threads, every anchor identical and equal to the plain mean's step."""
    k = 3
    cfg = load_config(None, [("averaging.compression", "none")])
    group = ExactGroup(k, [(ROUNDS + 1,)], cfg.averaging)
    stages = [make_stage("none", group.view(i), lr=1.0, momentum=0.0) for i in range(k)]
    starts = [s.anchor[0].clone() for s in stages]
    for i, stage in enumerate(stages):
        train(stage, 0, worker=i)
    deltas = [s0 - s.params[0].detach() for s0, s in zip(starts, stages)]
    threads = [threading.Thread(target=s.end_round, kwargs=dict(tokens=100, expected_group_size=k)) for s in stages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for stage in stages:
        assert torch.equal(stage.anchor[0], stages[0].anchor[0])
        torch.testing.assert_close(stage.anchor[0], starts[0] - torch.stack(deltas).mean(dim=0), rtol=0, atol=1e-6)
