"""Peers behind a NAT router, with real routing: network namespaces joined by bridges, a router namespace that
masquerades its home network and drops what comes in unasked (nftables), real ``p2p-diloco`` processes
(benchmarks/nat.py). Root only; skipped, naming what is missing (nftables), where namespaces or NAT cannot be made."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from nat import FOUNDERS, TINY, NATNetwork, NATSwarm, nat_unavailable, run_scenario  # noqa: E402

UNAVAILABLE = nat_unavailable()
pytestmark = [pytest.mark.root, pytest.mark.timeout(360),
              pytest.mark.skipif(UNAVAILABLE is not None, reason=f"the NAT test {UNAVAILABLE}")]


def test_peers_behind_nat_average_every_round_and_a_newcomer_behind_it_downloads_the_state(tmp_path):
    """On the internet a bootstrap node and a public peer; behind the NAT a client-mode peer, an auto-relay peer
    and a peer whose port the router forwards (announced with --announce-maddrs). The four average together every
    round, in one group, and hold bit-identical anchors after each. A client-mode newcomer behind the NAT joins the
    running swarm: it downloads the state, its first round ends on the others' anchor, and it averages with all four
every round after. A peer behind the NAT
    with none of these options is refused at start with a message naming what to set, not left to time out. Every
    namespace is gone after."""
    rounds = 16  # the newcomer (started after the first round) needs several rounds of a busy machine to start
    common = TINY + ["--train.num_rounds", str(rounds), "--diloco.inner_steps", "10"]
    with NATNetwork() as net:
        prefix = net.prefix
        swarm = NATSwarm(net, tmp_path, common)
        codes = run_scenario(swarm, newcomer_after=1)
        logs = {name: swarm.log(name) for name in codes}
    assert prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    for name in [*FOUNDERS, "newcomer"]:
        assert codes[name] == 0, logs[name][-3000:]
    anchors = {}
    for name in FOUNDERS:
        applied = swarm.applied(name)
        told = "\n".join(str({k: e.get(k) for k in ("applied_round", "averaged", "group_size", "fallback_reason")})
                         for e in applied)
        assert [e["applied_round"] for e in applied] == list(range(rounds)), f"{name}:\n{told}"
        assert all(e["averaged"] and e["group_size"] >= len(FOUNDERS) for e in applied), f"{name}:\n{told}"
        anchors[name] = {e["applied_round"]: e["anchor_sha256"] for e in applied}
    for r in range(rounds):
        assert len({anchors[name][r] for name in FOUNDERS}) == 1, r

    syncs = swarm.events("newcomer", "sync")
    assert syncs and syncs[0]["action"] == "reload" and syncs[0]["round"] >= 1, syncs
    first = swarm.events("newcomer", "round")[0]
    assert first["anchor_sha256"] == anchors["public"][first["anchor_applied_round"]], first
    joined = swarm.applied("newcomer")[1:]  # (its first: the round it reloaded into, averaged or not)
    assert joined and all(e["averaged"] and e["group_size"] == len(FOUNDERS) + 1 for e in joined), joined

    # each found reachable its own way, and said so
    assert "Reachable through a relay: /ip4/11.77.0.2/" in logs["relay"], logs["relay"][-3000:]
    assert "connected to 11.77.0.1:4100" in logs["forwarded"], logs["forwarded"][-3000:]
    assert "] Reachable: initial peer" in logs["public"]
    # the unreachable peer: a one-line error naming the options, at start
    assert codes["unreachable"] == 1, logs["unreachable"][-3000:]
    error = [line for line in logs["unreachable"].splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "other peers cannot reach this peer" in error[0], logs["unreachable"][-3000:]
    assert all(option in error[0] for option in ("--client-mode", "--use-auto-relay", "--announce-maddrs"))
    assert "Traceback" not in logs["unreachable"] and not (tmp_path / "unreachable" / "metrics-stage0.jsonl").exists()
