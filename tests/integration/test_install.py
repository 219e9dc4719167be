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
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from p2p_diloco.cli.main import build_parser
from tests.integration.conftest import LOOPBACK, wait_for_file

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
