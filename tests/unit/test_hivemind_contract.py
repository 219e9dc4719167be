"""Contracts of the hivemind internals the averager relies on (hivemind 1.1.12), one test per hook."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID

from p2p_diloco.swarm.averaging.guard import keep_round_key
from p2p_diloco.swarm.averaging.hivemind_api import (
    HIVEMIND_BASES,
    REPLACED,
    SUPPORTED_VERSION,
    DecentralizedAverager,
    check_version,
)

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


def _positional(function) -> list[str]:
    """Positional parameter names (a leading underscore, hivemind's "unused", ignored): we pass them by position."""
    return [p.name.lstrip("_") for p in inspect.signature(function).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _kind(function) -> str:
    return "async generator" if inspect.isasyncgenfunction(function) else \
        "coroutine" if inspect.iscoroutinefunction(function) else "function"


def _our_overrides() -> list[tuple[type, str, type]]:
    """(our class, method, the hivemind class it overrides it in) for every method our averaging redefines."""
    from p2p_diloco.swarm.averaging import allreduce, averager, guard

    found = []
    for module in (averager, allreduce, guard):
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            bases = [b for b in (*cls.__mro__[1:], *HIVEMIND_BASES) if b.__module__.startswith("hivemind")]
            if cls is guard.GuardedAverager:  # a mixin of hivemind's DecentralizedAverager
                bases = [DecentralizedAverager]
            elif not issubclass(cls, HIVEMIND_BASES):
                continue
            for name, member in vars(cls).items():
                base = next((b for b in bases if name in vars(b)), None)
                if callable(member) and base is not None and name not in ("__init__", "run"):
                    found.append((cls, name, base))
    return found


def test_every_method_our_averaging_overrides_exists_in_hivemind_with_the_same_parameters():
    overrides = _our_overrides()
    names = {(ours.__name__, name) for ours, name, _ in overrides}
    # the walk finds the hooks it must (a walk that found nothing would pass anything)
    assert {("PseudoGradientAverager", "_aggregate_with_group"), ("ExactAllReduceRunner", "rpc_aggregate_part"),
            ("RobustPartReducer", "accumulate_part"), ("GuardedAverager", "_step")} <= names, names
    for ours, name, base in overrides:
        theirs = vars(base)[name]
        mine = vars(ours)[name]
        assert _kind(mine) == _kind(theirs), (ours.__name__, name, base.__name__)
        assert _positional(mine) == _positional(theirs)[:len(_positional(mine))], (ours.__name__, name)


def test_every_method_our_averaging_replaces_exists_in_hivemind_with_the_parameters_it_is_called_with():
    for (cls, name), parameters in REPLACED.items():
        assert hasattr(cls, name), (cls.__name__, name)
        assert tuple(inspect.signature(getattr(cls, name)).parameters) == parameters, (cls.__name__, name)


def test_another_hivemind_version_is_refused_with_the_one_to_install():
    check_version(SUPPORTED_VERSION)
    with pytest.raises(ImportError, match=f"pip install hivemind=={SUPPORTED_VERSION}"):
        check_version("1.2.0")


def test_only_the_adapter_imports_hivemind_internals():
    """hivemind's averaging, its asyncio helpers, averaging protobufs and P2P contexts are reached through
    p2p_diloco/swarm/averaging/hivemind_api.py only."""
    internal = ("hivemind.averaging", "hivemind.utils.asyncio", "hivemind.utils.mpfuture")
    internal_names = {"averaging_pb2", "P2PContext", "MPFuture"}
    package = Path(__file__).resolve().parents[2] / "p2p_diloco"
    offenders = []
    for path in package.rglob("*.py"):
        if path.name == "hivemind_api.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hivemind") and (
                    node.module.startswith(internal) or internal_names & {a.name for a in node.names}):
                offenders.append(f"{path.relative_to(package)}: from {node.module} import ...")
    assert not offenders, offenders
