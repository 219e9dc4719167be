"""The dial-back check between real DHT nodes on 127.0.0.1 (p2p_diloco/swarm/discovery/reachability.py): a node
that listens where it says passes; one that announces an address nobody listens at is stopped with the message;
an initial peer without the check gives no verdict. Behind a real NAT: tests/integration/test_nat.py."""

from __future__ import annotations

import socket

import hivemind
import pytest

from p2p_diloco.config import DHTConfig
from p2p_diloco.swarm import SwarmError, start_dht, visible_maddrs
from p2p_diloco.swarm.discovery.reachability import check_reachable
from tests.integration.conftest import LOOPBACK

pytestmark = pytest.mark.timeout(120)


def _closed_port() -> int:
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


def _peer_id(dht) -> str:
    return dht.peer_id.to_base58()


def test_a_listening_peer_passes_and_one_announcing_a_dead_address_is_told_what_to_set(caplog):
    bootstrap = start_dht(DHTConfig(host_maddrs=[LOOPBACK]))
    nodes = [bootstrap]
    try:
        initial = visible_maddrs(bootstrap)
        good = start_dht(DHTConfig(initial_peers=initial, host_maddrs=[LOOPBACK]))
        nodes.append(good)
        with caplog.at_level("INFO"):
            check_reachable(good, DHTConfig(initial_peers=initial), [_peer_id(bootstrap)])
        assert f"Reachable: initial peer {_peer_id(bootstrap)} connected to 127.0.0.1:" in caplog.text

        dead = DHTConfig(initial_peers=initial, host_maddrs=[LOOPBACK],
                         announce_maddrs=[f"/ip4/127.0.0.1/tcp/{_closed_port()}"])
        hidden = start_dht(dead)
        nodes.append(hidden)
        with pytest.raises(SwarmError, match="other peers cannot reach this peer: .* sees this peer's connection "
                                             "come from 127.0.0.1.*--client-mode.*--use-auto-relay.*--announce-maddrs"):
            check_reachable(hidden, dead, [_peer_id(bootstrap)])
        # the ways out: client mode (never dialed), or the check turned off
        check_reachable(hidden, DHTConfig(initial_peers=initial, client_mode=True), [_peer_id(bootstrap)])
        check_reachable(hidden, DHTConfig(initial_peers=initial, reachability_check=False), [_peer_id(bootstrap)])
    finally:
        for node in reversed(nodes):
            node.shutdown()


def test_an_initial_peer_without_the_check_gives_no_verdict(caplog):
    """A stock hivemind node (or an older p2p-diloco) as the initial peer: the peer goes on, and says it could not
    check."""
    plain = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    peer = None
    try:
        initial = [str(m) for m in plain.get_visible_maddrs()]
        peer = start_dht(DHTConfig(initial_peers=initial, host_maddrs=[LOOPBACK],
                                   announce_maddrs=[f"/ip4/127.0.0.1/tcp/{_closed_port()}"]))
        with caplog.at_level("INFO"):
            check_reachable(peer, DHTConfig(initial_peers=initial), [_peer_id(plain)])
        assert "Could not check that other peers can reach this one" in caplog.text
        assert "protocols not supported" in caplog.text
    finally:
        if peer is not None:
            peer.shutdown()
        plain.shutdown()
