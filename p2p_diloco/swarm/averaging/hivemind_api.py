"""The hivemind internals the averaging builds on, in one place: imported here and nowhere else.

The averager subclasses hivemind's ``DecentralizedAverager``, ``AllReduceRunner`` and ``TensorPartReducer`` and
replaces three methods of their collaborators. None of that is hivemind's public API, and it changes between
versions, so the version is checked on import (:func:`check_version`) and ``tests/unit/test_hivemind_contract.py``
checks every hook: each method overridden (:data:`OVERRIDDEN`: found by walking our subclasses) or replaced
(:data:`REPLACED`) still exists in hivemind with the parameters we call it with, and the behaviour a hook exists for
is still there. The DHT, its validators and the compression codecs are hivemind's public API and are imported
where they are used.

Hooks replaced on instances:

- ``Matchmaking._request_join_group`` (:mod:`~p2p_diloco.swarm.averaging.guard`): a follower never asks a banned peer
  or an outsider to lead its group;
- ``GroupKeyManager.update_key_on_group_assembled`` (:func:`~p2p_diloco.swarm.averaging.guard.keep_round_key`): the
  group key stays the round's after a group assembles, so that a failed all-reduce's survivors meet again;
- ``DecentralizedAverager.get_stub`` (:mod:`~p2p_diloco.swarm.averaging.guard`): state is downloaded from members of a
  private swarm only.
"""

from __future__ import annotations

import hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import Matchmaking, MatchmakingException
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import CompressionInfo, PerTensorCompression
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished, enter_asynchronously

SUPPORTED_VERSION = "1.1.12"

REPLACED = {
    (Matchmaking, "_request_join_group"): ("self", "leader"),
    (GroupKeyManager, "update_key_on_group_assembled"): ("self", "group_info"),
    (DecentralizedAverager, "get_stub"): ("p2p", "peer", "namespace"),
}
"""(hivemind class, method) -> its parameters, as the replacement is called."""

HIVEMIND_BASES = (DecentralizedAverager, AllReduceRunner, TensorPartReducer)
"""The hivemind classes our averaging subclasses; every method a subclass redefines is a hook."""


def check_version(version: str) -> None:
    """ImportError unless ``version`` is the hivemind version these internals are known for."""
    if version != SUPPORTED_VERSION:
        raise ImportError(f"p2p_diloco's averaging is built on hivemind {SUPPORTED_VERSION} internals (see "
                          f"p2p_diloco/swarm/averaging/hivemind_api.py), but hivemind {version} is installed: "
                          f"pip install hivemind=={SUPPORTED_VERSION}")


check_version(hivemind.__version__)

__all__ = [
    "AllReduceRunner", "AllreduceException", "AveragingMode", "AveragingStage", "BannedException", "CompressionInfo",
    "DecentralizedAverager", "GroupKeyManager", "HIVEMIND_BASES", "MPFuture", "Matchmaking", "MatchmakingException",
    "P2PContext", "PeerID", "PerTensorCompression", "REPLACED", "SUPPORTED_VERSION", "TensorPartReducer",
    "aiter_with_timeout", "amap_in_executor", "attach_event_on_finished", "averaging_pb2", "check_version",
    "enter_asynchronously", "get_logger", "load_balance_peers",
]
