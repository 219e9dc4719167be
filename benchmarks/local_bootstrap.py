"""Starting a p2p-diloco bootstrap node for a benchmark's swarm (shared by the benchmark scripts)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def start_bootstrap(root: Path, host: str = "127.0.0.1", log=subprocess.DEVNULL, popen=subprocess.Popen,
                    timeout_s: float = 60.0, **popen_kwargs) -> tuple[subprocess.Popen, list[str]]:
    """A bootstrap node with its identity and maddrs file in ``root``; returns it and its multiaddrs once it
    listens. ``popen`` runs the command (an emulated host's launcher, for example)."""
    maddrs_file = root / "bootstrap.maddrs"
    proc = popen([sys.executable, "-m", "p2p_diloco", "bootstrap", "--host-maddrs", f"/ip4/{host}/tcp/0",
                  "--identity-path", str(root / "bootstrap.id"), "--maddrs-file", str(maddrs_file)],
                 stdout=log, stderr=subprocess.STDOUT, **popen_kwargs)
    deadline = time.monotonic() + timeout_s
    while not (maddrs_file.exists() and maddrs_file.read_text().strip()):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the bootstrap node in {root} did not start")
        time.sleep(0.2)
    return proc, maddrs_file.read_text().split()
