"""``p2p-diloco status``: who is training in a run, on which stage and round, how fast, read from the DHT.

Starts a client-mode DHT node (it makes only outgoing connections and stores nothing), reads the run's
progress records (:func:`p2p_diloco.swarm.fetch_progress`), prints a table or one JSON document, and shuts
the node down. Exit code 1 when no peer of the run is found.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from typing import TYPE_CHECKING

from p2p_diloco.cli.logs import configure_logging

if TYPE_CHECKING:  # (imported when used: it imports torch and hivemind, which `p2p-diloco --help` does not need)
    from p2p_diloco.swarm.discovery.progress import ProgressRecord

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "status", help="show the peers of a run: stages, rounds, throughput, loss", allow_abbrev=False,
        description="Join the swarm as a client (outgoing connections only), read the progress records of a run "
        "from the DHT and print each stage process: its peer (id shortened), stage, round, inner step, tokens/s, "
        "last loss and when it last reported; then the current round (the highest) and the total throughput "
        "(sum of tokens/s over the peers' stage 0: each peer once, whatever its number of stages). In a run "
        "averaged by fragment (diloco.fragments), each stage process is shown with the fragments it holds. Exit code 1 "
        "when no peer of the run is found.",
    )
    parser.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                        help="multiaddrs of a running bootstrap node or peer, ending in /p2p/<peer id>")
    parser.add_argument("--run-id", metavar="NAME", help="the run to show")
    parser.add_argument("--config", metavar="TOML",
                        help="take the run id and initial peers from a peer's config file (the options above win)")
    parser.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")
    parser.add_argument("--timeout", type=float, default=20.0, metavar="SECONDS",
                        help="give up joining the swarm and reading the records after this long (default 20)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
    from p2p_diloco.config import ConfigError
    from p2p_diloco.swarm import SwarmError, fetch_progress, start_dht
    from p2p_diloco.swarm.discovery.fingerprint import run_fragments
    from p2p_diloco.swarm.discovery.progress import records_run

    cfg = status_config(args)
    if not cfg.dht.initial_peers:
        raise ConfigError("dht.initial_peers: status needs the multiaddr of a running bootstrap node or peer "
                          "(--initial-peers)")
    configure_logging("WARNING")
    through = ", ".join(cfg.dht.initial_peers)
    dht = start_dht(cfg.dht, check_identity_free=False)
    try:
        deadline = time.monotonic() + args.timeout
        fragments = run_fragments(dht, cfg.run.run_id, timeout_s=max(1.0, deadline - time.monotonic()))
        if fragments:  # a run averaged by fragment: each fragment's records under its own key
            records = [r for f in range(fragments) for r in _read_records(
                dht, records_run(cfg.run.run_id, (f, fragments)), fetch_progress, deadline=deadline)]
        else:
            records = _read_records(dht, cfg.run.run_id, fetch_progress, deadline=deadline)
        from hivemind.utils import get_dht_time

        now = get_dht_time()
    finally:
        dht.shutdown()
    report = build_report(cfg.run.run_id, records, now, num_fragments=fragments)
    if records or args.json:  # scripts get a document either way, and the exit code
        print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    if not records:
        raise SwarmError(f"no peers of run {cfg.run.run_id} found through {through}: check --run-id and that "
                         "peers are running")
    return 0


def status_config(args: argparse.Namespace):
    """The [run] and [dht] settings of a client-mode node: no identity, no fixed port, no metrics server."""
    from p2p_diloco.config import load_config

    overrides = [("dht.client_mode", "true"), ("dht.identity_path", "none"), ("dht.host_maddrs", "/ip4/0.0.0.0/tcp/0"),
                 ("dht.announce_maddrs", ""), ("metrics.port", "none"),
                 ("dht.startup_timeout_s", str(args.timeout))]
    if args.initial_peers:
        overrides.append(("dht.initial_peers", ",".join(args.initial_peers)))
    if args.run_id:
        overrides.append(("run.run_id", args.run_id))
    elif not args.config:
        from p2p_diloco.config import ConfigError

        raise ConfigError("run.run_id: which run? give --run-id (or --config with the run's config file)")
    return load_config(args.config, overrides)


def _read_records(dht, run_id: str, fetch, deadline: float, max_attempts: int = 3) -> list[ProgressRecord]:
    """A node that has just joined may not reach the records' holders at once: a few bounded attempts."""
    for attempt in range(max_attempts):
        records = fetch(dht, run_id, timeout_s=max(1.0, deadline - time.monotonic()))
        if records or attempt == max_attempts - 1 or time.monotonic() + 1.0 >= deadline:
            return records
        time.sleep(1.0)
    return []


def short_id(peer_id: str, keep: int = 8) -> str:
    return peer_id if len(peer_id) <= keep + 3 else "..." + peer_id[-keep:]


def _number(value: float):
    return None if value is None or not math.isfinite(value) else value


def build_report(run_id: str, records: list[ProgressRecord], now: float, num_fragments: int = 0) -> dict:
    """The status of a run as one JSON-able document (what ``--json`` prints). In a run averaged by fragment
    (``num_fragments`` F), ``records`` are the fragments' (each record's stage is its fragment): one row per stage
    process with the fragments it holds, its round the lowest of theirs."""
    if num_fragments:
        return _fragment_report(run_id, records, now, num_fragments)
    rows = sorted(records, key=lambda r: (r.peer, r.stage, r.node))
    stage0 = {r.peer: r for r in rows if r.stage == 0}
    return {
        "run_id": run_id,
        "num_peers": len({r.peer for r in rows}),
        "num_processes": len(rows),
        "current_round": max((r.round for r in rows), default=None),
        "tokens_per_s_total": sum(_number(r.tokens_per_s) or 0.0 for r in stage0.values()),
        "tokens_per_s_total_over": "stage 0 of every peer",
        "peers": [{
            "peer": r.peer, "node": r.node, "stage": r.stage, "num_stages": r.num_stages, "round": r.round,
            "applied_round": r.applied_round, "inner_step": r.inner_step, "tokens_per_s": _number(r.tokens_per_s),
            "loss": _number(r.loss), "last_seen_s": round(max(0.0, now - r.time), 1),
        } for r in rows],
    }


def _fragment_report(run_id: str, records: list[ProgressRecord], now: float, num_fragments: int) -> dict:
    by_node: dict[str, list[ProgressRecord]] = {}
    for r in records:
        if r.num_stages == num_fragments:
            by_node.setdefault(r.node, []).append(r)
    rows = []
    for node, held in by_node.items():
        held.sort(key=lambda r: r.stage)
        last = held[-1]  # the loss lives on the stage that holds the last fragment
        rows.append({
            "peer": last.peer, "node": node, "stage": None, "fragments": [r.stage for r in held],
            "num_fragments": num_fragments, "round": min(r.round for r in held),
            "applied_round": min(r.applied_round for r in held), "inner_step": min(r.inner_step for r in held),
            "tokens_per_s": _number(held[0].tokens_per_s), "loss": _number(last.loss),
            "last_seen_s": round(max(0.0, now - max(r.time for r in held)), 1)})
    rows.sort(key=lambda row: (row["peer"], row["fragments"][0], row["node"]))
    first = {row["peer"]: row for row in rows if row["fragments"][0] == 0}
    return {
        "run_id": run_id,
        "num_peers": len({row["peer"] for row in rows}),
        "num_processes": len(rows),
        "num_fragments": num_fragments,
        "current_round": max((row["round"] for row in rows), default=None),
        "tokens_per_s_total": sum(row["tokens_per_s"] or 0.0 for row in first.values()),
        "tokens_per_s_total_over": "the stage holding fragment 0 of every peer",
        "peers": rows,
    }


def format_report(report: dict) -> str:
    """The table that ``status`` prints."""
    if not report["peers"]:
        return f"run {report['run_id']}: no peers found"
    by_fragment = bool(report.get("num_fragments"))
    header = f"{'peer':<12} {'fragments' if by_fragment else 'stage':>9} {'round':>6} {'inner step':>10} " \
             f"{'tokens/s':>10} {'loss':>7} {'last seen':>10}"
    lines = [f"run {report['run_id']}: {report['num_peers']} peer(s), {report['num_processes']} stage process(es)",
             header]
    for p in report["peers"]:
        tokens = f"{p['tokens_per_s']:,.0f}" if p["tokens_per_s"] is not None else "-"
        loss = f"{p['loss']:.3f}" if p["loss"] is not None else "-"
        held = f"{','.join(map(str, p['fragments']))}/{p['num_fragments']}" if by_fragment else \
            f"{p['stage']}/{p['num_stages']}"
        lines.append(f"{short_id(p['peer']):<12} {held:>9} {p['round']:>6} "
                     f"{p['inner_step']:>10} {tokens:>10} {loss:>7} {p['last_seen_s']:>7.0f} s ago")
    lines.append(f"current round: {report['current_round']}")
    over = "the peers' stage processes holding fragment 0" if by_fragment else "the peers' stage 0"
    lines.append(f"total throughput: {report['tokens_per_s_total']:,.0f} tokens/s (sum over {over})")
    return "\n".join(lines)
