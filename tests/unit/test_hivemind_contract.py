"""Contracts of the hivemind internals the averager relies on (hivemind 1.1.12), one test per hook."""

from __future__ import annotations

import asyncio

from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID

from p2p_diloco.swarm.guard import keep_round_key

ME, OTHER = PeerID(b"\x00" * 34), PeerID(b"\x01" * 34)


class _Dht:
    peer_id = ME


def _groups() -> list[GroupInfo]:
    """Two groups this peer was in, at different ranks."""
    return [GroupInfo(group_id=b"first", peer_ids=(ME, OTHER), gathered=(b"", b"")),
            GroupInfo(group_id=b"second", peer_ids=(OTHER, ME), gathered=(b"", b""))]


def test_hivemind_moves_the_group_key_after_every_assembled_group_and_keep_round_key_stops_it():
    """Why the averager keeps the round's key: hivemind rewrites it after each group (a failed all-reduce's
    survivors would then look for each other under different keys); with keep_round_key it stays."""
    round_key = "run_s0of1.0b" + "0" * 16
    moved = GroupKeyManager(_Dht(), "run_s0of1", "0" * 16, target_group_size=4)
    for group in _groups():
        asyncio.run(moved.update_key_on_group_assembled(group))
    assert moved.current_key != round_key  # the hook's reason: if hivemind stops doing this, the hook can go

    kept = GroupKeyManager(_Dht(), "run_s0of1", "0" * 16, target_group_size=4)
    keep_round_key(kept)
    keep_round_key(kept)  # idempotent
    for group in _groups():
        asyncio.run(kept.update_key_on_group_assembled(group))
    assert kept.current_key == round_key
    kept.group_bits = "1" * 16  # the next round's key is still set as before
    assert kept.current_key == "run_s0of1.0b" + "1" * 16
