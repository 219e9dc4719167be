"""The catalogue of bad input through the real command line (``python -m p2p_diloco ...``): a one-line error that
names the problem, a non-zero exit code (2: usage, 1: runtime), and nothing already saved overwritten. The
in-process cases are in tests/unit/test_bad_input.py; the table is in docs/user-guide.md, "Bad input"."""

from __future__ import annotations

import hashlib
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from p2p_diloco.config import DHTConfig
from p2p_diloco.swarm import SwarmError, start_dht
from tests.helpers import make_shards
from tests.integration.conftest import LOOPBACK, cli
from tests.integration.test_cli import assert_one_line_error

pytestmark = pytest.mark.timeout(240)
PEER_ID = "12D3KooWQRhMWEXs32iUEwckXD3ixtcp4M8THEUyqcMDAhgCsJGF"
TINY = ["--host-maddrs", LOOPBACK, "--model.preset", "tiny", "--data.batch_size", "4", "--data.seq_len", "32",
        "--data.eval_batches", "1", "--train.progress", "false", "--run.num_threads", "1"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- config ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("toml, args, expected", [
    ("[inner]\nlearning_rate = 1e-3\n", [], "inner.learning_rate: unknown key"),
    ("[diloco]\ninner_steps = \"many\"\n", [], "diloco.inner_steps: expected an integer, got 'many'"),
    ("", ["--diloco.inner_steps", "-1"], "diloco.inner_steps: must be a positive integer, got -1"),
    ("", ["--inner.lr", "0"], "inner.lr: must be a positive number, got 0.0"),
    ("", ["--stages", "5"], "pipeline.stages: 5 stages need at least 5 blocks, but the model has 4"),
    ("", ["--stages", "2", "--stage-layers", "1,2"], "pipeline.stage_layers: [1, 2] adds up to 3 blocks"),
])
def test_bad_config_is_a_usage_error_naming_the_key(tmp_path, toml, args, expected):
    config = tmp_path / "peer.toml"
    config.write_text(toml)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.toml").write_text("# the previous run's\n")
    result = run("peer", "--config", str(config), "--output-dir", str(out), *TINY, *args)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, expected)
    assert (out / "config.toml").read_text() == "# the previous run's\n"


# ---- addresses ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, expected", [
    (["peer", "--host-maddrs", "/ip4/127.0.0.1/udp/x"], "dht.host_maddrs: malformed multiaddr"),
    (["peer", "--initial-peers", "/ip4/127.0.0.1/tcp/31337"], "dht.initial_peers: '/ip4/127.0.0.1/tcp/31337' has no "
                                                              "/p2p/<peer id> part"),
    (["bootstrap", "--initial-peers", "/ip4/127.0.0.1/tcp/31337/p2p/not-base58!"], "dht.initial_peers: malformed"),
])
def test_malformed_multiaddr_is_a_usage_error(args, expected):
    result = run(*args)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, expected)


@pytest.fixture
def silent_peer():
    """A well-formed address where a TCP port accepts connections but nothing ever answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{PEER_ID}"


def test_unreachable_initial_peer_fails_within_the_startup_timeout(silent_peer):
    started = time.monotonic()
    with pytest.raises(SwarmError, match=r"could not reach any initial peer .*check the addresses"):
        start_dht(DHTConfig(host_maddrs=[LOOPBACK], initial_peers=[silent_peer], startup_timeout_s=3))
    assert time.monotonic() - started < 3 + 10


def test_unreachable_initial_peer_is_a_runtime_error_from_the_cli(tmp_path, silent_peer):
    result = run("bootstrap", "--initial-peers", silent_peer, "--dht.startup_timeout_s", "3", "--host-maddrs",
                 LOOPBACK, "--identity-path", str(tmp_path / "b.id"))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "could not reach any initial peer")


# ---- data -----------------------------------------------------------------------------------------------------

@pytest.fixture
def shards(tmp_path) -> Path:
    return make_shards(tmp_path / "shards", num_tokens=6000, vocab_size=61, with_eval=True)


@pytest.mark.parametrize("damage, extra, expected", [
    ("none", ["--model.vocab_size", "40"], r"train_00000\d.bin: token id \d+ at position \d+ is not below the "
                                            r"model's vocabulary size 40 \(model.vocab_size\) \(the largest id in "
                                            r"this file is 60\)"),
    ("empty shard", [], r"train_000001.bin: size 0 bytes is not a positive multiple of 2"),
    ("missing shard", [], r"train_000001.bin: listed in meta.json \(split 'train'\) but missing"),
    ("missing folder", [], r"data.path: .*/nowhere does not exist"),
])
def test_bad_data_is_refused_before_training(tmp_path, shards, damage, extra, expected):
    data = shards
    if damage == "empty shard":
        (shards / "train_000001.bin").write_bytes(b"")
    elif damage == "missing shard":
        (shards / "train_000001.bin").unlink()
    elif damage == "missing folder":
        data = tmp_path / "nowhere"
    out = tmp_path / "out"
    result = run("peer", "--data.path", str(data), "--output-dir", str(out), *TINY, *extra)
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "error: ")
    assert __import__("re").search(expected, result.stderr.strip().splitlines()[-1]), result.stderr[-2000:]
    assert not (out / "checkpoints").exists() and not (out / "config.toml").exists()  # refused before anything


def test_an_eval_split_too_small_names_the_options_that_fix_it(tmp_path):
    data = make_shards(tmp_path / "small", num_tokens=100, vocab_size=61, with_eval=True)  # eval: 100 < 4 x 33
    out = tmp_path / "out"
    result = run("peer", "--data.path", str(data), "--output-dir", str(out), *TINY)
    assert result.returncode == 2, result.stderr[-2000:]
    assert_one_line_error(result.stderr, f"error: data.eval_batches: the eval split of {data} has 100 tokens, fewer "
                                         "than one eval batch of data.batch_size 4 x (data.seq_len + 1) 33 = 132; use "
                                         "--data.eval_batches 0 (no evaluation), or --data.batch_size 3, or "
                                         "--data.seq_len 24")
    assert not (out / "checkpoints").exists() and not (out / "config.toml").exists()


# ---- prepare-data ---------------------------------------------------------------------------------------------

def write_texts(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for i in range(4):
        (folder / f"doc{i}.txt").write_text(f"plain text {i}\n" * 20)
    (folder / "latin1.txt").write_bytes("café crème\n".encode("latin-1"))
    return folder


def test_prepare_data_counts_bytes_that_are_not_utf8_and_never_overwrites_without_force(tmp_path):
    inputs, out = write_texts(tmp_path / "in"), tmp_path / "shards"
    result = run("prepare-data", str(inputs), "-o", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 bad records skipped, 1 of them not UTF-8 (2 invalid bytes)" in result.stdout
    assert "latin1.txt: not valid UTF-8: 2 invalid bytes, the first at byte offset 3" in result.stderr
    before = snapshot(out)
    result = run("prepare-data", str(inputs), "-o", str(out), "--eval-fraction", "0.5")
    assert result.returncode == 2
    assert_one_line_error(result.stderr, f"error: --output: {out} exists and is not empty; give --force to replace it")
    assert snapshot(out) == before
    result = run("prepare-data", str(inputs), "-o", str(tmp_path / "other"), "--on-bad-record", "stop")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, f"error: {inputs / 'latin1.txt'}: not valid UTF-8: 2 invalid bytes, the "
                                         "first at byte offset 3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "shards"]  # no hidden temporary folder left


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_an_interrupted_or_killed_prepare_data_leaves_no_temporary_folder(tmp_path, signum):
    """SIGTERM removes the temporary folder at once (exit 130); SIGKILL cannot, and the next run removes it."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(8):
        (inputs / f"big{i}.txt").write_bytes(b"some text to tokenize, line after line\n" * 150_000)  # 6 MB each
    out = tmp_path / "shards"
    process = subprocess.Popen(cli("prepare-data", str(inputs), "-o", str(out)), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".shards.tmp-*")) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, "prepare-data ended before its temporary folder was seen"
        time.sleep(0.3)  # into the writing
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    left = list(tmp_path.glob(".shards.tmp-*"))
    if signum == signal.SIGTERM:
        assert process.returncode == 130 and "interrupted" in stderr and left == []
    else:
        assert len(left) == 1
        (inputs / "big0.txt").write_bytes(b"small now\n")
        for i in range(1, 8):
            (inputs / f"big{i}.txt").write_text(f"small {i}\n")
        result = run("prepare-data", str(inputs), "-o", str(out))
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"Removed {left[0]}, left by process {process.pid}, which is gone" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == (["in", "shards"] if signum == signal.SIGKILL else ["in"])


# ---- checkpoints ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A peer's output folder after 2 rounds of 2 inner steps: checkpoints at inner steps 2 and 4."""
    root = tmp_path_factory.mktemp("trained")
    make_shards(root / "shards", num_tokens=6000, vocab_size=61, with_eval=True)
    result = run(*peer_command(root / "out", root / "shards"))
    assert result.returncode == 0, result.stderr[-3000:]
    folder = root / "out" / "checkpoints" / "stage0of1"
    assert sorted(p.name for p in folder.glob("*.json")) == ["step-00000002.json", "step-00000004.json"]
    return root


def peer_command(out: Path, data: Path, *extra: str) -> list[str]:
    return ["peer", "--run-id", "good-run", "--data.path", str(data), "--output-dir", str(out), *TINY,
            "--diloco.inner_steps", "2", "--train.num_rounds", "2", "--checkpoint.every_rounds", "1", *extra]


@pytest.fixture
def copy(trained, tmp_path) -> Path:
    """A copy of the trained peer's folders for one test to damage."""
    shutil.copytree(trained, tmp_path / "copy")
    return tmp_path / "copy"


@pytest.mark.parametrize("extra, expected", [
    (["--run-id", "other-run"], "belongs to run 'good-run', not 'other-run'; use another checkpoint folder or "
                                "--no-resume"),
    (["--model.ffn_dim", "256"], "does not fit this peer: checkpoint tensor"),
])
def test_checkpoint_of_another_run_or_shape_is_refused_and_kept(copy, extra, expected):
    folder = copy / "out" / "checkpoints"
    before = snapshot(folder)
    result = run(*peer_command(copy / "out", copy / "shards", *extra))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, expected)
    assert snapshot(folder) == before


def test_damaged_latest_checkpoint_falls_back_then_none_left_is_refused(copy):
    folder = copy / "out" / "checkpoints" / "stage0of1"
    data = folder / "step-00000004.safetensors"
    data.write_bytes(data.read_bytes()[:1000])  # truncated
    result = run(*peer_command(copy / "out", copy / "shards"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint data" in result.stderr and "falling back to the previous checkpoint" in result.stderr
    assert "Resumed from" in result.stderr and "step-00000002.json" in result.stderr

    for data in folder.glob("*.safetensors"):  # every checkpoint damaged: nothing to resume from
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    before = snapshot(copy / "out" / "checkpoints")
    result = run(*peer_command(copy / "out", copy / "shards"))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "no checkpoint in")
    assert "can be loaded" in result.stderr and "--no-resume" in result.stderr
    assert snapshot(copy / "out" / "checkpoints") == before


def test_shards_with_ids_past_their_vocabulary_are_named(tmp_path, shards):
    file = shards / "eval_000000.bin"
    tokens = np.fromfile(file, dtype="<u2")
    tokens[3] = 999
    tokens.tofile(file)
    result = run("peer", "--data.path", str(shards), "--output-dir", str(tmp_path / "out"), *TINY)
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "eval_000000.bin: token id 999 at position 3 is not below vocab_size 61 "
                                         "from meta.json (the largest id in this file is 999)")
