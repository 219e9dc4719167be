"""Issue 49's flood of made-up averagers' declarations, replayed against a swarm at the default storage limit: does
matchmaking still work?

A swarm on 127.0.0.1 as ``p2p-diloco bootstrap`` and ``peer`` start it: a bootstrap node and two peers' nodes, each
with ``dht.storage_limit_mb`` (256 MiB by default; its averagers' share of the storage holds 172,960 declarations).
Two honest averagers (one per peer's node) first form a group once without a flood. Then, on every node, straight
by hivemind's store request, far ahead of expiry (500 s), in requests of 2,000:

1. ``made-up``: one stranger sends ``--entries`` declarations of made-up averagers (a random peer id as subkey, as
   in the issue) under the round's group key;
2. ``identities``: ``--identities`` strangers, each a libp2p identity of its own, declare themselves under group keys
   of many rounds, the round the honest averagers use included: ``--entries`` in all.

After each, the two honest averagers look for their group under that round's key while the flood is kept. Reported:
entries sent and taken, the flood's time, what each node's ledger holds, refused and dropped, the resident memory of
the bootstrap node's DHT process, and whether (and how fast) the honest group formed.

    .venv/bin/python benchmarks/declaration_flood.py --out benchmarks/results/declaration-flood
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from hivemind.dht.protocol import DHTProtocol  # noqa: E402
from hivemind.dht.routing import DHTID  # noqa: E402
from hivemind.p2p import P2P  # noqa: E402
from hivemind.proto import dht_pb2  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

from p2p_diloco.config import AveragingConfig, DHTConfig  # noqa: E402
from p2p_diloco.swarm import PseudoGradientAverager, start_dht, visible_maddrs  # noqa: E402
from p2p_diloco.swarm.averaging.averager import group_prefix, round_bits  # noqa: E402
from p2p_diloco.swarm.discovery.records import swarm_validators  # noqa: E402
from p2p_diloco.swarm.discovery.storage_budget import storage_totals  # noqa: E402

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN = "declaration-flood"
BATCH = 2_000
CFG = AveragingConfig(compression="none")
TEMPLATES = [torch.zeros(256, 64), torch.zeros(64)]
STORE_HANDLER = "DHTProtocol.rpc_store"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def group_key(round_index: int) -> str:
    return f"{group_prefix(RUN, 0, 1)}.0b{round_bits(round_index)}"


async def _send(p2p, nodes, keys: list[str], subkeys: list[bytes], expiration: float) -> int:
    """Stores (key, subkey, True) on each of ``nodes`` in requests of :data:`BATCH`; how many entries they took."""
    taken, value = 0, DHTProtocol.serializer.dumps(True)
    for start in range(0, len(keys), BATCH):
        batch = slice(start, start + BATCH)
        request = dht_pb2.StoreRequest(
            keys=[DHTID.generate(source=key).to_bytes() for key in keys[batch]],
            subkeys=[DHTProtocol.serializer.dumps(subkey) for subkey in subkeys[batch]],
            values=[value] * len(keys[batch]), expiration_time=[expiration] * len(keys[batch]),
            in_cache=[False] * len(keys[batch]))
        for node in nodes:
            answer = await asyncio.wait_for(
                p2p.call_protobuf_handler(node, STORE_HANDLER, request, dht_pb2.StoreResponse), timeout=60)
            taken += sum(answer.store_ok)
    return taken


async def _flood(initial: list[str], nodes, mode: str, entries: int, num_identities: int, honest_round: int) -> int:
    expiration = get_dht_time() + 500
    identities = await asyncio.gather(*[P2P.create(initial_peers=initial, host_maddrs=LOOPBACK)
                                        for _ in range(1 if mode == "made-up" else num_identities)])
    try:
        if mode == "made-up":
            subkeys = [b"\x12\x20" + os.urandom(32) for _ in range(entries)]
            return await _send(identities[0], nodes, [group_key(honest_round)] * entries, subkeys, expiration)
        per_identity = entries // num_identities
        rounds = [honest_round] + [r for r in range(1 << 16) if r != honest_round][:per_identity - 1]
        taken = 0
        for p2p in identities:
            taken += await _send(p2p, nodes, [group_key(r) for r in rounds], [p2p.peer_id.to_bytes()] * len(rounds),
                                 expiration)
        return taken
    finally:
        await asyncio.gather(*[p2p.shutdown() for p2p in identities])


def honest_round(nodes, round_index: int) -> dict:
    """Two honest averagers, on the two peers' nodes, look for their group in ``round_index``."""
    averagers, started = [], time.monotonic()
    try:
        for node in nodes[1:]:
            averagers.append(PseudoGradientAverager(TEMPLATES, node, run_id=RUN, stage_index=0, num_stages=1,
                                                    cfg=CFG))
        for k, averager in enumerate(averagers):
            averager.set_expected_group_size(len(averagers))
            averager.start_round([torch.full_like(t, float(k + 1)) for t in TEMPLATES], round_index, weight=1.0)
        results = [averager.finish_round() for averager in averagers]
    finally:
        for averager in averagers:
            averager.shutdown()
    return {"round": round_index, "groups": [(r.averaged, r.group_size) for r in results],
            "formed": all(r.averaged and r.group_size == 2 for r in results), "seconds": round(
                time.monotonic() - started, 1), "fallbacks": [r.fallback_reason for r in results if not r.averaged]}


def ledger_row(totals: dict) -> dict:
    storage = totals["storage"]
    return {"held_mib": round(storage["held"]["averagers"] / 2**20, 2),
            "share_mib": round(storage["limit_bytes"] * 0.25 / 2**20, 2),
            "refused": storage["refused"]["averagers"], "evicted": storage.get("evicted", {}).get("averagers"),
            "senders": storage.get("senders", {}).get("averagers")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=172_960, help="declarations sent to each node, per flood")
    parser.add_argument("--identities", type=int, default=16, help="strangers of the second flood")
    parser.add_argument("--limit-mb", type=float, default=256.0, help="every node's dht.storage_limit_mb")
    parser.add_argument("--out", type=Path, help="folder for results.json and report.txt")
    args = parser.parse_args()
    nodes = [start_dht(DHTConfig(host_maddrs=LOOPBACK, storage_limit_mb=args.limit_mb),
                       record_validators=swarm_validators(RUN))]
    rows, lines = [], [" ".join(sys.argv)]
    try:
        initial = visible_maddrs(nodes[0])
        for _ in range(2):
            nodes.append(start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=initial,
                                             storage_limit_mb=args.limit_mb), record_validators=swarm_validators(RUN)))
        addresses = [a for node in nodes for a in visible_maddrs(node)]
        baseline = honest_round(nodes, 0)
        rows.append({"flood": "none", "honest": baseline})
        lines.append(f"no flood: honest group {baseline}")
        print(lines[-1], flush=True)
        for number, mode in enumerate(("made-up", "identities"), start=1):
            before = rss_mb(nodes[0].pid)
            started = time.monotonic()
            taken = asyncio.run(_flood(addresses, [n.peer_id for n in nodes], mode, args.entries, args.identities,
                                       number))
            seconds = time.monotonic() - started
            after = rss_mb(nodes[0].pid)
            ledgers = [ledger_row(storage_totals(node)) for node in nodes]
            honest = honest_round(nodes, number)
            row = {"flood": mode, "identities": 1 if mode == "made-up" else args.identities,
                   "sent_per_node": args.entries if mode == "made-up" else
                   args.entries // args.identities * args.identities, "taken_all_nodes": taken,
                   "flood_s": round(seconds, 1), "bootstrap_rss_mb": [round(before), round(after)],
                   "ledgers": ledgers, "honest": honest,
                   "ledgers_after_honest": [ledger_row(storage_totals(node)) for node in nodes]}
            rows.append(row)
            lines.append(json.dumps(row))
            print(lines[-1], flush=True)
    finally:
        for node in nodes:
            node.shutdown()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=2))
        (args.out / "report.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
