"""Unit tests of the model package: shapes, parameter counts, deterministic init, pipeline splits."""

from __future__ import annotations

import math

import pytest
import torch

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.sections import MODEL_PRESETS, ModelConfig
from p2p_diloco.model import (
    PRESETS,
    ModelArgs,
    Transformer,
    balanced_split,
    block_num_params,
    build_stage_model,
    check_split,
    count_parameters,
    embedding_num_params,
    estimate_num_params,
    head_num_params,
    loss_fn,
    model_args_from_config,
    stage_layer_ids,
    stage_num_params,
)

BYTE_VOCAB = 257


def tiny_args(**overrides) -> ModelArgs:
    values = dict(PRESETS["tiny"], vocab_size=BYTE_VOCAB)
    values.update(overrides)
    return ModelArgs(**values)


def tokens(args: ModelArgs, batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (batch, seq_len), generator=generator)  # (B, T)


@pytest.fixture(scope="module")
def tiny_model() -> Transformer:
    return Transformer(tiny_args())


# --- shapes and forward -------------------------------------------------------------------------


def test_full_model_returns_logits(tiny_model: Transformer) -> None:
    args = tiny_model.args
    assert tiny_model(tokens(args)).shape == (2, 16, args.vocab_size)


def test_partial_models_take_and_return_hidden_states(tiny_model: Transformer) -> None:
    args = tiny_model.args
    head = Transformer(args, layer_ids=[0, 1], first=True, last=False)
    middle = Transformer(args, layer_ids=[2], first=False, last=False)
    tail = Transformer(args, layer_ids=[3], first=False, last=True)
    assert head.tok_embeddings is not None and head.norm is None and head.output is None
    assert middle.tok_embeddings is None and middle.output is None
    assert tail.tok_embeddings is None and tail.output is not None
    hidden = head(tokens(args))
    assert hidden.shape == (2, 16, args.dim)
    assert middle(hidden).shape == (2, 16, args.dim)
    assert tail(hidden).shape == (2, 16, args.vocab_size)


def test_chained_stages_match_the_full_model(tiny_model: Transformer) -> None:
    args = tiny_model.args
    x = tokens(args)
    expected = tiny_model(x)
    for k in range(1, args.n_layers):
        front = Transformer(args, layer_ids=range(k), first=True, last=False)
        back = Transformer(args, layer_ids=range(k, args.n_layers), first=False, last=True)
        torch.testing.assert_close(back(front(x)), expected, rtol=0, atol=1e-6)


def test_attention_is_causal(tiny_model: Transformer) -> None:
    x = tokens(tiny_model.args, batch=1, seq_len=12)
    changed = x.clone()
    changed[0, 8] = (changed[0, 8] + 1) % tiny_model.args.vocab_size
    before, after = tiny_model(x), tiny_model(changed)
    torch.testing.assert_close(before[:, :8], after[:, :8], rtol=0, atol=0)
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_grouped_query_attention_runs() -> None:
    args = tiny_args(n_kv_heads=2)
    model = Transformer(args)
    assert model.layers["0"].attention.wk.weight.shape == (2 * args.head_dim, args.dim)
    assert model(tokens(args)).shape == (2, 16, args.vocab_size)


def test_too_long_a_sequence_is_refused(tiny_model: Transformer) -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny_model(tokens(tiny_model.args, batch=1, seq_len=tiny_model.args.max_seq_len + 1))


def test_rotary_tables_are_buffers_outside_state_dict(tiny_model: Transformer) -> None:
    names = {name for name, _ in tiny_model.named_parameters()} | set(tiny_model.state_dict())
    assert not any("rope" in name for name in names)
    assert {name for name, _ in tiny_model.named_buffers()} == {"rope_cos", "rope_sin"}


def test_untrained_loss_is_close_to_uniform(tiny_model: Transformer) -> None:
    x = tokens(tiny_model.args, batch=4, seq_len=64)
    loss = loss_fn(tiny_model(x[:, :-1]), x[:, 1:])
    assert loss.dtype == torch.float32
    assert abs(loss.item() - math.log(BYTE_VOCAB)) < 0.15


def test_loss_casts_low_precision_logits_to_fp32() -> None:
    logits = torch.zeros(2, 3, 5, dtype=torch.bfloat16)
    loss = loss_fn(logits, torch.zeros(2, 3, dtype=torch.long))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(5))


# --- parameter counts ---------------------------------------------------------------------------


def test_tiny_preset_has_about_a_million_parameters(tiny_model: Transformer) -> None:
    assert 0.8e6 <= count_parameters(tiny_model) <= 1.2e6
    assert estimate_num_params(tiny_model.args) == count_parameters(tiny_model)


def test_small_preset_estimate_equals_the_built_count() -> None:
    args = ModelArgs(**PRESETS["small"], vocab_size=BYTE_VOCAB)
    num_params = count_parameters(Transformer(args))
    assert num_params == estimate_num_params(args)
    assert 20e6 <= num_params <= 30e6


def test_large_presets_are_in_range_without_building() -> None:
    medium = ModelArgs(**PRESETS["medium"], vocab_size=BYTE_VOCAB)
    one_b = ModelArgs(**PRESETS["1b"], vocab_size=32000)
    assert 150e6 <= estimate_num_params(medium) <= 260e6
    assert 0.9e9 <= estimate_num_params(one_b) <= 1.2e9
    assert one_b.n_kv_heads < one_b.n_heads  # the 1b preset uses grouped-query attention


def test_count_pieces_match_built_modules(tiny_model: Transformer) -> None:
    args = tiny_model.args
    assert count_parameters(tiny_model.layers["0"]) == block_num_params(args)
    assert count_parameters(tiny_model.tok_embeddings) == embedding_num_params(args)
    assert count_parameters(tiny_model.norm) + count_parameters(tiny_model.output) == head_num_params(args)


def test_gqa_and_tied_estimates_equal_built_counts() -> None:
    for args in (tiny_args(n_kv_heads=1), tiny_args(tie_embeddings=True)):
        assert estimate_num_params(args) == count_parameters(Transformer(args))


def test_presets_cover_the_config_choices() -> None:
    assert set(PRESETS) == set(MODEL_PRESETS)


# --- deterministic init ---------------------------------------------------------------------------


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_two_builds_are_identical_whatever_the_global_rng(tiny_model: Transformer) -> None:
    torch.manual_seed(1234)
    assert_same_state(Transformer(tiny_model.args).state_dict(), tiny_model.state_dict())


def test_building_does_not_consume_the_global_rng() -> None:
    state = torch.random.get_rng_state()
    Transformer(tiny_args())
    assert torch.equal(torch.random.get_rng_state(), state)


def test_stage_parameters_equal_the_full_models(tiny_model: Transformer) -> None:
    full = tiny_model.state_dict()
    for first, layer_ids, last in ((True, [0], False), (False, [1, 2], False), (False, [2, 3], True)):
        stage = Transformer(tiny_model.args, layer_ids=layer_ids, first=first, last=last).state_dict()
        assert stage, layer_ids
        assert_same_state(stage, {key: full[key] for key in stage})
    names = set(Transformer(tiny_model.args, layer_ids=[2, 3], first=False, last=True).state_dict())
    assert "layers.2.attention.wq.weight" in names and "output.weight" in names
    assert "layers.0.attention.wq.weight" not in names and "tok_embeddings.weight" not in names


def test_init_seed_changes_every_random_weight(tiny_model: Transformer) -> None:
    other = Transformer(tiny_args(init_seed=1)).state_dict()
    for key, value in tiny_model.state_dict().items():
        if key.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), key
        else:
            assert not torch.equal(value, other[key]), key


def test_init_statistics(tiny_model: Transformer) -> None:
    residual_std = 0.02 / math.sqrt(2 * tiny_model.args.n_layers)
    params = dict(tiny_model.named_parameters())
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["layers.1.feed_forward.w2.weight"].std().item() == pytest.approx(residual_std, rel=0.05)
    assert params["layers.1.attention.wo.weight"].std().item() == pytest.approx(residual_std, rel=0.05)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params.values())


# --- tied embeddings ------------------------------------------------------------------------------


def test_tied_embeddings_share_one_tensor() -> None:
    args = tiny_args(tie_embeddings=True)
    model = Transformer(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert count_parameters(model) == count_parameters(Transformer(tiny_args())) - embedding_num_params(args)
    assert model(tokens(args)).shape == (2, 16, args.vocab_size)


@pytest.mark.parametrize("first, last", [(True, False), (False, True), (False, False)])
def test_tied_embeddings_are_refused_for_a_partial_model(first: bool, last: bool) -> None:
    with pytest.raises(ValueError, match="tie_embeddings"):
        Transformer(tiny_args(tie_embeddings=True), layer_ids=[0], first=first, last=last)


# --- argument validation and presets --------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(dim=130), "model.dim"),  # not divisible by 4 heads
        (dict(n_kv_heads=3), "model.n_kv_heads"),  # does not divide 4 heads
        (dict(dim=12, n_heads=4), "model.dim"),  # head_dim 3 is odd
        (dict(n_layers=0), "model.n_layers"),
        (dict(vocab_size=-1), "model.vocab_size"),
        (dict(ffn_dim=0), "model.ffn_dim"),
        (dict(norm_eps=0.0), "model.norm_eps"),
    ],
)
def test_model_args_validation_names_the_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        tiny_args(**overrides)


def test_bad_layer_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="layer_ids"):
        Transformer(tiny_args(), layer_ids=[4])
    with pytest.raises(ValueError, match="layer_ids"):
        Transformer(tiny_args(), layer_ids=[2, 1])


def test_model_args_from_config_overrides_the_preset() -> None:
    args = model_args_from_config(ModelConfig(preset="small", n_layers=3, init_seed=7), vocab_size=300)
    assert (args.dim, args.n_layers, args.vocab_size, args.init_seed) == (512, 3, 300, 7)
    args = model_args_from_config(ModelConfig(preset="tiny", vocab_size=1000, tie_embeddings=True), vocab_size=300)
    assert (args.vocab_size, args.tie_embeddings) == (1000, True)


def test_model_args_from_config_refuses_bad_values() -> None:
    with pytest.raises(ConfigError, match="model.preset"):
        model_args_from_config(ModelConfig(preset="huge"), vocab_size=BYTE_VOCAB)
    with pytest.raises(ConfigError, match="model.n_kv_heads"):
        model_args_from_config(ModelConfig(preset="tiny", n_kv_heads=3), vocab_size=BYTE_VOCAB)


# --- pipeline splits ------------------------------------------------------------------------------


@pytest.mark.parametrize("preset, vocab_size", [("tiny", BYTE_VOCAB), ("small", 32000), ("1b", 32000)])
def test_balanced_split_covers_every_block(preset: str, vocab_size: int) -> None:
    args = ModelArgs(**PRESETS[preset], vocab_size=vocab_size)
    for num_stages in range(1, args.n_layers + 1):
        split = balanced_split(args, num_stages)
        assert len(split) == num_stages and sum(split) == args.n_layers and min(split) >= 1
        assert split == balanced_split(args, num_stages)
        check_split(args, split)


def test_balanced_split_balances_parameters() -> None:
    args = ModelArgs(**PRESETS["1b"], vocab_size=32000)
    split = balanced_split(args, 4)
    assert split == [5, 6, 6, 5]  # the embedding and head each weigh about 1.5 blocks
    sizes = [stage_num_params(args, split, j) for j in range(4)]
    assert sum(sizes) == estimate_num_params(args)
    # No single move of a block between neighbouring stages lowers the largest stage.
    for j in range(3):
        for src, dst in ((j, j + 1), (j + 1, j)):
            moved = list(split)
            moved[src], moved[dst] = moved[src] - 1, moved[dst] + 1
            if moved[src] >= 1:
                assert max(stage_num_params(args, moved, k) for k in range(4)) >= max(sizes)
    assert balanced_split(args, 1) == [args.n_layers]


def test_balanced_split_refuses_too_many_stages() -> None:
    with pytest.raises(ConfigError, match="pipeline.stages"):
        balanced_split(tiny_args(), 5)


@pytest.mark.parametrize("split", [[2, 1], [3, 2], [4, 0], [5, -1], []])
def test_check_split_refuses_bad_splits(split: list[int]) -> None:
    with pytest.raises(ConfigError, match="pipeline.stage_layers"):
        check_split(tiny_args(), split)


def test_stage_layer_ids() -> None:
    assert stage_layer_ids([3, 3, 2], 0) == [0, 1, 2]
    assert stage_layer_ids([3, 3, 2], 2) == [6, 7]
    with pytest.raises(ValueError, match="stage_index"):
        stage_layer_ids([3, 3, 2], 3)


def test_build_stage_models_chain_to_the_full_model(tiny_model: Transformer) -> None:
    args = tiny_model.args
    split = balanced_split(args, 3)
    stages = [build_stage_model(args, split, j) for j in range(3)]
    assert [s.first for s in stages] == [True, False, False] and [s.last for s in stages] == [False, False, True]
    assert [count_parameters(s) for s in stages] == [stage_num_params(args, split, j) for j in range(3)]
    h = tokens(args)
    expected = tiny_model(h)
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, expected, rtol=0, atol=1e-6)
    whole = build_stage_model(args, [args.n_layers], 0)
    assert whole.first and whole.last and list(whole.layers) == [str(i) for i in range(args.n_layers)]


def test_build_stage_model_refuses_ties_across_stages() -> None:
    with pytest.raises(ConfigError, match="tie_embeddings"):
        build_stage_model(tiny_args(tie_embeddings=True), [2, 2], 0)
