"""The hivemind internals the averaging builds on, in one place: imported here and nowhere else.

The averager subclasses hivemind's ``DecentralizedAverager``, ``AllReduceRunner`` and ``TensorPartReducer`` and
replaces five methods of their collaborators. None of that is hivemind's public API, and it changes between
versions, so the version is checked on import (:func:`check_version`) and ``tests/unit/test_hivemind_contract.py``
checks every hook: each method overridden (:data:`OVERRIDDEN`: found by walking our subclasses) or replaced
(:data:`REPLACED`) still exists in hivemind with the parameters we call it with, and the behaviour a hook exists for
is still there. The DHT, its validators and the compression codecs are hivemind's public API and are imported
where they are used.

Hooks replaced on instances:

- ``Matchmaking._request_join_group`` (:mod:`~p2p_diloco.swarm.averaging.serving`): a follower never asks a banned peer
  or an outsider to lead its group;
- ``Matchmaking.follower_assemble_group`` (:class:`~p2p_diloco.swarm.averaging.guard.GroupViews`): a follower notes
  which leader relayed its group's records (hivemind forgets it before the group is averaged);
- ``Matchmaking.look_for_group`` (:class:`~p2p_diloco.swarm.averaging.guard.GroupViews`): the group comes back under
  its view id (hivemind's group id and a digest of the records as this peer read them), with the exact record this
  peer sent noted;
- ``GroupKeyManager.update_key_on_group_assembled`` (:func:`~p2p_diloco.swarm.averaging.serving.keep_round_key`): the
  group key stays the round's after a group assembles, so that a failed all-reduce's survivors meet again;

Replaced on the class, for the whole process: ``P2P.receive_raw_data``
(:func:`~p2p_diloco.swarm.averaging.limits.install_message_cap`): a message whose header declares more bytes
than the cap is refused before they are read (hivemind buffers whatever length a peer declares).

Added to, for the whole process: ``P2P.FORCE_REACHABILITY_MAPPING`` (:data:`BEHIND_NAT`, the p2p daemon's flags for
a node that reserves a slot on its initial peers as relays at once; see :func:`behind_nat_mode`).

Written by a test hook only: ``StepControl._data_for_gather`` (:func:`set_data_for_gather`: a hostile test peer's
record, made in the averager process).

Read or written, never named elsewhere: the private attributes of :data:`ATTRIBUTES` (the running groups, the
matchmaking, the pipe to the background process, the P2P, a container's parts by reducer), each through one function
of this module (``running_groups``, ``matchmaking_of``, ...); ``tests/unit/test_hivemind_contract.py`` checks that
hivemind still sets each one and that no other module of the package names any of them.

Wrapped, not replaced: ``StepControl.cancel`` (:func:`cancel_step`): the step reads as cancelled before the cancel's
signal reaches the averager process (hivemind sends the signal first); ``DecentralizedAverager._step``
(:func:`quiet_if_cancelled`): a step cancelled as its all-reduce ends stops without hivemind's uncaught
``InvalidStateError``.

Overridden so that hivemind's thread goes idle: ``DecentralizedAverager._get_current_state_from_host_process``
(:mod:`~p2p_diloco.swarm.averaging.state_host`): the state a peer serves comes from the training process through a
thread of ours, which keeps none of it once sent (hivemind's kept the last one until the next request).

Called, not replaced: ``DecentralizedAverager.get_stub`` and the ``rpc_download_state`` stream it opens
(:func:`~p2p_diloco.swarm.averaging.download.download_from` asks the donors the caller chose,
checking what arrives as it arrives, instead of hivemind's ``load_state_from_peers``, which orders donors by the
priority each declares in an unsigned DHT key and buffers whatever they send).
"""

from __future__ import annotations

import asyncio
import logging
import typing
from concurrent.futures import InvalidStateError

import hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.averaging.partition import BannedException, TensorPartContainer, TensorPartReducer
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

logger = logging.getLogger(__name__)

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
    (AllReduceRunner, "_ban_sender"): ("self", "peer_id"),
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
}
"""hivemind's private attributes our averaging reads or writes -> what they hold; only through the functions below."""

BEHIND_NAT = "p2p_diloco-behind-nat"
BEHIND_NAT_FLAGS = {"forceReachabilityPrivate": 1, "relayDiscovery": 0}
"""The p2p daemon's flags for a node behind NAT that relays make reachable (``dht.use_auto_relay``): its reachability
is private from the start (libp2p's AutoNAT never concludes for a node with private addresses only: nobody dials
those back) and its relays are the trusted ones it is given, its initial peers, without discovery (with discovery,
libp2p waits for 4 relay candidates or 3 minutes before it takes a reservation; a swarm seldom has 4 relays)."""

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
    restarted peer starts late, off the swarm's anchor. The step's state is shared memory, written here first;
    hivemind's own cancel then sends the signal."""
    MPFuture.cancel(control)  # (this process made the step: the shared state, no message)
    control.cancel()


def cancel_signalled(wait: asyncio.Future) -> bool:
    """Whether a step's ``wait_for_cancel()`` ended because the step was cancelled (its signal is set only then)."""
    return wait.done() and not wait.cancelled() and wait.exception() is None


async def quiet_if_cancelled(step_work: typing.Awaitable, step: StepControl | None) -> typing.Any:
    """hivemind's ``_step`` (``step_work``), ended quietly if the training process cancelled ``step`` meanwhile.

    A cancel (:func:`cancel_step`) can land between the all-reduce's end and hivemind's ``step.set_result``: that call
    then raises ``concurrent.futures.InvalidStateError`` (a cancelled future takes no result), which hivemind's step
    loop does not catch (it catches asyncio's, another class), and the step's task died with a traceback printed
    above a stopping peer's one-line error (a torchrun peer's other stage killed as a round ended: CI). The peer
    cancelled the step because it no longer wants the round's average, so nothing is lost; the same error on a step
    not cancelled is raised."""
    try:
        return await step_work
    except InvalidStateError:
        if step is None or not step.cancelled():
            raise
        logger.debug("This peer cancelled its averaging step as the step's all-reduce ended: its average is dropped")
        return None


def running_groups(averager: DecentralizedAverager) -> dict:
    return averager._running_groups


def groups_registered(averager: DecentralizedAverager):
    """The ``asyncio.Event`` hivemind sets whenever a group's all-reduce runners are registered."""
    return averager._pending_groups_registered


def matchmaking_of(averager: DecentralizedAverager) -> Matchmaking:
    return averager._matchmaking


def outer_pipe(averager: DecentralizedAverager):
    """The training process's end of the pipe that calls methods in the averager's background process."""
    return averager._outer_pipe


def p2p_of(averager: DecentralizedAverager) -> P2P:
    return averager._p2p


def input_parts(container: TensorPartContainer, reducer_index: int) -> list:
    """(part, compression info) of this peer's contribution to the slice of reducer ``reducer_index``."""
    return container._input_parts_by_peer[reducer_index]


def outputs_registered(container: TensorPartContainer, reducer_index: int) -> int:
    """How many averaged parts of reducer ``reducer_index``'s slice have been taken so far."""
    return container._outputs_registered_by_peer[reducer_index]


async def ban_sender(runner: AllReduceRunner, peer_id: PeerID) -> None:
    """hivemind's own way of refusing a sender for the rest of an all-reduce."""
    await runner._ban_sender(peer_id)


def wrap_join_request(matchmaking: Matchmaking, wrap) -> bool:
    """Replace ``matchmaking``'s follower join request by ``wrap(original)``; False (nothing done) if it was replaced
    already."""
    if "_request_join_group" in vars(matchmaking):
        return False
    matchmaking._request_join_group = wrap(matchmaking._request_join_group)
    return True


def behind_nat_mode() -> str:
    """The ``force_reachability`` value of hivemind's ``P2P.create`` that starts the daemon with
    :data:`BEHIND_NAT_FLAGS` (registered in hivemind's table of reachability modes on first use; call it in the process
    that starts the daemon). Pass the relays as ``trusted_relays``: the daemon refuses to start without any."""
    P2P.FORCE_REACHABILITY_MAPPING.setdefault(BEHIND_NAT, dict(BEHIND_NAT_FLAGS))
    return BEHIND_NAT


def set_data_for_gather(control: StepControl, data: bytes) -> None:
    """Replace the record a step gathers into its groups (hivemind keeps it read-only; a test hook's use)."""
    control._data_for_gather = data


__all__ = [
    "ATTRIBUTES", "BEHIND_NAT", "BEHIND_NAT_FLAGS", "CALLED", "P2P", "behind_nat_mode",
    "AllReduceRunner", "AllreduceException", "AveragingMode", "AveragingStage", "BannedException", "CompressionInfo",
    "DecentralizedAverager", "GroupKeyManager", "HIVEMIND_BASES", "MPFuture", "Matchmaking", "MatchmakingException",
    "P2PContext", "P2PDaemonError", "P2PHandlerError", "PeerID", "PerTensorCompression", "REPLACED",
    "SUPPORTED_VERSION", "StepControl",
    "TensorPartReducer", "achain", "aiter_with_timeout", "amap_in_executor", "as_aiter", "attach_event_on_finished",
    "averaging_pb2", "cancel_signalled", "cancel_step", "check_version", "enter_asynchronously", "get_logger",
    "load_balance_peers",
    "TensorPartContainer", "ban_sender", "groups_registered", "input_parts", "matchmaking_of", "outer_pipe",
    "outputs_registered", "p2p_of", "quiet_if_cancelled", "running_groups", "set_data_for_gather", "wrap_join_request",
]
