"""Can the swarm reach this node? A dial-back check: every DHT node serves it, a peer asks its initial peers at
start-up.

A node behind NAT or a firewall that nobody can dial, and that is not in client mode, still joins: its connections
to others go out, and libp2p reuses them for what others send it while they stay open. But a peer that is not
connected to it cannot open one (a groupmate sending its part, a newcomer asking for state): its rounds fail after
their timeouts, and so do those of its groupmates, with nothing that says why. So before it trains, a peer asks an
initial peer to dial it back: the initial peer takes the address it sees the peer's connection come from (behind
NAT: the router's public address), and opens a fresh TCP connection to each of the peer's announced addresses at
that address. None accepts: the peer stops with a message naming what to set (``--client-mode``,
``--use-auto-relay``, or a forwarded port and ``--announce-maddrs``). A peer with a relayed address (``/p2p-circuit``,
from ``--use-auto-relay``) is reachable through its relay; a client-mode peer is never dialed; both skip the dial.

Hostile input: the answering node dials only the address the connection comes from (never one a request names: it
cannot be made to connect to a third party), at most :data:`MAX_DIALS` ports, each for :data:`DIAL_TIMEOUT_S`, and
serves :data:`MAX_CHECKS_IN_FLIGHT` checks at once; a request is read up to :data:`MAX_REQUEST_BYTES` within
:data:`REQUEST_TIMEOUT_S`. The asking peer bounds the answer the same way; a lying answer can only make it skip
the message (or stop one that was reachable: its user then turns the check off).

Called by :func:`~p2p_diloco.swarm.discovery.dht.start_dht` (serving) and :mod:`p2p_diloco.stage_process` (asking).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import time
from collections.abc import Sequence
from typing import Optional

from p2p_diloco.swarm.errors import SwarmError

logger = logging.getLogger(__name__)

PROTOCOL = "p2p_diloco.dial_back.v1"
MAX_REQUEST_BYTES = 16 * 1024  # a peer's addresses as JSON: a few hundred bytes each
MAX_ADDRESSES = 32  # addresses of a request looked at
MAX_DIALS = 4  # ports dialed back per check
DIAL_TIMEOUT_S = 3.0
REQUEST_TIMEOUT_S = 5.0
MAX_CHECKS_IN_FLIGHT = 8
ASK_TIMEOUT_S = 12.0  # per initial peer asked: request, dials and answer
RELAY_WAIT_S = 10.0  # how long an auto-relay peer waits for its first relayed address


def observed_ip(maddr: str) -> Optional[str]:
    """The IP address of a connection's remote multiaddr (``/ip4/1.2.3.4/tcp/5``); None for a relayed one or any
    other kind."""
    parts = maddr.strip("/").split("/")
    if "p2p-circuit" in parts or len(parts) < 2 or parts[0] not in ("ip4", "ip6"):
        return None
    try:
        return str(ipaddress.ip_address(parts[1]))
    except ValueError:
        return None


def dial_targets(ip: str, maddrs: Sequence[str]) -> list[tuple[str, int]]:
    """The distinct TCP ports of ``maddrs`` announced at ``ip`` (the address the asking peer is seen from), at most
    :data:`MAX_DIALS`: ``[(ip, port), ...]``."""
    targets: list[tuple[str, int]] = []
    for maddr in list(maddrs)[:MAX_ADDRESSES]:
        parts = maddr.strip("/").split("/") if isinstance(maddr, str) else []
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or "p2p-circuit" in parts:
            continue
        try:
            same = ipaddress.ip_address(parts[1]) == ipaddress.ip_address(ip)
            port = int(parts[3])
        except ValueError:
            continue
        if same and 0 < port < 65536 and (ip, port) not in targets:
            targets.append((ip, port))
    return targets[:MAX_DIALS]


async def _dial(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT_S)
    except OSError:  # refused, unreachable, timed out (a TimeoutError is an OSError)
        return False
    writer.close()
    return True


async def _read_message(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    length = int.from_bytes(await reader.readexactly(4), "big")
    if length > max_bytes:
        raise ValueError(f"a message of {length} bytes, above {max_bytes}")
    return await reader.readexactly(length)


async def _write_message(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(len(payload).to_bytes(4, "big") + payload)
    await writer.drain()


class DialBackServer:
    """The answering side: one per DHT node, its handler registered on the node's p2p daemon."""

    def __init__(self):
        self.in_flight = 0

    async def handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.in_flight >= MAX_CHECKS_IN_FLIGHT:
            writer.close()
            return
        self.in_flight += 1
        try:
            request = json.loads(await asyncio.wait_for(_read_message(reader, MAX_REQUEST_BYTES), REQUEST_TIMEOUT_S))
            maddrs = request.get("maddrs") if isinstance(request, dict) else None
            ip = observed_ip(str(info.addr))
            targets = dial_targets(ip, maddrs if isinstance(maddrs, list) else []) if ip else []
            results = await asyncio.gather(*(_dial(host, port) for host, port in targets))
            answer = {"observed": ip, "dialed": [f"{host}:{port}" for host, port in targets],
                      "accepted": [f"{host}:{port}" for (host, port), ok in zip(targets, results) if ok]}
            await _write_message(writer, json.dumps(answer).encode())
        except Exception as e:  # a malformed or stalled request ends its stream, never the node
            logger.debug(f"Dial-back request from {info.peer_id} dropped: {e!r}")
        finally:
            self.in_flight -= 1
            writer.close()


async def _serve(_dht, node) -> None:
    await node.p2p.add_binary_stream_handler(PROTOCOL, DialBackServer().handle)


def serve_dial_back(dht, timeout_s: float = 10.0) -> None:
    """Answer dial-back checks on this DHT node (its background process) from now on."""
    dht.run_coroutine(_serve, return_future=True).result(timeout_s)


async def _ask_one(node, peer_id: str, maddrs: list[str]):
    from p2p_diloco.hivemind_adapter.p2p import PeerID

    _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), PROTOCOL)
    try:
        await _write_message(writer, json.dumps({"maddrs": maddrs}).encode())
        return json.loads(await _read_message(reader, MAX_REQUEST_BYTES))
    finally:
        writer.close()


async def _ask(_dht, node, peer_ids: Sequence[str], wait_for_relay_s: float) -> dict:
    """Runs in the DHT process: this node's addresses (after waiting up to ``wait_for_relay_s`` for a relayed one),
    and the first answer of ``peer_ids`` to a dial-back request, if any (each asked for :data:`ASK_TIMEOUT_S`)."""
    deadline = time.monotonic() + wait_for_relay_s
    while True:
        maddrs = [str(m) for m in await node.p2p.get_visible_maddrs(latest=True)]
        if any("/p2p-circuit" in m for m in maddrs) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    result = {"maddrs": maddrs, "answer": None, "checker": None, "errors": []}
    if any("/p2p-circuit" in m for m in maddrs):
        return result
    for peer_id in peer_ids:
        try:
            answer = await asyncio.wait_for(_ask_one(node, peer_id, maddrs), ASK_TIMEOUT_S)
        except Exception as e:  # an initial peer without the check (another version), gone, slow or hostile
            result["errors"].append(f"{peer_id}: {e!r}"[:300])
            continue
        if isinstance(answer, dict):
            result.update(answer=answer, checker=peer_id)
            return result
        result["errors"].append(f"{peer_id}: an answer that is not a JSON object")
    return result


def unreachable_message(maddrs: Sequence[str], answer: dict, checker: str) -> Optional[str]:
    """What to tell the user when ``answer`` (a dial-back by ``checker``) says nobody can dial this node; None when one
    of its addresses accepted the connection (or it has a relayed one)."""
    if any("/p2p-circuit" in m for m in maddrs):
        return None
    accepted = answer.get("accepted")
    if isinstance(accepted, list) and accepted:
        return None
    observed = answer.get("observed")
    seen = f"sees this peer's connection come from {observed}" if isinstance(observed, str) else \
        "cannot tell where this peer's connection comes from"
    return (f"other peers cannot reach this peer: initial peer {checker} {seen}, and none of this peer's addresses "
            f"({', '.join(maddrs)}) accepts a connection there. Behind NAT or a firewall, set one of: --client-mode "
            "(train and average without accepting connections: the simplest), --use-auto-relay (be reached through "
            "a relay: the initial peers), or, with a public address that reaches this machine on a TCP port (a port "
            "forwarded by the router, a cloud VM's public IP), listen on it and announce it: --host-maddrs "
            "/ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT. (dht.reachability_check = false "
            "skips this check)")


def check_reachable(dht, cfg, initial_peer_ids: Sequence[str]) -> None:
    """Stop with :class:`SwarmError` if the swarm cannot dial this node (see the module docstring). Nothing to check
    in client mode, with the check off or without initial peers; no initial peer answering is not a verdict (logged).

    Args:
        dht: this peer's running DHT node.
        cfg: its ``[dht]`` section.
        initial_peer_ids: the peer ids of ``cfg.initial_peers``, asked in turn.
    """
    if cfg.client_mode or not cfg.reachability_check or not initial_peer_ids:
        return
    wait_s = RELAY_WAIT_S if cfg.use_auto_relay else 0.0
    ask = functools.partial(_ask, peer_ids=list(initial_peer_ids), wait_for_relay_s=wait_s)
    try:
        result = dht.run_coroutine(ask, return_future=True).result(wait_s + ASK_TIMEOUT_S * len(initial_peer_ids) + 10)
    except Exception as e:  # the node did not answer in time (overloaded) or has no address yet: no verdict
        logger.info(f"Could not check that other peers can reach this one: {e!r}")
        return
    maddrs, answer, checker = result["maddrs"], result["answer"], result["checker"]
    relayed = [m for m in maddrs if "/p2p-circuit" in m]
    if relayed:
        logger.info(f"Reachable through a relay: {' '.join(relayed)}")
        return
    if answer is None:
        logger.info(f"Could not check that other peers can reach this one (no initial peer answered the "
                    f"dial-back check: {'; '.join(result['errors'])})")
        return
    message = unreachable_message(maddrs, answer, checker)
    if message is not None:
        if cfg.use_auto_relay:
            message = f"no relay gave this peer a reservation within {RELAY_WAIT_S:g} s, and " + message
        raise SwarmError(message)
    shown = ", ".join(str(a)[:64] for a in answer["accepted"][:MAX_DIALS])
    logger.info(f"Reachable: initial peer {checker} connected to {shown}")
