"""A stranger floods a DHT node with entries: the node's memory with the storage bound (``dht.storage_limit_mb``)
against the same node without one (a limit far above the flood), side by side in one run.

Each victim is a node as ``p2p-diloco bootstrap`` starts it (the run's validators); one flooder's node, which checks
nothing, sends ``--flood-mb`` of 15 kB entries under fresh keys straight to it, in requests of 50 (about 0.75 MB,
under the p2p daemon's 4 MiB cap per request), half to its storage and half to its cache, expiring 500 s ahead.
Reported: the resident memory of the victim's DHT process (``/proc/<pid>/status`` VmRSS) before and after, what its
ledger holds and refused, and the time the flood took. Then an honest peer's signed progress record: whether the
flooded victim still takes it.

    .venv/bin/python benchmarks/dht_flood.py --flood-mb 200 --limit-mb 32 --out benchmarks/results/dht-flood
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hivemind  # noqa: E402
from hivemind.dht.routing import DHTID  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402

from p2p_diloco.config import DHTConfig  # noqa: E402
from p2p_diloco.swarm import publish_progress, start_dht, visible_maddrs  # noqa: E402
from p2p_diloco.swarm.discovery.progress import ProgressRecord, progress_key  # noqa: E402
from p2p_diloco.swarm.discovery.records import swarm_validators  # noqa: E402
from p2p_diloco.swarm.discovery.storage_budget import storage_totals  # noqa: E402

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
RUN = "flood-bench"
ENTRY = 15_000
BATCH = 50


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _flood(_dht, node, victim, count: int, tag: str) -> int:
    expires, taken = get_dht_time() + 500, 0
    for start in range(0, count, BATCH):
        n = min(BATCH, count - start)
        keys = [DHTID.generate(source=f"{tag}-{start + i}") for i in range(n)]
        in_cache = (start // BATCH) % 2 == 1
        answer = await node.protocol.call_store(victim, keys, [os.urandom(ENTRY) for _ in range(n)], expires,
                                                in_cache=in_cache)
        taken += sum(answer or [])
    return taken


async def _holds(_dht, node, key: str) -> bool:
    return node.protocol.storage.get(DHTID.generate(source=key)) is not None


def one(label: str, limit_mb: float, flood_mb: float) -> dict:
    victim = start_dht(DHTConfig(host_maddrs=LOOPBACK, storage_limit_mb=limit_mb),
                       record_validators=swarm_validators(RUN))
    flooder = honest = None
    try:
        initial = visible_maddrs(victim)
        flooder = hivemind.DHT(start=True, initial_peers=initial, host_maddrs=LOOPBACK)
        honest = start_dht(DHTConfig(host_maddrs=LOOPBACK, initial_peers=initial),
                           record_validators=swarm_validators(RUN))
        before = rss_mb(victim.pid)
        count = int(flood_mb * 1e6) // ENTRY
        started = time.monotonic()
        taken = flooder.run_coroutine(partial(_flood, victim=victim.peer_id, count=count, tag=label))
        seconds = time.monotonic() - started
        after = rss_mb(victim.pid)
        record = ProgressRecord(peer="honest", stage=0, num_stages=1, round=1, inner_step=20, tokens_per_s=1.0,
                                loss=2.0, time=get_dht_time())
        publish_progress(honest, RUN, record, ttl_s=60)
        deadline, held = time.monotonic() + 20, False
        while not held and time.monotonic() < deadline:
            held = victim.run_coroutine(partial(_holds, key=progress_key(RUN)))
            time.sleep(0.3)
        totals = storage_totals(victim)
        result = {"label": label, "limit_mb": limit_mb, "flood_mb": count * ENTRY / 1e6, "taken": taken,
                  "sent": count, "flood_s": round(seconds, 1), "rss_before_mb": round(before, 1),
                  "rss_after_mb": round(after, 1), "rss_growth_mb": round(after - before, 1),
                  "honest_record_taken": held, "ledger": totals}
        print(f"{label}: limit {limit_mb} MiB, {count} entries ({count * ENTRY / 1e6:.0f} MB) sent in {seconds:.1f} s, "
              f"{taken} taken; DHT process RSS {before:.0f} -> {after:.0f} MB (+{after - before:.0f}); "
              f"honest record taken after the flood: {held}", flush=True)
        return result
    finally:
        for node in (honest, flooder, victim):
            if node is not None:
                node.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood-mb", type=float, default=200.0, help="bytes of entries the flooder sends (MB)")
    parser.add_argument("--limit-mb", type=float, default=32.0, help="the bounded victim's dht.storage_limit_mb")
    parser.add_argument("--out", type=Path, help="folder for results.json and report.txt")
    args = parser.parse_args()
    if args.flood_mb <= 0 or args.limit_mb <= 0:
        parser.error("--flood-mb and --limit-mb must be positive")
    rows = [one("bounded", args.limit_mb, args.flood_mb), one("unbounded", 1e6, args.flood_mb)]
    ratio = rows[1]["rss_growth_mb"] / max(rows[0]["rss_growth_mb"], 1.0)
    summary = (f"RSS growth of the flooded DHT process: bounded +{rows[0]['rss_growth_mb']:.0f} MB (limit "
               f"{args.limit_mb:g} MiB), unbounded +{rows[1]['rss_growth_mb']:.0f} MB: {ratio:.1f}x")
    print(summary)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=2))
        lines = [" ".join(sys.argv)] + [json.dumps({k: v for k, v in r.items() if k != "ledger"}) for r in rows]
        (args.out / "report.txt").write_text("\n".join(lines + [summary]) + "\n")


if __name__ == "__main__":
    main()
