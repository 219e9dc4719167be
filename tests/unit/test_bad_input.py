"""The catalogue of bad input, in process: each case ends in the subsystem's error naming the problem (or, for a
damaged latest checkpoint, a fallback to the previous good one), and a failed load changes nothing on disk.
The same cases through the real command line are in tests/integration/test_bad_input_cli.py; the table is in
docs/user-guide.md, "Bad input"."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.data import DataError, ShardDataset, WindowSampler, resolve_data_path
from p2p_diloco.model import ModelArgs, Transformer
from p2p_diloco.stage_setup import StageData, check_vocab
from p2p_diloco.training import CheckpointError, LocalExecutor, Stage
from p2p_diloco.training.state.persist import resume_stage, save_stage
from p2p_diloco.training.summary import TrainSummary
from tests.helpers import TINY_ARGS, make_shards


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "peer.toml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


# ---- config -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    ([("inner.no_such_key", "1")], "inner.no_such_key: unknown key"),
    ([("nosection.lr", "1")], "nosection.lr: unknown key"),
    ([("diloco.inner_steps", "ten")], "diloco.inner_steps: expected an integer, got 'ten'"),
    ([("train.progress", "maybe")], "train.progress: expected true or false"),
    ([("diloco.inner_steps", "0")], "diloco.inner_steps: must be a positive integer, got 0"),
    ([("diloco.inner_steps", "-5")], "diloco.inner_steps: must be a positive integer, got -5"),
    ([("inner.lr", "0")], "inner.lr: must be a positive number, got 0.0"),
    ([("inner.lr", "-1e-3")], "inner.lr: must be a positive number, got -0.001"),
    ([("inner.lr", "nan")], "inner.lr: expected a finite number"),
    ([("diloco.outer_lr", "0")], "diloco.outer_lr: must be a positive number"),
    ([("diloco.outer_lr_group_exponent", "-0.5")], "diloco.outer_lr_group_exponent: must be in [0, 1], got -0.5"),
    ([("diloco.outer_lr_group_exponent", "2")], "diloco.outer_lr_group_exponent: must be in [0, 1], got 2.0"),
    ([("diloco.outer_lr_largest_group", "1")], "diloco.outer_lr_largest_group: must be an integer in [2, 64]"),
    ([("diloco.overlap_steps", "0")], "diloco.overlap_steps: must be between 1 and diloco.inner_steps"),
    ([("diloco.inner_steps", "10"), ("diloco.overlap_steps", "11")], "diloco.overlap_steps: must be between 1"),
    ([("pipeline.stages", "5")], "pipeline.stages: 5 stages need at least 5 blocks, but the model has 4"),
    ([("pipeline.stages", "3"), ("model.n_layers", "2")], "pipeline.stages: 3 stages need at least 3 blocks"),
    ([("pipeline.stages", "2"), ("pipeline.stage_layers", "1,2")],
     "pipeline.stage_layers: [1, 2] adds up to 3 blocks, but the model has 4"),
    ([("pipeline.stages", "2"), ("pipeline.stage_layers", "4")], "pipeline.stage_layers: has 1 entries but"),
    ([("pipeline.stages", "2"), ("pipeline.stage_layers", "4,0")], "every stage needs at least one block"),
])
def test_bad_config_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


@pytest.mark.parametrize("text, message", [
    ("[inner]\nlearning_rate = 0.1\n", "inner.learning_rate: unknown key"),
    ("[optimizer]\nlr = 0.1\n", "optimizer.lr: unknown key"),
    ("[diloco]\ninner_steps = \"fifty\"\n", "diloco.inner_steps: expected an integer, got 'fifty'"),
    ("[diloco]\ninner_steps = 50.0\n", "diloco.inner_steps: expected an integer, got 50.0"),
    ("[inner]\nlr = true\n", "inner.lr: expected a number, got True"),
    ("[dht]\ninitial_peers = \"/ip4/1.2.3.4/tcp/1\"\n", "dht.initial_peers: '/ip4/1.2.3.4/tcp/1' has no /p2p/"),
    ("[pipeline]\nstage_layers = [[2], [2]]\n", "pipeline.stage_layers[0]: expected an integer"),
    ("inner_steps = 5\n", "inner_steps: expected a [inner_steps] table"),
    ("[diloco\ninner_steps = 5\n", "is not valid TOML"),
    (b"[run]\nrun_id = \"\xff\xfe\"\n", "is not UTF-8 text"),
])
def test_bad_config_files_name_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=None) as error:
        load_config(write(tmp_path, text))
    assert message in str(error.value)


def test_config_path_that_is_a_folder(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path)


# ---- addresses ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, message", [
    ("dht.initial_peers", "/ip4/300.1.2.3/tcp/31337/p2p/QmX", "dht.initial_peers: malformed multiaddr"),
    ("dht.initial_peers", "127.0.0.1:31337", "dht.initial_peers: malformed multiaddr"),
    ("dht.initial_peers", "/ip4/127.0.0.1/tcp/31337", "has no /p2p/<peer id> part"),
    ("dht.host_maddrs", "/ip4/0.0.0.0/tcp/notaport", "dht.host_maddrs: malformed multiaddr"),
    ("dht.host_maddrs", "/ip6/zz::1/tcp/0", "dht.host_maddrs: malformed multiaddr"),
    ("dht.announce_maddrs", "/dns/", "dht.announce_maddrs: malformed multiaddr"),
])
def test_malformed_multiaddrs_name_the_key(key, value, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [(key, value)])
    assert message in str(error.value)


# ---- checkpoints --------------------------------------------------------------------------------------------

def make_stage(args: dict = TINY_ARGS) -> Stage:
    cfg = load_config(None, [("diloco.mode", "none")])
    return Stage(Transformer(ModelArgs(**args)), stage_index=0, num_stages=1, inner_cfg=cfg.inner,
                 diloco_cfg=cfg.diloco, total_steps=100)


@pytest.fixture
def saved(tmp_path):
    """A checkpoint folder with two good checkpoints (steps 4 and 8) of run 'good-run'; returns (folder, sampler)."""
    sampler = WindowSampler(ShardDataset(make_shards(tmp_path / "data"), "train"), 16, 4, seed=1)
    stage = make_stage()
    folder = tmp_path / "checkpoints"
    for step in (4, 8):
        with torch.no_grad():
            for p in stage.params:
                p.add_(0.01)
        stage.inner_step, stage.round_index = step, step // 4
        save_stage(folder, stage, sampler, TrainSummary("p", "good-run", 0, 1, 1), "good-run", keep=3)
    return folder, sampler


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def resume(folder: Path, sampler, run_id: str = "good-run", args: dict = TINY_ARGS) -> Stage:
    stage = make_stage(args)
    path = resume_stage([(folder, stage)], sampler, TrainSummary("p", run_id, 0, 1, 1), run_id,
                        LocalExecutor(Transformer(ModelArgs(**args)), torch.device("cpu")))  # only common_value
    assert path is not None
    return stage


def damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    elif how == "flip":
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))
    elif how == "edit meta":  # a readable manifest whose content no longer matches its own checksum
        manifest = json.loads(raw)
        manifest["meta"]["inner_step"] = 1000
        path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("file, how", [("safetensors", "truncate"), ("safetensors", "flip"), ("json", "truncate"),
                                       ("json", "edit meta")])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(saved, file, how, caplog):
    folder, sampler = saved
    damage(folder / f"step-00000008.{file}", how)
    before = snapshot(folder)
    stage = resume(folder, sampler)
    assert stage.inner_step == 4  # the previous good one
    assert "falling back to the previous checkpoint" in caplog.text
    assert ("checksum" in caplog.text) or ("unreadable" in caplog.text)
    assert snapshot(folder) == before  # the damaged one is left for the user to look at


def test_no_loadable_checkpoint_is_refused_and_nothing_deleted(saved):
    folder, sampler = saved
    for step in (4, 8):
        damage(folder / f"step-0000000{step}.safetensors", "truncate")
    before = snapshot(folder)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be loaded.*--no-resume"):
        resume(folder, sampler)
    assert snapshot(folder) == before


def test_checkpoint_of_another_run_is_refused(saved):
    folder, sampler = saved
    before = snapshot(folder)
    with pytest.raises(CheckpointError, match=r"belongs to run 'good-run', not 'other-run'"):
        resume(folder, sampler, run_id="other-run")
    assert snapshot(folder) == before


def test_checkpoint_of_another_model_shape_is_refused(saved):
    folder, sampler = saved
    before = snapshot(folder)
    with pytest.raises(CheckpointError, match=r"does not fit this peer: checkpoint tensor .* has shape"):
        resume(folder, sampler, args=dict(TINY_ARGS, dim=64, n_heads=8))
    assert snapshot(folder) == before


def test_checkpoint_of_an_older_format_is_refused_with_advice(saved, caplog):
    folder, sampler = saved
    for step in (4, 8):
        manifest_path = folder / f"step-0000000{step}.json"
        manifest = json.loads(manifest_path.read_text())
        manifest_path.write_text(json.dumps(dict(manifest, version=1)))
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be loaded"):
        resume(folder, sampler)
    assert "of version 1; this build reads version 2 (start fresh with --no-resume" in caplog.text


# ---- data ---------------------------------------------------------------------------------------------------

def shards(tmp_path: Path, vocab_size: int = 61, max_id: int | None = None) -> Path:
    path = make_shards(tmp_path / "shards", num_tokens=5000, vocab_size=vocab_size, with_eval=True)
    if max_id is not None:  # write one id past the vocabulary into the train split's second file
        file = path / "train_000001.bin"
        tokens = np.fromfile(file, dtype="<u2")
        tokens[7] = max_id
        tokens.tofile(file)
    return path


def test_missing_data_folder(tmp_path):
    from p2p_diloco.config import DataConfig

    with pytest.raises(DataError, match=r"data.path: .*nowhere does not exist.*prepare-data"):
        resolve_data_path(DataConfig(path=str(tmp_path / "nowhere")))


def test_missing_shard(tmp_path):
    path = shards(tmp_path)
    (path / "train_000001.bin").unlink()
    with pytest.raises(DataError, match=r"train_000001.bin: listed in meta.json \(split 'train'\) but missing"):
        ShardDataset(path, "train")


def test_empty_shard(tmp_path):
    path = shards(tmp_path)
    (path / "train_000000.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"train_000000.bin: size 0 bytes .* truncated or corrupt"):
        ShardDataset(path, "train")


def test_empty_split(tmp_path):
    path = shards(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["splits"]["train"] = {"files": [], "num_tokens": 0}
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"split 'train' is empty"):
        ShardDataset(path, "train")


def test_token_ids_beyond_the_datas_vocabulary(tmp_path):
    path = shards(tmp_path, max_id=200)
    with pytest.raises(DataError, match=r"train_000001.bin: token id 200 .* not below vocab_size 61 from meta.json "
                                        r"\(the largest id in this file is 200\)"):
        ShardDataset(path, "train")


def test_token_ids_beyond_the_models_vocabulary(tmp_path):
    """model.vocab_size below the data's: refused before training, naming the file and its largest id."""
    train = ShardDataset(shards(tmp_path), "train")
    largest = max(int(np.fromfile(f, dtype="<u2").max()) for f in train.files)
    data = StageData(train, ShardDataset(train.path, "eval"), 16)
    check_vocab(data, 61)  # the data's own vocabulary: fine
    with pytest.raises(DataError, match=rf"train_00000\d.bin: token id \d+ at position \d+ is not below the model's "
                                        rf"vocabulary size 40 \(model.vocab_size\) \(the largest id in this file is "
                                        rf"{largest}\)"):
        check_vocab(data, 40)


def test_an_eval_split_too_small_for_one_batch_names_the_options_that_fix_it(tmp_path):
    from p2p_diloco.stage_setup import load_data

    path = write_meta_with_eval(tmp_path, num_train=20_000, num_eval=300)
    cfg = load_config(None, [("data.path", str(path)), ("data.seq_len", "64"), ("data.batch_size", "8")])
    with pytest.raises(ConfigError) as caught:
        load_data(cfg, max_seq_len=128)
    message = str(caught.value)
    assert message.startswith(f"data.eval_batches: the eval split of {path} has 300 tokens, fewer than one eval "
                              "batch of data.batch_size 8 x (data.seq_len + 1) 65 = 520")
    # each value named fits: 4 windows of 65 in 300 tokens, 8 windows of 37, and ~520 of 20,300 tokens held out
    assert "--data.eval_batches 0" in message and "--data.batch_size 4" in message
    assert "--data.seq_len 36" in message and "prepare-data --eval-fraction 0.033" in message
    assert "\n" not in message
    fitting = load_config(None, [("data.path", str(path)), ("data.seq_len", "64"), ("data.batch_size", "4")])
    assert load_data(fitting, max_seq_len=128).eval.num_tokens == 300
    no_eval = load_config(None, [("data.path", str(path)), ("data.seq_len", "64"), ("data.batch_size", "8"),
                                 ("data.eval_batches", "0")])
    assert load_data(no_eval, max_seq_len=128).eval is not None


def write_meta_with_eval(tmp_path: Path, num_train: int, num_eval: int) -> Path:
    from p2p_diloco.data import ShardWriter, atomic_output_dir, write_meta

    path = tmp_path / "small-eval"
    with atomic_output_dir(path) as tmp:
        splits = {}
        for split, num_tokens in (("train", num_train), ("eval", num_eval)):
            with ShardWriter(tmp, split, "uint16") as writer:
                writer.append(np.arange(num_tokens) % 61)
            splits[split] = writer.close()
        write_meta(tmp, "uint16", 61, "test", splits)
    return path
