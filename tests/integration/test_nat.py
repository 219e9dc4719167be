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
    and a peer whose port the router forwards (announced with --announce-maddrs). They average together, in one
    group, and hold bit-identical anchors after each round. A client-mode newcomer behind the NAT joins the running
    swarm: it downloads the state, its first round ends on the others' anchor, it averages with them after, and the
    run ends on one model. (On a busy machine a peer a few seconds late may miss a round's group, NAT or not: at
    most two, never two in a row, and it may reload the swarm's state past the next; a peer nobody could reach would
    miss them all.) A peer behind the NAT with none of these options is refused at start with a message naming what
    to set, not left to time out. Every namespace is gone after."""
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
    syncs = swarm.events("newcomer", "sync")
    assert syncs and syncs[0]["action"] == "reload" and syncs[0]["round"] >= 1, syncs
    # the rounds next to the one the newcomer reloaded into: groups re-form around it (as around any churn)
    arrival = range(syncs[0]["round"] - 1, syncs[0]["round"] + 2)
    assert arrival.stop < rounds, f"the newcomer arrived too late to average: {syncs}"
    ends = {name: {e["applied_round"]: e for e in swarm.applied(name)} for name in [*FOUNDERS, "newcomer"]}
    for name, by_round in ends.items():
        told = name + ":\n" + "\n".join(str({k: e.get(k) for k in ("applied_round", "averaged", "group_size",
                                                                    "fallback_reason")}) for e in by_round.values())
        if name != "newcomer":
            # a founder ends every round, or skips one only by taking the swarm's state past it: late for round 0's
            # group on a busy machine, it ends round 0 alone, finds the others a round ahead and reloads; started
            # after round 1, it joins as a newcomer does, by a reload (delayed mode: round 1's average still pending
            # there) and the resync that follows its first round
            reloads = [e for e in swarm.events(name, "sync") if e["action"] in ("reload", "resync")]
            skipped = sorted(set(range(rounds)) - set(by_round))
            assert len(skipped) <= 2 and all(any(e["applied_round"] >= r for e in reloads) for r in skipped), \
                (told, reloads)
        # on a busy machine a peer a few seconds late can miss a round's group (NAT or not); it is back at the next
        missed = [r for r, e in by_round.items() if not e["averaged"]]
        assert len(missed) <= 2 and not any(r + 1 in missed for r in missed), told
    for r in range(rounds):
        averaged = [name for name in ends if r in ends[name] and ends[name][r]["averaged"]]
        if r not in arrival:  # one group, most of the swarm in it, one anchor
            assert len(set(averaged) & set(FOUNDERS)) >= len(FOUNDERS) - 1, (r, averaged)
            assert len({ends[name][r]["anchor_sha256"] for name in averaged}) == 1, (r, averaged)
        assert r < arrival.stop or r in ends["newcomer"], r  # once in, the newcomer ends every round with them
    assert any(e["averaged"] and e["group_size"] == len(FOUNDERS) + 1 for e in ends["newcomer"].values())
    # the run ends on one model: the summary's anchor is the final one, so a peer whose last round fell back (late
    # for its group on a busy machine, as allowed above) and then took the swarm's final state counts as on it
    finals = {name: swarm.events(name, "summary")[-1]["anchor_sha256"] for name in ends}
    assert len(set(finals.values())) == 1, finals
    first = swarm.events("newcomer", "round")[0]
    assert first["anchor_sha256"] == ends["public"][first["anchor_applied_round"]]["anchor_sha256"], first

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
