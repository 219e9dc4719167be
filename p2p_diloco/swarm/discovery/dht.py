"""Starting a hivemind DHT node from a :class:`DHTConfig`, with errors a user can act on.

Called by the peer and bootstrap commands and by tests. The node is hivemind's, running its own p2pd daemon; a node
behind NAT with ``use_auto_relay`` takes its initial peers as relays at once
(:func:`~p2p_diloco.hivemind_adapter.p2p.behind_nat_mode`), and every node that accepts connections answers
dial-back checks (:mod:`~p2p_diloco.swarm.discovery.reachability`).
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Optional

from p2p_diloco.config import DHTConfig
from p2p_diloco.config.network import JOIN_MARGIN_S
from p2p_diloco.hivemind_adapter.dht import DHT
from p2p_diloco.hivemind_adapter.logs import quiet_vanished_senders
from p2p_diloco.hivemind_adapter.p2p import behind_nat_mode
from p2p_diloco.process import (
    die_with_parent,
    freeze_before_fork,
    leave_signals_to_parent,
    name_process,
    ready_or_killed,
)
from p2p_diloco.swarm.discovery.identity import IdentityLock, ensure_identity, load_signing_key
from p2p_diloco.swarm.discovery.reachability import serve_dial_back
from p2p_diloco.swarm.discovery.records import bind_signer, with_signer
from p2p_diloco.swarm.discovery.storage_budget import bound_storage
from p2p_diloco.swarm.errors import SwarmError

logger = logging.getLogger(__name__)

_KILL_WAIT_S = 5.0  # how long a SIGKILLed node process may take to be reaped
READY_MARGIN_S = JOIN_MARGIN_S  # see its docstring in config.network
RETRY_AFTER_S = 1.0  # between two starts of a node whose initial peers did not answer a ping in time


class _DHT(DHT):
    """hivemind's DHT process, which dies with the process that started it (no orphans). It and the p2pd daemon it
    starts run at training's CPU priority: they use little CPU, but every message of the swarm waits for them (at a
    lower priority, on a busy machine, matchmaking requests timed out and groups formed without their members). It
    holds the lock on its identity (if any) until it is shut down."""

    identity_lock = None

    def run(self) -> None:
        die_with_parent(signal.SIGKILL)
        name_process("diloco-dht")
        leave_signals_to_parent(own_group=True)  # a signal to the peer's group is for the peer to handle
        behind_nat_mode()  # (registered by the parent already, unless this process was not forked from it)
        quiet_vanished_senders()  # the traceback of a request whose sender vanished
        try:
            super().run()
        except (EOFError, OSError) as e:
            # a request whose sender vanished before it could be read: the file descriptors of its shared state went
            # with it, and hivemind's loop lets an EOFError through (it catches OSError). Seen as a node's process
            # ends (a stage stopping because another stage of its peer is gone): a traceback printed above its
            # one-line error. The node's loop is over either way; say so in one line
            logger.warning(f"DHT node stopped: a request's sender vanished ({type(e).__name__}: {e})")

    def shutdown(self) -> None:
        """hivemind's shutdown, then SIGKILL if the node has not stopped within its grace period. hivemind falls back
        to SIGTERM, which this process ignores (a signal to the peer's group is for the peer): the node would then
        stay alive, and the interpreter's exit, which joins every child process, would wait for it without end."""
        try:
            super().shutdown()
            if self.is_alive():
                self.kill()
                self.join(_KILL_WAIT_S)
        finally:
            if self.identity_lock is not None:
                self.identity_lock.release()


def start_dht(cfg: DHTConfig, record_validators: Iterable = (), check_identity_free: bool = True,
              ready_timeout_s: Optional[float] = None):
    """Start a DHT node in a background process and wait until it is ready.

    Args:
        cfg: the ``[dht]`` section.
        record_validators: hivemind record validators (schemas, e.g. ``run_record_validators(run_id)``) for this
            node; a signature validator with a key of this node's own is always added (see ``swarm.records``).
        check_identity_free: refuse an identity that a running node of the swarm already holds.
        ready_timeout_s: give up when the node is not ready after this long (default: ``cfg.startup_timeout_s``
            plus :data:`READY_MARGIN_S`); its process is then killed.

    Without ``cfg.identity_path`` the node gets a new identity, in a private folder removed at shutdown: its
    records are signed with its identity's key either way (see ``swarm.discovery.records``).

    Returns:
        A running ``hivemind.DHT``; the caller must ``shutdown()`` it.

    Raises:
        SwarmError: the daemon could not start, no initial peer could be reached, or a running node of this
            machine holds the identity.
    """
    identity_path, lock, ephemeral_dir = None, None, None
    if cfg.identity_path:
        peer_id, created = ensure_identity(cfg.identity_path)
        lock = IdentityLock(cfg.identity_path)
        identity_path = str(cfg.identity_path)
        logger.info(f"{'Created' if created else 'Using'} identity {identity_path} (peer id {peer_id})")
    else:
        ephemeral_dir = tempfile.mkdtemp(prefix="p2p-diloco-identity-")  # 0700: only this user reads the key
        identity_path = f"{ephemeral_dir}/identity.key"
        ensure_identity(identity_path)
    try:
        record_validators = with_signer(record_validators, load_signing_key(identity_path))
    except SwarmError:
        if lock is not None:
            lock.release()
        raise
    started = time.monotonic()
    ready_s = ready_timeout_s if ready_timeout_s is not None else cfg.startup_timeout_s + READY_MARGIN_S
    retry_until = started + min(ready_s, cfg.startup_timeout_s) - RETRY_AFTER_S
    freeze_before_fork()  # the node's process shares this one's heap: keep it shared
    while True:
        try:
            dht = _DHT(
                initial_peers=list(cfg.initial_peers) or None,
                host_maddrs=list(cfg.host_maddrs),
                announce_maddrs=list(cfg.announce_maddrs) or None,
                identity_path=identity_path,
                client_mode=cfg.client_mode,
                use_relay=cfg.use_relay,
                use_auto_relay=cfg.use_auto_relay,
                **_relay_options(cfg),
                startup_timeout=cfg.startup_timeout_s,
                check_if_identity_free=check_identity_free and ephemeral_dir is None,  # a new identity is free
                record_validators=list(record_validators),
                start=True,
                await_ready=False,
            )
            _wait_until_ready(dht, max(1.0, started + ready_s - time.monotonic()))
            break
        except Exception as e:
            if _no_answer_to_a_ping(e) and time.monotonic() < retry_until:
                # hivemind pings the initial peers once, for 3 s: an answer late on a busy machine or link is
                # not an unreachable peer; ask again while the start-up time lasts
                logger.info(f"No initial peer answered its ping in time; asking again ({e})")
                time.sleep(RETRY_AFTER_S)
                continue
            if lock is not None:
                lock.release()
            if ephemeral_dir is not None:
                shutil.rmtree(ephemeral_dir, ignore_errors=True)
            raise SwarmError(_explain_start_failure(e, cfg.initial_peers)) from None
    if ephemeral_dir is not None:  # the daemon has read the key, and the signer holds it: nothing to leave behind
        shutil.rmtree(ephemeral_dir, ignore_errors=True)  # (a SIGKILLed peer used to leave the folder in /tmp)
    dht.identity_lock = lock
    bind_signer(dht, record_validators)
    try:  # from now on; what the node took before is charged
        bound_storage(dht, cfg.storage_limit_mb)
    except Exception as e:
        dht.shutdown()
        raise SwarmError(f"could not bound the DHT node's storage (dht.storage_limit_mb): {e!r}") from None
    if not cfg.client_mode:  # a node that others can dial answers their dial-back checks (swarm.discovery.reachability)
        try:
            serve_dial_back(dht)
        except Exception as e:  # the node works without it: a peer asking it gets no verdict and goes on
            logger.warning(f"This node will not answer dial-back checks: {e!r}")
    return dht


def _relay_options(cfg: DHTConfig) -> dict:
    """With ``use_auto_relay`` and initial peers: the initial peers are this node's relays, a slot reserved on them at
    once (``behind_nat_mode``; hivemind's defaults wait for 4 relay candidates or 3 minutes)."""
    if not (cfg.use_auto_relay and cfg.use_relay and cfg.initial_peers):
        return {}
    return {"trusted_relays": list(cfg.initial_peers), "force_reachability": behind_nat_mode()}


def _no_answer_to_a_ping(error: Exception) -> bool:
    """Whether a node's start failed because no initial peer answered hivemind's one ping (3 s) in time."""
    return "initial_peers responded" in str(error)


def _wait_until_ready(dht, timeout_s: float) -> None:
    if not ready_or_killed(dht, dht.wait_until_ready, timeout_s, _KILL_WAIT_S):
        raise TimeoutError(f"the DHT node did not join the swarm within {timeout_s:.0f} s")


def _explain_start_failure(error: Exception, initial_peers: Sequence[str]) -> str:
    text = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
    # an initial peer that accepts connections but never answers shows up as the daemon's start timing out, or as
    # hivemind's "none of the initial_peers responded to a ping" when the daemon connected but the node is stopped
    if "bootstrap peers" in text or "initial_peers responded" in text or \
            (initial_peers and ("failed to start in" in text or "did not join" in text)):
        return (
            f"could not reach any initial peer ({', '.join(initial_peers)}): check the addresses, that the "
            "nodes are running and that their ports are reachable from here (a slow link may need a larger "
            "dht.startup_timeout_s)"
        )
    if "already taken" in text:
        return f"{text}: another running node uses this identity; give each node its own --identity-path"
    if "address already in use" in text:
        return (f"the DHT node failed to start: {text}: another process listens on that port; choose another one "
                "in --host-maddrs (/tcp/0: any free port)")
    return f"the DHT node failed to start: {text}"


def visible_maddrs(dht) -> list[str]:
    """Multiaddrs others can use to reach this node, as strings."""
    return [str(maddr) for maddr in dht.get_visible_maddrs()]
