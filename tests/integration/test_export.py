"""``p2p-diloco export`` and ``generate`` on the checkpoint of a real two-stage peer: the exported folder loads in
transformers with the logits of our model, the byte tokenizer in transformers matches ours, generate samples from the
checkpoint and from the folder alike, and bad input is a one-line error with nothing overwritten."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency (pip install -e '.[test]'): missing, this module fails

from p2p_diloco.cli.main import main
from p2p_diloco.data import ByteTokenizer
from p2p_diloco.model import ModelArgs, Transformer
from p2p_diloco.model.hf import hf_name
from p2p_diloco.model.sample import build_model
from p2p_diloco.training.state.anchor import load_peer_anchor
from p2p_diloco.training.state.checkpoint import save_checkpoint
from tests.integration.conftest import LOOPBACK, TINY_TRAINING, cli

pytestmark = pytest.mark.timeout(300)


def run(*args: str) -> subprocess.CompletedProcess:
    """A p2p-diloco command as a process (a peer), or in this process (export and generate: a new interpreter
    importing torch for each of them doubled this module's time on a busy machine)."""
    if args[0] not in ("export", "generate"):
        return subprocess.run(cli(*args), capture_output=True, text=True, timeout=240)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert all(word in lines[0] for word in words), lines[0]


@pytest.fixture(scope="module")
def peer(tmp_path_factory) -> Path:
    """A peer of two pipeline stages (blocks 3 + 1) that trained one round alone, on the built-in corpus."""
    folder = tmp_path_factory.mktemp("export") / "peer"
    result = run("peer", "--host-maddrs", LOOPBACK, "--output-dir", str(folder), "--stages", "2",
                 "--stage-layers", "3,1", "--train.num_rounds", "1", "--diloco.inner_steps", "4", *TINY_TRAINING)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_an_exported_pipelined_peer_loads_in_transformers_with_the_same_logits(peer, tmp_path):
    out = tmp_path / "hf"
    result = run("export", str(peer), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2-stage peer" in result.stdout
    anchor = load_peer_anchor(peer)
    assert len(anchor.folders) == 2 and len(anchor.tensors) == 2 + 4 * 9 + 1  # every stage joined
    ids = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(0))
    ours = build_model(anchor.args, anchor.tensors, torch.device("cpu"))(ids)
    theirs = hf_logits(out, ids)
    assert (theirs - ours).abs().max().item() < 1e-4  # fp32, every position: rotary convention included
    init = Transformer(anchor.args).state_dict()
    assert max((anchor.tensors[k] - init[k]).abs().max().item() for k in anchor.tensors) > 1e-3  # a trained model

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "Grüße, swarm!\n"
    assert tokenizer(text)["input_ids"] == ByteTokenizer().encode(text)
    assert tokenizer.decode(ByteTokenizer().encode(text)) == text
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 256
    provenance = json.loads((out / "p2p_diloco.json").read_text())
    assert provenance["stages"] == 2 and provenance["step"] == anchor.step == 4


def test_a_tied_single_stage_model_exports_without_a_separate_head(tmp_path):
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=300, max_seq_len=64,
                     rope_theta=500.0, tie_embeddings=True)
    model = Transformer(args)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    tensors = {f"anchor/{name}": p.detach().clone() for name, p in model.named_parameters()}
    save_checkpoint(tmp_path / "peer" / "checkpoints" / "stage0of1", 7, tensors,
                    {"run_id": "r", "round": 1, "applied_round": 0, "model": asdict(args)}, keep=2)
    out = tmp_path / "hf"
    result = run("export", str(tmp_path / "peer"), "--out", str(out), "--tokenizer", "byte")
    assert result.returncode == 0, result.stderr[-3000:]
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (hf_logits(out, ids) - model(ids)).abs().max().item() < 1e-4


def test_generate_samples_the_same_text_from_the_checkpoint_and_the_exported_folder(peer, tmp_path):
    out = tmp_path / "hf"
    assert run("export", str(peer), "--out", str(out)).returncode == 0
    samples = []
    for source in (peer, out):
        result = run("generate", str(source), "--prompt", "The ", "--max-new-tokens", "24", "--seed", "3",
                     "--device", "cpu")
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.startswith("The ") and "tokens from" in result.stderr
        samples.append(result.stdout)
    assert samples[0] == samples[1] and len(samples[0]) > len("The \n")
    greedy = run("generate", str(out), "--prompt", "a", "--max-new-tokens", "8", "--temperature", "0")
    assert greedy.returncode == 0, greedy.stderr[-3000:]


def test_a_sharded_bf16_export_loads_in_transformers_and_generate_reads_it(peer, tmp_path):
    out = tmp_path / "hf"
    result = run("export", str(peer), "--out", str(out), "--max-shard-size", "20KB", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files == sorted(set(index["weight_map"].values())) and "model.safetensors" not in files
    anchor = load_peer_anchor(peer)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))  # the dtype config.json gives
    assert model.dtype == torch.bfloat16
    theirs = {name: value for name, value in model.state_dict().items()}
    assert all(torch.equal(theirs[hf_name(name)], value.bfloat16()) for name, value in anchor.tensors.items())
    assert transformers.AutoTokenizer.from_pretrained(str(out)).model_max_length == anchor.args.max_seq_len
    result = run("generate", str(out), "--prompt", "The ", "--max-new-tokens", "8", "--device", "cpu")
    assert result.returncode == 0 and result.stdout.startswith("The "), result.stderr[-3000:]


def test_bad_input_is_a_one_line_error_and_nothing_is_overwritten(peer, tmp_path):
    one_line_error(run("export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "a")), "does not exist")
    (tmp_path / "empty").mkdir()
    one_line_error(run("export", str(tmp_path / "empty"), "--out", str(tmp_path / "a")), "no loadable checkpoint")
    half = tmp_path / "half"
    shutil.copytree(peer, half)
    shutil.rmtree(half / "checkpoints" / "stage1of2")
    one_line_error(run("export", str(half), "--out", str(tmp_path / "a")), "stage 1 of 2")
    one_line_error(run("export", str(peer), "--out", str(tmp_path / "a"), "--step", "999"), "step 999")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    one_line_error(run("export", str(peer), "--out", str(existing)), "exists")
    assert [p.name for p in existing.iterdir()] == ["keep.txt"] and (existing / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.tmp-*"))
    one_line_error(run("generate", str(tmp_path / "empty")), "no loadable checkpoint")
    one_line_error(run("generate", str(peer), "--max-new-tokens", "-1"), "must be >= 0")


def test_prepare_data_keeps_the_hf_tokenizer_for_export(tmp_path):
    from p2p_diloco.cli.export import checkpoint_tokenizer
    from p2p_diloco.data import HFTokenizer, load_tokenizer, prepare_data
    from tests.unit.test_data import make_hf_tokenizer_json

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text(f"hello world {i} " * 40)
    spec = make_hf_tokenizer_json(tmp_path / "tokenizer.json", ["<|endoftext|>"])
    prepare_data([docs], tmp_path / "shards", load_tokenizer(str(spec)), eval_fraction=0.2, progress=False)
    assert (tmp_path / "shards" / "tokenizer.json").read_bytes() == spec.read_bytes()
    tokenizer = checkpoint_tokenizer(str(tmp_path / "shards"), None, None, vocab_size=10_000)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eot_id is not None
