"""The hivemind averaging internals our averager builds on: the classes, the accessors of their private attributes,
and the methods of their collaborators replaced on instances.

The averager subclasses hivemind's ``DecentralizedAverager``, ``AllReduceRunner`` and ``TensorPartReducer``
(:data:`~p2p_diloco.hivemind_adapter.registry.HIVEMIND_BASES`: every method a subclass redefines is a hook the
contract test checks) and replaces four methods of their collaborators, on instances, each through one function of
this module listed in :data:`~p2p_diloco.hivemind_adapter.registry.PATCHES`:

- ``Matchmaking._request_join_group`` (:func:`wrap_join_request`, called by
  :class:`~p2p_diloco.swarm.averaging.server.AveragingServer`): a follower never asks a banned peer or an outsider
  to lead its group;
- ``Matchmaking.follower_assemble_group`` and ``Matchmaking.look_for_group`` (:func:`replace_group_assembly`, called
  by :class:`~p2p_diloco.swarm.averaging.server.AveragingServer` with the hooks of
  :class:`~p2p_diloco.swarm.averaging.guard.GroupViews`): a follower notes which leader relayed its group's records
  (hivemind forgets it before the group is averaged), and the group comes back under its view id (hivemind's group
  id and a digest of the records as this peer read them), with the exact record this peer sent noted;
- ``GroupKeyManager.update_key_on_group_assembled`` (:func:`keep_round_key`): the group key stays the round's after a
  group assembles, so that a failed all-reduce's survivors meet again.

Written by a test hook only: ``StepControl._data_for_gather`` (:func:`set_data_for_gather`: a hostile test peer's
record, made in the averager process).

Read or written, never named elsewhere: the private attributes of
:data:`~p2p_diloco.hivemind_adapter.registry.ATTRIBUTES` (the running groups, the matchmaking, the pipe to the
background process, the P2P, a container's parts by reducer), each through one function of this module
(``running_groups``, ``matchmaking_of``, ...).

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

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.averaging.partition import BannedException, TensorPartContainer, TensorPartReducer
from hivemind.compression import CompressionInfo, PerTensorCompression
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

from p2p_diloco.hivemind_adapter.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID

logger = logging.getLogger(__name__)


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


def set_data_for_gather(control: StepControl, data: bytes) -> None:
    """Replace the record a step gathers into its groups (hivemind keeps it read-only; a test hook's use)."""
    control._data_for_gather = data


def replace_group_assembly(matchmaking: Matchmaking, follower_assemble_group, look_for_group) -> None:
    """Replace ``matchmaking``'s ``follower_assemble_group(leader, msg)`` and ``look_for_group(step)`` by the two
    given (which call the originals, read from the instance before)."""
    matchmaking.follower_assemble_group = follower_assemble_group
    matchmaking.look_for_group = look_for_group


def keep_round_key(key_manager: GroupKeyManager) -> None:
    """Keep a hivemind ``GroupKeyManager``'s key as it was set (the round's key, set when the round starts) until it
    is set again: hivemind moves each member's key to a bucket of its own after every group it assembles, so that
    after a group whose all-reduce failed (a member gone) the survivors retried under different keys and never met
    again. Idempotent."""
    if "update_key_on_group_assembled" in vars(key_manager):
        return

    async def keep_the_round_key(group_info) -> None:
        return None

    key_manager.update_key_on_group_assembled = keep_the_round_key


__all__ = [
    "P2P",
    "AllReduceRunner", "AllreduceException", "AveragingMode", "AveragingStage", "BannedException", "CompressionInfo",
    "DecentralizedAverager", "GroupKeyManager", "MPFuture", "Matchmaking", "MatchmakingException",
    "P2PContext", "P2PDaemonError", "P2PHandlerError", "PeerID", "PerTensorCompression", "StepControl",
    "TensorPartReducer", "achain", "aiter_with_timeout", "amap_in_executor", "as_aiter", "attach_event_on_finished",
    "averaging_pb2", "cancel_signalled", "cancel_step", "enter_asynchronously", "get_logger", "keep_round_key",
    "load_balance_peers", "replace_group_assembly",
    "TensorPartContainer", "ban_sender", "groups_registered", "input_parts", "matchmaking_of", "outer_pipe",
    "outputs_registered", "p2p_of", "quiet_if_cancelled", "running_groups", "set_data_for_gather", "wrap_join_request",
]
