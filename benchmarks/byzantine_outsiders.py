"""The attacks of benchmarks/byzantine.py that no peer of the swarm mounts: an attacker's own DHT nodes beside the
honest peers, each with an identity of its own (signed records: K identities, K records). byzantine.py starts
``python benchmarks/byzantine.py --outsider KIND:K ...``, which runs :func:`run` in its own process until killed.

Kinds (K: identities, one DHT node each):

- ``sybil:K``: progress records ``AHEAD`` rounds past the swarm, all voting for one made-up anchor, a config
  fingerprint of another model, and a message declaring ``HUGE`` bytes to every honest averager, every 2 s;
- ``round-ahead:K``: records one round past the swarm's newest (``round_end = swarm`` once ended every honest round
  after one inner step on such a record);
- ``inflate:K``: records on the honest peers' own round (they once counted in the expected group size: rounds waited
  for peers that do not exist);
- ``squat:K``: each identity holds a state stream of every honest donor, reads a chunk every 5 s (under every stall
  timeout) and asks for a fresh stream every second (4 of them once took every serving slot for good);
- ``keysquat:K``: a node that checks nothing stores a plain value, expiring in 10**6 s, under the group key of every
  round ``<prefix>.0b<bits>`` of the run, and a declaration expiring as far ahead;
- ``vote:K``: downloads the state each peer serves and, where its fingerprint is none that any peer's record votes
  for (a poisoned donor: ``tests.hostile.peer poison-momentum``), votes for it from K identities.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from pathlib import Path

AHEAD = 1000  # rounds the sybil records claim beyond the swarm
HUGE = 2**40  # bytes the sybil's messages declare
KINDS = ("sybil", "round-ahead", "inflate", "squat", "keysquat", "vote")
FAKE_ANCHOR = "f" * 64
SQUAT_READ_EVERY_S = 5.0
KEY_ROUNDS = 64  # rounds whose group keys the key squatter takes (a benchmark run has fewer)

logger = logging.getLogger("byzantine.outsider")


def parse(spec: str) -> tuple[str, int]:
    """(kind, K) of ``kind:K``; SystemExit if malformed."""
    kind, _, count = spec.partition(":")
    if kind not in KINDS or not (count or "1").isdigit() or int(count or 1) < 1:
        raise SystemExit(f"--outsider: expected one of {', '.join(KINDS)}, as KIND:K (K >= 1), got {spec!r}")
    return kind, int(count or 1)


def run(spec: str, run_id: str, initial_peers: list[str], ready: Path, inner_steps: int) -> None:
    """Mount the attack ``spec`` on the run ``run_id`` (whose rounds are ``inner_steps`` long) until killed; write
    ``ready`` once it is in place, before the first honest peer starts."""
    from p2p_diloco.config import DHTConfig
    from p2p_diloco.swarm import start_dht
    from p2p_diloco.swarm.discovery.records import run_record_validators

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    kind, count = parse(spec)
    if kind == "keysquat":
        squat_keys(run_id, initial_peers, ready)
        return
    nodes = [start_dht(DHTConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers),
                       record_validators=run_record_validators(run_id)) for _ in range(count)]
    mine = {node.peer_id.to_base58() for node in nodes}
    ready.write_text("started\n")
    attack = {"sybil": Sybil, "round-ahead": RoundAhead, "inflate": Inflate, "squat": Squat, "vote": Vote}[kind]
    attack(nodes, run_id, inner_steps, mine).run()


def honest_records(node, run_id: str, mine: set[str]) -> list:
    from p2p_diloco.swarm import fetch_progress

    return [r for r in fetch_progress(node, run_id) if r.node not in mine]


def write_records(nodes, run_id: str, round_index: int, inner_step: int, applied_round: int, anchor: str) -> None:
    """One progress record per identity, all saying the same."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.swarm import publish_progress
    from p2p_diloco.swarm.discovery.progress import ProgressRecord
    from p2p_diloco.swarm.discovery.records import MAX_RECORD_TTL_S

    for i, node in enumerate(nodes):
        publish_progress(node, run_id, ProgressRecord(
            peer=f"outsider{i}", stage=0, num_stages=1, round=round_index, inner_step=inner_step, tokens_per_s=1e6,
            loss=0.01, time=get_dht_time(), applied_round=applied_round, anchor=anchor, prior_anchor=anchor),
            ttl_s=MAX_RECORD_TTL_S)


class Attack:
    """One outsider attack: every ``every_s`` seconds, :meth:`act` on the honest records as the first node reads
    them (once there are any)."""

    every_s = 2.0

    def __init__(self, nodes, run_id: str, inner_steps: int, mine: set[str]):
        self.nodes, self.run_id, self.inner_steps, self.mine = nodes, run_id, inner_steps, mine
        self.loop = asyncio.new_event_loop()
        self.p2ps = [self.loop.run_until_complete(node.replicate_p2p()) for node in nodes]

    def run(self) -> None:
        while True:
            records = honest_records(self.nodes[0], self.run_id, self.mine)
            if records:
                try:
                    self.act(records)
                except Exception as e:  # noqa: BLE001 (an attack step that failed is tried again)
                    logger.warning(f"{type(self).__name__}: {e!r}")
            time.sleep(self.every_s)

    def act(self, records: list) -> None:
        raise NotImplementedError

    def stub(self, p2p, peer: str):
        from hivemind.p2p import PeerID

        from p2p_diloco.swarm.averaging.averager import group_prefix
        from p2p_diloco.swarm.averaging.server import AveragingServer

        return AveragingServer.get_stub(p2p, PeerID.from_base58(peer), namespace=group_prefix(self.run_id, 0, 1))


class Sybil(Attack):
    sent = refused = 0
    fingerprint = None

    def act(self, records: list) -> None:
        from p2p_diloco.swarm.discovery.fingerprint import config_key, publish_fingerprint
        from p2p_diloco.swarm.discovery.records import MAX_RECORD_TTL_S

        if self.fingerprint is None:
            found = self.nodes[0].get(config_key(self.run_id), latest=True)
            honest = [e.value for e in (found.value.values() if found and isinstance(found.value, dict) else [])
                      if isinstance(e.value, dict)]
            if not honest:
                return
            self.fingerprint = dict(honest[0], **{"model.dim": honest[0]["model.dim"] + 1})
        top = max(r.round for r in records) + AHEAD
        write_records(self.nodes, self.run_id, top, top * self.inner_steps, top - 1, FAKE_ANCHOR)
        for node in self.nodes:
            publish_fingerprint(node, self.run_id, self.fingerprint, ttl_s=MAX_RECORD_TTL_S)
        for peer in {r.node for r in records}:
            try:
                self.refused += self.loop.run_until_complete(self.oversized(peer))
                self.sent += 1
            except Exception as e:  # a peer that cannot be reached, or that reset the stream: both fine
                logger.info(f"oversized message to {peer}: {e!r}")
        logger.info(f"{len(self.nodes)} sybil records at round {top}; oversized messages: {self.sent} sent, "
                    f"{self.refused} closed by the peer")

    async def oversized(self, peer: str) -> bool:
        """Whether the honest peer closed a stream that declared ``HUGE`` bytes before its first reply."""
        from hivemind.p2p import P2P, PeerID

        from p2p_diloco.swarm.averaging.averager import group_prefix
        from p2p_diloco.swarm.averaging.server import AveragingServer

        handler = AveragingServer._get_handle_name(group_prefix(self.run_id, 0, 1), "rpc_join_group")
        _info, reader, writer = await self.p2ps[0].call_binary_stream_handler(PeerID.from_base58(peer), handler)
        try:
            writer.write(P2P.MESSAGE_MARKER + HUGE.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\0" * 2**16)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), timeout=10) == b""
        finally:
            writer.close()


class RoundAhead(Attack):
    every_s = 0.5  # the honest peers read records every 0.5 s at a round's end

    def act(self, records: list) -> None:
        top = max(r.round for r in records)
        write_records(self.nodes, self.run_id, top + 1, (top + 1) * self.inner_steps, top, FAKE_ANCHOR)


class Inflate(Attack):
    def act(self, records: list) -> None:
        top = max(r.round for r in records)
        write_records(self.nodes, self.run_id, top, top * self.inner_steps + 1, top - 1, FAKE_ANCHOR)
        logger.info(f"{len(self.nodes)} records on round {top}")


class Squat(Attack):
    """Each identity holds one state stream of each honest donor (see tests/integration/test_wire_limits.py)."""

    def run(self) -> None:
        self.loop.run_until_complete(self.squat_all())

    async def squat_all(self) -> None:
        tasks: dict[tuple[int, str], asyncio.Task] = {}
        while True:
            records = await asyncio.to_thread(honest_records, self.nodes[0], self.run_id, self.mine)
            for peer in {r.node for r in records}:
                for i, p2p in enumerate(self.p2ps):
                    if (i, peer) not in tasks:
                        tasks[i, peer] = asyncio.ensure_future(self.squat(p2p, peer))
            held = sum(not t.done() for t in tasks.values())
            logger.info(f"squatting {held} (identity, donor) pairs")
            await asyncio.sleep(2)

    async def squat(self, p2p, peer: str) -> None:
        stub, stream, read_at = self.stub(p2p, peer), None, 0.0
        while True:
            with contextlib.suppress(StopAsyncIteration, Exception):  # refused: ask again
                fresh = await stub.rpc_download_state(self.request())
                await asyncio.wait_for(anext(fresh), timeout=10)
                stream, read_at = fresh, time.monotonic()  # admitted
            if stream is not None and time.monotonic() - read_at >= SQUAT_READ_EVERY_S:
                with contextlib.suppress(StopAsyncIteration, Exception):
                    await asyncio.wait_for(anext(stream), timeout=1)
                read_at = time.monotonic()
            await asyncio.sleep(1)

    @staticmethod
    def request():
        from hivemind.proto import averaging_pb2

        return averaging_pb2.DownloadRequest()


class Vote(Attack):
    """Votes for every served state that differs from what its donor's records say (a poisoned donor's)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.checked: dict[str, int] = {}  # donor -> the applied round of the state last downloaded from it
        self.target: tuple[int, int, str] | None = None  # (round, applied round, fingerprint) voted for

    def act(self, records: list) -> None:
        vouched = {r.anchor for r in records} | {r.prior_anchor for r in records}
        for r in records:
            if self.checked.get(r.node) == r.applied_round:
                continue
            self.checked[r.node] = r.applied_round
            meta, fingerprint = self.loop.run_until_complete(asyncio.wait_for(self.served(r.node), timeout=20))
            if fingerprint not in vouched:
                self.target = (meta["round"], meta["applied_round"], fingerprint)
                logger.info(f"{r.node} serves {fingerprint[:12]} after round {meta['applied_round']}, which no "
                            "record vouches for: voting for it")
        if self.target is not None:
            round_index, applied, fingerprint = self.target
            write_records(self.nodes, self.run_id, round_index, round_index * self.inner_steps + 1, applied,
                          fingerprint)

    async def served(self, peer: str) -> tuple[dict, str]:
        """(metadata, fingerprint) of the state ``peer`` serves (hivemind's own reading of a state stream)."""
        from hivemind.compression import deserialize_torch_tensor
        from hivemind.utils.serializer import MSGPackSerializer
        from hivemind.utils.streaming import combine_from_streaming

        from p2p_diloco.round.swarm_state import anchor_digest, state_fingerprint

        meta, tensors, parts = None, [], []
        async for message in await self.stub(self.p2ps[0], peer).rpc_download_state(Squat.request()):
            if message.metadata:
                meta = MSGPackSerializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        half = len(tensors) // 2
        return meta, state_fingerprint(anchor_digest(tensors[:half]), tensors[half:], meta["applied_round"],
                                       meta["outer_steps"])


def squat_keys(run_id: str, initial_peers: list[str], ready: Path) -> None:
    """``keysquat``: a plain hivemind node (it checks nothing, so it keeps what it stores and hands it to whoever
    asks) stores, every 10 s, a plain value and a declaration expiring in 10**6 s under the group key of each of the
    run's first ``KEY_ROUNDS`` rounds, which honest nodes hash to the same place."""
    import hivemind
    from hivemind.utils import get_dht_time

    from p2p_diloco.swarm.averaging.averager import group_prefix, round_bits

    node = hivemind.DHT(start=True, initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    keys = [f"{group_prefix(run_id, 0, 1)}.0b{round_bits(r)}" for r in range(KEY_ROUNDS)]
    first = True
    while True:
        forever = get_dht_time() + 10**6
        stored = sum(bool(node.store(key, b"squatted", expiration_time=forever)) for key in keys)
        declared = sum(bool(node.store(key, subkey=node.peer_id.to_bytes(), value=True, expiration_time=forever))
                       for key in keys)
        logger.info(f"plain values stored under {stored} of {len(keys)} round keys, declarations under {declared}")
        if first:
            ready.write_text("started\n")
            first = False
        time.sleep(10)
