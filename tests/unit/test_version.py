"""``p2p-diloco --version``: the version from the package metadata, and a clear line where there is none (the
installed command itself is run by tests/integration/test_install.py)."""

from __future__ import annotations

import pytest

import p2p_diloco
from p2p_diloco.cli.main import main


def test_version_is_the_metadatas(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"p2p-diloco {p2p_diloco.installed_version()}\n"
    assert p2p_diloco.__version__ == p2p_diloco.installed_version()


def test_not_installed_says_so(capsys, monkeypatch):
    assert p2p_diloco.installed_version("no-such-distribution-p2p-diloco") is None
    monkeypatch.setattr(p2p_diloco, "installed_version", lambda: None)
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("p2p-diloco: version unknown: the p2p-diloco distribution is not installed"), out
    assert p2p_diloco.__version__ == "0+unknown"
