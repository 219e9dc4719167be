"""Under torchrun, gloo's sockets are bound to this machine's interface towards MASTER_ADDR: left alone, gloo binds
what the hostname resolves to, often a loopback address that it then gives the other nodes (real lookups on this
machine's own interfaces, nothing sent)."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from p2p_diloco.pipeline.context import _bind_gloo_towards, _ipv4_address, interface_towards

INTERFACES = [name for _index, name in socket.if_nameindex()]
pytestmark = pytest.mark.skipif("lo" not in INTERFACES, reason="needs Linux's loopback interface 'lo'")


def test_the_interface_towards_an_address_of_this_machine_is_the_one_that_holds_it():
    assert interface_towards("127.0.0.1") == "lo"
    held = {name: _ipv4_address(name) for name in INTERFACES}
    assert held["lo"] == "127.0.0.1"
    for name, address in held.items():  # node 0 (MASTER_ADDR is its own): the interface holding that address
        if address is not None and not address.startswith("127."):
            assert interface_towards(address) == name


def test_no_interface_for_an_address_it_cannot_route():
    assert interface_towards("::1") is None  # IPv6: gloo is left to its own choice


def test_gloo_is_bound_unless_the_user_named_an_interface(monkeypatch, caplog):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    _bind_gloo_towards("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    _bind_gloo_towards("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"

    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with caplog.at_level(logging.WARNING):
        _bind_gloo_towards("::1")
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert "set GLOO_SOCKET_IFNAME if the stages cannot meet" in caplog.text
