"""Hostile peers against the robust averaging and the swarm's sync: does a swarm still train, and is the hostile
peer named?

4 tiny peers on 127.0.0.1, one of them hostile (``peer --test-hostility``, see p2p_diloco/faults.py), in turn:
- on the wire: pseudo-gradients scaled by 1000, replaced by random noise of 100x their norm, NaN, and a stale round
  replayed (its contribution of the previous round, claimed under that round's number);
- as the group's leader: ``forge-tokens`` (relays each follower's own record with 1000x fewer tokens, and returns
  averages 1000x too large), ``forge-round`` (tells one follower that another is on the wrong round);
- ``stall:20`` (joins every group, then sends nothing for 20 s), ``lowball`` (asks for the least precision);
- ``false-state`` (its progress records claim 1000 rounds more than it trained, and the state it serves is shifted
  by 1 everywhere: a poisoned donor with a fake round).
And ``outsider sybil:K``: the 3 honest peers and, beside them, K DHT nodes of one attacker, each with an identity of
its own (records are signed by their writer's identity: K identities, K records), that from the start write
progress records 1000 rounds ahead of the swarm, all voting for one made-up anchor (vote stuffing and fake rounds),
a config fingerprint of another model (a veto, as one record used to be), and send each honest peer's averager a
message whose header declares 2**40 bytes, every few seconds.

Baselines with the same tokens per peer: the 3 honest peers alone (what the honest peers would reach if the hostile
one had never joined: the target, within 2%) and 4 honest peers. With --undefended, the scaled attack once more with
the robust combination off (averaging.outlier_norm_ratio = clip_ratio = 0): what the defence prevents.

For each run: the honest peers' eval loss of the final anchor (their anchors are bit-identical: one number), its
gap to the 3-honest run, the rounds the honest peers averaged, the longest an honest peer waited at a round end,
the reloads and resyncs of honest peers, their peak memory against the 3-honest run, whether every honest peer named
the hostile one in its round metrics (with an offence) and had banned it by the end, and any honest peer named.

    python benchmarks/byzantine.py --out runs/byzantine          # ~20 minutes on 2 busy cores
    python benchmarks/byzantine.py --attacks scale:1000,nan --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_bootstrap import start_bootstrap  # noqa: E402

from p2p_diloco.swarm.averaging.guard import OFFENCES as GUARD_OFFENCES  # noqa: E402
from p2p_diloco.swarm.averaging.guard import STALL  # noqa: E402

ATTACKS = ("scale:1000", "noise:100", "nan", "stale:1", "forge-tokens", "forge-round", "stall:20", "lowball",
           "false-state", "sybil:4")
OUTSIDERS = ("sybil",)  # attacks mounted beside the 3 honest peers by this script (--outsider), not by a peer
OFFENCES = GUARD_OFFENCES | {STALL}  # what counts as naming a peer (stalls count towards a ban too)
AHEAD = 1000  # rounds the sybil records claim beyond the swarm
HUGE = 2**40  # bytes the sybil's messages declare
FAST = ["--averaging.matchmaking_time_s", "5", "--averaging.request_timeout_s", "2",
        "--averaging.round_timeout_s", "30", "--averaging.allreduce_timeout_s", "60",
        "--averaging.next_chunk_timeout_s", "20",
        "--train.progress", "false", "--checkpoint.every_rounds", "0"]


def run_swarm(workdir: Path, name: str, hostile: list[str], args: list[str], outsider: str = "",
              hostile_args: tuple[str, ...] = ()) -> list[Path]:
    """A bootstrap node and one peer per entry of ``hostile`` ("" for an honest one) on loopback; peer i samples
    its data with seed i; the hostile ones get ``hostile_args`` too; with ``outsider`` (``sybil:K``), the outsider's
    nodes start first, beside them; returns the peers' folders once all have finished."""
    root = workdir / name
    root.mkdir(parents=True)
    boot, maddrs = start_bootstrap(root, start_new_session=True)
    procs = []
    try:
        if outsider:
            ready = root / "outsider.ready"
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--outsider", outsider, "--run-id", name, "--ready-file", str(ready),
                 "--initial-peers", *maddrs], stdout=subprocess.DEVNULL, stderr=open(root / "outsider.log", "w")))
            deadline = time.monotonic() + 120
            while not ready.exists():  # its records are in before the first honest peer reads the swarm's
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError(f"{name}: the outsider did not start, see {root / 'outsider.log'}")
                time.sleep(0.5)
        outside = len(procs)
        folders = []
        for i, kind in enumerate(hostile):
            folders.append(root / f"peer{i}")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *maddrs, "--host-maddrs",
                 "/ip4/127.0.0.1/tcp/0", "--run-id", name, "--output-dir", str(folders[-1]), "--data.seed", str(i),
                 "--averaging.target_group_size", str(len(hostile)), "--train.wait_for_peers", str(len(hostile)),
                 *FAST, *args, *(["--test-hostility", kind, *hostile_args] if kind else [])],
                stdout=subprocess.DEVNULL, stderr=open(root / f"peer{i}.log", "w")))
        for i, proc in enumerate(procs[outside:]):
            if proc.wait() != 0:
                raise RuntimeError(f"{name}: peer {i} failed, see {root / f'peer{i}.log'}")
        return folders
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        boot.terminate()
        boot.wait()


def outsider(spec: str, run_id: str, initial_peers: list[str], ready: Path) -> None:
    """The outsider attack ``sybil:K`` (runs until killed): K DHT nodes, one identity each, join the swarm; once the
    honest peers' records are in, every 2 s each node writes a progress record ``AHEAD`` rounds past the swarm's
    largest, all holding one made-up anchor, and a config fingerprint of another model (the honest one with
    model.dim + 1), and sends a message declaring ``HUGE`` bytes to every honest peer's averager."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils import get_dht_time

    from p2p_diloco.config import DHTConfig
    from p2p_diloco.swarm import fetch_progress, publish_progress, start_dht
    from p2p_diloco.swarm.averaging.averager import PseudoGradientAverager, group_prefix
    from p2p_diloco.swarm.discovery.fingerprint import config_key, publish_fingerprint
    from p2p_diloco.swarm.discovery.progress import ProgressRecord
    from p2p_diloco.swarm.discovery.records import MAX_RECORD_TTL_S, run_record_validators

    kind, _, count = spec.partition(":")
    if kind not in OUTSIDERS or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"--outsider: expected sybil:K (K >= 1), got {spec!r}")
    nodes = [start_dht(DHTConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers),
                       record_validators=run_record_validators(run_id)) for _ in range(int(count))]
    fake_anchor = "f" * 64
    handler = PseudoGradientAverager._get_handle_name(group_prefix(run_id, 0, 1), "rpc_join_group")
    loop = asyncio.new_event_loop()
    p2p = loop.run_until_complete(nodes[0].replicate_p2p())
    sent = refused = 0

    async def oversized(peer: str) -> bool:
        """Whether the honest peer closed a stream that declared ``HUGE`` bytes before its first reply."""
        _info, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler)
        try:
            writer.write(P2P.MESSAGE_MARKER + HUGE.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"\0" * 2**16)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), timeout=10) == b""
        finally:
            writer.close()

    ready.write_text("started\n")
    fingerprint = None
    while True:
        records = [r for r in fetch_progress(nodes[0], run_id) if not r.peer.startswith("sybil")]  # the honest
        if fingerprint is None:
            found = nodes[0].get(config_key(run_id), latest=True)
            honest = [e.value for e in (found.value.values() if found and isinstance(found.value, dict) else [])
                      if isinstance(e.value, dict)]
            fingerprint = dict(honest[0], **{"model.dim": honest[0]["model.dim"] + 1}) if honest else None
        if records and fingerprint:
            top = max(r.round for r in records)
            for i, node in enumerate(nodes):
                publish_progress(node, run_id, ProgressRecord(
                    peer=f"sybil{i}", stage=0, num_stages=1, round=top + AHEAD, inner_step=(top + AHEAD) * 10,
                    tokens_per_s=1e6, loss=0.01, time=get_dht_time(), applied_round=top + AHEAD - 1,
                    anchor=fake_anchor, prior_anchor=fake_anchor), ttl_s=MAX_RECORD_TTL_S)
                publish_fingerprint(node, run_id, fingerprint, ttl_s=MAX_RECORD_TTL_S)
            for peer in {r.node for r in records}:
                try:
                    refused += loop.run_until_complete(oversized(peer))
                    sent += 1
                except Exception as e:  # a peer that cannot be reached, or that reset the stream: both fine
                    print(f"oversized message to {peer}: {e!r}", file=sys.stderr)
            print(f"round {top}: {len(nodes)} sybil records at round {top + AHEAD}; oversized messages: {sent} sent, "
                  f"{refused} closed by the peer", file=sys.stderr, flush=True)
        time.sleep(2)


def events(folder: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, open(folder / "metrics-stage0.jsonl")) if e["kind"] == kind]


def measure(folders: list[Path], hostile: list[str]) -> dict:
    """Loss, agreement and identification of one run, from the peers' metrics and summaries."""
    summaries = [json.loads((f / "summary-stage0.json").read_text()) for f in folders]
    honest = [i for i, kind in enumerate(hostile) if not kind]
    bad_ids = {summaries[i]["peer"] for i, kind in enumerate(hostile) if kind}
    applied = {i: [e for e in events(folders[i], "round") if e["applied_round"] is not None] for i in honest}
    named_by, banned_by, named_honest = 0, 0, set()
    for i in honest:
        offences = {peer for e in applied[i] for peer, reasons in e["suspects"].items() if OFFENCES & set(reasons)}
        named_by += bool(bad_ids) and bad_ids <= offences
        banned_by += bool(bad_ids) and bad_ids <= set(applied[i][-1]["banned"] if applied[i] else [])
        named_honest |= {f"{peer} ({','.join(sorted(reasons))})" for e in applied[i]
                         for peer, reasons in e["suspects"].items() if peer not in bad_ids and OFFENCES & set(reasons)}
    digests = [{e["applied_round"]: e["anchor_sha256"] for e in applied[i]} for i in honest]
    return {
        "eval_loss": statistics.mean(summaries[i]["eval_loss_final"] for i in honest),
        "eval_loss_spread": max(summaries[i]["eval_loss_final"] for i in honest)
        - min(summaries[i]["eval_loss_final"] for i in honest),
        "averaged_rounds": min(sum(e["averaged"] for e in applied[i]) for i in honest),
        "rounds": len(applied[honest[0]]),
        "anchors_identical": all(d == digests[0] for d in digests),
        "named_by": named_by, "banned_by": banned_by, "honest_peers": len(honest),
        "honest_named": sorted(named_honest),
        "reasons": sorted({r for i in honest for e in applied[i] for peer, reasons in e["suspects"].items()
                           if peer in bad_ids for r in reasons}),
        "tokens_per_peer": summaries[honest[0]]["tokens"],
        "max_wait_s": max(e["waited_s"] for i in honest for e in applied[i]),
        "reloads": sum(summaries[i]["reloads"] + summaries[i]["resyncs"] for i in honest),
        "rss_mb": statistics.mean(summaries[i]["max_rss_mb"] for i in honest),
    }


def report(results: dict, args) -> str:
    base = results["honest-3"]["eval_loss"]
    base_rss = results["honest-3"]["rss_mb"]
    lines = [f"4 tiny peers (1 hostile), H = {args.h}, {args.rounds} rounds, "
             f"{results['honest-3']['tokens_per_peer']:,} tokens per peer; eval loss of the honest peers' final "
             "anchor against the 3 honest peers alone; max wait: the longest an honest peer waited at a round end; "
             "reloads: honest reloads and resyncs; memory: honest peers' mean peak RSS against the 3 honest alone",
             f"{'run':<22} {'eval loss':>9} {'vs 3 honest':>11} {'averaged':>8}  {'anchors':<9} {'max wait':>8} "
             f"{'reloads':>7} {'memory':>7}  {'named by':<9} {'banned by':<9} reasons"]
    for name, r in results.items():
        gap = (r["eval_loss"] - base) / base
        hostile = name.startswith(("hostile", "undefended"))
        named = f"{r['named_by']}/{r['honest_peers']}" if hostile else "-"
        banned = f"{r['banned_by']}/{r['honest_peers']}" if hostile else "-"
        lines.append(f"{name:<22} {r['eval_loss']:>9.4f} {gap:>+11.2%} {r['averaged_rounds']:>4}/{r['rounds']:<3}  "
                     f"{'identical' if r['anchors_identical'] else 'DIFFER':<9} {r['max_wait_s']:>7.1f}s "
                     f"{r['reloads']:>7} {r['rss_mb'] / base_rss - 1:>+7.1%}  {named:<9} {banned:<9} "
                     f"{','.join(r['reasons']) or '-'}")
        if r["honest_named"]:
            lines.append(f"  honest peers named as offenders: {r['honest_named']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=",".join(ATTACKS),
                        help="--test-hostility values, and sybil:K for the outsider, one run each")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--h", type=int, default=25, help="inner steps per round")
    parser.add_argument("--undefended", action="store_true", help="also run scale:1000 with the defence off")
    parser.add_argument("--peer-args", default="", help="extra peer arguments, e.g. '--averaging.compression none'")
    parser.add_argument("--hostile-args", default="",
                        help="extra arguments of the hostile peer only, e.g. '--averaging.matchmaking_time_s 2' (a "
                             "leader that declares the earliest expiration, so that the others join its groups)")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("byzantine-%Y%m%d-%H%M%S"))
    parser.add_argument("--outsider", help=argparse.SUPPRESS)  # the outsider's own process (see run_swarm)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.outsider:
        outsider(args.outsider, args.run_id, args.initial_peers, args.ready_file)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "64", "--run.num_threads", "1",
              "--train.num_rounds", str(args.rounds), "--diloco.inner_steps", str(args.h), "--data.eval_batches", "8",
              "--train.eval_every_rounds", "0", *args.peer_args.split()]
    runs = {"honest-3": ["", "", ""], "honest-4": ["", "", "", ""]}
    attacks = [kind for kind in args.attacks.split(",") if kind]
    runs.update({f"hostile {kind}": ["", "", "", kind] for kind in attacks if kind.partition(":")[0] not in OUTSIDERS})
    outsiders = {f"outsider {kind}": kind for kind in attacks if kind.partition(":")[0] in OUTSIDERS}
    runs.update({name: ["", "", ""] for name in outsiders})
    if args.undefended:
        runs["undefended scale:1000"] = ["", "", "", "scale:1000"]
    results: dict = {}
    started = time.monotonic()
    workdir = args.out / "runs"  # the peers' metrics and logs, kept for a look
    shutil.rmtree(workdir, ignore_errors=True)
    for i, (name, hostile) in enumerate(runs.items()):
        extra = ["--averaging.outlier_norm_ratio", "0", "--averaging.clip_ratio", "0"] \
            if name.startswith("undefended") else []
        folders = run_swarm(workdir, f"run{i}", hostile, common + extra, outsiders.get(name, ""),
                            tuple(args.hostile_args.split()))
        results[name] = measure(folders, hostile)
        print(f"{name} ({folders[0].parent}): eval loss {results[name]['eval_loss']:.4f}, named by "
              f"{results[name]['named_by']}, {time.monotonic() - started:.0f} s", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "report.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
