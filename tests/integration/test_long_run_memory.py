"""What a long run's memory depends on, with real averager processes: what the training process shares with its
averagers' processes, and what it keeps after serving its state (``benchmarks/soak.py`` measures a whole swarm)."""

from __future__ import annotations

import gc
import time

import hivemind
import pytest
import torch

from p2p_diloco.config import AveragingConfig
from p2p_diloco.swarm import PseudoGradientAverager

pytestmark = pytest.mark.timeout(180)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
CFG = AveragingConfig(matchmaking_time_s=3, request_timeout_s=3, round_timeout_s=8, allreduce_timeout_s=15,
                      next_chunk_timeout_s=10, compression="none")
STATE_MB = 12  # anchor and momentum served: 3 tensors of 1M floats, twice


def _kb(path: str, field: str) -> int:
    with open(path) as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.fixture
def dhts():
    root = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    initial = [str(m) for m in root.get_visible_maddrs()]
    nodes = [hivemind.DHT(start=True, initial_peers=initial, host_maddrs=LOOPBACK) for _ in range(2)]
    yield nodes
    for node in nodes + [root]:
        node.shutdown()


def test_a_donor_keeps_nothing_of_the_states_it_served(dhts):
    """Each state a peer serves is a copy of its unit's anchor and momentum, made in the training process and handed
    to the averager's process in shared memory: once sent, the training process holds none of it (hivemind's loop
    kept the last one until the next request, for good after a single download)."""
    templates = [torch.zeros(1000, 1000) for _ in range(3)]
    donor, newcomer = [PseudoGradientAverager(templates, dht, run_id="mem", stage_index=0, num_stages=1, cfg=CFG)
                       for dht in dhts]
    try:
        donor.state_provider = lambda: ({"round": 4}, [t + 1 for t in templates] + [t + 2 for t in templates])
        baseline_kb = _kb("/proc/self/status", "RssShmem")
        for _ in range(2):
            metadata, tensors = newcomer.download_state([str(donor.peer_id)], timeout_s=30)
            assert metadata == {"round": 4} and len(tensors) == 6 and float(tensors[3][0, 0]) == 2.0
            del metadata, tensors  # (what the newcomer received passes through this process too)
            gc.collect()
            time.sleep(0.5)  # the averagers' processes close their copies as their streams end
            kept_mb = (_kb("/proc/self/status", "RssShmem") - baseline_kb) / 1024
            assert kept_mb < STATE_MB / 4, f"the donor kept {kept_mb:.1f} MB of a {STATE_MB} MB state it served"
    finally:
        donor.shutdown()
        newcomer.shutdown()


def test_an_averagers_process_shares_the_training_processs_heap_through_its_collections(dhts):
    """The averager's process is forked from the training process and shares its heap until either writes to it:
    a full garbage collection in the training process no longer writes to the objects they share (each used to
    copy every page holding one, ~60 MB per averager within minutes of a peer's start). The process is named."""
    objects = [[i] for i in range(400_000)]  # the training process's long-lived state (about 40 MB of objects)
    averager = PseudoGradientAverager([torch.zeros(16)], dhts[0], run_id="cow", stage_index=0, num_stages=1,
                                      cfg=CFG)
    try:
        with open(f"/proc/{averager.pid}/comm") as f:
            assert f.read().strip() == "diloco-avg"
        rollup = f"/proc/{averager.pid}/smaps_rollup"
        private_kb = _kb(rollup, "Private_Dirty")
        objects.append([0])
        gc.collect()  # a full collection, in the training process
        copied_mb = (_kb(rollup, "Private_Dirty") - private_kb) / 1024
        assert copied_mb < 10, f"a collection in the training process unshared {copied_mb:.0f} MB of the heap"
    finally:
        averager.shutdown()
        del objects
