"""The command line as a user meets it: --help, one-line errors with non-zero exit codes, plan's JSON for scripts,
the bootstrap node's identity and clean exit, prepare-data."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess

import pytest

from tests.integration.conftest import LOOPBACK, cli, wait_for_file

pytestmark = pytest.mark.timeout(180)
FAKE_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWQRhMWEXs32iUEwckXD3ixtcp4M8THEUyqcMDAhgCsJGF"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["peer"], ["bootstrap"], ["swarm"], ["prepare-data"], ["status"], ["plan"]])
def test_help(command):
    result = run(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: p2p-diloco" in result.stdout


def test_help_config_lists_keys():
    result = run("peer", "--help-config")
    assert result.returncode == 0 and "diloco.inner_steps" in result.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["peer", "--inner.no_such_key", "1"], "inner.no_such_key: unknown key"),
        (["peer", "--diloco.inner_steps", "0"], "diloco.inner_steps: must be a positive integer"),
        (["peer", "--inner.lr", "fast"], "inner.lr: expected a number"),
        (["peer", "--initial-peers", "/ip4/300.1.2.3/tcp/31337"], "dht.initial_peers: malformed multiaddr"),
        (["peer", "--initial-peers", "not-an-address"], "dht.initial_peers: malformed multiaddr"),
        (["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/notaport"], "dht.host_maddrs: malformed multiaddr"),
        (["peer", "--config", "/nonexistent/peer.toml"], "does not exist"),
        (["swarm", "--peers", "0"], "--peers: must be at least 1"),
        (["plan", "--preset", "tiny", "--fragments", "9"], "--fragments: must lie in [1, 6]"),
        (["peer", "--data.path", "/nonexistent/shards", "--host-maddrs", LOOPBACK],
         "data.path: /nonexistent/shards does not exist"),
        # a model no machine holds (8.9B parameters, batch 16 x 2048): stopped before anything is built
        (["peer", "--model.preset", "1b", "--model.n_layers", "400", "--host-maddrs", LOOPBACK],
         "run.check_memory: this peer needs about"),
    ],
)
def test_bad_input_is_one_line_error(args, expected):
    result = run(*args)
    assert result.returncode != 0
    assert_one_line_error(result.stderr, expected)
    assert "Traceback" not in result.stdout


def test_plan_json_of_a_preset_is_the_whole_of_stdout():
    """``plan --json`` is for scripts: in a process of its own, which imports torch for the preset's model, stdout
    is the one JSON object and nothing else (tests/unit/test_plan.py checks its numbers in-process)."""
    result = run("plan", "--preset", "tiny", "--vocab-size", "4096", "--fragments", "4", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["inputs"]["fragment_share"] == pytest.approx(524416 / (524288 + 4 * 213248 + 524416))


def assert_one_line_error(stderr: str, expected: str) -> None:
    """The last line is the error, it is the only one, and no traceback came before it (logs may)."""
    lines = stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], stderr
    assert expected in lines[-1], lines[-1]
    assert "Traceback" not in stderr


def test_unreachable_initial_peer_is_one_line_error(tmp_path):
    result = run("peer", "--initial-peers", FAKE_PEER, "--host-maddrs", LOOPBACK, "--output-dir", str(tmp_path))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "could not reach any initial peer")


def start_bootstrap(tmp_path, identity):
    maddrs_file = tmp_path / "maddrs"
    maddrs_file.unlink(missing_ok=True)
    proc = subprocess.Popen(cli("bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(identity),
                                "--maddrs-file", str(maddrs_file)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, wait_for_file(maddrs_file, proc).split()


def test_bootstrap_identity_created_0600_and_reused_and_clean_exit(tmp_path):
    identity = tmp_path / "bootstrap.id"
    proc, maddrs = start_bootstrap(tmp_path, identity)
    assert stat.S_IMODE(identity.stat().st_mode) == 0o600
    peer_id = maddrs[0].rsplit("/p2p/", 1)[1]
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "--initial-peers " + maddrs[0] in out
    assert "Traceback" not in err

    proc, maddrs_again = start_bootstrap(tmp_path, identity)  # restart: same identity, same peer id
    assert maddrs_again[0].rsplit("/p2p/", 1)[1] == peer_id
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 0


@pytest.mark.parametrize("damage", ["garbage", "world_readable", "missing_folder"])
def test_bootstrap_refuses_bad_identity(tmp_path, damage):
    identity = tmp_path / "id"
    if damage == "garbage":
        identity.write_bytes(b"not a key")
        identity.chmod(0o600)
        expected = "does not hold a libp2p private key"
    elif damage == "world_readable":
        run_ok = subprocess.Popen(cli("bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(identity),
                                      "--maddrs-file", str(tmp_path / "m")), start_new_session=True)
        wait_for_file(tmp_path / "m", run_ok)
        os.killpg(run_ok.pid, signal.SIGTERM)
        run_ok.wait(timeout=30)
        identity.chmod(0o644)
        expected = "accessible by other users"
    else:
        identity = tmp_path / "no" / "such" / "id"
        expected = "does not exist"
    before = identity.read_bytes() if identity.exists() else None
    result = run("bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(identity))
    assert result.returncode == 1
    assert_one_line_error(result.stderr, expected)
    assert (identity.read_bytes() if identity.exists() else None) == before  # nothing overwritten


def test_prepare_data_and_train_on_it(tmp_path, monkeypatch):
    """prepare-data, then a peer trains on the shards to the end, logging to TensorBoard and to an offline W&B run
    as well (no network: W&B's folders are in tmp_path); the summary line is still alone on stdout."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.unit.test_metrics_sinks import wandb_history

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):
        (docs / f"doc{i}.txt").write_text(f"The quick brown fox {i} jumps over the lazy dog.\n" * 50)
    out = tmp_path / "shards"
    result = run("prepare-data", str(docs), "--output", str(out), "--eval-fraction", "0.1")
    assert result.returncode == 0, result.stderr
    assert (out / "meta.json").exists()
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    result = run("peer", "--data.path", str(out), "--host-maddrs", LOOPBACK, "--output-dir", str(tmp_path / "p"),
                 "--train.num_rounds", "2", "--diloco.inner_steps", "5", "--data.batch_size", "4",
                 "--data.seq_len", "32", "--train.progress", "false", "--run.num_threads", "1",
                 "--metrics.tensorboard_dir", "tb", "--metrics.wandb_project", "p2p-diloco-test")
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = result.stdout.splitlines()
    summary = json.loads(line)["summary"]
    assert summary["rounds_completed"] == 2

    (tb_folder,) = (tmp_path / "p" / "tb").glob("stage0-*")
    scalars = EventAccumulator(str(tb_folder))
    scalars.Reload()
    assert scalars.Scalars("train/loss")[-1].step == 10 and scalars.Scalars("eval/loss")[-1].step == 10
    assert scalars.Scalars("summary/fallback_rounds")[-1].value == summary["fallback_rounds"]
    (log,) = (tmp_path / "p" / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(log)
    assert [row["inner_step"] for row in history if "train/loss" in row][-1] == 10
    assert [row["summary/tokens"] for row in history if "summary/tokens" in row] == [summary["tokens"]]

    empty = tmp_path / "empty"
    empty.mkdir()
    result = run("prepare-data", str(empty), "--output", str(out), "--force")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, "error: ")
    assert (out / "meta.json").exists()  # the failed prepare left the existing shards alone


@pytest.mark.parametrize("argv, code", [(["peer", "--inner.no_such_key", "1"], 2), (["peer", "--help-config"], 0),
                                        (["swarm", "--peers", "0"], 2), (["plan", "--help"], 0),
                                        (["peer", "--data.path", "/nonexistent", "--no-resume", "--host-maddrs",
                                          "/ip4/127.0.0.1/tcp/0", "--run.num_threads", "1"], None)])
def test_a_mistake_or_a_help_is_told_before_torch_is_imported(argv, code):
    """The early exits (help, a config mistake) do not pay torch's import: seconds on a busy machine."""
    import subprocess
    import sys

    script = ("import sys\nfrom p2p_diloco.cli.main import main\ntry:\n    code = main(sys.argv[1:])\n"
              "except SystemExit as e:\n    code = e.code\n"
              "print('exit', code, 'torch' in sys.modules, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    last = result.stderr.strip().splitlines()[-1]
    if code is None:  # a mistake found by reading the data: torch is there by then, and the error is one line
        assert last.startswith("exit 1 "), result.stderr
        assert "error: data.path: /nonexistent does not exist" in result.stderr
    else:
        assert last == f"exit {code} False", result.stderr
