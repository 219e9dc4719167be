"""Handing a unit's state from the training process to its averager's process when a peer downloads it, keeping
nothing of it afterwards.

The averager's process serves a newcomer the state it asks the training process for (anchor and momentum: fresh
copies, ``Stage.shareable_state``). hivemind's thread that answers those requests in the training process keeps the
last state it sent in its local variables until the next request comes, which may be never: after a single download
each averager held a copy of its unit's anchor and momentum in shared memory for the rest of the run (twice the
unit's parameters in fp32; with churn, every donor). :class:`StateHost` answers them instead, on a pipe and a thread
of its own, and drops each state as soon as it is sent (the averager's process drops its own copy once the stream
is over). hivemind's thread stays, idle.

Made in the training process before the averager's process is forked (:class:`~p2p_diloco.swarm.averaging.server.
AveragingServer`); :meth:`StateHost.request` is called in the averager's process
(:class:`~p2p_diloco.swarm.averaging.server.AveragingServer`'s hook of hivemind's ``rpc_download_state``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import weakref
from collections.abc import Callable

from p2p_diloco.hivemind_adapter.averaging import MPFuture

logger = logging.getLogger(__name__)


class StateHost:
    """The training process's end of state requests (see the module's docstring).

    Args:
        get_current_state: () -> (metadata, tensors, compression infos or None); held weakly (a bound method: the
            thread ends with its averager).
        serializer: what metadata is sent as (hivemind's ``MSGPackSerializer``).
    """

    def __init__(self, get_current_state: Callable, serializer):
        receiver, self._requests = mp.Pipe(duplex=False)
        self._thread = threading.Thread(target=_answer_requests, daemon=True, name="averager-state-host",
                                        args=(receiver, weakref.WeakMethod(get_current_state), serializer))
        self._thread.start()

    async def request(self):
        """In the averager's process: the state to serve, as hivemind's ``rpc_download_state`` takes it
        ((serialized metadata, tensors, infos))."""
        future = MPFuture()
        self._requests.send(future)
        return await future

    def close(self) -> None:
        """In the training process: end the thread (at the averager's shutdown)."""
        try:
            self._requests.send(None)
        except (OSError, ValueError):  # the pipe is closed already
            pass
        self._thread.join(timeout=5.0)


def _answer_requests(requests, get_current_state_ref: weakref.WeakMethod, serializer) -> None:
    """The thread: answer each request, then drop it and the state it carries (nothing outlives the answer)."""
    while True:
        try:
            future = requests.recv()
        except (EOFError, OSError):
            return
        if future is None or not _answer(future, get_current_state_ref, serializer):
            return
        del future  # the state sent is its result: freed here, not when the next request comes


def _answer(future: MPFuture, get_current_state_ref: weakref.WeakMethod, serializer) -> bool:
    """Send the current state as ``future``'s result; False once the averager is gone."""
    get_current_state = get_current_state_ref()
    if get_current_state is None:
        future.set_exception(RuntimeError("the averager was shut down"))
        return False
    try:
        metadata, tensors, infos = get_current_state()
        future.set_result((serializer.dumps(metadata), tuple(t.detach().cpu() for t in tensors), infos))
    except Exception as e:  # the state provider's failure: the request fails, the thread goes on
        logger.warning(f"Could not hand this unit's state to its averager: {e!r}")
        future.set_exception(e)
    return True
