"""The report of a run that ``status`` prints and ``status --serve`` shows: the run's progress records read through a
DHT node (:func:`read_run`), made into one JSON-able document (:func:`build_report`), and its table
(:func:`format_report`). Each stage process's row has its state (training, finished, silent) and train-loss curve, and
the document the groups of the last rounds (who averaged with whom).

The swarm's modules are imported inside the functions that read: ``status``'s command process imports this module
but neither torch nor hivemind (only its forked reader does, and ``status --serve``). Called by
:mod:`p2p_diloco.cli.status` and :mod:`p2p_diloco.cli.status_serve`.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from p2p_diloco.medians import lower_median

if TYPE_CHECKING:
    from p2p_diloco.swarm.discovery.progress import ProgressRecord

SILENT_AFTER_S = 30.0
"""A record not refreshed for this long (3 times its writer's refresh period, ``SwarmLink.publish_every_s``) is of a
stage process not heard from: stopped, stuck or unreachable. Its record expires 120 s after its last refresh."""
STATES = ("training", "finished", "silent", "left")  # a row's state ("left": status --serve, a record gone)
MAX_GROUP_ROUNDS = 4  # the rounds whose groups the document shows (the latest)
MAX_GROUP_ENTRIES = 64  # (round, unit) entries of the document's groups
MAX_GROUPS_PER_ENTRY = 32  # distinct groups shown for one round of one unit


def read_run(dht, run_id: str, deadline: float, max_attempts: int = 3) -> tuple[list[ProgressRecord], int]:
    """(records, number of fragments or 0) of run ``run_id``, read through ``dht`` before ``deadline``
    (monotonic)."""
    from p2p_diloco.swarm import fetch_progress
    from p2p_diloco.swarm.discovery.fingerprint import run_fragments
    from p2p_diloco.swarm.discovery.progress import records_run

    fragments = run_fragments(dht, run_id, timeout_s=max(1.0, deadline - time.monotonic()))
    runs = [records_run(run_id, (f, fragments)) for f in range(fragments)] or [run_id]
    records = []
    for run in runs:  # (up to 1024 fragments, each read bounded by the deadline too)
        if time.monotonic() >= deadline:
            break
        records += _read_records(dht, run, fetch_progress, deadline=deadline, max_attempts=max_attempts)
    return records, fragments


def _read_records(dht, run_id: str, fetch, deadline: float, max_attempts: int = 3) -> list[ProgressRecord]:
    """A node that has just joined may not reach the records' holders at once: a few attempts, all before
    ``deadline`` (monotonic)."""
    records = []
    for attempt in range(max_attempts):
        if time.monotonic() + 0.5 >= deadline:
            return records
        records = fetch(dht, run_id, timeout_s=max(0.5, deadline - time.monotonic()))
        if records or attempt == max_attempts - 1 or time.monotonic() + 1.0 >= deadline:
            return records
        time.sleep(1.0)
    return records


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
    report = {
        "run_id": run_id,
        "num_peers": len({r.peer for r in rows}),
        "num_processes": len(rows),
        "current_round": max((r.round for r in rows), default=None),
        "tokens_per_s_total": sum(_number(r.tokens_per_s) or 0.0 for r in stage0.values()),
        "tokens_per_s_total_over": "stage 0 of every peer",
        "peers": [{
            "peer": r.peer, "node": r.node, "stage": r.stage, "num_stages": r.num_stages, "round": r.round,
            "applied_round": r.applied_round, "inner_step": r.inner_step, "tokens_per_s": _number(r.tokens_per_s),
            "loss": _number(r.loss), "last_seen_s": round(max(0.0, now - r.time), 1), **_facts(r, [r], now),
        } for r in rows],
        **_swarm_facts([r.eval_losses for r in rows], [r.round for r in rows], [r.bytes_sent for r in rows]),
    }
    report["groups"] = swarm_groups(report["peers"])
    return report


def _facts(evaluated: ProgressRecord, held: list[ProgressRecord], now: float) -> dict:
    """A row's eval loss (that of ``evaluated``'s last evaluation) and train losses, rounds averaged, bytes sent, bans,
    groups and state (of the stage process that wrote ``held``)."""
    last = evaluated.eval_losses[-1] if evaluated.eval_losses else (None, None)
    bans = {peer: why for r in held for peer, why in r.bans}
    last_seen_s = max(0.0, now - max(r.time for r in held))
    return {"eval_round": last[0], "eval_loss": last[1], "rounds_averaged": held[0].rounds_averaged,
            "bytes_sent": held[0].bytes_sent, "bans": [{"peer": peer, "reason": why} for peer, why in bans.items()],
            "state": peer_state(all(r.finished for r in held), last_seen_s),
            "train_losses": [[r, loss] for r, loss in evaluated.train_losses],
            "groups": [{"round": r, "unit": h.stage, "nodes": list(nodes)} for h in held for r, nodes in h.groups
                       if h.node in nodes]}  # a writer names the groups it was in, not others'


def peer_state(finished: bool, last_seen_s: float) -> str:
    """A stage process's state from its record: ``finished`` (it applied the run's last round), ``silent`` (not
    refreshed for :data:`SILENT_AFTER_S`) or ``training``."""
    if finished:
        return "finished"
    return "silent" if last_seen_s > SILENT_AFTER_S else "training"


def swarm_groups(rows: list[dict]) -> list[dict]:
    """Who averaged with whom: the distinct groups the rows name, of the last :data:`MAX_GROUP_ROUNDS` rounds, newest
    first; per round and unit (stage, or fragment), each group's members (``node``, with its ``peer`` where a row
    has that node, else None) sorted by node. Rounds past the lower median of the rows' rounds are left out (one
    record claiming rounds nobody else has moves nothing); rows of peers gone (``left``) do not count for it."""
    present = [row["round"] for row in rows if row.get("state") != "left"]
    limit = lower_median(present or [row["round"] for row in rows]) if rows else -1
    peers = {row["node"]: row["peer"] for row in rows}
    found: dict[tuple[int, int], set[tuple[str, ...]]] = {}
    for row in rows:
        for group in row["groups"]:
            if group["round"] <= limit:
                found.setdefault((group["round"], group["unit"]), set()).add(tuple(sorted(group["nodes"])))
    latest = set(sorted({r for r, _ in found}, reverse=True)[:MAX_GROUP_ROUNDS])
    entries = [{"round": r, "unit": unit,
                "groups": [[{"node": node, "peer": peers.get(node)} for node in nodes]
                           for nodes in sorted(groups)[:MAX_GROUPS_PER_ENTRY]]}
               for (r, unit), groups in sorted(found.items(), key=lambda item: (-item[0][0], item[0][1]))
               if r in latest]
    return entries[:MAX_GROUP_ENTRIES]


def _swarm_facts(evals: list, rounds: list[int], bytes_sent: list[int]) -> dict:
    """The run's bytes sent (every stage process's) and its eval-loss curve: for each round, the lower median of the
    eval losses the stage processes report for it, up to the lower median of their rounds (one record's claim of
    rounds the swarm has not reached, or of a loss the others do not share, does not move the curve)."""
    limit = lower_median(rounds) if rounds else -1
    by_round: dict[int, list[float]] = {}
    for told in evals:
        for round_index, loss in told:
            if round_index <= limit:
                by_round.setdefault(round_index, []).append(loss)
    return {"bytes_sent_total": sum(bytes_sent),
            "eval_curve": [[r, lower_median(losses)] for r, losses in sorted(by_round.items())]}


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
            "last_seen_s": round(max(0.0, now - max(r.time for r in held)), 1), **_facts(last, held, now)})
    rows.sort(key=lambda row: (row["peer"], row["fragments"][0], row["node"]))
    first = {row["peer"]: row for row in rows if row["fragments"][0] == 0}
    report = {
        "run_id": run_id,
        "num_peers": len({row["peer"] for row in rows}),
        "num_processes": len(rows),
        "num_fragments": num_fragments,
        "current_round": max((row["round"] for row in rows), default=None),
        "tokens_per_s_total": sum(row["tokens_per_s"] or 0.0 for row in first.values()),
        "tokens_per_s_total_over": "the stage holding fragment 0 of every peer",
        "peers": rows,
        **_swarm_facts([by_node[row["node"]][-1].eval_losses for row in rows], [row["round"] for row in rows],
                       [row["bytes_sent"] for row in rows]),
    }
    report["groups"] = swarm_groups(rows)
    return report


def format_report(report: dict) -> str:
    """The table that ``status`` prints."""
    if not report["peers"]:
        return f"run {report['run_id']}: no peers found"
    by_fragment = bool(report.get("num_fragments"))
    header = f"{'peer':<12} {'fragments' if by_fragment else 'stage':>9} {'round':>6} {'inner step':>10} " \
             f"{'tokens/s':>10} {'loss':>7} {'last seen':>10} {'state':>8}"
    lines = [f"run {report['run_id']}: {report['num_peers']} peer(s), {report['num_processes']} stage process(es)",
             header]
    for p in report["peers"]:
        tokens = f"{p['tokens_per_s']:,.0f}" if p["tokens_per_s"] is not None else "-"
        loss = f"{p['loss']:.3f}" if p["loss"] is not None else "-"
        held = f"{','.join(map(str, p['fragments']))}/{p['num_fragments']}" if by_fragment else \
            f"{p['stage']}/{p['num_stages']}"
        lines.append(f"{short_id(p['peer']):<12} {held:>9} {p['round']:>6} "
                     f"{p['inner_step']:>10} {tokens:>10} {loss:>7} {p['last_seen_s']:>7.0f} s ago {p['state']:>8}")
    lines.append(f"current round: {report['current_round']}")
    over = "the peers' stage processes holding fragment 0" if by_fragment else "the peers' stage 0"
    lines.append(f"total throughput: {report['tokens_per_s_total']:,.0f} tokens/s (sum over {over})")
    return "\n".join(lines)
