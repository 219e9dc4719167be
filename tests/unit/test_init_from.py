"""``model.init_from``: a Hugging Face Llama folder read stage by stage, checked against the config and the data's
tokenizer, and its weights digest. Folders are written here with safetensors and our transformers names (the
integration test writes one with transformers itself)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from p2p_diloco.config import ConfigError, ModelConfig, load_config
from p2p_diloco.model import ModelArgs, Transformer, build_stage_model
from p2p_diloco.model.fragments import fitting_split, fragment_parts, split_parameters, stage_fragments
from p2p_diloco.model.hf import byte_tokenizer_json, hf_config, hf_name
from p2p_diloco.model.hf_folder import expected_shapes, load_stage, open_hf_folder, weights_digest
from p2p_diloco.model.init_from import DIGEST_CACHE_FILE, check_tokenizer, init_digest, init_model_args
from p2p_diloco.stage_process import build_model

ARGS = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=257, max_seq_len=64,
                 rope_theta=500.0, norm_eps=1e-6)


def trained_like(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """A model's parameters (our names) that are not those of any init: every value drawn, norms included."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=generator) * 0.1 for name, p in Transformer(args).named_parameters()}


def write_folder(path: Path, args: ModelArgs, tensors: dict[str, torch.Tensor], num_shards: int = 1,
                 dtype: torch.dtype = torch.float32, tokenizer: dict | None = None) -> Path:
    """A LlamaForCausalLM folder: one model.safetensors, or ``num_shards`` shards and their index."""
    path.mkdir(parents=True)
    weights = {hf_name(name): value.to(dtype).contiguous() for name, value in tensors.items()}
    (path / "config.json").write_text(json.dumps(hf_config(args, 256)))
    (path / "tokenizer.json").write_text(json.dumps(tokenizer or byte_tokenizer_json()))
    if num_shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names, weight_map = sorted(weights, reverse=True), {}  # another order than the digest's
    for index in range(num_shards):
        file = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: weights[name] for name in names[index::num_shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    return trained_like(ARGS)


@pytest.fixture
def sharded(tmp_path, weights) -> Path:
    return write_folder(tmp_path / "sharded", ARGS, weights, num_shards=3)


def test_expected_shapes_are_those_of_the_built_model():
    for args in (ARGS, ModelArgs(dim=48, n_layers=2, n_heads=6, n_kv_heads=3, ffn_dim=80, vocab_size=100,
                                 max_seq_len=16, tie_embeddings=True)):
        assert expected_shapes(args) == {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}


@pytest.mark.parametrize("split", [[4], [3, 1], [1, 1, 2]])
def test_every_stage_of_any_split_loads_its_own_tensors(tmp_path, weights, sharded, split):
    single = write_folder(tmp_path / "single", ARGS, weights)
    for path in (single, sharded):
        folder = open_hf_folder(path)
        assert folder.args == ARGS
        loaded = {}
        for index in range(len(split)):
            stage = build_model(ARGS, split, index, folder)
            loaded.update({name: p.detach() for name, p in stage.named_parameters()})
        assert loaded.keys() == weights.keys()
        assert all(torch.equal(loaded[name], weights[name]) for name in weights)


def test_a_stage_reads_only_its_own_tensors(sharded, monkeypatch):
    import safetensors

    read, real_open = [], safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    build_model(ARGS, [3, 1], 1, open_hf_folder(sharded))
    assert sorted(read) == sorted([f"model.layers.3.{n}" for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight")] + ["model.norm.weight", "lm_head.weight"])


def test_each_fragment_of_a_stage_holds_the_folders_values(sharded, weights):
    folder, parts = open_hf_folder(sharded), fragment_parts(ARGS, 3)
    split = fitting_split(ARGS, parts, 2)
    for index in range(2):
        stage = build_model(ARGS, split, index, folder)
        for fragment, params in split_parameters(stage.named_parameters(), parts).items():
            assert fragment in stage_fragments(split, parts, index)
            assert all(torch.equal(p.detach(), weights[name]) for name, p in params)


def test_a_bf16_folder_loads_its_values_in_fp32_and_its_digest_differs(tmp_path, weights, sharded):
    half = write_folder(tmp_path / "bf16", ARGS, weights, dtype=torch.bfloat16)
    model = build_stage_model(ARGS, [4], 0, initialize=False)
    load_stage(open_hf_folder(half), model)
    assert all(torch.equal(p.detach(), weights[name].bfloat16().float()) for name, p in model.named_parameters())
    assert weights_digest(open_hf_folder(half)) != weights_digest(open_hf_folder(sharded))


def test_the_digest_is_of_the_weights_not_of_their_files(tmp_path, weights, sharded):
    single = write_folder(tmp_path / "single", ARGS, weights)
    digest = weights_digest(open_hf_folder(sharded))
    assert weights_digest(open_hf_folder(single)) == digest and len(digest) == 64
    changed = dict(weights)
    changed["layers.3.ffn_norm.weight"] = weights["layers.3.ffn_norm.weight"].clone()
    changed["layers.3.ffn_norm.weight"][5] += 1e-6
    assert weights_digest(open_hf_folder(write_folder(tmp_path / "other", ARGS, changed, 2))) != digest
    # older checkpoints keep rotary buffers; not parameters, they are neither loaded nor hashed
    _set_tensor(sharded, "model.layers.1.self_attn.rotary_emb.inv_freq", torch.ones(4),
                beside="model.layers.1.self_attn.q_proj.weight")
    assert weights_digest(open_hf_folder(sharded)) == digest


def test_the_digest_is_cached_for_these_very_files(tmp_path, sharded):
    folder, out = open_hf_folder(sharded), tmp_path / "peer"
    digest = init_digest(folder, out)
    cache = json.loads((out / DIGEST_CACHE_FILE).read_text())
    assert cache["sha256"] == digest
    (out / DIGEST_CACHE_FILE).write_text(json.dumps(dict(cache, sha256="ab" * 32)))
    assert init_digest(folder, out) == "ab" * 32  # read from the cache, not computed
    shard = folder.files[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # the file changed
    assert init_digest(folder, out) == digest
    (out / DIGEST_CACHE_FILE).write_text("{not json")
    assert init_digest(folder, out) == digest


def _set_tensor(path: Path, name: str, value: torch.Tensor, beside: str | None = None) -> None:
    """Put ``value`` as tensor ``name`` into the shard that holds ``beside`` (default: ``name``)."""
    file = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][beside or name]
    tensors = load_file(str(path / file))
    tensors[name] = value
    save_file(tensors, str(path / file), metadata={"format": "pt"})


def _gpt2(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, model_type="gpt2", architectures=["GPT2LMHeadModel"])))


def _truncate(path: Path) -> None:
    file = path / "model-00002-of-00003.safetensors"
    file.write_bytes(file.read_bytes()[:-100])


@pytest.mark.parametrize("damage, words", [
    (_gpt2, ["config.json describes a 'gpt2' model", "only LlamaForCausalLM"]),
    (lambda p: _set_tensor(p, "model.layers.0.self_attn.q_proj.weight", torch.zeros(16, 32)),
     ["model.layers.0.self_attn.q_proj.weight has shape [16, 32]", "needs [32, 32]"]),
    (lambda p: (p / "model-00003-of-00003.safetensors").unlink(),
     ["model-00003-of-00003.safetensors is missing", "model.safetensors.index.json"]),
    (lambda p: _set_tensor(p, "model.layers.0.self_attn.q_proj.bias", torch.zeros(32),
                           beside="model.layers.0.self_attn.q_proj.weight"),
     ["'model.layers.0.self_attn.q_proj.bias' is not a parameter"]),
    (lambda p: _set_tensor(p, "model.norm.weight", torch.zeros(32, dtype=torch.int32)),
     ["model.norm.weight", "dtype I32 is not a float type"]),
    (_truncate, ["model-00002-of-00003.safetensors", "does not fit"]),
    (lambda p: _set_tensor(p, "model.norm.weight", torch.ones(32), beside="model.embed_tokens.weight"),
     ["model.norm.weight is in both"]),
    (lambda p: (p / "config.json").write_text(json.dumps(dict(json.loads((p / "config.json").read_text()),
                                                              num_hidden_layers=3))),
     ["model.layers.3.", "not a parameter of the model config.json describes (3 layers)"]),
    (lambda p: (p / "config.json").write_text(json.dumps(dict(json.loads((p / "config.json").read_text()),
                                                              num_hidden_layers=5))),
     ["no tensor model.layers.4.", "missing"]),
    (lambda p: (p / "config.json").write_text(json.dumps(dict(json.loads((p / "config.json").read_text()),
                                                              hidden_act="gelu"))),
     ["hidden_act is 'gelu'"]),
    (lambda p: (p / "config.json").unlink(), ["no config.json"]),
])
def test_a_folder_that_does_not_fit_is_refused_in_one_line(sharded, damage, words):
    damage(sharded)
    with pytest.raises(ConfigError) as error:
        open_hf_folder(sharded)
    message = str(error.value)
    assert message.startswith(f"model.init_from: {sharded}: ") and "\n" not in message
    assert all(word in message for word in words), message


def test_no_folder_or_no_weights_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a folder"):
        open_hf_folder(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(hf_config(ARGS, None)))
    with pytest.raises(ConfigError, match="no model.safetensors and no model.safetensors.index.json"):
        open_hf_folder(tmp_path / "empty")


def test_the_shape_comes_from_the_folder_and_a_conflicting_key_is_named(sharded):
    folder = open_hf_folder(sharded)
    assert init_model_args(ModelConfig(), folder) == ARGS
    assert init_model_args(ModelConfig(dim=32, n_layers=4, init_seed=9), folder) == ARGS  # equal: no conflict
    for cfg, words in ((ModelConfig(preset="small"), "model.preset: 'small' conflicts with model.init_from"),
                       (ModelConfig(dim=64), "model.dim: 64 conflicts with model.init_from's hidden_size 32"),
                       (ModelConfig(max_seq_len=128), "model.max_seq_len: 128 conflicts with model.init_from's "
                                                      "max_position_embeddings 64"),
                       (ModelConfig(tie_embeddings=True), "model.tie_embeddings: true conflicts")):
        with pytest.raises(ConfigError, match=words):
            init_model_args(cfg, folder)


def test_without_init_from_the_preset_is_tiny_and_the_split_is_checked_early():
    cfg = load_config(None, [])
    assert cfg.model.preset is None and cfg.model.preset_name == "tiny"
    with pytest.raises(ConfigError, match="pipeline.stages: 5 stages"):
        load_config(None, [("pipeline.stages", "5")])
    # with init_from the layers are the folder's: the peer checks the split once it has read config.json
    assert load_config(None, [("pipeline.stages", "5"), ("model.init_from", "/some/folder")]).pipeline.stages == 5
    assert load_config(None, [("train.num_rounds", "0")]).train.num_rounds == 0


def test_the_tokenizer_must_be_the_datas(tmp_path, sharded):
    folder = open_hf_folder(sharded)
    check_tokenizer(folder, tmp_path, "byte")  # the byte tokenizer as export writes it
    data = tmp_path / "shards"
    data.mkdir()
    theirs = byte_tokenizer_json()
    (data / "tokenizer.json").write_text(json.dumps(theirs))
    check_tokenizer(folder, data, "hf:tokenizer.json")
    other = copy.deepcopy(theirs)
    vocab = other["model"]["vocab"]
    first, second = list(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (data / "tokenizer.json").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match="is not the one the data was prepared with .* their vocabularies differ"):
        check_tokenizer(folder, data, "hf:tokenizer.json")
    (sharded / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        check_tokenizer(folder, tmp_path, "byte")


def test_merges_written_either_way_are_the_same_tokenizer(tmp_path, weights):
    mine = byte_tokenizer_json()
    mine["model"]["merges"] = ["a b", "ab c"]
    theirs = copy.deepcopy(mine)
    theirs["model"]["merges"] = [["a", "b"], ["ab", "c"]]
    folder = open_hf_folder(write_folder(tmp_path / "m", ARGS, weights, tokenizer=mine))
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "tokenizer.json").write_text(json.dumps(theirs))
    check_tokenizer(folder, tmp_path / "shards", "hf:tokenizer.json")
    theirs["model"]["merges"] = [["a", "b"]]
    (tmp_path / "shards" / "tokenizer.json").write_text(json.dumps(theirs))
    with pytest.raises(ConfigError, match="their merges differ"):
        check_tokenizer(folder, tmp_path / "shards", "hf:tokenizer.json")


def test_the_fingerprint_holds_the_weights_digest_and_names_a_difference():
    from p2p_diloco.swarm.discovery.fingerprint import config_fingerprint, differences
    from p2p_diloco.swarm.discovery.records import FingerprintValue

    meta = {"vocab_size": 257, "dtype": "uint16", "tokenizer": "byte"}
    loaded, other = config_fingerprint(ARGS, [4], meta, init_digest="ab" * 32), \
        config_fingerprint(ARGS, [4], meta, init_digest="cd" * 32)
    assert differences(loaded, other) == ["model.init_from weights differ: sha256 abababababab… here, "
                                          "sha256 cdcdcdcdcdcd… in the swarm"]
    random = config_fingerprint(ARGS, [4], meta)
    assert differences(random, loaded) == ["model.init_from weights differ: none (random init from "
                                           "model.init_seed) here, sha256 abababababab… in the swarm"]
    assert differences(config_fingerprint(ModelArgs(**{**ARGS.__dict__, "rope_theta": 1e4}), [4], meta), random) \
        == ["model.rope_theta is 10000.0 here but 500.0 in the swarm"]
    assert differences(dict(random, version=2), random) == [
        "version is 2 here but 3 in the swarm: its peers run a p2p-diloco release that plans or combines rounds "
        "differently; run the swarm's release"]
    for fingerprint in (loaded, random):  # the DHT's schema stores only what parsing leaves unchanged
        assert FingerprintValue.parse_obj(fingerprint).dict(by_alias=True) == fingerprint
    with pytest.raises(ValueError):
        FingerprintValue.parse_obj(dict(loaded, **{"model.init_from": "not a digest"}))


def test_a_pipelined_peer_refuses_a_folder_that_does_not_fit_before_starting_stages(tmp_path, sharded, capsys):
    from p2p_diloco.cli.main import main

    out = tmp_path / "peer"
    common = ["peer", "--model.init_from", str(sharded), "--output-dir", str(out), "--stages", "2"]
    assert main([*common, "--model.n_heads", "8"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: model.n_heads: 8 conflicts with model.init_from's "
                                               f"num_attention_heads 4 ({sharded / 'config.json'}); leave "
                                               "model.n_heads unset (the shape comes from the folder)")
    assert main([*common, "--pipeline.stage_layers", "2,3"]) == 2
    assert "pipeline.stage_layers: [2, 3] adds up to 5 blocks, but the model has 4" in capsys.readouterr().err
    tied_args = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": True})
    tied = write_folder(tmp_path / "tied", tied_args, trained_like(tied_args))
    assert main(["peer", "--model.init_from", str(tied), "--output-dir", str(out), "--stages", "2"]) == 2
    assert "pipeline.stages: " + str(tied / "config.json") + " ties the output head" in capsys.readouterr().err
    assert not (out / "stages.toml").exists()  # no stage process was started


def a_real_checkpoint(path: Path, weights: dict[str, torch.Tensor], num_shards: int) -> Path:
    """A bf16 folder as the Hub ships them: config fields our decoder does not use, a BOS, and the tokenizer and
    generation files (special tokens, a chat template, the model's context length)."""
    source = write_folder(path, ARGS, weights, num_shards=num_shards, dtype=torch.bfloat16)
    config = json.loads((source / "config.json").read_text())
    config.update(bos_token_id=1, pretraining_tp=1, torch_dtype="bfloat16", transformers_version="4.44.0")
    del config["dtype"]
    (source / "config.json").write_text(json.dumps(config, indent=1))
    (source / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|endoftext|>", "model_max_length": 64, "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    (source / "special_tokens_map.json").write_text('{"bos_token": "<s>", "eos_token": "<|endoftext|>"}\n')
    (source / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 256, "temperature": 0.6}')
    (source / "LICENSE").write_text("the base model's license\n")
    return source


def export_from(tmp_path: Path, source: Path, weights: dict[str, torch.Tensor], *options: str) -> Path:
    """Export a one-stage peer that started from ``source`` and applied no round: its anchor is the folder's."""
    from p2p_diloco.cli.main import main
    from p2p_diloco.training.state.checkpoint import save_checkpoint

    peer = tmp_path / "peer"
    anchor = {f"anchor/{name}": value.bfloat16().float() for name, value in weights.items()}
    if not (peer / "config.toml").exists():
        save_checkpoint(peer / "checkpoints" / "stage0of1", 0, anchor,
                        {"run_id": "r", "round": 0, "applied_round": -1, "model": ARGS.__dict__}, keep=2)
        (peer / "config.toml").write_text(f"[model]\ninit_from = {json.dumps(str(source))}\n")
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    assert main(["export", str(peer), "--out", str(out), *options]) == 0
    return out


def stored(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        out.update(load_file(str(file)))
    return out


@pytest.mark.parametrize("num_shards", [1, 3])
def test_export_gives_back_a_bf16_folder_unchanged(tmp_path, weights, num_shards, capsys):
    source = a_real_checkpoint(tmp_path / "llama", weights, num_shards)
    out = export_from(tmp_path, source, weights)
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "LICENSE"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    theirs, ours = stored(source), stored(out)
    assert ours.keys() == theirs.keys()
    assert all(ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], theirs[name]) for name in theirs)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]  # it fits in one file
    assert "the tokenizer and settings of" in capsys.readouterr().out


def test_export_shards_as_transformers_does_and_casts_on_request(tmp_path, weights):
    from p2p_diloco.model.export import read_hf_folder

    source = a_real_checkpoint(tmp_path / "llama", weights, 1)
    out = export_from(tmp_path, source, weights, "--max-shard-size", "20KB", "--dtype", "float32")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files == sorted(set(index["weight_map"].values()))
    assert all(f"-of-{len(files):05d}.safetensors" in f for f in files)
    ours = stored(out)
    for file in files:  # at most 20 kB of tensors per file, or one tensor larger than that (the embedding) alone
        sizes = [t.numel() * 4 for t in load_file(str(out / file)).values()]
        assert sum(sizes) <= 20_000 or len(sizes) == 1, (file, sizes)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in ours.values())
    assert all(t.dtype == torch.float32 and torch.equal(t, weights[name].bfloat16().float())
               for name, t in read_hf_folder(out)[1].items() for t in [ours[hf_name(name)]])
    config, theirs = json.loads((out / "config.json").read_text()), json.loads((source / "config.json").read_text())
    assert config == dict(theirs, torch_dtype="float32")  # only the dtype changed


def test_export_without_a_source_is_fp32_with_the_models_context_length(tmp_path, weights):
    from p2p_diloco.cli.main import main
    from p2p_diloco.training.state.checkpoint import save_checkpoint

    peer = tmp_path / "peer"
    save_checkpoint(peer / "checkpoints" / "stage0of1", 0, {f"anchor/{k}": v for k, v in weights.items()},
                    {"run_id": "r", "round": 0, "applied_round": -1, "model": ARGS.__dict__}, keep=2)
    assert main(["export", str(peer), "--out", str(tmp_path / "out"), "--tokenizer", "byte"]) == 0
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["model_max_length"] == 64
    assert all(t.dtype == torch.float32 for t in stored(tmp_path / "out").values())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "float32"


def test_export_refuses_another_tokenizer_for_a_source_and_a_bad_size(tmp_path, weights, capsys):
    from p2p_diloco.cli.main import main

    source = a_real_checkpoint(tmp_path / "llama", weights, 1)
    export_from(tmp_path, source, weights)
    assert main(["export", str(tmp_path / "peer"), "--out", str(tmp_path / "x"), "--tokenizer", "byte"]) != 0
    assert "leave --tokenizer out" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "peer"), "--out", str(tmp_path / "x"), "--max-shard-size", "5 parsecs"]) != 0
    assert "--max-shard-size" in capsys.readouterr().err and not (tmp_path / "x").exists()
    source.rename(tmp_path / "moved")  # gone: said, and exported as a run from random weights
    assert main(["export", str(tmp_path / "peer"), "--out", str(tmp_path / "x"), "--tokenizer", "byte"]) == 0
    assert "cannot be read (not here)" in capsys.readouterr().err
    assert all(t.dtype == torch.float32 for t in stored(tmp_path / "x").values())


def test_sizes_read_as_transformers_reads_them():
    from p2p_diloco.model.export import parse_size

    assert [parse_size(s) for s in ("5GB", "500MB", "2GiB", "20KB", "1234")] == [5 * 10**9, 5 * 10**8, 2 * 2**30,
                                                                                 20_000, 1234]
    with pytest.raises(ValueError):
        parse_size("0")
