"""Identity files and their lock: created 0600, bad ones refused without being touched, one node per identity on
a machine. Files only, no network."""

from __future__ import annotations

import multiprocessing as mp
import stat

import pytest

from p2p_diloco.swarm import SwarmError, ensure_identity
from p2p_diloco.swarm.discovery.identity import IdentityLock


def test_created_0600_and_reused(tmp_path):
    path = tmp_path / "node.id"
    peer_id, created = ensure_identity(path)
    assert created and stat.S_IMODE(path.stat().st_mode) == 0o600
    again, created_again = ensure_identity(path)
    assert (again, created_again) == (peer_id, False)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_readable_by_others_is_refused_with_the_chmod_to_run(tmp_path, mode):
    path = tmp_path / "node.id"
    ensure_identity(path)
    path.chmod(mode)
    before = path.read_bytes()
    with pytest.raises(SwarmError, match=f"run `chmod 600 {path}`"):
        ensure_identity(path)
    assert path.read_bytes() == before and stat.S_IMODE(path.stat().st_mode) == mode


def test_garbage_is_refused_and_never_overwritten(tmp_path):
    path = tmp_path / "node.id"
    path.write_bytes(b"\x00not a key")
    path.chmod(0o600)
    with pytest.raises(SwarmError, match="does not hold a libp2p private key"):
        ensure_identity(path)
    assert path.read_bytes() == b"\x00not a key"


def test_missing_folder_is_an_error_not_created(tmp_path):
    path = tmp_path / "no" / "such" / "node.id"
    with pytest.raises(SwarmError, match=r"folder .*/no/such does not exist; create it \(mkdir -p "):
        ensure_identity(path)
    assert not (tmp_path / "no").exists()


def test_lock_refuses_a_second_holder_until_released(tmp_path):
    path = tmp_path / "node.id"
    first = IdentityLock(path)
    with pytest.raises(SwarmError, match=r"in use by another running node on this machine \(pid \d+"):
        IdentityLock(path)  # flock locks belong to open files: a second open in this process conflicts too
    first.release()
    IdentityLock(path).release()


def _hold_and_die(path, ready) -> None:
    IdentityLock(path)
    ready.set()
    import os

    os._exit(0)  # no release: the kernel drops the lock with the process


def test_lock_of_a_dead_process_is_free(tmp_path):
    path = tmp_path / "node.id"
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_and_die, args=(path, ready))
    holder.start()
    holder.join(timeout=30)
    assert ready.is_set() and holder.exitcode == 0
    assert (tmp_path / "node.id.lock").exists()  # the stale file does not matter
    IdentityLock(path).release()


def test_a_link_planted_at_the_lock_name_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    (tmp_path / "id.key.lock").symlink_to(victim)
    with pytest.raises(SwarmError, match="is a symbolic link"):
        IdentityLock(tmp_path / "id.key")
    assert victim.read_text() == "keep me\n"


def test_the_bootstrap_maddrs_file_is_written_through_an_unpredictable_name(tmp_path):
    from p2p_diloco.cli.bootstrap import _write_atomically

    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    (tmp_path / ".bootstrap.maddrs.tmp").symlink_to(victim)  # the name the old code wrote through
    _write_atomically(tmp_path / "bootstrap.maddrs", "/ip4/127.0.0.1/tcp/1/p2p/QmX\n")
    assert (tmp_path / "bootstrap.maddrs").read_text() == "/ip4/127.0.0.1/tcp/1/p2p/QmX\n"
    assert victim.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".bootstrap.maddrs.tmp", "bootstrap.maddrs", "precious.txt"]
