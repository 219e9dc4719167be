"""Fragments of the model (model/fragments.py) and streaming sync (round/fragments.py): the cut, which
parameters each holds, splits that fit, the staggered round ends, stages of fragments training exactly as one
stage of the whole model does, and each fragment averaged exactly when its round ends."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.model import ModelArgs, build_stage_model
from p2p_diloco.model.fragments import (
    FragmentView,
    check_split_fits,
    describe,
    fitting_split,
    fragment_of,
    fragment_parts,
    part_sizes,
    round_shifts,
    split_parameters,
    stage_fragments,
)
from p2p_diloco.round.fragments import Fragments
from p2p_diloco.training import Stage
from p2p_diloco.training.simulate import ExactGroup


def fragment_units(module, parts: list[int], cfg, total_steps: int, averagers=None) -> Fragments:
    """A stage process's units over ``module``: one Stage per fragment (over a view of its parameters), or the
    module itself for one fragment, as the peer and the quality benchmark build them."""
    averagers = averagers or {}
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    held = split_parameters(named, parts)
    if len(held) == 1:
        return Fragments([Stage(module, stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                                total_steps=total_steps, averager=averagers.get(0))])
    return Fragments([Stage(FragmentView(params), stage_index=0, num_stages=1, inner_cfg=cfg.inner,
                            diloco_cfg=cfg.diloco, total_steps=total_steps, averager=averagers.get(f),
                            fragment=(f, len(held))) for f, params in held.items()])


def round_ends(units: Fragments, rounds: int) -> dict[int, list[tuple[int, int]]]:
    """Unit -> (inner step its round ended after, its steps), driven as the trainer drives them (no training)."""
    H, ends = units.H, {i: [] for i in range(len(units.stages))}
    for r in range(rounds):
        for step in range(r * H + 1, (r + 1) * H + 1):
            for stage in units.stages:
                stage.inner_step = step
            for i in units.ending_early(r, step):
                ends[i].append((step, Fragments.round_tokens(units.stages[i], step, 1)))
                units.stages[i].round_index += 1
        for i in units.ending(r):
            ends[i].append(((r + 1) * H, Fragments.round_tokens(units.stages[i], (r + 1) * H, 1)))
            units.stages[i].round_index += 1
    return ends


def args(n_layers: int = 4, dim: int = 32, vocab: int = 512, tie: bool = False) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=vocab,
                     max_seq_len=16, tie_embeddings=tie)


def largest(a: ModelArgs, parts: list[int]) -> int:
    sizes, ends = part_sizes(a), list(itertools.accumulate([0] + parts))
    return max(sum(sizes[ends[i]:ends[i + 1]]) for i in range(len(parts)))


@pytest.mark.parametrize("n_layers,vocab", [(4, 512), (4, 4096), (8, 4096), (6, 64)])
def test_the_cut_is_the_contiguous_one_with_the_smallest_largest_fragment(n_layers, vocab):
    a = args(n_layers, vocab=vocab)
    n = n_layers + 2
    for F in range(1, n + 1):
        parts = fragment_parts(a, F)
        assert len(parts) == F and sum(parts) == n and min(parts) >= 1
        brute = min(largest(a, [e - s for s, e in zip((0,) + cuts, cuts + (n,))])
                    for cuts in itertools.combinations(range(1, n), F - 1))
        assert largest(a, parts) == brute


def test_bad_fragment_counts_name_the_key():
    for F in (0, 7):
        with pytest.raises(ConfigError, match=r"diloco.fragments: must lie in \[1, 6\]"):
            fragment_parts(args(4), F)


def test_every_parameter_has_the_fragment_of_its_part():
    a = args(4, vocab=4096)
    parts = fragment_parts(a, 4)
    assert parts == [1, 2, 2, 1], describe(parts)
    assert describe(parts) == "0: embedding, 1: block 0 to block 1, 2: block 2 to block 3, 3: head"
    model = build_stage_model(a, [4], 0)
    by_fragment = split_parameters(model.named_parameters(), parts)
    assert [n for n, _ in by_fragment[0]] == ["tok_embeddings.weight"]
    assert {n.split(".")[1] for n, _ in by_fragment[1]} == {"0", "1"}
    assert {n.split(".")[1] for n, _ in by_fragment[2]} == {"2", "3"}
    assert sorted(n for n, _ in by_fragment[3]) == ["norm.weight", "output.weight"]
    assert sum(len(v) for v in by_fragment.values()) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="in no part"):
        fragment_of("layers.9.attention.wq.weight", parts)


def test_a_split_must_hold_whole_fragments():
    parts = [2, 2, 2]  # embedding + block 0 | blocks 1-2 | block 3 + head
    check_split_fits([1, 3], parts)
    check_split_fits([3, 1], parts)
    check_split_fits([1, 2, 1], parts)
    check_split_fits([4], parts)
    with pytest.raises(ConfigError, match=r"stage 1 starts at block 2, inside a fragment \(fragments 0: embedding "
                                          r"to block 0, 1: block 1 to block 2, 2: block 3 to head\)"):
        check_split_fits([2, 2], parts)
    assert stage_fragments([1, 3], parts, 0) == [0]
    assert stage_fragments([1, 3], parts, 1) == [1, 2]
    assert stage_fragments([4], parts, 0) == [0, 1, 2]


def largest_stage(sizes: list[int], split: list[int]) -> int:
    """Parameters of a split's largest stage (stage 0 holds the embedding, the last the head)."""
    ends = [0] + [1 + sum(split[:j + 1]) for j in range(len(split) - 1)] + [len(sizes)]
    return max(sum(sizes[x:y]) for x, y in zip(ends, ends[1:]))


@pytest.mark.parametrize("n_layers,num_fragments", [(4, 3), (4, 4), (6, 4), (8, 6)])
def test_the_default_split_of_a_run_by_fragment_is_the_best_of_whole_fragments(n_layers, num_fragments):
    """``pipeline.stages`` P without a split: stages of whole fragments, each with a block, the largest stage as small
    as any such split allows (brute force over every split of the blocks)."""
    a = args(n_layers)
    parts = fragment_parts(a, num_fragments)
    sizes = part_sizes(a)
    for P in range(1, n_layers + 1):
        fitting = []
        for cuts in itertools.combinations(range(1, n_layers), P - 1):
            split = [b - a_ for a_, b in zip((0, *cuts), (*cuts, n_layers))]
            try:
                check_split_fits(split, parts)
            except ConfigError:
                continue
            fitting.append((largest_stage(sizes, split), split))
        if not fitting:
            with pytest.raises(ConfigError, match=r"pipeline.stages: .* do not fit the fragments"):
                fitting_split(a, parts, P)
            continue
        split = fitting_split(a, parts, P)
        check_split_fits(split, parts)
        assert sum(split) == n_layers and len(split) == P and min(split) >= 1
        assert largest_stage(sizes, split) == min(f[0] for f in fitting), (P, split)


def test_round_shifts_stagger_the_fragments_over_the_round():
    assert round_shifts(1, 50) == [0]
    assert round_shifts(4, 20) == [15, 10, 5, 0]
    assert round_shifts(3, 50) == [33, 16, 0]
    with pytest.raises(ConfigError, match="needs diloco.inner_steps >= 4"):
        round_shifts(4, 3)


def test_stages_of_fragments_train_exactly_as_one_stage_of_the_whole_model():
    """Inner AdamW is per tensor and the clip uses the peer's total norm: F stages over FragmentViews of one model
    take bit-identical inner steps to one stage over the model (streaming changes only when each averages)."""
    a = args(4, vocab=256)
    cfg = load_config(None, [("diloco.inner_steps", "4")])
    whole, split = build_stage_model(a, [4], 0), build_stage_model(a, [4], 0)
    one = Stage(whole, stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco, total_steps=8)
    parts = fragment_parts(a, 3)
    views = split_parameters(split.named_parameters(), parts)
    many = [Stage(FragmentView(named), stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                  total_steps=8) for named in views.values()]
    assert [n for s in many for n in s.param_names] == one.param_names  # the model's order: the same total norm
    torch.manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, 256, (2, 9))
        for model in (whole, split):
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        one.inner_update(torch.linalg.vector_norm(one.grad_norms(), 2))
        norm = torch.linalg.vector_norm(torch.cat([s.grad_norms() for s in many]), 2)
        for s in many:
            s.inner_update(norm)
    for (name, p), (name2, q) in zip(whole.named_parameters(), split.named_parameters()):
        assert name == name2 and torch.equal(p, q), name


def test_fragment_rounds_end_staggered_and_the_last_one_on_the_runs_last_step():
    """H = 20, F = 4, 3 rounds: fragment f's rounds end after steps 20 r + 5 (f + 1) (the regular end for the last
    fragment), and every fragment's last round ends on the run's last step, longer by its shift: what a peer's
    trainer and the quality benchmark both run (one holder, ``Fragments``)."""
    a = args(4, vocab=4096)
    cfg = load_config(None, [("diloco.inner_steps", "20")])
    units = fragment_units(build_stage_model(a, [4], 0), fragment_parts(a, 4), cfg, total_steps=60)
    units.stagger(num_rounds=3)
    assert round_ends(units, 3) == {0: [(5, 5), (25, 20), (60, 35)], 1: [(10, 10), (30, 20), (60, 30)],
                                    2: [(15, 15), (35, 20), (60, 25)], 3: [(20, 20), (40, 20), (60, 20)]}
    together = fragment_units(build_stage_model(a, [4], 0), fragment_parts(a, 4), cfg, total_steps=60)
    assert round_ends(together, 1) == {i: [(20, 20)] for i in range(4)}  # not staggered: all on the round end
    whole = build_stage_model(a, [4], 0)
    one = fragment_units(whole, fragment_parts(a, 1), cfg, total_steps=60)
    one.stagger(num_rounds=3)  # a whole stage is never staggered
    assert len(one.stages) == 1 and one.stages[0].module is whole and one.stages[0].round_shift == 0
    assert round_ends(one, 3) == {0: [(20, 20), (40, 20), (60, 20)]}


def test_streamed_fragments_average_each_fragment_exactly_when_it_ends():
    """Two workers, blocking mode with a plain-averaging outer step (lr 1, no momentum): when a fragment's round
    ends, its anchor on both workers is exactly the mean of their working parameters of that fragment, while the
    other fragments' anchors stay where their own last round left them."""
    a = args(4, vocab=128)
    cfg = load_config(None, [("diloco.inner_steps", "4"), ("diloco.mode", "none"), ("diloco.outer_lr", "1.0"),
                             ("diloco.outer_momentum", "0.0"), ("diloco.nesterov", "false"),
                             ("averaging.compression", "none")])
    parts = fragment_parts(a, 2)
    models = [build_stage_model(a, [4], 0) for _ in range(2)]
    named = split_parameters([(n, tuple(p.shape)) for n, p in models[0].named_parameters()], parts)
    groups = {f: ExactGroup(2, [s for _, s in v], cfg.averaging, timeout_s=60) for f, v in named.items()}
    workers = [fragment_units(m, parts, cfg, 8, averagers={f: g.view(k) for f, g in groups.items()})
               for k, m in enumerate(models)]
    for worker in workers:
        worker.stagger(num_rounds=2)
    torch.manual_seed(1)
    for step in range(1, 9):
        for model, worker in zip(models, workers):
            tokens = torch.randint(0, 128, (2, 9))
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            worker.inner_update(torch.linalg.vector_norm(worker.grad_norms(), 2))
            worker.merge_due()
        r = (step - 1) // 4
        ending = workers[0].ending_early(r, step) + (workers[0].ending(r) if step % 4 == 0 else [])
        for i in ending:
            before = [[p.detach().clone() for p in w.stages[i].params] for w in workers]
            others = [[t.clone() for t in w.stages[j].anchor] for w in workers for j in range(2) if j != i]
            threads = [threading.Thread(target=w.stages[i].end_round, args=(100, 2)) for w in workers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for w in workers:
                for anchor, p0, p1 in zip(w.stages[i].anchor, *before):
                    torch.testing.assert_close(anchor, (p0 + p1) / 2, rtol=0, atol=1e-6)
            assert all(torch.equal(x, y) for x, y in zip(workers[0].stages[i].anchor, workers[1].stages[i].anchor))
            after = [[t for t in w.stages[j].anchor] for w in workers for j in range(2) if j != i]
            assert all(torch.equal(x, y) for old, new in zip(others, after) for x, y in zip(old, new))
    assert [stage.round_index for stage in workers[0].stages] == [2, 2]  # every fragment's rounds, to the last


def test_a_run_by_fragment_fixes_the_fragment_count_not_the_split():
    """The config fingerprint of a run averaged by fragment: peers of any split agree; another F, or a peer that
    averages by stage, differs by the key a user would change (and every fingerprint passes the DHT's schema)."""
    from p2p_diloco.swarm.discovery.fingerprint import config_fingerprint, differences
    from p2p_diloco.swarm.discovery.records import FingerprintValue

    a, meta = args(4), {"vocab_size": 512, "dtype": "uint16", "tokenizer": "byte"}
    whole, split = config_fingerprint(a, [4], meta, 3), config_fingerprint(a, [1, 3], meta, 3)
    assert differences(whole, split) == []
    assert differences(config_fingerprint(a, [4], meta, 4), whole) == ["diloco.fragments is 4 here but 3 in the swarm"]
    by_stage = config_fingerprint(a, [4], meta)
    assert differences(by_stage, whole) == ["diloco.fragments is None here but 3 in the swarm",
                                            "pipeline.stage_layers is [4] here but None in the swarm",
                                            "pipeline.stages is 1 here but None in the swarm"]
    for fingerprint in (whole, split, by_stage):
        # hivemind's schema validator stores only what parsing leaves unchanged (no default filled in)
        assert FingerprintValue.parse_obj(fingerprint).dict(by_alias=True) == fingerprint
    with pytest.raises(ConfigError, match="diloco.fragments: must be 0"):
        load_config(None, [("diloco.fragments", "-1")])
