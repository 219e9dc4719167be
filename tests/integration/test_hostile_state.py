"""Issue 16 §1 and §5 against real hivemind DHTs and averager processes on 127.0.0.1: a state download asks only
the donors it is given (the downloader picks them from the swarm's signed records, never from the priorities
averagers declare for themselves), and a hostile donor that serves another layout, more tensors, another dtype or
trickles its bytes is dropped for the next donor within the download's bound. The checks of what a state may hold
(the agreed anchor, its round) are in ``tests/unit/test_sync_trust.py``."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import typing

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.streaming import split_for_streaming

from p2p_diloco.swarm import PseudoGradientAverager
from p2p_diloco.swarm.averaging import download
from p2p_diloco.swarm.averaging.server import AveragingServer
from tests.integration.test_byzantine import CFG, TEMPLATES, network, peer_id  # noqa: F401 (network: a fixture)

pytestmark = pytest.mark.timeout(180)
HONEST_STATE = [torch.full(t.shape, 0.5) for t in TEMPLATES * 2]  # anchor and momentum


def hostile_state(kind: str):
    if kind == "more tensors":
        return [torch.ones(t.shape) for t in TEMPLATES * 3]
    if kind == "another shape":
        return [torch.ones(3, *t.shape) for t in TEMPLATES * 2]
    if kind == "fp16":
        return [torch.ones(t.shape, dtype=torch.float16) for t in TEMPLATES * 2]
    if kind == "fewer tensors":
        return [torch.ones(t.shape) for t in TEMPLATES]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["more tensors", "another shape", "fp16"])
def test_a_donor_serving_another_layout_is_dropped_for_the_next(network, kind):  # noqa: F811
    hostile, honest, newcomer = network.averager(), network.averager(), network.averager()
    hostile.state_provider = lambda: ({"served_by": "hostile"}, hostile_state(kind))
    honest.state_provider = lambda: ({"served_by": "honest"}, HONEST_STATE)
    hostile.server.state_sharing_priority, honest.server.state_sharing_priority = 1e9, 0.0  # declared: ignored
    downloaded = newcomer.download_state([peer_id(hostile), peer_id(honest)], timeout_s=20)
    assert downloaded is not None and downloaded[0] == {"served_by": "honest"}
    assert all(torch.equal(a, b) for a, b in zip(downloaded[1], HONEST_STATE))
    assert newcomer.download_state([peer_id(hostile)], timeout_s=10) is None  # alone, the hostile donor gives nothing


def test_the_donors_asked_are_the_ones_given_whatever_they_declare(network):  # noqa: F811
    first, second, newcomer = network.averager(), network.averager(), network.averager()
    for averager, name in ((first, "first"), (second, "second")):
        averager.state_provider = lambda name=name: ({"served_by": name}, HONEST_STATE)
    first.server.state_sharing_priority, second.server.state_sharing_priority = 0.0, 1e9
    assert newcomer.download_state([peer_id(first), peer_id(second)], timeout_s=20)[0] == {"served_by": "first"}
    assert newcomer.download_state([peer_id(second)], timeout_s=20)[0] == {"served_by": "second"}
    assert newcomer.download_state([], timeout_s=5) is None


class Trickling(AveragingServer):
    """A donor that sends its state a small chunk at a time, each well within hivemind's per-message timeout."""

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        first = True
        for tensor in HONEST_STATE:
            for part in split_for_streaming(serialize_torch_tensor(tensor), chunk_size_bytes=1024):
                await asyncio.sleep(1.0)
                yield averaging_pb2.DownloadData(tensor_part=part, metadata=b"" if not first else
                                                 self.serializer.dumps({"served_by": "slow"}))
                first = False


Trickling.__name__ = AveragingServer.__name__  # hivemind names a servicer's handlers after its class


def test_a_donor_that_trickles_is_abandoned_within_the_bound(network):  # noqa: F811
    """hivemind's downloader bounds each message (``next_chunk_timeout_s``), not the download: a donor that sends a
    chunk every second held a newcomer for as long as it liked. The whole download is bounded; the slow donor gets
    a share of it, the next donor the rest."""
    slow = PseudoGradientAverager(TEMPLATES, network.dht(), run_id="run", stage_index=0, num_stages=1, cfg=CFG,
                                  server_type=Trickling)
    network.averagers.append(slow)
    honest, newcomer = network.averager(), network.averager()
    honest.state_provider = lambda: ({"served_by": "honest"}, HONEST_STATE)
    started = time.monotonic()
    downloaded = newcomer.download_state([peer_id(slow), peer_id(honest)], timeout_s=15)
    took = time.monotonic() - started
    assert downloaded is not None and downloaded[0] == {"served_by": "honest"}
    assert 0.6 * 15 - 1 < took < 15 + 2, took  # the slow donor had its share (0.6 of the bound), no more
    started = time.monotonic()
    assert newcomer.download_state([peer_id(slow)], timeout_s=6) is None
    assert 6 - 1 < time.monotonic() - started < 6 + 2


class Truncating(AveragingServer):
    """A donor that stops half-way through its second tensor (it left, or it means to waste the newcomer's time)."""

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        first, second = (serialize_torch_tensor(tensor) for tensor in HONEST_STATE[:2])
        yield averaging_pb2.DownloadData(tensor_part=first, metadata=self.serializer.dumps({"served_by": "truncating"}))
        half = runtime_pb2.Tensor()
        half.CopyFrom(second)
        half.buffer = second.buffer[:len(second.buffer) // 2]
        yield averaging_pb2.DownloadData(tensor_part=half)


Truncating.__name__ = AveragingServer.__name__


def test_a_donor_whose_stream_ends_inside_a_tensor_is_named_for_it_and_dropped(network, capfd):  # noqa: F811
    """A stream that ends part-way through a tensor is reported as what it is (not as a shape that does not fit),
    and the next donor serves the state. (The download runs in the newcomer's averager process: its warning reaches
    the captured stderr through a handler of the test's own, pytest's log capture stays in the parent.)"""
    handler = logging.StreamHandler(sys.stderr)
    downloads = logging.getLogger(download.__name__)
    downloads.addHandler(handler)
    try:
        downloaded, logged = truncated_download(network, capfd)
    finally:
        downloads.removeHandler(handler)
    assert downloaded is not None and downloaded[0] == {"served_by": "honest"}
    size = 4 * HONEST_STATE[1].numel()
    assert f"the donor's stream ended inside tensor 1 ({size // 2} of {size} bytes)" in logged, logged[-3000:]


def truncated_download(network, capfd):  # noqa: F811
    truncating = PseudoGradientAverager(TEMPLATES, network.dht(), run_id="run", stage_index=0, num_stages=1, cfg=CFG,
                                        server_type=Truncating)
    network.averagers.append(truncating)
    honest, newcomer = network.averager(), network.averager()
    honest.state_provider = lambda: ({"served_by": "honest"}, HONEST_STATE)
    downloaded = newcomer.download_state([peer_id(truncating), peer_id(honest)], timeout_s=20)
    return downloaded, capfd.readouterr().err
