"""The hivemind internals the averaging builds on, in one place: imported here and nowhere else.

The averager subclasses hivemind's ``DecentralizedAverager``, ``AllReduceRunner`` and ``TensorPartReducer`` and
replaces five methods of their collaborators. None of that is hivemind's public API, and it changes between
versions, so the version is checked on import (:func:`check_version`) and ``tests/unit/test_hivemind_contract.py``
checks every hook: each method overridden (:data:`OVERRIDDEN`: found by walking our subclasses) or replaced
(:data:`REPLACED`) still exists in hivemind with the parameters we call it with, and the behaviour a hook exists for
is still there. The DHT, its validators and the compression codecs are hivemind's public API and are imported
where they are used.

Hooks replaced on instances:

- ``Matchmaking._request_join_group`` (:mod:`~p2p_diloco.swarm.averaging.guard`): a follower never asks a banned peer
  or an outsider to lead its group;
- ``Matchmaking.follower_assemble_group`` (:class:`~p2p_diloco.swarm.averaging.guard.GroupViews`): a follower notes
  which leader relayed its group's records (hivemind forgets it before the group is averaged);
- ``Matchmaking.look_for_group`` (:class:`~p2p_diloco.swarm.averaging.guard.GroupViews`): the group comes back under
  its view id (hivemind's group id and a digest of the records as this peer read them), with the exact record this
  peer sent noted;
- ``GroupKeyManager.update_key_on_group_assembled`` (:func:`~p2p_diloco.swarm.averaging.guard.keep_round_key`): the
  group key stays the round's after a group assembles, so that a failed all-reduce's survivors meet again;

Replaced on the class, for the whole process: ``P2P.receive_raw_data``
(:func:`~p2p_diloco.swarm.averaging.limits.install_message_cap`): a message whose header declares more bytes
than the cap is refused before they are read (hivemind buffers whatever length a peer declares).

Written by a test hook only: ``StepControl._data_for_gather`` (:func:`set_data_for_gather`: a hostile test peer's
record, made in the averager process).

Wrapped, not replaced: ``StepControl.cancel`` (:func:`cancel_step`): the step reads as cancelled before the cancel's
signal reaches the averager process (hivemind sends the signal first).

Called, not replaced: ``DecentralizedAverager.get_stub`` and the ``rpc_download_state`` stream it opens
(:meth:`~p2p_diloco.swarm.averaging.averager.PseudoGradientAverager.download_state` asks the donors the caller chose,
checking what arrives as it arrives, instead of hivemind's ``load_state_from_peers``, which orders donors by the
priority each declares in an unsigned DHT key and buffers whatever they send).
"""

from __future__ import annotations

import hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import CompressionInfo, PerTensorCompression
from hivemind.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.asyncio import (
    achain,
    aiter_with_timeout,
    amap_in_executor,
    as_aiter,
    attach_event_on_finished,
    enter_asynchronously,
)

SUPPORTED_VERSION = "1.1.12"

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
}
"""hivemind internals called directly (not replaced) -> their parameters, as we call them."""

HIVEMIND_BASES = (DecentralizedAverager, AllReduceRunner, TensorPartReducer)
"""The hivemind classes our averaging subclasses; every method a subclass redefines is a hook."""


def check_version(version: str) -> None:
    """ImportError unless ``version`` is the hivemind version these internals are known for."""
    if version != SUPPORTED_VERSION:
        raise ImportError(f"p2p_diloco's averaging is built on hivemind {SUPPORTED_VERSION} internals (see "
                          f"p2p_diloco/swarm/averaging/hivemind_api.py), but hivemind {version} is installed: "
                          f"pip install hivemind=={SUPPORTED_VERSION}")


check_version(hivemind.__version__)


def cancel_step(control: StepControl) -> None:
    """Cancel an averaging step so that the averager process reads it as cancelled when the cancel's signal arrives.

    hivemind's ``StepControl.cancel()`` sends the signal to the averager process, then marks the step cancelled, and
    the averager decides on ``step.cancelled()`` when the signal arrives: a training process descheduled between the
    two (a busy machine) leaves the step looking for its group (or averaging) to its timeout, and the next round of a
    restarted peer starts late, off the swarm's anchor. The step's state
    is shared memory, written here first; hivemind's own cancel then sends the signal."""
    MPFuture.cancel(control)  # (this process made the step: the shared state, no message)
    control.cancel()

def set_data_for_gather(control: StepControl, data: bytes) -> None:
    """Replace the record a step gathers into its groups (hivemind keeps it read-only; a test hook's use)."""
    control._data_for_gather = data


__all__ = [
    "CALLED", "P2P",
    "AllReduceRunner", "AllreduceException", "AveragingMode", "AveragingStage", "BannedException", "CompressionInfo",
    "DecentralizedAverager", "GroupKeyManager", "HIVEMIND_BASES", "MPFuture", "Matchmaking", "MatchmakingException",
    "P2PContext", "P2PDaemonError", "P2PHandlerError", "PeerID", "PerTensorCompression", "REPLACED",
    "SUPPORTED_VERSION", "StepControl",
    "TensorPartReducer", "achain", "aiter_with_timeout", "amap_in_executor", "as_aiter", "attach_event_on_finished",
    "averaging_pb2", "cancel_step", "check_version", "enter_asynchronously", "get_logger", "load_balance_peers",
    "set_data_for_gather",
]
