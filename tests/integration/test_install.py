"""p2p-diloco as a user installs it: ``python -m build`` makes a wheel and an sdist of the checkout, each is installed
(not editable) into a fresh virtual environment, and the ``p2p-diloco`` of that environment runs every command,
reports its version from the package metadata and starts a bootstrap node on hivemind's own p2pd daemon.

Offline and fast: the build runs without isolation (the backend is in the test extra), pip installs only the
artifact (``--no-deps --no-index``), and the heavy dependencies (torch, hivemind, ...) come from this interpreter's
site-packages through a path line in a ``.pth`` file of the new environment: sys.path then has that environment's
own site-packages first and these after it. A path line is not a site dir, so the ``.pth`` files there (the editable
install's finder of the checkout) are not run: the p2p_diloco imported is the installed one, which the tests check.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

from p2p_diloco.cli.main import build_parser
from tests.integration.conftest import FAST_AVERAGING, LOOPBACK, wait_for_file

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
SDIST_EXTRAS = ["peers/peer.toml", "peers/demo.toml", "peers/compose.toml", "bootstrap/bootstrap.toml",
                "bootstrap/README.md", "bootstrap/p2p-diloco-bootstrap.service"]


def package_files() -> set[str]:
    """Every file of the package folder in the checkout, as a path relative to the checkout (bytecode left out)."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "p2p_diloco").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def clean_env() -> dict[str, str]:
    """This environment without what would put the checkout or another site on the new environment's sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    return {**env, "PYTHONNOUSERSITE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def check_run(args: list, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, args))} exited with {result.returncode}:\n{result.stderr}"
    return result


class Venv:
    """A fresh virtual environment with one artifact (wheel or sdist) of p2p-diloco installed."""

    def __init__(self, folder: Path, artifact: Path) -> None:
        self.folder, self.bin = folder, folder / "bin"
        check_run([sys.executable, "-m", "venv", "--without-pip", folder], cwd=folder.parent)
        self.site = Path(self.python("-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
        host = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
        (self.site / "host-packages.pth").write_text("".join(f"{path}\n" for path in host))
        # this interpreter's pip installs into the new environment; an sdist is built there with the host's
        # setuptools (reached through the .pth), as a user's `pip install p2p_diloco-X.tar.gz` builds it
        check_run([sys.executable, "-m", "pip", "--python", self.bin / "python", "install", "--quiet", "--no-deps",
                   "--no-index", "--no-build-isolation", artifact], cwd=folder.parent, timeout=240)

    def python(self, *args: str) -> str:
        return check_run([self.bin / "python", *args], cwd=self.folder).stdout

    def cli(self, *args: str) -> str:
        return check_run([self.bin / "p2p-diloco", *args], cwd=self.folder).stdout

    def installed_package(self) -> set[str]:
        return {p.relative_to(self.site).as_posix() for p in (self.site / "p2p_diloco").rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """``python -m build`` of the checkout: the sdist, and the wheel built from that sdist."""
    out = tmp_path_factory.mktemp("dist")
    check_run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, ROOT], cwd=out, timeout=240)
    return {"wheel": next(out.glob("p2p_diloco-*.whl")), "sdist": next(out.glob("p2p_diloco-*.tar.gz"))}


@pytest.fixture(scope="module")
def wheel_venv(dist, tmp_path_factory) -> Venv:
    return Venv(tmp_path_factory.mktemp("wheel") / "venv", dist["wheel"])


def test_wheel_and_sdist_carry_every_file_of_the_package(dist):
    assert dist["wheel"].name == f"p2p_diloco-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        wheel_names = set(wheel.namelist())
        entry_points = wheel.read(f"p2p_diloco-{VERSION}.dist-info/entry_points.txt").decode()
    with tarfile.open(dist["sdist"]) as sdist:
        top = f"p2p_diloco-{VERSION}/"
        sdist_names = {m.name.removeprefix(top) for m in sdist.getmembers() if m.isfile()}
    expected = package_files()
    assert {"p2p_diloco/cli/main.py", "p2p_diloco/examples/peer.toml", "p2p_diloco/examples/bootstrap.toml"} <= expected
    assert expected - wheel_names == set(), "package files missing from the wheel (package data?)"
    assert expected - sdist_names == set(), "package files missing from the sdist"
    assert set(SDIST_EXTRAS) - sdist_names == set(), "example configs missing from the sdist"
    assert "p2p-diloco = p2p_diloco.cli.main:run_main" in entry_points


def test_installed_wheel_runs_every_command_from_its_own_files(wheel_venv):
    assert wheel_venv.installed_package() == package_files()
    module = wheel_venv.python("-c", "import p2p_diloco; print(p2p_diloco.__file__)").strip()
    assert Path(module) == wheel_venv.site / "p2p_diloco" / "__init__.py", "p2p_diloco is not the installed one"
    assert not Path(module).resolve().is_relative_to(ROOT)
    assert wheel_venv.cli("--version").strip() == f"p2p-diloco {VERSION}"
    plan = wheel_venv.cli("plan", "--paper")
    assert plan.startswith("Plan: 107,000,000,000 parameters"), plan[:300]
    assert "usage: p2p-diloco" in wheel_venv.cli("--help")
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"peer", "bootstrap", "swarm", "prepare-data", "plan", "status", "export", "generate"} <= set(action.choices)
    for command in action.choices:
        assert f"usage: p2p-diloco {command}" in wheel_venv.cli(command, "--help")


def test_installed_wheel_writes_the_readmes_example_config(wheel_venv):
    """A wheel-only user gets peers/peer.toml, the file the README's commands read, from the package, and the
    installed package's config loader accepts it."""
    assert wheel_venv.cli("config", "--example", "peer") == (ROOT / "peers" / "peer.toml").read_text()
    wheel_venv.cli("config", "--example", "peer", "--out", "peers/peer.toml")
    assert (wheel_venv.folder / "peers" / "peer.toml").read_text() == (ROOT / "peers" / "peer.toml").read_text()
    run_id = wheel_venv.python("-c", "from p2p_diloco.config import load_config; "
                                     "print(load_config('peers/peer.toml').run.run_id)")
    assert run_id.strip() == "p2p-diloco-public"


def test_installed_wheel_runs_a_bootstrap_node_on_hiveminds_p2pd(wheel_venv):
    p2pd = Path(wheel_venv.python("-c", "import importlib.resources as r, hivemind.hivemind_cli as cli; "
                                        "print(r.files(cli) / 'p2pd')").strip())
    assert p2pd.is_file() and os.access(p2pd, os.X_OK), f"hivemind's p2pd daemon is not there: {p2pd}"
    maddrs_file = wheel_venv.folder / "bootstrap.maddrs"
    proc = subprocess.Popen([wheel_venv.bin / "p2p-diloco", "bootstrap", "--host-maddrs", LOOPBACK,
                             "--identity-path", wheel_venv.folder / "bootstrap.id", "--maddrs-file", maddrs_file],
                            cwd=wheel_venv.folder, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        maddrs = wait_for_file(maddrs_file, proc, timeout=120).split()
        assert maddrs and all(m.startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in m for m in maddrs), maddrs
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    assert "--initial-peers " + maddrs[0] in out


def test_sdist_installs_what_the_wheel_installs(dist, wheel_venv, tmp_path):
    sdist_venv = Venv(tmp_path / "venv", dist["sdist"])
    assert sdist_venv.installed_package() == wheel_venv.installed_package()
    assert sdist_venv.cli("--version").strip() == f"p2p-diloco {VERSION}"


# ------------------------------------------------------------------------------------------------ the README's walk

README_ADDRESS = re.compile(r"^/(ip4|dns4)/(203\.0\.113\.\d+|[a-z0-9.-]*example\.org)/")
# what the walk does not run, by the command's first word, and why: the install lines are what the wheel_venv
# fixture does to this very wheel (pip from the registry is not reachable in CI); torchrun needs two machines
# (tests/integration/test_torchrun_cluster.py runs its script on one)
NOT_RUN = {"make": "the Makefile's targets: CI runs make test itself",
           "python3": "a venv and its activation: the wheel_venv fixture makes one",
           "pip": "torch, python -m build and the wheel: the dist and wheel_venv fixtures build and install it",
           "NNODES=2": "torchrun across two machines"}
FAST = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "32", "--data.eval_batches", "2",
        "--train.num_rounds", "1", "--diloco.inner_steps", "5", "--train.progress", "false",
        "--run.num_threads", "1", "--host-maddrs", LOOPBACK, *FAST_AVERAGING]


def readme_lines() -> list[list[str]]:
    """Every command line of README.md's bash blocks, top to bottom, as words (continuations joined)."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        lines += [words for line in block.replace("\\\n", " ").splitlines()
                  if (words := shlex.split(line, comments=True))]
    return lines


def make_llama(path: Path) -> None:
    """/models/my-llama of the README: a bf16 LlamaForCausalLM of 4 blocks with the byte tokenizer."""
    import json

    import torch
    import transformers

    from p2p_diloco.model.hf import byte_tokenizer_json

    config = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(path))
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json()))


class Walk:
    """Runs the README's commands in the wheel's venv, in its folder, as a user would, with these substitutions
    (each a thing of the user's world the test makes for itself): the README's example addresses are the walk's
    own bootstrap node; a listening address is 127.0.0.1; ``/models/my-llama`` and ``my-data.jsonl.gz`` are made
    here; the export's ``runs/swarm-.../peer0`` is the folder the README's Hugging Face peer wrote; ``--serve 8080``
    is any free port. A peer also gets :data:`FAST` after its own options (the tiny preset, one round of 5 steps,
    nobody waited for, the tests' averaging timeouts): the README's peers train a 26M model for 1000 rounds."""

    def __init__(self, venv: Venv):
        self.venv, self.here = venv, venv.folder
        self.maddrs: list[str] = []
        self.background: list[subprocess.Popen] = []
        self.ran: list[str] = []

    def substitute(self, argv: list[str]) -> list[str]:
        out, skip = [], False
        for word in argv:
            if skip:
                skip = False
                continue
            if word == "--announce-maddrs":  # the README's public address: not this machine's
                skip = True
                continue
            if README_ADDRESS.match(word):
                out += [m for m in self.maddrs if m not in out]
                continue
            if word.startswith("/ip4/0.0.0.0/"):
                word = LOOPBACK
            word = {"/models/my-llama": str(self.here / "models" / "my-llama"),
                    "/models/my-llama/tokenizer.json": str(self.here / "models" / "my-llama" / "tokenizer.json"),
                    "runs/swarm-.../peer0": "runs/peer"}.get(word, word)
            out.append(word)
        if out[0] == "status" and "--serve" in out:
            out[out.index("--serve") + 1] = "0"
        if out[0] == "peer":
            fast = FAST if "--model.init_from" not in out else FAST[2:]  # (the folder gives the shape)
            out += [*fast, "--train.wait_for_peers", "1"]
        return out

    def start(self, argv: list[str], ready: str, timeout: float = 120) -> str:
        """Start a long-running command in the background; its output once it has printed ``ready``."""
        log = self.here / f"background-{len(self.background)}.log"
        proc = subprocess.Popen([self.venv.bin / "p2p-diloco", *argv], cwd=self.here, env=clean_env(),
                                stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.background.append(proc)
        deadline = time.monotonic() + timeout
        while ready not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"p2p-diloco {shlex.join(argv)} exited with {proc.returncode} or hung:\n{log.read_text()[-3000:]}"
            time.sleep(0.3)
        time.sleep(0.5)
        return log.read_text()

    def run(self, words: list[str]) -> None:
        argv = self.substitute(words[1:])
        self.ran.append(argv[0])
        started = time.monotonic()
        print(f"README: p2p-diloco {shlex.join(words[1:])}\n  runs as: p2p-diloco {shlex.join(argv)}", flush=True)
        if argv[0] == "bootstrap":
            out = self.start(argv, "--initial-peers ")
            assert re.search(r"--initial-peers /ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", out), out
        elif argv[0] == "status" and "--serve" in argv:
            out = self.start(argv, "(Ctrl-C to stop)")
            url = re.search(r"(http://\S+/)", out).group(1)
            with urllib.request.urlopen(url + "api/status", timeout=10) as response:
                assert response.status == 200
        else:
            result = subprocess.run([self.venv.bin / "p2p-diloco", *argv], cwd=self.here, env=clean_env(),
                                    capture_output=True, text=True, timeout=240)
            assert result.returncode == 0, \
                f"README: p2p-diloco {shlex.join(words[1:])}\nran as: p2p-diloco {shlex.join(argv)}\n" \
                f"exit code {result.returncode}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        print(f"  {time.monotonic() - started:.1f} s", flush=True)

    def stop(self) -> None:
        for proc in self.background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.background:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_every_command_of_the_readme_runs_top_to_bottom_in_the_wheels_venv(wheel_venv):
    """The README walked as a user walks it, in a fresh venv with the wheel installed: every p2p-diloco line of its
    bash blocks, in order, exits 0 (the bootstrap nodes and the status page stay up in the background), with only
    :class:`Walk`'s substitutions. A README command that fails fails here, naming the line. What is not run is
    listed in :data:`NOT_RUN` with the reason, and lines with "..." are fragments of a command (the cluster
    options), whose options ``tests/unit/test_deployment.py`` parses."""
    import gzip
    import json

    walk = Walk(wheel_venv)
    # the public swarm the README's first peer joins: a bootstrap node of the walk's own, whose address stands for
    # every example address of the README
    out = walk.start(["bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", "public.id"], "--initial-peers ")
    walk.maddrs = re.search(r"--initial-peers (.+)", out).group(1).split()
    make_llama(walk.here / "models" / "my-llama")
    texts = [f"Document {i}: " + " ".join(f"word{(i * j) % 97}" for j in range(200)) for i in range(300)]
    with gzip.open(walk.here / "my-data.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    skipped = set()
    try:
        for words in readme_lines():
            if words[0] in NOT_RUN:
                skipped.add(words[0])
            elif words[0] == "p2p-diloco" and "..." not in words:
                walk.run(words)
            elif words[0] != "p2p-diloco":
                raise AssertionError(f"a README line the walk does not know: {shlex.join(words)}")
    finally:
        walk.stop()
    assert skipped == set(NOT_RUN), skipped
    # the README's paths all ran (the count of each: a README that lost one fails here too)
    assert {c: walk.ran.count(c) for c in set(walk.ran)} == {
        "--version": 1, "plan": 2, "config": 1, "peer": 3, "bootstrap": 2, "status": 1, "prepare-data": 1,
        "export": 1, "generate": 1}, walk.ran
    assert (walk.here / "my-model" / "config.json").is_file()
