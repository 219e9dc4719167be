"""Contracts of the hivemind internals the project relies on (hivemind 1.1.12): every patch of
:data:`~p2p_diloco.hivemind_adapter.registry.PATCHES`, every method replaced or called, every private attribute and
every subclassed hivemind class, one test per hook; and that nothing outside the adapter package imports hivemind
or names one of its private attributes."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import logging
import re
import subprocess
from contextvars import ContextVar
from pathlib import Path
from types import SimpleNamespace

import hivemind
import pytest
import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID

from p2p_diloco.hivemind_adapter import SUPPORTED_VERSION, check_version
from p2p_diloco.hivemind_adapter.averaging import DecentralizedAverager, Matchmaking, keep_round_key
from p2p_diloco.hivemind_adapter.p2p import BEHIND_NAT_FLAGS, P2P, behind_nat_mode
from p2p_diloco.hivemind_adapter.registry import ATTRIBUTES, CALLED, HIVEMIND_BASES, PATCHES, REPLACED
from tests.unit.bare import bare

ADAPTER = Path(__file__).resolve().parents[2] / "p2p_diloco" / "hivemind_adapter"
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
    """(our class, method, the hivemind class it overrides it in) for every method our subclasses of hivemind's
    classes (:data:`HIVEMIND_BASES`: the averaging, the DHT, its stores and validators) redefine."""
    from p2p_diloco.swarm.averaging import allreduce, averager, guard, server, slices
    from p2p_diloco.swarm.discovery import averager_keys, dht, records, storage_budget

    found = []
    for module in (averager, server, allreduce, slices, guard, dht, storage_budget, records, averager_keys):
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            bases = [b for b in (*cls.__mro__[1:], *HIVEMIND_BASES) if b.__module__.startswith("hivemind")]
            if not issubclass(cls, HIVEMIND_BASES):
                continue
            for name, member in vars(cls).items():
                base = next((b for b in bases if name in vars(b)), None)
                # classes are not hooks: hivemind caches a servicer's stub type on the class (_stub_type)
                if callable(member) and not inspect.isclass(member) and base is not None \
                        and name not in ("__init__", "run"):
                    found.append((cls, name, base))
    return found


def test_every_method_our_subclasses_override_exists_in_hivemind_with_the_same_parameters():
    overrides = _our_overrides()
    names = {(ours.__name__, name) for ours, name, _ in overrides}
    # the walk finds the hooks it must (a walk that found nothing would pass anything)
    assert {("AveragingServer", "_aggregate_with_group"), ("ExactAllReduceRunner", "rpc_aggregate_part"),
            ("RobustPartReducer", "accumulate_part"), ("AveragingServer", "_step"), ("BoundedStorage", "store"),
            ("BoundedStorage", "store_subkey"), ("_DHT", "shutdown"), ("SignatureValidator", "validate")} <= names, \
        names
    for ours, name, base in overrides:
        theirs = vars(base)[name]
        mine = vars(ours)[name]
        assert _kind(mine) == _kind(theirs), (ours.__name__, name, base.__name__)
        assert _positional(mine) == _positional(theirs)[:len(_positional(mine))], (ours.__name__, name)


def test_every_method_we_replace_or_call_exists_in_hivemind_with_the_parameters_it_is_called_with():
    for (cls, name), parameters in (REPLACED | CALLED).items():
        assert hasattr(cls, name), (cls.__name__, name)
        assert tuple(inspect.signature(getattr(cls, name)).parameters) == parameters, (cls.__name__, name)


def test_every_private_attribute_we_use_is_one_hivemind_sets():
    """Each private attribute of :data:`ATTRIBUTES` is assigned in its hivemind class (a renamed one would make the
    adapter's accessor raise AttributeError deep in a round)."""
    for (cls, name), _what in ATTRIBUTES.items():
        if name in vars(cls):  # a method (replaced on instances: REPLACED checks its parameters)
            continue
        source = inspect.getsource(cls)
        assert re.search(rf"self\.{name}\b[^=\n]*=[^=]", source), (cls.__name__, name)


def test_every_patch_is_applied_from_the_adapter_and_covered_by_a_contract_test_here():
    """:data:`PATCHES` is the whole list: each patch is a function of the adapter package, and each has the tests of
    this file that check the hivemind internals it relies on (a patch added without one fails here)."""
    covered = {
        "cap_received_messages": ["test_hivemind_buffers_the_length_a_peer_declares_so_the_message_cap_replaces_its_"
                                  "reader"],
        "behind_nat_mode": ["test_a_reachability_mode_added_to_hiveminds_table_starts_the_daemon_with_its_flags"],
        "swap_store_class": ["test_a_bounded_store_keeps_the_parameters_and_the_layout_of_hiveminds",
                             "test_a_node_makes_its_two_stores_once_so_a_class_swap_in_place_bounds_them"],
        "name_store_senders": [
            "test_a_dht_node_serves_store_requests_through_the_handler_that_storage_budget_wraps_to_name_the_sender",
            "test_the_wrapped_store_handler_names_the_sender_to_the_stores_it_makes_and_only_to_them"],
        "quiet_vanished_senders": [
            "test_hivemind_logs_a_vanished_senders_traceback_in_the_dht_loop_and_the_filter_drops_it"],
        "wrap_join_request": [
            "test_the_matchmaking_swaps_replace_hiveminds_methods_on_the_instance_only",
            "test_hivemind_relays_the_records_through_the_leader_and_forgets_it_so_a_follower_notes_both",
            "test_guarded_matchmaking_hands_back_the_group_under_its_view_id_with_its_origin"],
        "replace_group_assembly": [
            "test_the_matchmaking_swaps_replace_hiveminds_methods_on_the_instance_only",
            "test_hivemind_relays_the_records_through_the_leader_and_forgets_it_so_a_follower_notes_both",
            "test_guarded_matchmaking_hands_back_the_group_under_its_view_id_with_its_origin"],
        "keep_round_key": ["test_hivemind_moves_the_group_key_after_every_assembled_group_and_keep_round_key_stops_it"],
    }
    assert set(covered) == set(PATCHES)
    for name, patch in PATCHES.items():
        assert patch.apply.__module__.startswith("p2p_diloco.hivemind_adapter."), name
        assert patch.scope in ("process", "instance") and patch.target and patch.why, name
        assert all(callable(globals().get(test)) for test in covered[name]), (name, covered[name])


def _private_names() -> set[str]:
    """The private names of hivemind the adapter lists (attributes read or written, methods replaced or called)."""
    return {name for _cls, name in (*ATTRIBUTES, *REPLACED, *CALLED) if name.startswith("_")}


def test_no_private_hivemind_name_is_used_outside_the_adapter():
    """The private names of hivemind that the adapter lists appear nowhere else in the package, and no other module
    swaps an object's class or replaces a hivemind method (:data:`REPLACED`) on an object: everything reaches them
    through p2p_diloco/hivemind_adapter/."""
    private, replaced = _private_names(), {name for _cls, name in REPLACED}
    assert {"_running_groups", "_matchmaking", "_ban_sender", "_request_join_group", "_validators", "_client",
            "_private_key", "__setstate__", "_data_for_gather"} <= private
    offenders = []
    for where, node in _nodes_outside_the_adapter():
        named = node.attr if isinstance(node, ast.Attribute) else \
            node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
        if named in private:
            offenders.append(f"{where}:{node.lineno}: {named}")
        for target in node.targets if isinstance(node, ast.Assign) else ():
            if isinstance(target, ast.Attribute) and target.attr == "__class__":
                offenders.append(f"{where}:{node.lineno}: __class__ swapped")
            elif isinstance(target, ast.Attribute) and target.attr in replaced:
                offenders.append(f"{where}:{node.lineno}: {target.attr}: a hivemind method swapped on an object")
    assert not offenders, offenders


def _nodes_outside_the_adapter():
    """(file, AST node) of every module of the package but those of the adapter package."""
    package = ADAPTER.parent
    for path in sorted(package.rglob("*.py")):
        if ADAPTER not in path.parents:
            yield from ((path.relative_to(package), node) for node in ast.walk(ast.parse(path.read_text())))


def test_the_walk_of_the_package_sees_its_modules_and_skips_the_adapter():
    files = {str(where) for where, node in _nodes_outside_the_adapter() if isinstance(node, ast.Module)}
    assert {"swarm/discovery/dht.py", "swarm/averaging/server.py", "compression/codecs.py"} <= files
    assert not any(f.startswith("hivemind_adapter/") for f in files)


def test_another_hivemind_version_is_refused_with_the_one_to_install():
    check_version(SUPPORTED_VERSION)
    with pytest.raises(ImportError, match=f"pip install hivemind=={SUPPORTED_VERSION}"):
        check_version("1.2.0")


def test_only_the_adapter_imports_hivemind():
    """No module of the package outside p2p_diloco/hivemind_adapter/ imports hivemind, public names included: they
    are re-exported by the adapter."""
    offenders = []
    for where, node in _nodes_outside_the_adapter():
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        offenders += [f"{where}:{node.lineno}: import {name}" for name in names
                      if name == "hivemind" or name.startswith("hivemind.")]
    assert not offenders, offenders


def _source(function) -> str:
    """A function's source with whitespace collapsed (hivemind's line breaks are not part of the contract)."""
    return " ".join(inspect.getsource(function).split())


def test_hivemind_relays_the_records_through_the_leader_and_forgets_it_so_a_follower_notes_both():
    """Why GroupViews exists: the leader builds every record from what each follower sent it (its own from its step)
    and relays them all unchecked; a follower's group is assembled by follower_assemble_group(leader, message), and
    hivemind resets current_leader before the group is averaged; the group that _step averages, and registers its
    all-reduce under, is the one look_for_group(step) returned."""
    assert "self.step_control.data_for_gather if peer_id == self.peer_id else " \
           "self.current_followers[peer_id].gather" in _source(Matchmaking.leader_assemble_group)
    assert "gathered=group_info.gathered" in _source(Matchmaking.rpc_join_group)
    join = _source(Matchmaking._request_join_group)
    assert "gather=self.step_control.data_for_gather" in join
    assert "return await self.follower_assemble_group(leader, message)" in join
    assert "finally: self.was_accepted_to_group.clear() self.current_leader = None" in join
    step = _source(DecentralizedAverager._step)
    assert "group_info = await self._matchmaking.look_for_group(step)" in step
    assert "with self._register_allreduce_group(group_info):" in step
    assert "self._aggregate_with_group( group_info," in step
    assert dataclasses.replace(_groups()[0], group_id=b"view").gathered == (b"", b"")  # a dataclass, replaceable


def test_hivemind_holds_parts_for_an_unknown_group_so_guarded_averagers_refuse_foreign_views_at_once():
    """Why AveragingServer overrides rpc_aggregate_part: hivemind holds a part whose group is not registered until
    this peer registers its next group (the sender would wait out its timeout and see a stall), and lets one sender's
    timeout end every other sender's stream."""
    source = _source(DecentralizedAverager.rpc_aggregate_part)
    assert "if request.group_id not in self._running_groups:" in source
    assert "await self._pending_groups_registered.wait()" in source
    # every sender's handler awaits the one future that registers the group's all-reduce: a handler cancelled when
    # its sender gives up cancels it for all (why ours shields it); the routing is otherwise as ours
    assert "group = await future" in source
    assert "group.rpc_aggregate_part(achain(as_aiter(request), stream), context)" in source


def test_a_follower_that_gave_up_on_its_leader_follows_nobody_and_keeps_looking():
    """What AveragingServer._await_registered reads: a follower sets current_leader when its leader accepts it and
    clears it when it gives up (a timeout) or is done, a leader's group is its assembled_group future, each request
    is bounded by request_timeout, and the averager clears _pending_groups_registered while it looks for a group."""
    join = _source(Matchmaking._request_join_group)
    assert "self.current_leader = leader" in join and "except asyncio.TimeoutError:" in join
    assert "message = await asyncio.wait_for(anext(stream), timeout=self.request_timeout)" in join
    assert "self.assembled_group.set_result(group_info)" in _source(Matchmaking.leader_assemble_group)
    assert "self.assembled_group = asyncio.Future()" in _source(Matchmaking.look_for_group)
    step = _source(DecentralizedAverager._step)
    assert "self._pending_groups_registered.clear()" in step


class _Matchmaking:
    """hivemind's Matchmaking as far as the hooks go: a follower's group comes from follower_assemble_group, called
    through self, inside _request_join_group, inside look_for_group."""

    def __init__(self, leader, gathered):
        self.leader, self.gathered = leader, gathered

    async def look_for_group(self, step):
        return await self._request_join_group(self.leader) if self.leader is not None else \
            GroupInfo(b"led", (ME, OTHER), self.gathered)

    async def _request_join_group(self, leader):
        message = SimpleNamespace(group_id=b"followed", ordered_peer_ids=[ME.to_bytes(), OTHER.to_bytes()],
                                  gathered=self.gathered)  # as the leader's protobuf message holds them
        return await self.follower_assemble_group(leader, message)

    async def follower_assemble_group(self, leader, msg):
        return GroupInfo(msg.group_id, tuple(PeerID(p) for p in msg.ordered_peer_ids), tuple(msg.gathered))


@pytest.mark.parametrize("leader", [OTHER, None])
def test_guarded_matchmaking_hands_back_the_group_under_its_view_id_with_its_origin(leader):
    from p2p_diloco.swarm.averaging.guard import GroupOrigin, PeerGuard, view_digest
    from p2p_diloco.swarm.averaging.server import AveragingServer

    averager = bare(AveragingServer)  # its matchmaking alone
    averager.guard, averager.dht = PeerGuard(ban_after=3), SimpleNamespace(peer_id=ME)
    averager.buffered_round = torch.full((1,), -1)  # averaging no round
    averager._matchmaking = _Matchmaking(leader, (b"mine", b"theirs"))
    averager._guard_matchmaking()
    averager._guard_matchmaking()  # idempotent
    step = SimpleNamespace(data_for_gather=b"mine")
    group = asyncio.run(averager._matchmaking.look_for_group(step))
    raw = b"followed" if leader is not None else b"led"
    assert group.group_id == raw + view_digest((ME, OTHER), (b"mine", b"theirs"))
    assert averager.group_views.origin(group.group_id) == GroupOrigin(leader or ME, b"mine")


def test_the_matchmaking_swaps_replace_hiveminds_methods_on_the_instance_only():
    """wrap_join_request and replace_group_assembly set the replacement on the Matchmaking object (hivemind looks
    each method up on self at every call: _request_join_group in look_for_group, follower_assemble_group in
    _request_join_group), once; the class keeps hivemind's."""
    from p2p_diloco.hivemind_adapter.averaging import replace_group_assembly, wrap_join_request

    assert "group = await self._request_join_group(next_leader)" in _source(Matchmaking._request_join_potential_leaders)
    matchmaking, calls = _Matchmaking(OTHER, (b"mine", b"theirs")), []

    def wrap(original):
        async def join(leader):
            calls.append(leader)
            return await original(leader)
        return join

    assert wrap_join_request(matchmaking, wrap) and not wrap_join_request(matchmaking, wrap)  # once

    async def assemble(leader, msg):
        return "assembled"

    async def look(step):
        return await matchmaking._request_join_group(OTHER)

    replace_group_assembly(matchmaking, assemble, look)
    assert asyncio.run(matchmaking.look_for_group(None)) == "assembled" and calls == [OTHER]
    assert {"_request_join_group", "follower_assemble_group", "look_for_group"} <= set(vars(matchmaking))
    assert vars(_Matchmaking)["look_for_group"] is not look and "_request_join_group" in vars(_Matchmaking)


def test_hivemind_buffers_the_length_a_peer_declares_so_the_message_cap_replaces_its_reader():
    """Why cap_received_messages (installed by limits.install_message_cap) replaces P2P.receive_raw_data: hivemind
    reads an 8-byte length header and then that many bytes, whatever the length; every protobuf message of a stream
    is read through P2P.receive_raw_data, looked up on the class at each call (so replacing it there covers every
    stream of the process). Our copy reads the header as hivemind does, and refuses a length above the cap before
    reading on."""
    from p2p_diloco.hivemind_adapter.p2p import MessageTooLargeError, cap_received_messages
    from p2p_diloco.swarm.averaging.limits import MAX_MESSAGE_BYTES, install_message_cap

    install_message_cap()
    installed = P2P.receive_raw_data
    cap_received_messages(MAX_MESSAGE_BYTES)  # idempotent
    assert P2P.receive_raw_data is installed and installed.message_cap
    theirs = installed.__wrapped__
    source = _source(theirs)
    assert "header = await reader.readexactly(P2P.HEADER_LEN)" in source
    assert "content_length = int.from_bytes(header, P2P.BYTEORDER)" in source
    assert "data = await reader.readexactly(content_length)" in source
    assert _source(P2P.receive_protobuf).count("await P2P.receive_raw_data(reader)") == 2
    assert (P2P.HEADER_LEN, P2P.BYTEORDER) == (8, "big")

    async def receive(function):
        reader = asyncio.StreamReader()
        reader.feed_data((2**40).to_bytes(8, "big") + b"\x00" * 1024)  # a header declaring 1 TiB, then 1 KiB
        return await asyncio.wait_for(function(reader), timeout=1)

    with pytest.raises(asyncio.TimeoutError):  # hivemind waits to buffer all of it
        asyncio.run(receive(theirs))
    with pytest.raises(MessageTooLargeError):  # ours refuses at once
        asyncio.run(receive(installed))


def test_hivemind_signals_a_cancel_before_the_step_reads_cancelled_so_cancel_step_marks_it_first():
    """hivemind's StepControl.cancel() sends the cancel's signal before the step reads as cancelled, and the averager
    process decides on step.cancelled() when the signal arrives: the window a descheduled training process left a
    cancelled step matching in. cancel_step marks the step first; the signal is still sent, once."""
    from hivemind.averaging.control import StepControl

    from p2p_diloco.hivemind_adapter.averaging import MPFuture, cancel_step

    def step_seen_at_signal(cancel) -> list[bool]:
        trigger, signal = MPFuture(), MPFuture()  # (first: a StepControl cannot start hivemind's MPFuture backend)
        control = StepControl(scheduled_time=0.0, deadline=float("inf"), allow_retries=True, weight=1.0,
                              data_for_gather=b"")
        control.attach(trigger, signal)
        seen = []
        original = signal.set_result
        signal.set_result = lambda result: (seen.append(control.cancelled()), original(result))
        cancel(control)
        assert control.cancelled() and signal.done() and trigger.cancelled()
        return seen

    assert step_seen_at_signal(StepControl.cancel) == [False]  # hivemind's order: the window is there
    assert step_seen_at_signal(cancel_step) == [True]  # ours: cancelled before the signal, which is sent once


def test_set_data_for_gather_changes_what_a_step_gathers():
    """A hostile test peer's record is made in the averager process (a record of MiBs does not cross hivemind's pipe
    from the training process): hivemind's StepControl keeps it in _data_for_gather, read by data_for_gather."""
    from hivemind.averaging.control import StepControl

    from p2p_diloco.hivemind_adapter.averaging import MPFuture, set_data_for_gather

    MPFuture()  # (first: a StepControl cannot start hivemind's MPFuture backend, and a test alone has none yet)
    control = StepControl(scheduled_time=0.0, deadline=float("inf"), allow_retries=True, weight=1.0,
                          data_for_gather=b"sent")
    set_data_for_gather(control, b"replaced")
    assert control.data_for_gather == b"replaced"
    control.attach(trigger := MPFuture(), cancel := MPFuture())  # (a step let go: nothing for its __del__ to raise)
    trigger.set_result(None), cancel.set_result(None)


def test_a_reachability_mode_added_to_hiveminds_table_starts_the_daemon_with_its_flags():
    """behind_nat_mode (a peer with --use-auto-relay): hivemind's P2P.create gives the daemon the flags of the
    force_reachability mode it is passed, read from its table, and the relays as trustedRelays; the daemon hivemind
    ships knows both flags (a flag it does not know stops it at start)."""
    mode = behind_nat_mode()
    assert behind_nat_mode() == mode and P2P.FORCE_REACHABILITY_MAPPING[mode] == BEHIND_NAT_FLAGS
    source = _source(P2P.create)
    assert "process_kwargs.update(cls.FORCE_REACHABILITY_MAPPING.get(force_reachability, {}))" in source
    assert '("trustedRelays", trusted_relays)' in source and "**process_kwargs" in source
    args = P2P._make_process_args("p2pd", **BEHIND_NAT_FLAGS)
    assert {"-forceReachabilityPrivate=1", "-relayDiscovery=0"} <= set(args), args
    daemon = Path(hivemind.__file__).parent / "hivemind_cli" / "p2pd"
    usage = subprocess.run([str(daemon), "-h"], capture_output=True, text=True, timeout=30)
    assert all(f"-{flag}" in usage.stdout + usage.stderr for flag in (*BEHIND_NAT_FLAGS, "trustedRelays"))


def test_hivemind_shuts_down_on_the_futures_of_running_groups_so_the_server_finalizes_their_runners():
    """hivemind's DecentralizedAverager._shutdown calls finalize() on each running group's future, not on its runner:
    an AttributeError traceback whenever a peer stops with a group registered. AveragingServer._shutdown cancels the
    runner a done future holds and passes over the futures still waiting for theirs."""
    from p2p_diloco.swarm.averaging.server import AveragingServer

    class Runner:
        cancelled = False

        def finalize(self, *, cancel: bool = False) -> None:
            self.cancelled = cancel

    async def shut_down(method) -> bool:
        runner, running, waiting = Runner(), asyncio.Future(), asyncio.Future()
        running.set_result(runner)
        averager = SimpleNamespace(client_mode=True, _running_groups={b"g": running, b"g.P": waiting})
        await method(averager, 1.0)
        return runner.cancelled

    with pytest.raises(AttributeError, match="finalize"):
        asyncio.run(shut_down(DecentralizedAverager._shutdown))
    assert asyncio.run(shut_down(AveragingServer._shutdown))


def test_hivemind_keeps_the_last_state_served_until_the_next_request_so_a_state_host_answers_instead():
    """Why the averager hands its state over through :class:`StateHost`: hivemind's thread in the training process
    keeps the state it served in its locals (and the result of its future) until the next request arrives."""
    from hivemind.averaging import averager

    loop = _source(averager._background_thread_fetch_current_state)
    assert "trigger, future = pipe.recv()" in loop
    assert "future.set_result((state_metadata, state_tensors, tensor_infos))" in loop
    assert "del state_tensors" not in loop and "del future" not in loop  # if hivemind drops them, the hook can go
    assert "_background_thread_fetch_current_state" in _source(DecentralizedAverager.__init__)
    assert "self._get_current_state_from_host_process()" in _source(DecentralizedAverager.rpc_download_state)


def test_a_dht_node_serves_store_requests_through_the_handler_that_storage_budget_wraps_to_name_the_sender():
    """Why name_store_senders (called by storage_budget) wraps the entry of the daemon client's table of unary
    handlers named ``DHTProtocol.rpc_store``: hivemind registers the node's rpc_store there (bound when the node
    starts, so a class swap cannot reach it), the client calls it with the request and the sender's peer id from the
    daemon, and rpc_store makes its stores within that call, through the node's storage or cache."""
    from hivemind.dht.node import DHTNode
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
    from hivemind.p2p.p2p_daemon_bindings.p2pclient import Client

    from p2p_diloco.hivemind_adapter.dht import STORE_HANDLER

    assert DHTProtocol._get_handle_name(None, "rpc_store") == STORE_HANDLER
    assert "await self.add_p2p_handlers(self.p2p, AuthRPCWrapper(self, AuthRole.SERVICER, self.authorizer))" \
        in _source(DHTProtocol.create)
    unary = _source(P2P._add_protobuf_unary_handler)
    assert "async def _unary_handler(request: bytes, remote_id: PeerID) -> bytes:" in unary
    assert "await self._client.add_unary_handler(handle_name, _unary_handler, balanced=balanced)" in unary
    assert "await self.control.add_unary_handler(proto, handler, balanced=balanced)" \
        in _source(Client.add_unary_handler)
    assert "self.unary_handlers[proto] = handler" in _source(ControlClient.add_unary_handler)
    served = _source(ControlClient._handle_persistent_request)
    assert "remote_id = PeerID(request.peer)" in served
    assert "await self.unary_handlers[request.proto](request.data, remote_id)" in served
    store = _source(DHTProtocol.rpc_store)
    assert "storage = self.cache if in_cache else self.storage" in store
    assert "storage.store_subkey(key_id, subkey, item.value, item.expiration_time)" in store
    assert "storage.store(key_id, value_bytes, expiration_time)" in store
    assert "storage.store_subkey(key_id, subkey, value_bytes, expiration_time)" in store
    # a node's own stores (its processes' declarations and records, when it is among the nearest) skip the handler:
    # they are charged to the node itself
    assert "self.protocol.storage.store( key_id, record.value, record.expiration_time, subkey=subkey )" \
        in _source(DHTNode.store_many)


def test_the_wrapped_store_handler_names_the_sender_to_the_stores_it_makes_and_only_to_them():
    from p2p_diloco.hivemind_adapter.dht import STORE_HANDLER, name_store_senders

    sender: ContextVar = ContextVar("sender", default=None)
    seen = []

    async def theirs(request: bytes, remote_id) -> bytes:
        seen.append(sender.get())
        return request

    p2p = SimpleNamespace(_client=SimpleNamespace(control=SimpleNamespace(unary_handlers={STORE_HANDLER: theirs})))
    name_store_senders(p2p, sender)
    wrapped = p2p._client.control.unary_handlers[STORE_HANDLER]
    name_store_senders(p2p, sender)  # idempotent
    assert p2p._client.control.unary_handlers[STORE_HANDLER] is wrapped
    assert asyncio.run(wrapped(b"request", OTHER)) == b"request"
    assert seen == [OTHER.to_bytes()] and sender.get() is None
    name_store_senders(SimpleNamespace(_client=SimpleNamespace(control=SimpleNamespace(unary_handlers={}))),
                       sender)  # a node in client mode serves no stores: nothing to wrap


def test_a_bounded_store_keeps_the_parameters_and_the_layout_of_hiveminds():
    """storage_budget swaps the class of hivemind's stores for BoundedStorage (swap_store_class): its two overrides
    take hivemind's parameters; it reads ``data`` and deletes through ``__delitem__`` (of TimedStorage and of a
    dictionary value), and releases a plain value that hivemind's store_subkey replaces with a new dictionary."""
    from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
    from hivemind.utils.timed_storage import TimedStorage

    from p2p_diloco.swarm.discovery.storage_budget import BoundedStorage

    for name in ("store", "store_subkey"):
        assert _positional(vars(BoundedStorage)[name]) == _positional(vars(DHTLocalStorage)[name]), name
    assert "__delitem__" in vars(TimedStorage) and issubclass(DictionaryDHTValue, TimedStorage)
    assert "del self.data[key], self.key_to_heap[key]" in _source(TimedStorage.__delitem__)
    replaced = _source(DHTLocalStorage.store_subkey)
    assert "if isinstance(previous_value, BinaryDHTValue) and expiration_time > previous_expiration_time: " \
           "new_storage = DictionaryDHTValue()" in replaced
    assert isinstance(DHTLocalStorage().data, dict)



def test_a_node_makes_its_two_stores_once_so_a_class_swap_in_place_bounds_them():
    """What swap_store_class relies on: a DHT node's protocol makes its storage and cache once, as plain
    DHTLocalStorage objects (no __slots__: a subclass adding attributes shares their layout), and serves every store
    through them; the swap keeps what a store holds and refuses a class that is not a subclass."""
    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.utils import get_dht_time

    from p2p_diloco.hivemind_adapter.dht import swap_store_class

    assert "self.storage, self.cache = DHTLocalStorage(), DHTLocalStorage(maxsize=cache_size)" \
        in _source(DHTProtocol.create)
    assert all("__slots__" not in vars(cls) for cls in DHTLocalStorage.__mro__ if cls.__module__.startswith("hivemind"))

    class Counted(DHTLocalStorage):
        def store(self, key, value, expiration_time, subkey=None) -> bool:
            self.count = getattr(self, "count", 0) + 1
            return super().store(key, value, expiration_time, subkey)

    store, key = DHTLocalStorage(), DHTID.generate(source="k")
    store.store(key, b"kept", get_dht_time() + 60)
    swap_store_class(store, Counted)
    assert type(store) is Counted and store.get(key).value == b"kept"
    assert store.store(DHTID.generate(source="other"), b"new", get_dht_time() + 60) and store.count == 1
    with pytest.raises(TypeError):
        swap_store_class(DHTLocalStorage(), dict)


def test_hivemind_logs_a_vanished_senders_traceback_in_the_dht_loop_and_the_filter_drops_it():
    """quiet_vanished_senders filters, on hivemind's DHT logger, the traceback DHT._run logs when the pipe of a
    request's sender cannot be read (an OSError); anything else that logger logs passes."""
    from hivemind.dht import dht as hivemind_dht

    from p2p_diloco.hivemind_adapter.logs import DHT_LOGGER, _not_a_vanished_sender, quiet_vanished_senders

    assert hivemind_dht.logger.name == DHT_LOGGER
    loop = _source(hivemind_dht.DHT.run)
    assert "async def _run():" in loop
    assert "method, args, kwargs = self._inner_pipe.recv() except (OSError, ConnectionError, RuntimeError) as e: " \
           "logger.exception(e)" in loop
    quiet_vanished_senders()
    quiet_vanished_senders()  # idempotent
    assert logging.getLogger(DHT_LOGGER).filters.count(_not_a_vanished_sender) == 1

    def record(function: str, error: BaseException | None) -> logging.LogRecord:
        made = logging.LogRecord(DHT_LOGGER, logging.ERROR, __file__, 1, "message", None,
                                 (type(error), error, None) if error else None, func=function)
        return made

    logger = logging.getLogger(DHT_LOGGER)
    assert not logger.filter(record("_run", OSError("pipe gone")))
    assert logger.filter(record("_run", ValueError("other")))
    assert logger.filter(record("_run", None)) and logger.filter(record("store", OSError("elsewhere")))


def test_a_private_key_comes_back_from_its_der_bytes_through_hiveminds_unpickling():
    """private_key_from_der builds hivemind's RSAPrivateKey through __setstate__, which loads the DER bytes of
    _private_key (the state hivemind's own __getstate__ makes)."""
    from hivemind.utils.crypto import RSAPrivateKey

    from p2p_diloco.hivemind_adapter.crypto import private_key_from_der

    assert "self._private_key = serialization.load_der_private_key(self._private_key, password=None)" \
        in _source(RSAPrivateKey.__setstate__)
    assert 'state["_private_key"] = self.to_bytes()' in _source(RSAPrivateKey.__getstate__)
    original = RSAPrivateKey()
    copy = private_key_from_der(original.to_bytes())
    assert copy.get_public_key().to_bytes() == original.get_public_key().to_bytes()
    assert original.get_public_key().verify(b"data", copy.sign(b"data"))


def test_a_nodes_validators_are_read_from_hiveminds_composite():
    """validators_of reads CompositeValidator._validators (the node's record_validator), in its order."""
    from hivemind.dht.validation import CompositeValidator

    from p2p_diloco.hivemind_adapter.crypto import RSAPrivateKey
    from p2p_diloco.hivemind_adapter.dht import validators_of
    from p2p_diloco.swarm.discovery.records import RecordBounds, SignatureValidator

    bounds, signer = RecordBounds(), SignatureValidator(RSAPrivateKey())
    composite = CompositeValidator([bounds, signer])
    assert set(map(id, validators_of(composite))) == {id(bounds), id(signer)}
    assert validators_of(bounds) == [bounds]
