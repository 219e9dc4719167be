"""A peer whose two stages run on two machines (``peers/launch-torchrun.sh``: torchrun, one stage per node, gloo)
in a swarm with a two-stage peer of one machine: three hosts emulated with network namespaces on one bridge, so
that torchrun's store, gloo and hivemind meet each other's addresses, not 127.0.0.1. Needs root. The scenario is
``benchmarks/torchrun_cluster.py``'s; its third step (both nodes restarted, the peer resumes and averages again)
runs there: two more torch start-ups per node cost a minute and a half on a busy 2-core machine."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import FAST_AVERAGING, TINY_TRAINING

pytestmark = [pytest.mark.root, pytest.mark.timeout(420)]

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def wan():
    """Three hosts 10.88.0.1-3 on one bridge, unshaped, under namespace names of this test process's own."""
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces (ip netns) emulate the machines of the cluster")
    if shutil.which("ip") is None:
        pytest.skip("needs the ip command (iproute2) to emulate the machines of the cluster")
    sys.path.insert(0, str(BENCHMARKS))
    from netns import EmulatedWAN, run_prefix

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    network = EmulatedWAN(3, None, prefix=run_prefix())
    try:
        network.__enter__()
    except subprocess.CalledProcessError as e:
        network.close()
        pytest.skip(f"ip netns does not work here: {' '.join(e.cmd)}: {e.stderr.strip()}")
    try:
        yield network
    finally:
        network.close()
        for sig, handler in handlers.items():  # (the WAN's own handlers close it and exit)
            signal.signal(sig, handler)


def test_a_peer_across_two_nodes_averages_with_the_swarm_and_stops_whole(tmp_path, wan):
    """Host 0 runs a bootstrap node and a 2-stage peer; hosts 1 and 2 are the two nodes of a torchrun peer (one stage
    each), started as the README says. The cluster peer's first rounds are averaged with the other peer, stage by
    stage, onto the same anchors. Node 1's stage process is SIGKILLed: node 0's stage stops at once with one line
    saying a stage of its peer is gone, both nodes' torchrun exit with an error, and no process is left on them."""
    from torchrun_cluster import Cluster

    cluster = Cluster(wan, tmp_path, [*TINY_TRAINING, *FAST_AVERAGING])
    cluster.start_swarm()
    cluster.first_rounds_averaged()
    stopped = cluster.kill_node_stage(bound_s=60)
    assert [code for code, _ in stopped["exits"]] == [1, 1], stopped
