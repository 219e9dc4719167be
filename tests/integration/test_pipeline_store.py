"""Issue 16 §5: the stages of a local multi-stage peer meet through nothing another machine can reach.

torch's ``TCPStore`` listens on all interfaces even with MASTER_ADDR=127.0.0.1, and the stages' object collectives
unpickle what they receive: our launcher gives the stages a ``FileStore`` in a private directory and binds gloo to
the loopback interface. Two real stage processes are started with the launcher's environment, and every socket they
listen on is checked while their process group is up."""

from __future__ import annotations

import ipaddress
import os
import stat
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from p2p_diloco.config import ConfigError
from p2p_diloco.pipeline.context import STORE_FILE, PipelineContext, launched_as_stage
from p2p_diloco.pipeline.launch import stage_environment

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc")]

STAGE = """
import sys
from p2p_diloco.pipeline.context import PipelineContext
context = PipelineContext.from_environment(2, "cpu", 60)
print(context.all_gather_objects(context.stage_index), flush=True)
sys.stdin.readline()
context.barrier()
context.close()
"""


def listening_addresses(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    addresses = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                # /proc prints each 32-bit word of the address in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                addresses.append(str(ipaddress.ip_address(words)))
    return addresses


def test_local_stages_listen_on_loopback_only_and_meet_through_a_private_file_store():
    with tempfile.TemporaryDirectory(prefix="p2p-diloco-stages-") as folder:  # as run_local_stages makes it
        store_path = Path(folder) / "store"
        stages = [subprocess.Popen([sys.executable, "-c", STAGE], env=stage_environment(j, 2, store_path),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for j in range(2)]
        try:
            assert [stage.stdout.readline().strip() for stage in stages] == ["[0, 1]"] * 2  # the group is up
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and store_path.exists()
            for stage in stages:
                addresses = listening_addresses(stage.pid)
                assert addresses, "gloo listens somewhere: the check would find a store or a pair socket"
                assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses
            for stage in stages:
                stage.stdin.write("\n")
                stage.stdin.flush()
            assert [stage.wait(timeout=60) for stage in stages] == [0, 0]
        finally:
            for stage in stages:
                stage.kill()
                stage.wait()


def test_torch_tcp_store_listens_on_every_interface_whatever_its_host():
    """Why the launcher uses no TCPStore: bound to MASTER_ADDR=127.0.0.1, it still listens on all interfaces."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    wildcard = [a for a in listening_addresses(os.getpid()) if ipaddress.ip_address(a).is_unspecified]
    assert wildcard, listening_addresses(os.getpid())
    del store


def test_a_stage_refuses_a_store_file_others_can_reach(monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    env = stage_environment(0, 2, shared / "store")
    assert "MASTER_ADDR" not in env and "MASTER_PORT" not in env and env["GLOO_SOCKET_IFNAME"] == "lo"
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launched_as_stage() and os.environ[STORE_FILE] == str(shared / "store")
    with pytest.raises(ConfigError, match="must be private to this user"):
        PipelineContext.from_environment(2, "cpu", 5)
