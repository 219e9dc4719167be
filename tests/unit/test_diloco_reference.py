"""The trainer's rounds against an independent, plain single-process simulation of K DiLoCo workers.

The reference is written from the DiLoCo paper with stock PyTorch pieces only (``torch.optim.AdamW``,
``clip_grad_norm_``, ``torch.optim.SGD(nesterov=True)`` on the global parameters, exact mean of the
workers' pseudo-gradients, computed in float64 and rounded once). The system under test is K real
``Trainer`` loops (in threads, one per worker) whose averager is an in-process exact average: same
seeds must give the same anchor to 1e-6.
"""

from __future__ import annotations

import copy
import math
import threading
from pathlib import Path

import pytest
import torch

from p2p_diloco.config import load_config
from p2p_diloco.data import ShardDataset, WindowSampler
from p2p_diloco.model import ModelArgs, Transformer, loss_fn
from p2p_diloco.round.outcome import RoundOutcome
from p2p_diloco.round.position import Position
from p2p_diloco.training import LocalExecutor, Stage, Trainer, inner_lr, read_metrics
from tests.helpers import TINY_ARGS, make_shards

K, ROUNDS, H, BATCH, SEQ = 3, 3, 5, 4, 16
ARGS = TINY_ARGS


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> ShardDataset:
    return ShardDataset(make_shards(tmp_path_factory.mktemp("data") / "shards"), "train")


def config(tmp_path: Path, mode_overrides=()):
    return load_config(None, [("diloco.inner_steps", str(H)), ("train.num_rounds", str(ROUNDS)),
                              ("data.batch_size", str(BATCH)), ("inner.warmup_steps", "3"),
                              ("inner.grad_clip", "0.5"), ("train.eval_every_rounds", "0"),
                              ("checkpoint.every_rounds", "0"), ("run.output_dir", str(tmp_path)),
                              *mode_overrides])


def reference_diloco(cfg, dataset: ShardDataset, seeds: list[int]) -> list[torch.Tensor]:
    """DiLoCo with K workers as the design states it (docs/design.md §2): H AdamW steps, exact mean of
    pseudo-gradients, Nesterov outer SGD; in ``delayed`` mode round r's mean is applied at the end of round r+1 and
    each worker continues from the new global parameters minus its own not yet averaged progress; ``eager`` (arXiv
    2502.12996) does the same for the global parameters, while each worker keeps its own copy of the outer state (an
    SGD of its own) and continues from it, stepped at the end of round r with ``mean(r-1) - s(r-1) delta_k(r-1) + s(r)
    delta_k(r)``, where ``s`` is the worker's share in its last group (1 before the first: nothing is known of a group
    yet). ``delayed`` with ``overlap_steps`` tau < H applies round r's mean tau steps into round r+1 instead, each
    worker continuing from the new global parameters minus its progress since round r+1 began."""
    mode = cfg.diloco.mode
    tau = cfg.diloco.merge_step
    base = Transformer(ModelArgs(**ARGS))
    global_params = [p.detach().clone().requires_grad_(True) for p in base.parameters()]
    # every outer step of the global params is on a mean of all K workers: with diloco.outer_lr_group_exponent a,
    # the step of a group of K is outer_lr * (K / 2) ** a, K capped at diloco.outer_lr_largest_group (design 2.3)
    group = min(len(seeds), cfg.diloco.outer_lr_largest_group)
    group_lr = cfg.diloco.outer_lr * (group / 2) ** cfg.diloco.outer_lr_group_exponent
    outer = torch.optim.SGD(global_params, lr=group_lr, momentum=cfg.diloco.outer_momentum, nesterov=True)
    workers = [copy.deepcopy(base) for _ in seeds]
    optimizers = [torch.optim.AdamW(
        [{"params": [p for p in w.parameters() if p.dim() >= 2], "weight_decay": cfg.inner.weight_decay},
         {"params": [p for p in w.parameters() if p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.inner.lr, betas=(cfg.inner.beta1, cfg.inner.beta2), eps=cfg.inner.eps) for w in workers]
    samplers = [WindowSampler(dataset, SEQ, BATCH, seed) for seed in seeds]
    starts = [[g.detach().clone() for g in global_params] for _ in seeds]
    eager_params = [[g.detach().clone().requires_grad_(True) for g in global_params] for _ in seeds]
    eager_opts = [torch.optim.SGD(params, lr=cfg.diloco.outer_lr, momentum=cfg.diloco.outer_momentum, nesterov=True)
                  for params in eager_params]
    previous, previous_share = None, 1.0
    merge_early = mode == "delayed" and tau < H
    for r in range(ROUNDS):
        deltas = []
        if merge_early and previous is not None:  # the global step every worker meets tau steps into this round
            for g, mean in zip(global_params, _exact_mean(previous)):
                g.grad = mean
            outer.step()
        for k, (worker, opt, sampler) in enumerate(zip(workers, optimizers, samplers)):
            for step in range(r * H, (r + 1) * H):
                if merge_early and previous is not None and step == r * H + tau:
                    with torch.no_grad():
                        for i, p in enumerate(worker.parameters()):
                            p.copy_(global_params[i].detach() - (starts[k][i] - p.detach()))
                    starts[k] = [g.detach().clone() for g in global_params]
                for group in opt.param_groups:
                    group["lr"] = _reference_lr(step, cfg.inner, ROUNDS * H)
                x, y = sampler.next_batch()
                loss_fn(worker(x), y).backward()
                torch.nn.utils.clip_grad_norm_(worker.parameters(), cfg.inner.grad_clip)
                opt.step()
                opt.zero_grad()
            deltas.append([s - p.detach() for s, p in zip(starts[k], worker.parameters())])
        to_apply = deltas if mode == "none" else None if merge_early else previous
        if mode == "eager":
            share = 1.0 if previous is None else 1.0 / len(seeds)  # equal tokens: 1/K in every group
            for k in range(len(seeds)):
                fresh = [share * d for d in deltas[k]]
                grads = fresh if previous is None else [
                    f + m - previous_share * old for f, m, old in zip(fresh, _exact_mean(previous), previous[k])]
                for e, grad in zip(eager_params[k], grads):
                    e.grad = grad
                for group in eager_opts[k].param_groups:  # before any group: a step alone, at outer_lr
                    group["lr"] = cfg.diloco.outer_lr if previous is None else group_lr
                eager_opts[k].step()
            previous_share = share
        if to_apply is not None:
            for g, mean in zip(global_params, _exact_mean(to_apply)):
                g.grad = mean
            outer.step()
        for k, worker in enumerate(workers):
            with torch.no_grad():
                for i, p in enumerate(worker.parameters()):
                    if mode == "none":
                        p.copy_(global_params[i])
                    elif mode == "eager":
                        p.copy_(eager_params[k][i])
                    elif merge_early:
                        continue  # the round's progress stays in place until its mean replaces it
                    else:
                        p.copy_(global_params[i].detach() - deltas[k][i])
            starts[k] = [p.detach().clone() for p in worker.parameters()]
        previous = deltas
    if mode != "none":  # the end of training applies the last round's mean
        for g, mean in zip(global_params, _exact_mean(previous)):
            g.grad = mean
        outer.step()
    return [g.detach() for g in global_params]


def _exact_mean(deltas: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Exact averaging: the mean in float64, rounded once."""
    return [torch.stack([d[i] for d in deltas]).double().mean(dim=0).float() for i in range(len(deltas[0]))]


def _reference_lr(step: int, inner, total: int) -> float:
    if step < inner.warmup_steps:
        return inner.lr * (step + 1) / inner.warmup_steps
    progress = (step - inner.warmup_steps) / (total - inner.warmup_steps)
    return inner.lr * (inner.min_lr_ratio + (1 - inner.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class InProcessExactAverager:
    """K threads meet at a barrier; each returns the exact weighted mean of all K contributions."""

    def __init__(self, k: int):
        self.barrier = threading.Barrier(k, timeout=60)
        self.slots: dict[int, tuple[list[torch.Tensor], float]] = {}

    def view(self, index: int) -> _View:
        return _View(self, index)


class _View:
    compresses, round_settled = False, False

    def __init__(self, shared: InProcessExactAverager, index: int):
        self.shared, self.index, self.pending = shared, index, None

    def set_expected_group_size(self, size: int) -> None:
        assert size == K

    def start_round(self, contribution, round_index: int, weight: float, compute_s: float = 0.0,
                    budget_s: float = 0.0) -> None:
        self.shared.slots[self.index] = ([t.clone() for t in contribution], weight)
        self.pending = round_index

    def finish_round(self, timeout=None, hopeless=None, feedback=None) -> RoundOutcome:
        self.shared.barrier.wait()
        slots = [self.shared.slots[i] for i in sorted(self.shared.slots)]
        total = sum(w for _, w in slots)
        averaged = [(sum(c[i].double() * w for c, w in slots) / total).float() for i in range(len(slots[0][0]))]
        self.shared.barrier.wait()  # nobody overwrites a slot before everyone has read the round
        return RoundOutcome(average=averaged, averaged=True, group_size=len(slots), group_tokens=total)

    def cancel_round(self) -> None: ...
    def shutdown(self) -> None: ...


class _FixedSwarm:
    """The trainer's view of the swarm; remembers what each progress record would have said. With ``rounds`` (a
    dict shared by the workers), the round each worker's records name, as the DHT would show them to the others."""

    def __init__(self, rounds: dict[int, int] | None = None, index: int = 0):
        self.anchor_fingerprint = ""
        self.record_reads = 0  # reads of the DHT's records (none here)
        self.published: list[tuple[int, str, str]] = []  # (applied round, fingerprint published, actual one)
        self.rounds, self.index = rounds, index

    def expected_group_size(self, round_index: int, met: frozenset = frozenset()) -> int:
        return K

    def publish(self, position: Position, *args, **kwargs) -> None:
        self.published.append((position.applied_round, self.anchor_fingerprint, self.stage.state_fingerprint()[0]))
        if self.rounds is not None:
            self.rounds[self.index] = position.round

    def announce(self, position: Position, round_index: int, *args) -> None:
        self.publish(Position(round_index, 0, position.applied_round))

    def others_ended_round(self, round_index: int, trained_fraction: float = 1.0) -> bool:
        return self.rounds is not None and any(r > round_index for i, r in self.rounds.items() if i != self.index)

    def moved_past(self, round_index: int) -> bool:
        return False


def run_trainers(cfg, dataset: ShardDataset, seeds: list[int], tmp_path: Path,
                 swarms: list[_FixedSwarm] | None = None, trainers: list | None = None) -> list[Stage]:
    """K trainers in threads (``cfg``: one config for all, or one per worker); ``trainers`` collects them."""
    shared = InProcessExactAverager(K)
    stages, errors = [], []
    swarms = swarms if swarms is not None else [_FixedSwarm() for _ in range(K)]
    cfgs = cfg if isinstance(cfg, list) else [cfg] * K

    def worker(k: int) -> None:
        try:
            cfg = cfgs[k]
            model = Transformer(ModelArgs(**ARGS))
            stage = Stage(model, stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                          total_steps=ROUNDS * H, averager=shared.view(k))
            stages.append(stage)
            swarms[k].stage = stage
            trainer = Trainer(cfg, stage, LocalExecutor(model, torch.device("cpu")),
                              WindowSampler(dataset, SEQ, BATCH, seeds[k]), [], swarm=swarms[k],
                              output_dir=tmp_path / f"w{k}", peer_name=f"w{k}")
            if trainers is not None:
                trainers.append(trainer)
            trainer.run()
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)
            shared.barrier.abort()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(K)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return stages


def test_schedule_matches_reference():
    cfg = config(Path("."))
    for step in range(ROUNDS * H):
        assert inner_lr(step, cfg.inner, ROUNDS * H) == pytest.approx(_reference_lr(step, cfg.inner, ROUNDS * H))


GROUP_LR = [("diloco.outer_lr_group_exponent", "0.5")]
"""An outer step that grows with the group (design 2.3; the default is DiLoCo's, one lr for any group)."""


@pytest.mark.parametrize("mode", ["none", "delayed", "eager", "delayed-tau2", "delayed-group-lr", "eager-group-lr"])
def test_trainer_matches_plain_diloco_simulation(dataset, tmp_path, mode):
    torch.manual_seed(0)
    overrides = [("diloco.mode", "delayed"), ("diloco.overlap_steps", "2")] if mode == "delayed-tau2" else \
        [("diloco.mode", mode.removesuffix("-group-lr"))] + (GROUP_LR if mode.endswith("-group-lr") else [])
    cfg = config(tmp_path, overrides)
    seeds = [11, 22, 33]
    expected = reference_diloco(cfg, dataset, seeds)
    swarms = [_FixedSwarm() for _ in range(K)]
    stages = run_trainers(cfg, dataset, seeds, tmp_path, swarms)
    for stage in stages:
        assert stage.round_index == ROUNDS
        for theta, ref in zip(stage.anchor, expected):
            torch.testing.assert_close(theta, ref, rtol=0, atol=1e-6)
    first = stages[0].anchor
    for stage in stages[1:]:  # the exact average is the same on every worker: bit-identical anchors
        assert all(torch.equal(a, b) for a, b in zip(stage.anchor, first))
    # ... and bit-identical momentum and counts: the state fingerprint every worker published for each applied round
    # (what a downloaded state is checked against) is one per round
    published = {}
    for swarm in swarms:
        for applied, _, actual in swarm.published:
            published.setdefault(applied, set()).add(actual)
    assert len(published) > ROUNDS and all(len(fps) == 1 for fps in published.values()), published
    assert len({stage.state_fingerprint()[0] for stage in stages}) == 1
    # the simulation is not trivially satisfied: the anchor moved away from its init
    init = list(Transformer(ModelArgs(**ARGS)).parameters())
    assert max((a - b).abs().max().item() for a, b in zip(first, init)) > 1e-3


def test_the_three_modes_are_different_algorithms(dataset, tmp_path):
    """Guards the test above: the modes must not coincide, or matching them would prove nothing."""
    anchors = {mode: reference_diloco(config(tmp_path, [("diloco.mode", mode)]), dataset, [11, 22, 33])
               for mode in ("none", "delayed", "eager")}
    anchors["delayed-tau2"] = reference_diloco(config(tmp_path, [("diloco.mode", "delayed"),
                                                                 ("diloco.overlap_steps", "2")]), dataset, [11, 22, 33])
    for mode in ("delayed", "eager"):
        anchors[f"{mode}-group-lr"] = reference_diloco(config(tmp_path, [("diloco.mode", mode), *GROUP_LR]), dataset,
                                                       [11, 22, 33])
    for a, b in (("none", "delayed"), ("delayed", "eager"), ("none", "eager"), ("delayed", "delayed-tau2"),
                 ("none", "delayed-tau2"), ("delayed", "delayed-group-lr"), ("eager", "eager-group-lr")):
        gap = max((x - y).abs().max().item() for x, y in zip(anchors[a], anchors[b]))
        assert gap > 1e-4, (a, b, gap)


def test_progress_records_carry_the_fingerprint_of_the_round_they_name(dataset, tmp_path):
    """delayed with overlap_steps < H applies round r's average mid-round: every progress record published
    after that (one per inner step here) names round r as applied, so it must carry the anchor's fingerprint
    after round r. Peers compare anchors at the applied round their records share: a stale fingerprint reads
    as divergence where there is none (and hides it where there is)."""
    cfg = config(tmp_path, [("diloco.mode", "delayed"), ("diloco.overlap_steps", "2"), ("train.log_every", "1")])
    swarms = [_FixedSwarm() for _ in range(K)]
    run_trainers(cfg, dataset, [11, 22, 33], tmp_path, swarms)
    for swarm in swarms:
        named = [(applied, published, actual) for applied, published, actual in swarm.published if applied >= 0]
        # every round was applied and published (the last by the final flush: the peer publishes it as it leaves,
        # for the agreement on the final anchor)
        assert len({applied for applied, _, _ in named}) == ROUNDS
        stale = [(applied, published[:8], actual[:8]) for applied, published, actual in named if published != actual]
        assert not stale, stale


@pytest.mark.parametrize("mode", ["none", "delayed"])
def test_a_slow_worker_ends_each_round_with_the_others_and_contributes_its_tokens(dataset, tmp_path, mode):
    """diloco.round_end = swarm: a worker at a third of the others' speed ends every round when the first of them
    ends it (the in-process averager is a barrier: a round that did not end together would hang), with fewer steps
    of its own; the fastest worker trains every step of every round; weights are the tokens each trained on, and the
    anchors are bit-identical."""
    common = [("diloco.mode", mode), ("diloco.inner_steps", "12"), ("averaging.matchmaking_time_s", "0.004"),
              ("averaging.request_timeout_s", "0.002")]  # a peer finishes its round if that takes < 1 ms
    fast = config(tmp_path, common)
    slow = config(tmp_path, [*common, ("train.slowdown", "3")])
    rounds: dict[int, int] = {}
    swarms = [_FixedSwarm(rounds, k) for k in range(K)]
    trainers: list = []
    stages = run_trainers([fast, fast, slow], dataset, [11, 22, 33], tmp_path, swarms, trainers)
    by_name = {t.summary.peer: t for t in trainers}
    tokens = {name: t.summary.tokens for name, t in by_name.items()}
    per_step = BATCH * SEQ
    # each round: the first to end it trained its H steps, the others what they trained meanwhile (at least one
    # step each). How many the other fast one trained is up to the scheduler: threads share the GIL, and on a busy
    # machine one fast thread can get much less time than the other (seen under two busy loops: 1472 vs 2304)
    per_round = {name: [e["tokens"] for e in read_metrics(tmp_path / name / "metrics-stage0.jsonl")
                        if e["kind"] == "round" and not e["flush"]] for name in by_name}
    assert all(len(r) == ROUNDS for r in per_round.values()), per_round
    assert all(max(r[i] for r in per_round.values()) == 12 * per_step for i in range(ROUNDS)), per_round
    assert all(t >= per_step for r in per_round.values() for t in r), per_round
    assert tokens["w2"] < 0.8 * max(tokens["w0"], tokens["w1"]), tokens
    for t in trainers:
        assert t.summary.averaged_rounds == ROUNDS and t.summary.fallback_rounds == 0
        assert t.stage.inner_step == ROUNDS * 12  # the schedule position of a round ended early is its end
    first = stages[0].anchor
    for stage in stages[1:]:
        assert all(torch.equal(a, b) for a, b in zip(stage.anchor, first))


def test_the_outer_step_grows_with_the_group_only_up_to_the_largest_group():
    """group_lr: a fallback (1) and a pair (2) take outer_lr; the step grows as (g / 2) ** a up to the largest group;
    a larger group (or a crowd of identities joining one) takes the largest group's step; exponent 0 is a fixed
    step."""
    from p2p_diloco.round.outer import group_lr
    assert group_lr(0.7, 0.5, 1, 4) == group_lr(0.7, 0.5, 2, 4) == 0.7
    assert group_lr(0.7, 0.5, 3, 4) == pytest.approx(0.7 * 1.5 ** 0.5)
    assert group_lr(0.7, 0.5, 4, 4) == group_lr(0.7, 0.5, 8, 4) == group_lr(0.7, 0.5, 1000, 4) \
        == pytest.approx(0.7 * 2 ** 0.5)
    assert group_lr(0.7, 0.5, 8, 8) == pytest.approx(1.4)
    assert {group_lr(0.7, 0.0, g, 4) for g in (1, 2, 4, 8, 64)} == {0.7}
