"""Hostile peers against the robust averaging: does a swarm still train, and is the hostile peer named?

4 tiny peers on 127.0.0.1, one of them hostile (``peer --test-hostility``, see p2p_diloco/faults.py), in turn:
pseudo-gradients scaled by 1000, replaced by random noise of 100x their norm, NaN, and a stale round replayed
(its contribution of the previous round, claimed under that round's number). Baselines with the same tokens per
peer: the 3 honest peers alone (what the honest peers would reach if the hostile one had never joined: the target,
within 2%) and 4 honest peers. With --undefended, the scaled attack once more with the robust combination off
(averaging.outlier_norm_ratio = clip_ratio = 0): what the defence prevents.

For each run: the honest peers' eval loss of the final anchor (their anchors are bit-identical: one number), its
gap to the 3-honest run, the rounds the honest peers averaged, whether every honest peer named the hostile one in
its round metrics (with an offence) and had banned it by the end.

    python benchmarks/byzantine.py --out runs/byzantine          # ~10 minutes on 2 busy cores
    python benchmarks/byzantine.py --attacks scale:1000,nan --rounds 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_bootstrap import start_bootstrap  # noqa: E402

ATTACKS = ("scale:1000", "noise:100", "nan", "stale:1")
OFFENCES = {"malformed", "nonfinite", "norm", "round", "metadata", "bad average"}
FAST = ["--averaging.matchmaking_time_s", "5", "--averaging.request_timeout_s", "2",
        "--averaging.round_timeout_s", "30", "--averaging.allreduce_timeout_s", "60",
        "--averaging.next_chunk_timeout_s", "20",
        "--train.progress", "false", "--checkpoint.every_rounds", "0"]


def run_swarm(workdir: Path, name: str, hostile: list[str], args: list[str]) -> list[Path]:
    """A bootstrap node and one peer per entry of ``hostile`` ("" for an honest one) on loopback; peer i samples
    its data with seed i; returns the peers' folders once all have finished."""
    root = workdir / name
    root.mkdir(parents=True)
    boot, maddrs = start_bootstrap(root, start_new_session=True)
    procs = []
    try:
        folders = []
        for i, kind in enumerate(hostile):
            folders.append(root / f"peer{i}")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "p2p_diloco", "peer", "--initial-peers", *maddrs, "--host-maddrs",
                 "/ip4/127.0.0.1/tcp/0", "--run-id", name, "--output-dir", str(folders[-1]), "--data.seed", str(i),
                 "--averaging.target_group_size", str(len(hostile)), "--train.wait_for_peers", str(len(hostile)),
                 *FAST, *args, *(["--test-hostility", kind] if kind else [])],
                stdout=subprocess.DEVNULL, stderr=open(root / f"peer{i}.log", "w")))
        for i, proc in enumerate(procs):
            if proc.wait() != 0:
                raise RuntimeError(f"{name}: peer {i} failed, see {root / f'peer{i}.log'}")
        return folders
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        boot.terminate()
        boot.wait()


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
    }


def report(results: dict, args) -> str:
    base = results["honest-3"]["eval_loss"]
    lines = [f"4 tiny peers (1 hostile), H = {args.h}, {args.rounds} rounds, "
             f"{results['honest-3']['tokens_per_peer']:,} tokens per peer; eval loss of the honest peers' final "
             "anchor against the 3 honest peers alone",
             f"{'run':<22} {'eval loss':>9} {'vs 3 honest':>11} {'averaged':>8}  {'anchors':<9} {'named by':<9} "
             f"{'banned by':<9} reasons"]
    for name, r in results.items():
        gap = (r["eval_loss"] - base) / base
        hostile = name.startswith("hostile") or name.startswith("undefended")
        named = f"{r['named_by']}/{r['honest_peers']}" if hostile else "-"
        banned = f"{r['banned_by']}/{r['honest_peers']}" if hostile else "-"
        lines.append(f"{name:<22} {r['eval_loss']:>9.4f} {gap:>+11.2%} {r['averaged_rounds']:>4}/{r['rounds']:<3}  "
                     f"{'identical' if r['anchors_identical'] else 'DIFFER':<9} {named:<9} {banned:<9} "
                     f"{','.join(r['reasons']) or '-'}")
        if r["honest_named"]:
            lines.append(f"  honest peers named as offenders: {r['honest_named']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="--test-hostility values, one run each")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--h", type=int, default=25, help="inner steps per round")
    parser.add_argument("--undefended", action="store_true", help="also run scale:1000 with the defence off")
    parser.add_argument("--peer-args", default="", help="extra peer arguments, e.g. '--averaging.compression none'")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("byzantine-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--model.preset", "tiny", "--data.batch_size", "8", "--data.seq_len", "64", "--run.num_threads", "1",
              "--train.num_rounds", str(args.rounds), "--diloco.inner_steps", str(args.h), "--data.eval_batches", "8",
              "--train.eval_every_rounds", "0", *args.peer_args.split()]
    runs = {"honest-3": ["", "", ""], "honest-4": ["", "", "", ""]}
    runs.update({f"hostile {kind}": ["", "", "", kind] for kind in args.attacks.split(",") if kind})
    if args.undefended:
        runs["undefended scale:1000"] = ["", "", "", "scale:1000"]
    results: dict = {}
    started = time.monotonic()
    workdir = args.out / "runs"  # the peers' metrics and logs, kept for a look
    shutil.rmtree(workdir, ignore_errors=True)
    for i, (name, hostile) in enumerate(runs.items()):
        extra = ["--averaging.outlier_norm_ratio", "0", "--averaging.clip_ratio", "0"] \
            if name.startswith("undefended") else []
        folders = run_swarm(workdir, f"run{i}", hostile, common + extra)
        results[name] = measure(folders, hostile)
        print(f"{name} ({folders[0].parent}): eval loss {results[name]['eval_loss']:.4f}, named by "
              f"{results[name]['named_by']}, {time.monotonic() - started:.0f} s", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "report.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
