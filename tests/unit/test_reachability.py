"""The dial-back check's own logic (p2p_diloco/swarm/discovery/reachability.py): which addresses the answering node
dials (only those at the address the request comes from), what it does with hostile requests, and the verdict the
asking peer draws. Real dials and DHTs: tests/integration/test_reachability.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from p2p_diloco.swarm.discovery import reachability
from p2p_diloco.swarm.discovery.reachability import (
    MAX_CHECKS_IN_FLIGHT,
    MAX_DIALS,
    DialBackServer,
    dial_targets,
    observed_ip,
    unreachable_message,
)

PEER = "12D3KooWEDyZjtNMYAD8fXks6TjHjDVpEUYxfVDKjABnTzeY3YXF"


def test_observed_ip_of_a_direct_connection_only():
    assert observed_ip("/ip4/11.77.0.1/tcp/4100") == "11.77.0.1"
    assert observed_ip("/ip6/::1/tcp/7") == "::1"
    assert observed_ip(f"/ip4/11.77.0.2/tcp/1/p2p/{PEER}/p2p-circuit") is None
    assert observed_ip("/dns4/example.org/tcp/1") is None
    assert observed_ip("/ip4/not-an-ip/tcp/1") is None
    assert observed_ip("") is None


def test_only_ports_announced_at_the_observed_address_are_dialed_each_once_and_a_few_at_most():
    maddrs = [f"/ip4/192.168.77.5/tcp/4000/p2p/{PEER}",  # a home address: not where the connection comes from
              "/ip4/11.77.0.1/tcp/4100", f"/ip4/11.77.0.1/tcp/4100/p2p/{PEER}",  # the same port twice
              "/ip4/11.77.0.1/udp/4100/quic", f"/ip4/11.77.0.1/tcp/1/p2p/{PEER}/p2p-circuit/p2p/{PEER}",
              "/ip4/11.77.0.1/tcp/0", "/ip4/11.77.0.1/tcp/70000", "/ip4/11.77.0.1/tcp/x", "garbage", 7, None]
    assert dial_targets("11.77.0.1", maddrs) == [("11.77.0.1", 4100)]
    many = [f"/ip4/11.77.0.1/tcp/{port}" for port in range(5000, 5100)]
    assert dial_targets("11.77.0.1", many) == [("11.77.0.1", port) for port in range(5000, 5000 + MAX_DIALS)]
    assert dial_targets("203.0.113.9", many) == []  # never a third party's address
    assert dial_targets("::1", ["/ip6/0:0::1/tcp/9"]) == [("::1", 9)]  # the same address, written otherwise


class _Writer:
    def __init__(self):
        self.data, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def serve(raw: bytes, remote: str, server: DialBackServer | None = None) -> tuple[dict | None, _Writer]:
    """One request through the server's handler, as the p2p daemon hands it over; its answer (None: none)."""

    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        writer = _Writer()
        await (server or DialBackServer()).handle(SimpleNamespace(addr=remote, peer_id=PEER), reader, writer)
        return writer

    writer = asyncio.run(go())
    if not writer.data:
        return None, writer
    return json.loads(writer.data[4:]), writer


def request(maddrs) -> bytes:
    payload = json.dumps({"maddrs": maddrs}).encode()
    return len(payload).to_bytes(4, "big") + payload


def test_hostile_requests_are_dropped_without_a_dial(monkeypatch):
    dials = []

    async def dial(host, port):
        dials.append((host, port))
        return True

    monkeypatch.setattr(reachability, "_dial", dial)
    oversized = (reachability.MAX_REQUEST_BYTES + 1).to_bytes(4, "big") + b"x" * 64
    for raw in (oversized, b"\x00\x00\x00\x05{nope", b"\x00\x00", request("not a list")[:9]):
        answer, writer = serve(raw, "/ip4/127.0.0.1/tcp/1")
        assert answer is None and writer.closed
    answer, _ = serve(request("/ip4/127.0.0.1/tcp/5"), "/ip4/127.0.0.1/tcp/1")  # maddrs not a list
    assert answer["dialed"] == []
    answer, _ = serve(request(["/ip4/127.0.0.1/tcp/5"]), f"/ip4/11.77.0.2/tcp/1/p2p/{PEER}/p2p-circuit")
    assert answer == {"observed": None, "dialed": [], "accepted": []}  # a relayed connection: nothing to dial
    busy = DialBackServer()
    busy.in_flight = MAX_CHECKS_IN_FLIGHT
    answer, writer = serve(request(["/ip4/127.0.0.1/tcp/5"]), "/ip4/127.0.0.1/tcp/1", busy)
    assert answer is None and writer.closed and busy.in_flight == MAX_CHECKS_IN_FLIGHT
    assert dials == []


@pytest.mark.parametrize("answer", [{"observed": "11.77.0.1", "dialed": [], "accepted": []},
                                    {"observed": "11.77.0.1", "dialed": ["11.77.0.1:4100"], "accepted": []},
                                    {"accepted": "not a list"}, {}])
def test_no_accepted_address_tells_what_to_set(answer):
    message = unreachable_message(["/ip4/192.168.77.5/tcp/4000"], answer, PEER)
    assert message.startswith("other peers cannot reach this peer: initial peer " + PEER)
    for option in ("--client-mode", "--use-auto-relay", "--announce-maddrs", "dht.reachability_check = false"):
        assert option in message
    assert ("11.77.0.1" in message) == ("observed" in answer)


def test_an_accepted_or_a_relayed_address_is_reachable():
    assert unreachable_message(["/ip4/11.77.0.3/tcp/4000"], {"accepted": ["11.77.0.3:4000"]}, PEER) is None
    relayed = f"/ip4/11.77.0.2/tcp/1/p2p/{PEER}/p2p-circuit/p2p/{PEER}"
    assert unreachable_message(["/ip4/192.168.77.5/tcp/4000", relayed], {"accepted": []}, PEER) is None
