"""``peer --model.init_from``: real peers start from a sharded Llama folder that transformers wrote. A two-stage peer
that trains 0 rounds exports the folder's tensors bit for bit, and its model gives transformers' logits; a peer that
loaded other weights is refused by the swarm with a message naming the difference."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency (pip install -e '.[test]'): missing, this module fails
from safetensors.torch import load_file, save_file

from p2p_diloco.cli.main import main
from p2p_diloco.model.hf import byte_tokenizer_json
from p2p_diloco.model.hf_folder import open_hf_folder, weights_digest
from p2p_diloco.model.sample import build_model
from p2p_diloco.training.state.anchor import load_peer_anchor
from tests.integration.conftest import LOOPBACK, cli

pytestmark = pytest.mark.timeout(300)
SMALL = ["--data.batch_size", "8", "--data.seq_len", "32", "--data.eval_batches", "2", "--train.progress", "false",
         "--run.num_threads", "1"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A bf16 LlamaForCausalLM of transformers' own init (norm scales drawn too, so that none is left at its init),
    saved in 12 shards with its index, the byte tokenizer of the built-in corpus, and the tokenizer files of a Hub
    checkpoint (special tokens, a chat template, the context length)."""
    path = tmp_path_factory.mktemp("init") / "llama"
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=500.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=256, pretraining_tp=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(str(path), max_shard_size="20KB")
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json()))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "\u0000", "eos_token": "<|endoftext|>",
        "model_max_length": 64, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "\u0000", "eos_token": "<|endoftext|>"}))
    assert (path / "generation_config.json").is_file()
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    return path


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in path.glob("*.safetensors"):
        out.update(load_file(str(file)))
    return out


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_a_pipelined_peer_starts_from_the_folder_and_exports_it_bit_for_bit(folder, tmp_path):
    peer = tmp_path / "peer"
    result = subprocess.run(cli("peer", "--host-maddrs", LOOPBACK, "--output-dir", str(peer), "--model.init_from",
                                str(folder), "--train.num_rounds", "0", "--stages", "2", "--stage-layers", "3,1",
                                *SMALL), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = tmp_path / "hf"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", str(peer), "--out", str(exported)]) == 0
    theirs, ours = tensors_of(folder), load_file(str(exported / "model.safetensors"))  # 5GB a shard: one file
    assert ours.keys() == theirs.keys() and len(ours) == 2 + 4 * 9 + 1
    assert all(ours[name].dtype == torch.bfloat16 for name in ours)
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)  # load -> 0 rounds -> export: the same bits
    assert_same_files(folder, exported, sharded=False)
    resharded = tmp_path / "resharded"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", str(peer), "--out", str(resharded), "--max-shard-size", "20KB"]) == 0
    assert_same_files(folder, resharded, sharded=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert tokenizer.model_max_length == 64 and tokenizer.bos_token == "\u0000" and tokenizer.chat_template

    anchor = load_peer_anchor(peer)  # both stages' anchors joined: every stage loaded its own tensors
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = build_model(anchor.args, anchor.tensors, torch.device("cpu"))(ids)
    assert (hf_logits(folder, ids) - logits).abs().max().item() < 1e-4  # rope_theta and rms_norm_eps included
    assert (hf_logits(exported, ids) - logits).abs().max().item() < 1e-4
    cached = json.loads((peer / "init_from.json").read_text())["sha256"]
    assert cached == weights_digest(open_hf_folder(folder))


def assert_same_files(source: Path, exported: Path, sharded: bool) -> None:
    """Every file of ``source`` is in ``exported``: config.json field by field, the shards as transformers cut them
    (when ``sharded``), every tensor bit for bit, every other file byte for byte; besides them, p2p_diloco.json."""
    names = {p.name for p in source.iterdir()}
    if not sharded:
        names = {n for n in names if not n.startswith("model-") and n != "model.safetensors.index.json"}
        names.add("model.safetensors")
    assert {p.name for p in exported.iterdir()} == names | {"p2p_diloco.json"}
    assert json.loads((exported / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    if sharded:
        index = "model.safetensors.index.json"
        assert json.loads((exported / index).read_text())["weight_map"] == \
            json.loads((source / index).read_text())["weight_map"]
    for name in names - {"config.json"}:
        if name.endswith(".safetensors"):
            theirs, ours = (tensors_of(source) if not sharded else load_file(str(source / name)),
                            load_file(str(exported / name)))
            assert ours.keys() == theirs.keys(), name
            assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours), name
        elif not name.endswith(".index.json"):
            assert (exported / name).read_bytes() == (source / name).read_bytes(), name


def test_a_peer_that_loaded_other_weights_is_refused_by_the_swarm(folder, tmp_path):
    """A DHT node of the run publishes the config record a peer started from ``folder`` publishes (one peer's process
    fewer than a real first peer); a real peer started from a copy with one value changed is refused."""
    from p2p_diloco.config import DataConfig, DHTConfig
    from p2p_diloco.data import read_meta, resolve_data_path
    from p2p_diloco.swarm import start_dht, visible_maddrs
    from p2p_diloco.swarm.discovery.fingerprint import config_fingerprint, config_key, publish_fingerprint
    from p2p_diloco.swarm.discovery.records import swarm_validators

    other = tmp_path / "other"
    shutil.copytree(folder, other)
    shard = json.loads((other / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    tensors = load_file(str(other / shard))
    tensors["model.norm.weight"][0] += 0.25  # a change bf16 can hold
    save_file(tensors, str(other / shard), metadata={"format": "pt"})
    loaded = open_hf_folder(folder)
    theirs, mine = weights_digest(loaded), weights_digest(open_hf_folder(other))
    assert theirs != mine
    record = config_fingerprint(loaded.args, [4], read_meta(resolve_data_path(DataConfig())), init_digest=theirs)

    node = start_dht(DHTConfig(host_maddrs=[LOOPBACK]), record_validators=swarm_validators("init-from"))
    try:
        publish_fingerprint(node, "init-from", record, ttl_s=120)
        deadline = time.monotonic() + 30
        while node.get(config_key("init-from"), latest=True) is None:
            assert time.monotonic() < deadline, "the record was not stored"
            time.sleep(0.2)
        result = subprocess.run(cli("peer", "--host-maddrs", LOOPBACK, "--initial-peers", visible_maddrs(node)[0],
                                    "--run-id", "init-from", "--output-dir", str(tmp_path / "peer"),
                                    "--model.init_from", str(other), "--train.num_rounds", "1", *SMALL),
                                capture_output=True, text=True, timeout=180)
    finally:
        node.shutdown()
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"error: this peer's config does not fit the swarm of run 'init-from': model.init_from weights "
                    f"differ: sha256 {mine[:12]}… here, sha256 {theirs[:12]}… in the swarm (1 of 1 live peers). Use "
                    "the swarm's settings, or another --run-id"), result.stderr[-3000:]
