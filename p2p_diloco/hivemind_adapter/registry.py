"""Every way this project reaches into hivemind beyond its public API, listed: what the contract test
(``tests/unit/test_hivemind_contract.py``) iterates, so that a hivemind release that moves one fails a test instead
of a round.

- :data:`PATCHES`: each patch (a method replaced on a class or an instance, a class swapped, a handler wrapped, a
  table or a logger added to), by the name of the function of this package that applies it;
- :data:`REPLACED`: the hivemind methods those patches replace, with the parameters the replacement is called with;
- :data:`CALLED`: hivemind internals called directly, with the parameters we call them with;
- :data:`ATTRIBUTES`: hivemind's private attributes read or written, each through one function of this package;
- :data:`HIVEMIND_BASES`: the hivemind classes subclassed elsewhere in the project; every method a subclass
  redefines is a hook, found by walking the subclasses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from p2p_diloco.hivemind_adapter import averaging, dht, logs, p2p
from p2p_diloco.hivemind_adapter.averaging import (
    AllReduceRunner,
    DecentralizedAverager,
    GroupKeyManager,
    Matchmaking,
    StepControl,
    TensorPartContainer,
    TensorPartReducer,
)
from p2p_diloco.hivemind_adapter.crypto import RSAPrivateKey
from p2p_diloco.hivemind_adapter.dht import DHT, CompositeValidator, DHTLocalStorage, RecordValidatorBase
from p2p_diloco.hivemind_adapter.p2p import P2P


@dataclass(frozen=True)
class Patch:
    """One change this project makes to hivemind's objects."""

    apply: Callable
    """The function of this package that makes it."""
    target: str
    """What of hivemind it changes."""
    scope: str
    """``process`` (a class, table or logger: every object of the process) or ``instance`` (one object)."""
    why: str
    """What breaks without it."""


PATCHES: dict[str, Patch] = {patch.apply.__name__: patch for patch in (
    Patch(p2p.cap_received_messages, "P2P.receive_raw_data", "process",
          "hivemind buffers whatever length a peer declares before any handler sees the message"),
    Patch(p2p.behind_nat_mode, "P2P.FORCE_REACHABILITY_MAPPING", "process",
          "a node behind NAT reserves a slot on its initial peers as relays at once"),
    Patch(dht.swap_store_class, "DHTLocalStorage.__class__ (a node's storage and cache)", "instance",
          "a node keeps every entry its validators let through, without a bound on their number"),
    Patch(dht.name_store_senders, "P2P._client.control.unary_handlers['DHTProtocol.rpc_store']", "instance",
          "a node's stores are charged to the sender of the store request, which reaches the handler only"),
    Patch(logs.quiet_vanished_senders, "the logger of hivemind.dht.dht (DHT._run)", "process",
          "a request whose sender vanished printed a traceback above a stopping peer's one-line error"),
    Patch(averaging.wrap_join_request, "Matchmaking._request_join_group", "instance",
          "a follower never asks a banned peer or an outsider to lead its group"),
    Patch(averaging.replace_group_assembly, "Matchmaking.follower_assemble_group, Matchmaking.look_for_group",
          "instance", "a follower notes its group's leader and record; the group comes back under its view id"),
    Patch(averaging.keep_round_key, "GroupKeyManager.update_key_on_group_assembled", "instance",
          "hivemind moves the group key after every group: a failed all-reduce's survivors never met again"),
)}
"""Every patch, by the name of the function that applies it."""

REPLACED = {
    (Matchmaking, "_request_join_group"): ("self", "leader"),
    (Matchmaking, "follower_assemble_group"): ("self", "leader", "msg"),
    (Matchmaking, "look_for_group"): ("self", "step"),
    (GroupKeyManager, "update_key_on_group_assembled"): ("self", "group_info"),
    (P2P, "receive_raw_data"): ("reader",),
}
"""(hivemind class, method) -> its parameters, as the replacement is called."""

CALLED = {
    (DecentralizedAverager, "get_stub"): ("p2p", "peer", "namespace"),
    (AllReduceRunner, "_ban_sender"): ("self", "peer_id"),
    (RSAPrivateKey, "__setstate__"): ("self", "state"),
}
"""hivemind internals called directly (not replaced) -> their parameters, as we call them."""

ATTRIBUTES = {
    (DecentralizedAverager, "_running_groups"): "group id -> the future of its all-reduce runner (this process's)",
    (DecentralizedAverager, "_pending_groups_registered"): "set whenever a group's runners are registered",
    (DecentralizedAverager, "_matchmaking"): "the background process's Matchmaking",
    (DecentralizedAverager, "_outer_pipe"): "the training process's end of the pipe to the background process",
    (DecentralizedAverager, "_p2p"): "the background process's P2P",
    (TensorPartContainer, "_input_parts_by_peer"): "reducer index -> this peer's parts of that reducer's slice",
    (TensorPartContainer, "_outputs_registered_by_peer"): "reducer index -> the averaged parts taken from it so far",
    (Matchmaking, "_request_join_group"): "the follower's join request (replaced on the instance: REPLACED)",
    (StepControl, "_data_for_gather"): "the record a step gathers into its group (set_data_for_gather, a test hook)",
    (CompositeValidator, "_validators"): "the validators a node checks records with (dht.validators_of)",
    (P2P, "_client"): "the p2p daemon's client, whose table of unary handlers holds the node's store handler",
    (RSAPrivateKey, "_private_key"): "the key, DER bytes in a state to __setstate__ (crypto.private_key_from_der)",
}
"""hivemind's private attributes this project reads or writes -> what they hold; only through this package."""

HIVEMIND_BASES = (DecentralizedAverager, AllReduceRunner, TensorPartReducer, DHT, DHTLocalStorage, RecordValidatorBase)
"""The hivemind classes the project subclasses; every method a subclass redefines is a hook."""

__all__ = ["ATTRIBUTES", "CALLED", "HIVEMIND_BASES", "PATCHES", "Patch", "REPLACED"]
