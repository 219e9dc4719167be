"""Unit tests of pseudo-gradient compression: codecs, low rank, error feedback, the adaptive plan."""

from __future__ import annotations

import asyncio
import hashlib
import math

import numpy as np
import pytest
import torch
from hivemind.compression import CompressionInfo
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p_diloco.compression import CODECS, CompressionPolicy, decode_tensor, roundtrip, sparse
from p2p_diloco.compression.blockwise import BLOCK
from p2p_diloco.compression.codecs import REGISTERED, average_rounding, codec_for, result_codec
from p2p_diloco.compression.lowrank import desired_rank, fit_q, orthonormalize, reconstruct, seeded_q
from p2p_diloco.compression.policy import LINK_SPREAD
from p2p_diloco.config import AveragingConfig
from p2p_diloco.swarm.averaging.reduce import RoundReducer


def sample(*shape, seed=0, scale=1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("shape", [(1000,), (37, 129), (BLOCK * 3,), (1,), (5, 7, 11)])
def test_codec_round_trip_error_bounds(shape):
    x = sample(*shape, scale=3.0)
    x.view(-1)[0] = 40.0  # an outlier: blockwise scales keep it from ruining the other blocks
    assert torch.equal(roundtrip("fp32", x), x)
    fp16 = roundtrip("fp16", x)
    assert ((fp16 - x).abs() <= x.abs() * 2**-11 + 1e-7).all()
    flat = torch.nn.functional.pad(x.reshape(-1), (0, (-x.numel()) % BLOCK))
    block_max = flat.view(-1, BLOCK).abs().amax(dim=1).repeat_interleave(BLOCK)[: x.numel()].view(shape)
    for name, levels in (("int8", 127), ("int4", 7)):
        y = roundtrip(name, x)
        assert y.shape == x.shape
        assert ((y - x).abs() <= block_max / levels / 2 * (1 + 1e-5)).all(), name
    assert torch.equal(roundtrip("int8", roundtrip("int8", x)), roundtrip("int8", x)) or \
        torch.allclose(roundtrip("int8", roundtrip("int8", x)), roundtrip("int8", x), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int4"])
def test_payload_sizes_and_ratios(name):
    x = sample(10_000)
    message = CODECS[name].compress(x, CompressionInfo.from_tensor(x))
    assert len(message.buffer) == CODECS[name].encoded_size(x.numel())
    ratio = len(message.buffer) / (4 * x.numel())
    assert ratio <= {"fp32": 1.0, "fp16": 0.5, "int8": 0.26, "int4": 0.14}[name]


# ---- the registry: every codec behind one interface ------------------------------------------------------------

WIRE_DIGESTS = {  # sha256 of each codec's message for WIRE_SAMPLE: the wire format, pinned
    "fp32": "d32a648d078514c3693df44feb70f885",
    "fp16": "8129774c913db548ace7092aa819169c",
    "int8": "77e4180e494ccbe4056d37afe39065d1",
    "int4": "17ebb0c4fe26602de95f4013dd2fc0f1",
    "topk2:64": "c96ae361df5427235771910569af4f11",
    "sparse8": "f990132f47647840650f132c7940f372",
}
PARAMETERS = {"k": st.integers(min_value=1, max_value=sparse.CHUNK)}
"""A strategy for each kind of parameter a codec's name carries (``Codec.parameter``)."""


def wire_sample() -> torch.Tensor:
    """Values of distinct magnitudes (no ties for a top-k to break) whose every sum is exact in float64."""
    i = torch.arange(15000)
    x = (((i * 7919) % 15013 + 1) * (1 - 2 * (i % 2))).float().reshape(3, 5000) * 2.0**-14
    x[0, :7] = 0
    return x


@pytest.mark.parametrize("name", sorted(WIRE_DIGESTS))
def test_every_codecs_wire_format_is_unchanged(name):
    x = wire_sample()
    message = codec_for(name).compress(x, CompressionInfo.from_tensor(x))
    assert hashlib.sha256(message.SerializeToString()).hexdigest()[:32] == WIRE_DIGESTS[name]


def test_the_registry_parses_every_name_a_plan_gives_and_refuses_others():
    assert [codec_for(name).name for name in ("fp32", "fp16", "int8", "int4", "sparse8", "topk2:64")] == \
        ["fp32", "fp16", "int8", "int4", "sparse8", "topk2:64"]
    assert result_codec("topk2:64") == "sparse8" and result_codec("int4") == "int4"
    for bad in ("int2", "int8:4", "topk2", "topk2:", "topk2:x", "topk2:0", f"topk2:{sparse.CHUNK + 1}", ""):
        with pytest.raises(ValueError):
            codec_for(bad)
    assert len({codec.family for codec in REGISTERED}) == len(REGISTERED)
    assert len({(codec.compression_type, codec.wire_dtype) for codec in REGISTERED}) == len(REGISTERED)


def test_the_config_takes_the_scheme_list_of_the_compression_package():
    from p2p_diloco.compression import SCHEMES
    from p2p_diloco.config.network import COMPRESSIONS

    assert COMPRESSIONS is SCHEMES


@pytest.mark.parametrize("codec_class", REGISTERED, ids=lambda codec: codec.family)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), rows=st.integers(min_value=1, max_value=3), columns=st.integers(min_value=1, max_value=5000),
       seed=st.integers(min_value=0, max_value=2**16), scale=st.sampled_from([0.0, 1e-38, 1e-3, 1.0, 1e30]),
       density=st.sampled_from([1.0, 0.1, 0.001]))
def test_every_registered_codec_decodes_what_it_encodes_within_its_size(codec_class, data, rows, columns, seed,
                                                                         scale, density):
    """What a codec adds by being registered: its name parses back to it, its messages carry its wire pair and
    decode (through the registry) to its roundtrip, finite, of the tensor's shape, in at most its encoded size, an
    average of two sent back fits the size the planner counts, and a payload one byte short or long is refused."""
    name = codec_class.family
    if codec_class.parameter is not None:
        name += f":{data.draw(PARAMETERS[codec_class.parameter])}"
    codec = codec_for(name)
    assert type(codec) is codec_class and codec.name == name
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, columns, generator=g) * scale * (torch.rand(rows, columns, generator=g) < density)
    message = codec.compress(x, CompressionInfo.from_tensor(x))
    assert (message.compression, message.dtype) == (codec.compression_type, codec.wire_dtype)
    decoded = decode_tensor(message, max_values=x.numel())
    assert decoded.shape == x.shape and decoded.dtype == torch.float32 and torch.isfinite(decoded).all()
    assert torch.equal(decoded, codec.roundtrip(x))
    assert len(message.buffer) <= codec.encoded_size(x.numel())
    other = torch.randn(rows, columns, generator=g) * scale
    average = (codec.roundtrip(x) + codec.roundtrip(other)) / 2
    returned = codec.result_codec().compress(average, CompressionInfo.from_tensor(average))
    assert len(returned.buffer) <= codec.average_size(x.numel(), group_size=2)
    for buffer in (message.buffer[:-1], message.buffer + b"\0"):
        damaged = type(message)()
        damaged.CopyFrom(message)
        damaged.buffer = buffer
        with pytest.raises(ValueError):
            decode_tensor(damaged)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_malformed_payloads_are_refused(name):
    x = sample(600)
    good = CODECS[name].compress(x, CompressionInfo.from_tensor(x))
    truncated = type(good)()
    truncated.CopyFrom(good)
    truncated.buffer = good.buffer[:-1]
    with pytest.raises(ValueError, match="does not fit shape"):
        decode_tensor(truncated)
    bad_scale = type(good)()
    bad_scale.CopyFrom(good)
    bad_scale.buffer = b"\x00\x00\xc0\x7f" + good.buffer[4:]  # a NaN scale
    with pytest.raises(ValueError, match="non-finite"):
        decode_tensor(bad_scale)
    if name == "int8":
        out_of_range = type(good)()
        out_of_range.CopyFrom(good)
        out_of_range.buffer = good.buffer[:-1] + b"\x80"  # -128
        with pytest.raises(ValueError, match="out of range"):
            decode_tensor(out_of_range)


@pytest.mark.parametrize("name", ["int8", "int4", "sparse8"])
def test_a_finite_scale_whose_largest_code_overflows_float32_is_refused(name):
    """A scale of 3e38 is finite, but 3e38 x 127 (or x 7) is past float32: such a payload is refused, never decoded
    into inf. An honest scale is a finite value's magnitude over the largest code, so its codes always decode."""
    x = torch.zeros(600)
    x[3] = -2.0
    good = codec_for(name).compress(x, CompressionInfo.from_tensor(x))
    assert torch.equal(decode_tensor(good), x)
    hostile = type(good)()
    hostile.CopyFrom(good)
    at = 2 * math.ceil(600 / sparse.CHUNK) if name == "sparse8" else 0  # the first scale, after sparse8's counts
    hostile.buffer = good.buffer[:at] + np.float32(3e38).tobytes() + good.buffer[at + 4:]
    with pytest.raises(ValueError, match="past float32"):
        decode_tensor(hostile)
    largest = np.finfo(np.float32).max / (127 if name != "int4" else 7)
    edge = type(good)()
    edge.CopyFrom(good)
    edge.buffer = good.buffer[:at] + np.float32(largest * (1 - 1e-6)).tobytes() + good.buffer[at + 4:]
    assert torch.isfinite(decode_tensor(edge)).all()  # the largest scales still decode, to finite values


@pytest.mark.parametrize("name", ["fp32", "fp16", "int8", "int4", "sparse8"])
def test_the_rounding_bound_of_an_average_holds_and_is_not_loose(name):
    """A receiver allows a reducer's average the rounding of its codec (robust.pair_excess): the bound read from the
    decoded average holds for Gaussian, heavy-tailed, sparse and zero values, and for the dense ones it is within 5
    times the true rounding."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(5000, generator=g)
    heavy = dense / torch.rand(5000, generator=g).clamp(min=1e-3) ** 0.5  # Student-t-like tails
    sparse_values = torch.zeros(9000)
    sparse_values[torch.randperm(9000, generator=g)[:300]] = torch.randn(300, generator=g)
    for x in (dense, heavy, sparse_values, torch.zeros(70)):
        message = codec_for(name).compress(x, CompressionInfo.from_tensor(x))
        decoded = decode_tensor(message)
        error, bound = float((decoded - x).norm()), average_rounding(message, decoded)
        assert error <= bound, (name, error, bound)
        if name == "fp32" or x is dense or x is heavy:
            assert bound <= 5 * error, (name, error, bound)
    topk = codec_for("topk2:8").compress(dense, CompressionInfo.from_tensor(dense))
    assert average_rounding(topk, decode_tensor(topk)) == 0.0  # no reducer sends an average as a top-k contribution


def test_low_rank_is_exact_for_matrices_of_rank_at_most_r():
    a, b = sample(96, 3, seed=1), sample(64, 3, seed=2)
    m = a @ b.t()  # rank 3
    q = seeded_q(64, 4, "test")
    p = orthonormalize(m @ q)  # rank-deficient: 4 columns, rank 3
    q2 = m.t() @ p
    torch.testing.assert_close(reconstruct(p, q2), m, rtol=1e-4, atol=1e-4)
    assert torch.allclose(p.t() @ p, torch.eye(4), atol=1e-5)


def _lowrank_roundtrip(m: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = orthonormalize(m @ q)
    q_new = m.t() @ p
    return reconstruct(p, q_new), q_new


@pytest.mark.parametrize("codec", ["int8", "int4", "lowrank"])
def test_error_feedback_tracks_the_running_sum(codec):
    """Over 100 rounds, the sum of what was sent equals the sum of the true updates minus the residual, and the
    residual stays bounded."""
    feedback = torch.zeros(64, 48)
    sent_sum, true_sum = torch.zeros(64, 48), torch.zeros(64, 48)
    q = seeded_q(48, 4, "ef")
    norms = []
    for t in range(100):
        delta = sample(64, 48, seed=100 + t)
        m = delta + feedback
        sent, q = _lowrank_roundtrip(m, q) if codec == "lowrank" else (roundtrip(codec, m), q)
        feedback = m - sent
        sent_sum += sent
        true_sum += delta
        norms.append(feedback.norm().item())
    torch.testing.assert_close(sent_sum + feedback, true_sum, rtol=1e-4, atol=1e-3)
    delta_norm = sample(64, 48).norm().item()
    assert max(norms[50:]) <= 20 * delta_norm
    assert max(norms[50:]) <= 1.5 * max(norms[25:50]) + 1e-6  # no growth: the residual has settled


def test_fit_q_is_deterministic_and_extends():
    warm = seeded_q(10, 3, "w")
    assert torch.equal(fit_q(None, 10, 3, "s"), fit_q(None, 10, 3, "s"))
    assert not torch.equal(fit_q(None, 10, 3, "s"), fit_q(None, 10, 3, "t"))
    assert torch.equal(fit_q(warm, 10, 2, "s"), warm[:, :2])
    extended = fit_q(warm, 10, 5, "s")
    assert extended.shape == (10, 5) and torch.equal(extended[:, :3], warm)


def test_desired_rank_follows_the_spectrum():
    flat = torch.linalg.qr(sample(50, 8))[0] * 3.0  # equal singular values
    steep = flat * torch.tensor([10.0, 1.0, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3])
    assert desired_rank(flat, 8, 1, 64) == 16
    assert desired_rank(steep, 8, 1, 64) == 4
    assert desired_rank(flat, 8, 1, 12) == 12  # bounded
    middle = flat * torch.tensor([4.0, 3.0, 2.0, 1.5, 1.0, 0.6, 0.4, 0.3])
    assert desired_rank(middle, 8, 1, 64) == 8


SHAPES = [(256, 128), (128, 384), (128,), (257, 128), (16, 16)]


def cfg(**overrides) -> AveragingConfig:
    """An averaging section where this test's matrices are big enough for low rank."""
    return AveragingConfig(**{"lowrank_min_size": 1000, **overrides})


def member(rank=8, bits=8, q_round=3, error=None, bandwidth=1000.0, compute=0.0) -> dict:
    """A member's gathered metadata. By default no round of compute measured: no bandwidth budget, so 'adaptive'
    plans low rank with nothing cut (the tests of its ladder give a round of compute and a link)."""
    return {"compression": {"rank": rank, "bits": bits, "q_round": q_round}, "last_error": error,
            "bandwidth_mbit": bandwidth, "compute_s": compute}


def test_plan_agreement_is_order_free_and_deterministic():
    policy = CompressionPolicy(SHAPES, cfg(compression="adaptive", max_rank=64))
    members = [member(8, 8), member(4, 8), member(16, 4)]
    plan = policy.agree(members)
    assert plan == policy.agree(list(reversed(members)))
    assert plan.rank == 8 and plan.warm_round == 3 and plan.codecs[0] == "int8"  # the lower medians
    two = policy.agree([member(16, 8), member(4, 4)])  # no majority in a pair: the smaller proposal wins
    assert (two.rank, two.codecs[0]) == (4, "int4")
    assert plan.lowrank == (0, 1, 3)  # the vector and the 16x16 matrix are quantized whole
    assert policy.agree([member(q_round=3), member(q_round=2)]).warm_round is None
    # at a rank where low rank would send more than half of a matrix's values, that matrix goes whole
    assert policy.agree([member(32)]).lowrank == (0, 1, 3) and policy.agree([member(48)]).lowrank == (1,)
    assert policy.agree([member(q_round=-1), member(q_round=-1)]).warm_round is None


def test_one_hostile_proposal_cannot_lower_the_precision_of_an_honest_majority():
    """A well-formed record asking for rank 1, 4 bits, a link and a round of compute a million times too slow, and
    no compression error: among 3 honest members the plan is theirs, but for the link, the one claim that still
    pulls the budget down, by LINK_SPREAD at most (before: rank 1 at 4 bits, the least precision there is)."""
    policy = CompressionPolicy(SHAPES, cfg(compression="adaptive", target_error=0.5, max_rank=64))
    # links just fast enough for rank 16 at 8 bits within the budget (21 KB a contribution; 34 KB allowed)
    honest = [member(8, 8, error=0.6, bandwidth=0.012, compute=60.0) for _ in range(3)]
    lowball = member(1, 4, q_round=-1, error=0.0, bandwidth=1e-8, compute=6e-5)
    alone = policy.agree(honest)
    assert alone.rank == 16 and alone.codecs[0] == "int8"  # doubled: the honest errors are above target
    attacked = policy.agree(honest + [lowball])
    # the budget of a link 4x slower, not 1e6x: about a quarter of the rank, still at 8 bits
    assert alone.rank // LINK_SPREAD <= attacked.rank < alone.rank and attacked.codecs[0] == "int8"
    assert policy.payload_bytes(attacked) <= 0.5 * 60.0 * (0.012 / LINK_SPREAD) * 1e6 / 8 / 1.5
    assert attacked.warm_round is None  # a member can still force a cold start (a stated limit)
    # without the link claim, nothing of the lowball proposal is left
    assert policy.agree(honest + [dict(lowball, bandwidth_mbit=0.012)]).rank == 16
    # a rank beyond max_rank is never planned, whoever proposes it
    assert policy.agree([member(1000)] * 3).rank == 64
    # an honest slow link within LINK_SPREAD of the median is respected in full
    slow = [member(8, bandwidth=0.01, compute=60.0), member(8, bandwidth=0.01, compute=60.0),
            member(8, bandwidth=0.003, compute=60.0)]
    assert policy.agree(slow) == policy.agree([dict(m, bandwidth_mbit=0.003) for m in slow])
    assert policy.agree(slow).rank < policy.agree([member(8, bandwidth=0.01, compute=60.0)] * 3).rank


def test_one_member_of_a_pair_cuts_the_rank_and_the_budget_at_most_link_spread_fold():
    """A pair has no majority, and its lower medians were either member's own values: a proposal of rank 1, or a
    link or a round of compute claimed a million times too slow, each took the pair's plan from rank 16 to rank 1
    at 4 bits. Now neither member's proposal nor its claims go below the other's over LINK_SPREAD."""
    policy = CompressionPolicy(SHAPES, cfg(compression="adaptive", target_error=0.5, max_rank=64))
    honest = member(8, 8, error=0.6, bandwidth=0.012, compute=60.0)  # just fast enough for rank 16 at 8 bits
    alone = policy.agree([honest, honest])
    assert alone.rank == 16 and alone.codecs[0] == "int8"
    lowballs = {"rank": member(1, 8, error=0.6, bandwidth=0.012, compute=60.0),
                "link": dict(honest, bandwidth_mbit=1e-8), "compute": dict(honest, compute_s=6e-5),
                "all": member(1, 4, q_round=-1, error=0.0, bandwidth=1e-8, compute=6e-5)}
    for name, lowball in lowballs.items():
        for pair in ([honest, lowball], [lowball, honest]):
            attacked = policy.agree(pair)
            assert attacked.rank >= alone.rank / LINK_SPREAD, (name, attacked)
            assert policy._budget(pair) >= policy._budget([honest, honest]) / LINK_SPREAD * (1 - 1e-9), name
    # an honest pair within LINK_SPREAD of each other is read as before: the smaller proposal, the slower link
    assert policy.agree([member(16, 8), member(4, 4)]).rank == 4
    slow = [honest, dict(honest, bandwidth_mbit=0.004)]
    assert policy.agree(slow) == policy.agree([dict(honest, bandwidth_mbit=0.004)] * 2) != alone
    # groups of 3 or more keep their lower medians: an honest majority bounds them
    assert policy.agree([member(16), member(2), member(2)]).rank == 2


def test_adaptive_rank_grows_with_the_group_error_within_the_budget():
    policy = CompressionPolicy(SHAPES, cfg(compression="adaptive", target_error=0.5, max_rank=64))
    assert policy.agree([member(8, error=0.2), member(8, error=0.4)]).rank == 8
    assert policy.agree([member(8, error=0.9), member(8, error=0.4)]).rank == 16  # group mean 0.65 > 0.5
    assert policy.agree([member(8, error=None)]).rank == 8  # the first round: nothing measured yet
    slow = policy.agree([member(8, error=0.9, bandwidth=0.05, compute=10.0)] * 4)
    budget = 0.5 * 10.0 * 0.05e6 / 8 / 1.5
    assert slow.rank < 16 and (policy.payload_bytes(slow) <= budget or (slow.rank, slow.codecs[0]) == (1, "int4"))
    assert policy.agree([member(8, compute=0.0)]).rank == 8  # no compute measured: no budget to apply


def test_next_proposal_follows_the_shared_spectrum_deterministically():
    policy = CompressionPolicy(SHAPES, cfg(compression="adaptive", rank=8, max_rank=64))
    plan = policy.agree([member(q_round=-1)])
    flat_qs = {i: torch.linalg.qr(sample(SHAPES[i][1], 8, seed=i))[0] for i in plan.lowrank}
    proposal = policy.next_proposal(plan, flat_qs, 5)
    assert proposal == policy.next_proposal(plan, {i: q.clone() for i, q in flat_qs.items()}, 5)
    assert proposal == {"rank": 16, "bits": 8, "q_round": 5}
    steep = {i: q * torch.tensor([10.0] + [1e-3] * 7) for i, q in flat_qs.items()}
    assert policy.next_proposal(plan, steep, 5)["rank"] == 4


def test_fixed_schemes():
    for scheme, codec in (("none", "fp32"), ("fp16", "fp16"), ("int8", "int8")):
        policy = CompressionPolicy(SHAPES, cfg(compression=scheme))
        plan = policy.agree([member(q_round=-1)])
        assert plan.lowrank == () and set(plan.codecs) == {codec}
    lowrank = CompressionPolicy(SHAPES, cfg(compression="lowrank", rank=4))
    plan = lowrank.agree([member(4, q_round=-1, error=0.99)])
    assert plan.rank == 4 and plan.lowrank == (0, 1, 3)  # fixed rank, whatever the error
    assert lowrank.next_proposal(plan, {}, 2) == {"rank": 4, "bits": 8, "q_round": 2}


def whole_bytes(bits: int) -> int:
    """Bytes of one contribution of SHAPES, every tensor whole, from the blockwise layout: a 4-byte scale per block
    of BLOCK values and ``bits`` per value."""
    return sum(4 * math.ceil(math.prod(s) / BLOCK) + math.ceil(math.prod(s) * bits / 8) for s in SHAPES)


def link_for(contribution_bytes: float, group_size: int = 4, compute_s: float = 60.0) -> float:
    """The link (Mbit/s) on which ``contribution_bytes`` is exactly the budget of a round: bandwidth_budget (0.5)
    of a round of compute, over the all-reduce's 2(N-1)/N contributions."""
    return contribution_bytes * 8 * (2 * (group_size - 1) / group_size) / (0.5 * compute_s * 1e6)


def test_adaptive_sends_whole_tensors_at_the_least_lossy_bits_the_link_fits_else_low_rank():
    """The ladder: int8 whole where the round's contribution fits the budget, else int4 whole, else low rank."""
    policy = CompressionPolicy(SHAPES, cfg(compression="adaptive", max_rank=64))

    def plan_on(link: float, bits: int = 8, **kw):
        return policy.agree([member(8, bits, bandwidth=link, compute=60.0, **kw) for _ in range(4)])

    int8, int4 = whole_bytes(8), whole_bytes(4)
    assert policy.payload_bytes(plan_on(1000.0)) == int8  # the layout the ladder budgets with
    for link, codec in ((link_for(int8), "int8"), (link_for(int8) * 0.999, "int4"), (link_for(int4), "int4")):
        plan = plan_on(link)
        assert plan.codecs == (codec,) * len(SHAPES) and plan.lowrank == () and plan.warm_round is None, link
        assert plan.rank == 8  # kept: low rank starts from it if the link narrows
    narrow = plan_on(link_for(int4) * 0.999)
    assert narrow.lowrank == (0, 1, 3) and policy.payload_bytes(narrow) <= int4 * 0.999
    # a group that proposes 4 bits is never sent 8, and is sent low rank below int4's budget too
    assert plan_on(1000.0, bits=4).codecs == ("int4",) * len(SHAPES)
    assert plan_on(link_for(int4) * 0.999, bits=4).lowrank == (0, 1, 3)
    # no round of compute measured yet: no budget, low rank (the most a first round can cost)
    assert policy.agree([member(8)] * 4).lowrank == (0, 1, 3)
    # nothing fits and no matrix is large enough for low rank: whole at 4 bits, the fewest bytes there are
    small = CompressionPolicy(SHAPES, cfg(compression="adaptive", lowrank_min_size=10**9))
    tight = [member(8, bandwidth=1e-6, compute=60.0)] * 4
    assert small.agree(tight).codecs == ("int4",) * len(SHAPES) and small.agree(tight).lowrank == ()
    # one member claiming a link a million times slower moves the group by LINK_SPREAD at most
    roomy = link_for(int8) * LINK_SPREAD
    lowball = member(8, bandwidth=roomy * 1e-6, compute=60.0)
    assert policy.agree([member(8, bandwidth=roomy, compute=60.0)] * 3 + [lowball]).codecs[0] == "int8"


async def reduce_together(reducers, contributions, plan, round_index: int):
    group = InMemoryGroup(len(reducers))
    return await asyncio.gather(*(r.reduce(c, plan, round_index, group.member())
                                  for r, c in zip(reducers, contributions)))


def test_a_whole_round_leaves_no_warm_q_and_the_next_low_rank_round_starts_cold():
    """After a round sent whole, the next proposal names no round of Qs (there are none); a low-rank round after it
    starts from seeded Qs on every member, and the round after that warm from its Qs."""
    shapes = [(96, 64), (64,)]
    policy_cfg = AveragingConfig(compression="adaptive", rank=4, lowrank_min_size=1000)
    reducers = [RoundReducer(CompressionPolicy(shapes, policy_cfg), seed="g") for _ in range(2)]
    policy = reducers[0].policy
    links = {"wide": 1000.0, "narrow": 1e-5}
    proposals = [policy.initial_proposal()] * 2
    for round_index, link in enumerate(("wide", "narrow", "narrow")):
        metadata = [{"compression": p, "last_error": None, "bandwidth_mbit": links[link], "compute_s": 10.0}
                    for p in proposals]
        plan = policy.agree(metadata)
        assert (plan.lowrank == ()) == (link == "wide")
        assert plan.warm_round == (1 if round_index == 2 else None)
        contributions = [[sample(*s, seed=10 * k + round_index) for s in shapes] for k in range(2)]
        outcomes = asyncio.run(reduce_together(reducers, contributions, plan, round_index))
        assert all(torch.equal(a, b) for a, b in zip(outcomes[0].averaged, outcomes[1].averaged))
        proposals = [r.policy.next_proposal(plan, o.q_avgs, round_index) for r, o in zip(reducers, outcomes)]
        assert proposals[0]["q_round"] == (-1 if link == "wide" else round_index)


class InMemoryGroup:
    """K reducers meet per phase; each gets the exact mean of what all K sent (as the real all-reduce does)."""

    def __init__(self, k: int):
        self.k, self.calls = k, {}

    def member(self):
        async def allreduce(tensors, codecs, phase):
            entry = self.calls.setdefault(phase, {"tensors": [], "event": asyncio.Event()})
            entry["tensors"].append([roundtrip(c, t) for c, t in zip(codecs, tensors)])
            if len(entry["tensors"]) == self.k:
                entry["event"].set()
            await entry["event"].wait()
            return [torch.stack([ts[i] for ts in entry["tensors"]]).mean(0) for i in range(len(tensors))]
        return allreduce


@pytest.mark.parametrize("scheme", ["int8", "lowrank", "adaptive"])
def test_round_reducer_feedback_identity_and_agreement(scheme):
    shapes = [(96, 64), (64,), (64, 64)]
    cfg = AveragingConfig(compression=scheme, rank=4, lowrank_min_size=1000)
    contributions = [[sample(*s, seed=10 * k + i) for i, s in enumerate(shapes)] for k in range(2)]
    reducers = [RoundReducer(CompressionPolicy(shapes, cfg), seed="g") for _ in range(2)]
    plan = reducers[0].policy.agree([{"compression": reducers[0].policy.initial_proposal(), "last_error": None,
                                      "bandwidth_mbit": 100.0, "compute_s": 0.0}])
    group = InMemoryGroup(2)

    async def run():
        return await asyncio.gather(*(r.reduce(c, plan, 0, group.member()) for r, c in zip(reducers, contributions)))

    outcomes = asyncio.run(run())
    for a, b in zip(outcomes[0].averaged, outcomes[1].averaged):
        assert torch.equal(a, b)  # same shared data, same result
    for outcome, contribution in zip(outcomes, contributions):
        sent = [c - r for c, r in zip(contribution, outcome.residuals)]
        assert all(s.shape == c.shape for s, c in zip(sent, contribution))
        assert 0 < outcome.stats["compression_error"] < 1
    exact_mean = [(a + b) / 2 for a, b in zip(*contributions)]
    sent_mean = [((ca - ra) + (cb - rb)) / 2 for ca, cb, ra, rb in
                 zip(contributions[0], contributions[1], outcomes[0].residuals, outcomes[1].residuals)]
    for got, want in zip(outcomes[0].averaged, sent_mean):  # the average is the mean of what was sent
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * max(1.0, want.abs().max().item()))
    assert math.isfinite(sum(x.sum().item() for x in exact_mean))
