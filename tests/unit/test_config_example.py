"""``p2p-diloco config --example NAME``: a wheel-only user gets the README's example configs from the package, and they
are the repository's files byte for byte (the wheel's own contents: tests/integration/test_install.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2p_diloco.cli.config_example import EXAMPLES, example_text
from p2p_diloco.cli.main import EXIT_USAGE, main
from p2p_diloco.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_the_packaged_example_is_the_repositorys_file(name):
    repo_path, _ = EXAMPLES[name]
    assert example_text(name) == (ROOT / repo_path).read_text(), (
        f"p2p_diloco/examples/{name}.toml differs from {repo_path}: copy the repository's file over it")


def test_every_packaged_example_is_listed():
    assert {p.stem for p in (ROOT / "p2p_diloco" / "examples").glob("*.toml")} == set(EXAMPLES)


@pytest.mark.parametrize("name", ["peer", "bootstrap"])
def test_the_printed_example_is_a_valid_config(name, capsys, tmp_path):
    assert main(["config", "--example", name]) == 0
    printed = capsys.readouterr().out
    assert printed == (ROOT / EXAMPLES[name][0]).read_text()
    path = tmp_path / f"{name}.toml"
    path.write_text(printed)
    cfg = load_config(path)
    if name == "peer":  # the first peer of a new swarm waits for a second one, bounded
        assert cfg.train.wait_for_peers == 2 and cfg.train.wait_for_peers_timeout_s > 0


def test_out_writes_the_file_and_refuses_to_replace_it_without_force(capsys, tmp_path):
    out = tmp_path / "peers" / "peer.toml"  # the README's path, its folder created
    assert main(["config", "--example", "peer", "--out", str(out)]) == 0
    assert out.read_text() == example_text("peer")
    assert load_config(out).run.run_id == "p2p-diloco-public"
    assert main(["config", "--example", "peer", "--out", str(out)]) == 0  # the same text again: nothing to lose
    assert main(["config", "--example", "demo", "--out", str(out)]) == EXIT_USAGE  # another example would replace it
    out.write_text("# my edits\n")
    assert main(["config", "--example", "peer", "--out", str(out)]) == EXIT_USAGE
    assert "--force" in capsys.readouterr().err
    assert out.read_text() == "# my edits\n"
    assert main(["config", "--example", "peer", "--out", str(out), "--force"]) == 0
    assert out.read_text() == example_text("peer")
    assert main(["config", "--example", "peer", "--out", str(tmp_path)]) == EXIT_USAGE  # a folder, not a file


def test_without_an_example_it_lists_them(capsys):
    assert main(["config"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in EXAMPLES)
