"""SparseLoCo (arXiv 2508.15706) as the `sparseloco` compression: its codecs, and its round against Algorithm 1 of
the paper written out here in plain torch.

Algorithm 1, per worker r and round t: e_r <- beta e_r + Delta_r; Delta^_r = Q(TopK(e_r)); e_r <- e_r - Delta^_r;
Delta = (1/R) sum_r Delta^_r; theta <- theta - alpha Delta. Where this project departs, the reference departs with
it and says so: Q(TopK(.)) is our 2-bit code (sign, and the mean of the lower or the upper half of the kept
magnitudes of the chunk), and the average crosses the wire once more, 8-bit per chunk (`sparse8`), because the
group's all-reduce sends each reducer's average back rather than all-gathering every contribution.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hivemind.compression import CompressionInfo
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from p2p_diloco.compression import sparse
from p2p_diloco.compression.codecs import codec_for, decode_tensor, result_codec, roundtrip
from p2p_diloco.compression.policy import LINK_SPREAD, CompressionPolicy
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.round.stage import Stage
from p2p_diloco.training.simulate import ExactGroup

SHAPES = [(3, 5000), (300,)]  # a tensor of full chunks and a shorter last one, and one shorter than a chunk


def encode(name: str, tensor: torch.Tensor):
    return codec_for(name).compress(tensor, CompressionInfo.from_tensor(tensor))


def test_topk2_keeps_the_k_largest_of_each_chunk_as_sign_and_one_of_two_magnitudes():
    torch.manual_seed(0)
    x = torch.randn(3, 5000)
    sent = roundtrip("topk2:64", x).reshape(-1)
    flat = x.reshape(-1)
    kept_counts = sparse.kept_per_chunk(flat.numel(), 64)
    assert kept_counts == [64, 64, 64, math.ceil(64 * (15000 - 3 * 4096) / 4096)]
    for c, kept in enumerate(kept_counts):
        chunk, got = flat[c * 4096:(c + 1) * 4096], sent[c * 4096:(c + 1) * 4096]
        index = torch.nonzero(got).reshape(-1)
        assert set(index.tolist()) == set(chunk.abs().topk(kept).indices.tolist())
        assert torch.equal(torch.sign(got[index]), torch.sign(chunk[index]))
        size = chunk[index].abs().double()
        high = size > (size.min() + size.max()) / 2
        expected = torch.where(high, size[high].mean(), size[~high].mean()).float()
        assert torch.equal(got[index].abs(), expected)  # above the middle of the range: the upper mean
    # what the wire already carries crosses it unchanged (the averager encodes the reducer's roundtrip again)
    assert torch.equal(roundtrip("topk2:64", sent.reshape(3, 5000)), sent.reshape(3, 5000))
    sparse_input = torch.zeros(5000)
    sparse_input[[3, 70, 4500]] = torch.tensor([1.0, -2.0, 3.0])  # fewer non-zero values than k: all kept, no more
    assert torch.equal(roundtrip("topk2:64", sparse_input) != 0, sparse_input != 0)
    assert len(encode("topk2:64", x).buffer) == codec_for("topk2:64").encoded_size(x.numel()) < x.numel() * 4 / 100


def test_the_average_comes_back_sparse_with_8_bit_values():
    torch.manual_seed(1)
    a, b = (roundtrip("topk2:32", torch.randn(9000)) for _ in range(2))
    mean = (a + b) / 2
    message = encode(result_codec("topk2:32"), mean)
    back = decode_tensor(message)
    assert torch.equal(back != 0, mean != 0)  # the support is kept exactly
    assert (back - mean).abs().max() <= mean.abs().max() / 127 / 2 * 1.001  # each value within half a code
    assert len(message.buffer) <= codec_for("topk2:32").average_size(9000, group_size=2)


def _bad(message, **changes):
    for field, value in changes.items():
        if field == "buffer":
            message.buffer = value
        else:
            setattr(message, field, value)
    return message


@pytest.mark.parametrize("damage", ["short", "long", "k zero", "k over chunk", "index out", "index order",
                                    "nan scale", "negative scale", "count over share"])
def test_a_malformed_topk2_part_is_refused_before_it_is_decoded(damage):
    x = torch.randn(5000)
    message = encode("topk2:16", x)
    raw = bytearray(message.buffer)
    num_chunks, kept = 2, sum(sparse.kept_per_chunk(5000, 16))
    index_at = 4 + 10 * num_chunks
    if damage == "short":
        raw = raw[:-1]
    elif damage == "long":
        raw += b"\0"
    elif damage == "k zero":
        raw[0:4] = np.uint32(0).tobytes()
    elif damage == "k over chunk":
        raw[0:4] = np.uint32(sparse.CHUNK + 1).tobytes()
    elif damage == "index out":  # the last chunk is 904 values long: index 1000 is outside it
        last = index_at + 2 * (kept - 1)
        raw[last:last + 2] = np.uint16(1000).tobytes()
    elif damage == "index order":
        raw[index_at:index_at + 4] = raw[index_at + 2:index_at + 4] + raw[index_at:index_at + 2]
    elif damage == "nan scale":
        raw[8:12] = np.float32("nan").tobytes()
    elif damage == "negative scale":
        raw[12:16] = np.float32(-1.0).tobytes()
    elif damage == "count over share":
        raw[4:6] = np.uint16(17).tobytes()
    with pytest.raises(ValueError):
        decode_tensor(_bad(message, buffer=bytes(raw)), max_values=5000)


def test_a_sparse_part_declaring_more_values_than_expected_is_refused_before_any_allocation():
    message = encode("topk2:16", torch.randn(5000))
    message.size[:] = [10**9]
    with pytest.raises(ValueError, match="more than the 5000 expected"):
        decode_tensor(message, max_values=5000)
    average = encode("sparse8", torch.zeros(5000))
    raw = bytearray(average.buffer)
    raw[0:2] = np.uint16(5000).tobytes()  # a count over the chunk's 4096 values
    with pytest.raises(ValueError):
        decode_tensor(_bad(average, buffer=bytes(raw)), max_values=5000)


def test_sparseloco_plans_every_tensor_as_topk_and_decays_its_feedback():
    cfg = load_config(None, [("averaging.compression", "sparseloco"), ("averaging.sparse_topk", "32"),
                             ("averaging.sparse_feedback_decay", "0.9")]).averaging
    policy = CompressionPolicy(SHAPES, cfg)
    plan = policy.agree([{"compression": policy.initial_proposal(), "last_error": None, "bandwidth_mbit": 100.0,
                          "compute_s": 1.0}])
    assert plan.codecs == ("topk2:32", "topk2:32") and plan.lowrank == ()
    assert policy.feedback_decay == 0.9
    assert CompressionPolicy(SHAPES, load_config(None, []).averaging).feedback_decay == 1.0
    assert policy.payload_bytes(plan) == sum(codec_for("topk2:32").encoded_size(math.prod(s)) for s in SHAPES)
    # a slow link: k halves until the round fits half a round of compute on it (the budget of 'adaptive')
    budget_bytes = cfg.bandwidth_budget * 1.0 * 0.002 * 1e6 / 8  # 2 kbit/s, 1 s of compute, a group of 1
    slow = policy.agree([{"compression": policy.initial_proposal(), "last_error": None, "bandwidth_mbit": 0.002,
                          "compute_s": 1.0}])
    k = codec_for(slow.codecs[0]).k
    assert k < 32 and (k == 1 or policy.transfer_bytes(slow, 1) <= budget_bytes)
    assert k == 1 or policy.transfer_bytes(policy._sparse_plan(2 * k), 1) > budget_bytes
    for key, value in (("sparse_topk", "0"), ("sparse_topk", "4097"), ("sparse_feedback_decay", "1.5")):
        with pytest.raises(ConfigError, match=f"averaging.{key}"):
            load_config(None, [("averaging.compression", "sparseloco"), (f"averaging.{key}", value)])


def _member(policy, topk=None, mbit=100.0):
    proposal = dict(policy.initial_proposal(), **({} if topk is None else {"topk": topk}))
    return {"compression": proposal, "last_error": None, "bandwidth_mbit": mbit, "compute_s": 1.0}


def test_sparseloco_k_is_the_groups_lower_median_and_its_budget_counts_the_average_sent_back():
    cfg = load_config(None, [("averaging.compression", "sparseloco"), ("averaging.sparse_topk", "64")]).averaging
    policy = CompressionPolicy([(64, 4096)], cfg)
    ks = lambda plan: {codec_for(c).k for c in plan.codecs}  # noqa: E731
    # one member proposing k = 1 (or 4096) cannot move the group's k; a member that proposes none counts as 64
    assert ks(policy.agree([_member(policy, 1), _member(policy, 64), _member(policy, 256)])) == {64}
    assert ks(policy.agree([_member(policy, 4096), _member(policy, 32), _member(policy, 32)])) == {32}
    old_peer = _member(policy)
    del old_peer["compression"]["topk"]
    assert ks(policy.agree([old_peer, _member(policy, 256), _member(policy, 256)])) == {256}
    # a pair has no majority: one member's k of 1 cuts the other's at most LINK_SPREAD-fold (it took it to 1)
    assert ks(policy.agree([_member(policy, 1), _member(policy, 64)])) == {int(64 / LINK_SPREAD)}
    assert ks(policy.agree([_member(policy, 32), _member(policy, 64)])) == {32}  # within it: the smaller
    # the average a member sends back holds up to group-size times k values per chunk at 3 bytes: a link whose
    # budget fits the contributions of a group of 8 but not their averages halves k
    plan = policy._sparse_plan(64)
    sent, both = policy.payload_bytes(plan), policy.transfer_bytes(plan, 8)
    assert both > 2 * sent
    butterfly = 2 * 7 / 8
    for budget in (1.5 * sent, (sent + both) / 2):
        mbit = budget * butterfly * 8 / 1e6 / cfg.bandwidth_budget  # the link on which this is the budget
        k = ks(policy.agree([_member(policy, mbit=mbit) for _ in range(8)])).pop()
        assert k < 64 and policy.transfer_bytes(policy._sparse_plan(k), 8) <= budget * 1.0001
    # the same link in a group of 2 keeps more: fewer averages overlap, each holds fewer values
    assert ks(policy.agree([_member(policy, mbit=mbit) for _ in range(2)])).pop() > k


@pytest.mark.parametrize("topk", [0, -3, 4097, 10**12, True, 2.5, "64", None])
def test_a_groupmates_sparse_k_out_of_range_is_refused(topk):
    from p2p_diloco.swarm.averaging.gathered import GatheredError, check_gathered
    info = {"round": 1, "tokens": 10, "compute_s": 1.0, "bandwidth_mbit": 10.0,
            "compression": {"rank": 4, "bits": 8, "q_round": -1, "topk": topk}}
    with pytest.raises(GatheredError, match="compression.topk"):
        check_gathered(info)
    info["compression"]["topk"] = 64
    assert check_gathered(info) is info


class Tensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(SHAPES[0]))
        self.b = nn.Parameter(torch.zeros(SHAPES[1]))


def reference_sparseloco(deltas: list[list[list[torch.Tensor]]], k: int, beta: float, alpha: float):
    """Algorithm 1 of the paper (see the module docstring) over ``deltas[round][worker]``; the final theta."""
    theta = [torch.zeros(s) for s in SHAPES]
    errors = [[torch.zeros(s) for s in SHAPES] for _ in deltas[0]]
    for round_deltas in deltas:
        sent = []
        for worker, delta in enumerate(round_deltas):
            errors[worker] = [beta * e + d for e, d in zip(errors[worker], delta)]
            compressed = [roundtrip(f"topk2:{k}", e) for e in errors[worker]]  # Q(TopK(e))
            errors[worker] = [e - c for e, c in zip(errors[worker], compressed)]
            sent.append(compressed)
        mean = [sum(parts) / len(parts) for parts in zip(*sent)]
        mean = [roundtrip("sparse8", m) for m in mean]  # this project's departure: the average's own wire
        theta = [t - alpha * m for t, m in zip(theta, mean)]
    return theta


def test_a_sparseloco_group_follows_algorithm_1_of_the_paper():
    k, beta, alpha, rounds, workers = 32, 0.9, 1.0, 4, 3
    cfg = load_config(None, [("diloco.mode", "none"), ("diloco.inner_steps", "1"), ("diloco.outer_lr", str(alpha)),
                             ("diloco.outer_momentum", "0"), ("diloco.outer_lr_group_exponent", "0"),
                             ("averaging.compression", "sparseloco"),
                             ("averaging.sparse_topk", str(k)), ("averaging.sparse_feedback_decay", str(beta)),
                             ("averaging.clip_ratio", "0"), ("averaging.outlier_norm_ratio", "0")])
    group = ExactGroup(workers, SHAPES, cfg.averaging)
    stages = [Stage(Tensors(), stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                    total_steps=rounds, averager=group.view(i)) for i in range(workers)]
    g = torch.Generator().manual_seed(7)
    deltas = [[[torch.randn(s, generator=g) * (1 + w) for s in SHAPES] for w in range(workers)]
              for _ in range(rounds)]

    def train_round(worker: int, round_index: int):
        stage = stages[worker]
        with torch.no_grad():
            for p, d in zip(stage.params, deltas[round_index][worker]):
                p.sub_(d)  # the round's pseudo-gradient phi0 - phi is exactly d
        stage.inner_step += 1
        return stage.end_round(tokens=100, expected_group_size=workers)

    with ThreadPoolExecutor(workers) as pool:  # blocking mode: each round end waits for the whole group
        for r in range(rounds):
            reports = list(pool.map(train_round, range(workers), [r] * workers))
            assert all(report.outcome.averaged for report in reports)
    expected = reference_sparseloco(deltas, k, beta, alpha)
    for stage in stages:
        for theta, ref in zip(stage.anchor, expected):
            torch.testing.assert_close(theta, ref, rtol=0, atol=1e-5)
    # not trivially satisfied: a dense DiLoCo mean of the same deltas ends elsewhere
    dense = [-sum(sum(d[w][i] for w in range(workers)) / workers for d in deltas) for i in range(len(SHAPES))]
    assert max((a - b).abs().max().item() for a, b in zip(expected, dense)) > 0.1


@settings(max_examples=200, deadline=None)
@given(num_values=st.integers(min_value=1, max_value=9000), k=st.integers(min_value=0, max_value=5000),
       counts=st.lists(st.integers(min_value=0, max_value=70), min_size=1, max_size=3),
       scales=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=0, max_size=6),
       indices=st.lists(st.integers(min_value=0, max_value=2**16 - 1), max_size=200),
       codes=st.binary(max_size=60), average=st.booleans())
@example(num_values=10, k=0, counts=[1], scales=[3e38], indices=[3], codes=b"\x7f", average=True)  # 3e38 x 127: inf
def test_any_sparse_message_with_a_well_formed_header_decodes_finite_or_is_refused(num_values, k, counts, scales,
                                                                                     indices, codes, average):
    """Headers that parse, with any counts, scales, indices and codes: a ValueError, or a finite tensor of the
    declared shape whose non-zero values sit where the message said."""
    head = b"" if average else np.uint32(k).tobytes()
    scale_bytes = np.asarray(scales, dtype="<f4").tobytes()
    buffer = head + np.asarray(counts, dtype="<u2").tobytes() + scale_bytes + \
        np.asarray(indices, dtype="<u2").tobytes() + codes
    message = encode("sparse8" if average else "topk2:8", torch.zeros(num_values))
    message.buffer = buffer
    try:
        tensor = decode_tensor(message, max_values=num_values)
    except ValueError:
        return
    assert tensor.shape == (num_values,) and torch.isfinite(tensor).all()
    assert int(torch.count_nonzero(tensor)) <= len(indices)
