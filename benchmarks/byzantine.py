"""Hostile peers and outsiders against a swarm that a newcomer joins mid-run: does the swarm still train, does the
newcomer get the swarm's state, and is nobody honest hurt?

Every run: a bootstrap node, 3 honest tiny peers on 127.0.0.1 (4 in the ``honest-4`` baseline), for a row
``KIND`` a fourth peer run with ``python -m tests.hostile.peer KIND -- <peer args>`` (see tests/hostile), for a
row ``outsider KIND:K`` an attacker's K DHT identities beside them (benchmarks/byzantine_outsiders.py), and a
NEWCOMER that starts once the first honest peer has ended ``--join-after`` rounds and must download the swarm's
state. A row ``A+B`` mounts both (``poison-momentum+vote:4``: a donor that serves the true anchor with a crafted
outer momentum, and 4 identities that vote for the state it serves). The rows of issue 30 (the default):

- ``poison-momentum+vote:4``: the poisoned donor above, whose state the votes make look like the swarm's;
- ``tiny-clock``: a donor whose state claims ``seconds_per_step`` = 5e-320 (it once killed every downloader);
- ``outsider round-ahead:1``: one never-met identity writing records one round past the swarm's newest
  (``diloco.round_end = swarm``, the default, once ended every honest round after one step);
- ``outsider inflate:5``: 5 identities writing records on the honest peers' round (once counted in the group size);
- ``fat-metadata:16``: a peer whose record gathered into each group carries 16 MiB of empty msgpack maps;
- ``outsider squat:4``: 4 identities holding state streams of every donor, reading a chunk every 5 s;
- ``equivocate:1.5`` and ``reply-scale:10``: a reducer that returns an average 1.5x too large to one member only,
  and one that returns averages 10x too large to all;
- ``outsider keysquat:1``: a plain value with a far-future expiration under every round's matchmaking key.
Earlier rows (``scale:1000``, ``nan``, ``false-state``, ``sybil:4``, ...) run with ``--attacks``.

Collusion (issue 49): a row ``NxKIND`` runs N hostile peers of that kind, and ``--honest`` sets the honest ones;
``--collusion`` runs the rows of a quarter of the swarm colluding, 2 of 8: ``2xcollude-wipe:2`` and
``2xcollude-end:2`` (they average honestly for rounds 0-1, earning whatever trust that gives, then vouch together
for an all-zero state, 3 rounds ahead or as the run's final one, and serve it), with the newcomer arriving after
they strike (``--join-after 3``), against ``honest-6``:

    python benchmarks/byzantine.py --collusion --out runs/collusion     # ~20 minutes on 2 busy cores

Baselines with the same tokens per peer and the same newcomer: the 3 honest peers alone (``honest-3``: the target)
and 4 honest peers. Targets of every row, each reported as its own column with ok or MISS: the honest peers' eval
loss of their final anchor at most 2% above ``honest-3``'s; their anchors (the newcomer's included) bit-identical
after every round; no honest process dies (or hangs past the run's bound); the newcomer holds the swarm's anchor
(its first state whose anchor is the honest peers' one for that round) within 2x ``honest-3``'s join time, counted
from its start; inner steps per round of the honest peers at least 90% of ``honest-3``'s (rounds not shortened); their
mean peak RSS at most 10% above ``honest-3``'s; no honest peer (the newcomer included) banned by an honest one.

    python benchmarks/byzantine.py --out runs/byzantine          # ~25 minutes on 2 busy cores
    python benchmarks/byzantine.py --attacks tiny-clock --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # where hostile peers import tests.hostile from
sys.path.insert(0, str(Path(__file__).resolve().parent))
import byzantine_outsiders  # noqa: E402
from local_bootstrap import start_bootstrap  # noqa: E402

from p2p_diloco.swarm.averaging.guard import OFFENCES as GUARD_OFFENCES  # noqa: E402
from p2p_diloco.swarm.averaging.guard import STALL  # noqa: E402

ATTACKS = ("poison-momentum+vote:4", "tiny-clock", "round-ahead:1", "inflate:5", "fat-metadata:16", "squat:4",
           "equivocate:1.5", "reply-scale:10", "keysquat:1")
COLLUSION = ("2xcollude-wipe:2", "2xcollude-end:2")
OFFENCES = GUARD_OFFENCES | {STALL}  # what counts as naming a peer (stalls count towards a ban too)
FAST = ["--averaging.matchmaking_time_s", "5", "--averaging.request_timeout_s", "2",
        "--averaging.round_timeout_s", "30", "--averaging.allreduce_timeout_s", "60",
        "--averaging.next_chunk_timeout_s", "20",
        "--train.progress", "false", "--checkpoint.every_rounds", "0"]
BATCH, SEQ = 8, 64
RUN_BOUND_S = 900  # a run still going after this is killed: its honest processes count as hung
# targets: (column, test on a row's result and honest-3's)
TARGETS = {
    "loss": lambda r, calm: r["eval_loss"] <= calm["eval_loss"] * 1.02,
    "anchors": lambda r, calm: r["anchors_identical"],
    "alive": lambda r, calm: not r["died"],
    "join": lambda r, calm: r["join_s"] is not None and r["join_s"] <= 2 * calm["join_s"],
    "steps": lambda r, calm: r["steps_per_round"] >= 0.9 * calm["steps_per_round"],
    "memory": lambda r, calm: r["rss_mb"] <= 1.10 * calm["rss_mb"],
    "bans": lambda r, calm: not r["honest_banned"],
}


def split_row(row: str) -> tuple[str, str]:
    """(hostility, outsider) of a row ``A``, ``A+B``; either may be '' (a hostility may be ``NxKIND``)."""
    hostility, outsider = "", ""
    for part in row.split("+"):
        if part.partition(":")[0] in byzantine_outsiders.KINDS:
            outsider = part
        else:
            hostility = part
    return hostility, outsider


class Swarm:
    """One run's processes: the outsider (if any), the peers, the newcomer; every one killed at the end."""

    def __init__(self, root: Path, maddrs: list[str], args: list[str], group_size: int):
        self.root, self.maddrs, self.args, self.group_size = root, maddrs, args, group_size
        self.procs: dict[str, subprocess.Popen] = {}

    def start_outsider(self, spec: str, run_id: str, inner_steps: int) -> None:
        ready = self.root / "outsider.ready"
        self.procs["outsider"] = proc = subprocess.Popen(
            [sys.executable, __file__, "--outsider", spec, "--run-id", run_id, "--ready-file", str(ready),
             "--h", str(inner_steps), "--initial-peers", *self.maddrs],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "outsider.log", "w"), start_new_session=True)
        deadline = time.monotonic() + 120
        while not ready.exists():  # in place before the first honest peer reads the swarm's records
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the outsider did not start, see {self.root / 'outsider.log'}")
            time.sleep(0.5)

    def start_peer(self, name: str, seed: int, run_id: str, extra: list[str], hostility: str = "") -> Path:
        """A peer; ``hostility``: a hostile one of that kind (``<kind>[:<value>]``, tests/hostile)."""
        folder = self.root / name
        command, env = [sys.executable, "-m", "p2p_diloco"], None
        if hostility:
            command = [sys.executable, "-m", "tests.hostile.peer", hostility, "--"]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.procs[name] = subprocess.Popen(
            [*command, "peer", "--initial-peers", *self.maddrs, "--host-maddrs",
             "/ip4/127.0.0.1/tcp/0", "--run-id", run_id, "--output-dir", str(folder), "--data.seed", str(seed),
             "--averaging.target_group_size", str(self.group_size), *FAST, *self.args, *extra],
            stdout=subprocess.DEVNULL, stderr=open(self.root / f"{name}.log", "w"), env=env)
        return folder

    def wait(self, names: list[str], deadline: float) -> dict[str, int | None]:
        """Exit codes of ``names`` (None: still running at ``deadline``, then killed)."""
        codes = {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def kill(self) -> None:
        outsider = self.procs.get("outsider")
        if outsider is not None:  # with its DHT nodes' processes, which a kill of the outsider alone leaves behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(outsider.pid, signal.SIGKILL)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def run_swarm(workdir: Path, name: str, peers: list[str], args: list[str], outsider: str, inner_steps: int,
              join_after: int, hostile_args: tuple[str, ...] = ()) -> dict:
    """A bootstrap node, one peer per entry of ``peers`` ("" for an honest one; peer i samples its data with seed
    i), the outsider ``outsider`` started first if any, and a newcomer once peer 0 has ended ``join_after`` rounds;
    returns the folders, exit codes and the newcomer's start time (epoch s) once all peers have finished."""
    root = workdir / name
    root.mkdir(parents=True)
    boot, maddrs = start_bootstrap(root, start_new_session=True)
    swarm = Swarm(root, maddrs, args, group_size=len(peers) + 1)
    try:
        if outsider:
            swarm.start_outsider(outsider, name, inner_steps)
        folders = [swarm.start_peer(f"peer{i}", i, name, ["--train.wait_for_peers", str(len(peers)),
                                                          *(hostile_args if kind else ())], hostility=kind)
                   for i, kind in enumerate(peers)]
        deadline = time.monotonic() + RUN_BOUND_S
        while len(events(folders[0], "round")) < join_after and time.monotonic() < deadline \
                and swarm.procs["peer0"].poll() is None:
            time.sleep(0.5)
        newcomer_started = time.time()
        newcomer = swarm.start_peer("newcomer", len(peers), name, [])
        codes = swarm.wait([f"peer{i}" for i in range(len(peers))] + ["newcomer"], deadline)
        return {"folders": folders, "newcomer": newcomer, "codes": codes, "newcomer_started": newcomer_started}
    finally:
        swarm.kill()
        boot.terminate()
        boot.wait()


def events(folder: Path, kind: str) -> list[dict]:
    path = folder / "metrics-stage0.jsonl"
    if not path.exists():
        return []
    return [e for e in map(json.loads, open(path)) if e["kind"] == kind]


def summary(folder: Path) -> dict | None:
    path = folder / "summary-stage0.json"
    return json.loads(path.read_text()) if path.exists() else None


def joined(newcomer: Path, started: float, anchors: dict[int, str]) -> float | None:
    """Seconds from the newcomer's start to the first time it held the honest peers' anchor of a round: a state it
    downloaded (reload or resync), or a round it averaged with them (a newcomer that arrives while the swarm's
    first average is still in flight joins that round's group without a download); None if it never held it."""
    for e in events(newcomer, "sync") + events(newcomer, "round"):
        if e["applied_round"] is not None and anchors.get(e["applied_round"]) == e["anchor_sha256"]:
            return e["time"] - started
    return None


def anchor_splits(folders: list[Path], newcomer: Path) -> tuple[list[int], bool]:
    """(applied rounds after which the honest peers' anchors, the newcomer's included once it has one, were not all
    one, whether their final anchors are), from their round metrics; the final anchor is the one each peer left
    with (its summary): a resync or reload after the last round it applied replaced that round's anchor, and the
    round metrics alone named a peer that took the agreed anchor at the end as one that differs."""
    held: dict[int, set[str]] = {}
    finals = set()
    for folder in [*folders, newcomer]:
        rounds = {e["applied_round"]: e["anchor_sha256"] for e in events(folder, "round")
                  if e["applied_round"] is not None}
        for r, digest in rounds.items():
            held.setdefault(r, set()).add(digest)
        left_with = (summary(folder) or {}).get("anchor_sha256")
        if left_with:
            finals.add(left_with)
        elif rounds:
            finals.add(rounds[max(rounds)])
    return sorted(r for r, digests in held.items() if len(digests) > 1), len(finals) == 1


def measure(run: dict, peers: list[str]) -> dict:
    """The targets' numbers of one run, from the peers' metrics and summaries."""
    folders, codes = run["folders"], run["codes"]
    honest = [i for i, kind in enumerate(peers) if not kind]
    summaries = {i: summary(folders[i]) for i in range(len(peers))}
    finished = [i for i in honest if summaries[i] is not None]
    bad_ids = {summaries[i]["peer"] for i, kind in enumerate(peers) if kind and summaries[i]}
    newcomer = summary(run["newcomer"])
    honest_ids = {summaries[i]["peer"] for i in finished} | ({newcomer["peer"]} if newcomer else set())
    applied = {i: [e for e in events(folders[i], "round") if e["applied_round"] is not None] for i in honest}
    mine = [e for e in events(run["newcomer"], "round") if e["applied_round"] is not None]
    digests = [{e["applied_round"]: e["anchor_sha256"] for e in applied[i]} for i in honest]
    anchors = {r: d for digest in digests for r, d in digest.items()}
    late = {e["applied_round"]: e["anchor_sha256"] for e in mine}
    named_by, banned_by, honest_banned = 0, 0, set()
    for events_of in [*applied.values(), mine]:
        banned = set(events_of[-1]["banned"]) if events_of else set()
        honest_banned |= banned & honest_ids
    for i in honest:
        offences = {peer for e in applied[i] for peer, reasons in e["suspects"].items() if OFFENCES & set(reasons)}
        named_by += bool(bad_ids) and bad_ids <= offences
        banned_by += bool(bad_ids) and bad_ids <= set(applied[i][-1]["banned"] if applied[i] else [])
    splits, final_identical = anchor_splits([folders[i] for i in honest], run["newcomer"])
    return {
        "split_rounds": splits, "final_identical": final_identical,
        "eval_loss": statistics.mean(summaries[i]["eval_loss_final"] for i in finished) if finished else float("nan"),
        "averaged_rounds": min(sum(e["averaged"] for e in applied[i]) for i in honest),
        "rounds": max(len(applied[i]) for i in honest),
        "anchors_identical": not splits and bool(late),
        "died": sorted(name for name, code in codes.items() if code != 0 and (
            name == "newcomer" or not peers[int(name.removeprefix("peer"))])),
        "join_s": joined(run["newcomer"], run["newcomer_started"], anchors),
        "steps_per_round": statistics.mean(summaries[i]["tokens"] for i in finished) / (BATCH * SEQ)
        / max(len(applied[i]) for i in honest) if finished else 0.0,
        "rss_mb": statistics.mean(summaries[i]["max_rss_mb"] for i in finished) if finished else float("nan"),
        "honest_banned": sorted(honest_banned),
        "named_by": named_by, "banned_by": banned_by, "honest_peers": len(honest), "hostile": bool(bad_ids),
        "reasons": sorted({r for i in honest for e in applied[i] for peer, reasons in e["suspects"].items()
                           if peer in bad_ids for r in reasons}),
        "tokens_per_peer": summaries[finished[0]]["tokens"] if finished else 0,
        "reloads": sum(summaries[i]["reloads"] + summaries[i]["resyncs"] for i in finished),
        "newcomer_reloads": (newcomer["reloads"] + newcomer["resyncs"]) if newcomer else None,
        "max_wait_s": max((e["waited_s"] for i in honest for e in applied[i]), default=0.0),
    }


def anchors_cell(r: dict) -> str:
    if not r["split_rounds"]:
        return "identical"
    final = "final one" if r["final_identical"] else "final DIFFER"
    return f"split {','.join(map(str, r['split_rounds']))}, {final}"


def remeasure(out: Path, honest_count: int = 3) -> dict:
    """results.json of ``out`` with the anchors re-read from its run folders (a report of a run measured by an earlier
    version of :func:`measure`)."""
    results = json.loads((out / "results.json").read_text())
    for i, (name, r) in enumerate(results.items()):
        root = out / "runs" / f"run{i}"
        honest = [root / f"peer{k}" for k in range(honest_count + (name == f"honest-{honest_count + 1}"))]
        r["split_rounds"], r["final_identical"] = anchor_splits(honest, root / "newcomer")
        r["anchors_identical"] = not r["split_rounds"]
        if r["join_s"] is None:  # measured before a round the newcomer averaged counted as joining
            anchors = {e["applied_round"]: e["anchor_sha256"] for e in events(honest[0], "round")
                       if e["applied_round"] is not None}
            first = min(e["time"] for e in events(root / "newcomer", "eval"))  # its first row: a lower bound
            r["join_s"] = joined(root / "newcomer", first, anchors)
    return results


def hostile_peers(hostility: str) -> list[str]:
    """The hostile peers' kinds (``<kind>[:<value>]``) of a row's hostility (``NxKIND``: N of them)."""
    if not hostility:
        return []
    count, x, kind = hostility.partition("x")
    return [kind] * int(count) if x and count.isdigit() else [hostility]


def report(results: dict, args) -> str:
    calm = results[f"honest-{args.honest}"]
    mark = {True: "ok", False: "MISS"}
    base = f"honest-{args.honest}"
    lines = [f"{args.honest} honest tiny peers (+ hostile ones, or + an outsider's identities) and a newcomer after "
             f"round {args.join_after}, H = {args.h}, {args.rounds} rounds, {calm['tokens_per_peer']:,} tokens per "
             f"peer. loss: honest eval loss vs {base} (<= +2%); anchors: honest + newcomer bit-identical; died: honest "
             "processes (newcomer included) that exited non-zero or hung; join: newcomer's start to holding the "
             f"swarm's anchor (<= 2x {base}'s); steps: inner steps per round (>= 90% of {base}'s); memory: "
             f"honest mean peak RSS vs {base} (<= +10%); bans: honest peers banned by honest ones; "
             "named/banned: honest peers that named / banned the hostile one",
             f"{'run':<40} {'eval loss':>9} {'loss':>13} {'anchors':<27} {'died':<9} {'join':>13} {'steps':>10} "
             f"{'memory':>12} {'bans':<7} {'averaged':>8} {'reloads':>7} {'named/banned':<12} reasons"]
    for name, r in results.items():
        ok = {target: test(r, calm) for target, test in TARGETS.items()}
        join = f"{r['join_s']:.1f}s" if r["join_s"] is not None else "never"
        hostile = f"{r['named_by']}/{r['banned_by']} of {r['honest_peers']}" if r["hostile"] else "-"
        gap = r["eval_loss"] / calm["eval_loss"] - 1
        lines.append(
            f"{name:<40} {r['eval_loss']:>9.4f} {gap:>+7.2%} {mark[ok['loss']]:<4} "
            f"{anchors_cell(r):<22} {mark[ok['anchors']]:<4} {len(r['died']) or 'none':<4} {mark[ok['alive']]:<4} "
            f"{join:>7} {mark[ok['join']]:<4} {r['steps_per_round']:>5.1f} {mark[ok['steps']]:<4} "
            f"{r['rss_mb'] / calm['rss_mb'] - 1:>+6.1%} {mark[ok['memory']]:<4} "
            f"{len(r['honest_banned']) or 'none':<4} {mark[ok['bans']]:<2} {r['averaged_rounds']:>4}/{r['rounds']:<3} "
            f"{r['reloads']:>7} {hostile:<12} {','.join(r['reasons']) or '-'}")
        if r["died"] or r["honest_banned"]:
            lines.append(f"  died: {r['died']}; honest peers banned: {r['honest_banned']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=",".join(ATTACKS),
                        help="rows: hostile kinds (tests/hostile), outsider KIND:K, or HOSTILITY+KIND:K, "
                        "comma-separated")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--h", type=int, default=25, help="inner steps per round")
    parser.add_argument("--join-after", type=int, default=1,
                        help="rounds peer 0 ends before the newcomer starts (its own start takes ~20 s on busy cores: "
                             "it arrives rounds later)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip honest-(N+1) (honest-N, N = --honest, always runs)")
    parser.add_argument("--honest", type=int, default=3, help="honest peers beside the hostile ones (default 3)")
    parser.add_argument("--collusion", action="store_true",
                        help="the collusion rows: --honest 6 --join-after 3 --attacks " + ",".join(COLLUSION))
    parser.add_argument("--peer-args", default="", help="extra peer arguments, e.g. '--averaging.compression none'")
    parser.add_argument("--hostile-args", default="",
                        help="extra arguments of the hostile peer only, e.g. '--averaging.matchmaking_time_s 2' (a "
                             "leader that declares the earliest expiration, so that the others join its groups)")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("byzantine-%Y%m%d-%H%M%S"))
    parser.add_argument("--report-from", type=Path, help="print the report of an earlier --out folder again")
    parser.add_argument("--outsider", help=argparse.SUPPRESS)  # the outsider's own process (see Swarm)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collusion:
        args.honest, args.join_after, args.attacks = 6, 3, ",".join(COLLUSION)
    if args.outsider:
        byzantine_outsiders.run(args.outsider, args.run_id, args.initial_peers, args.ready_file, args.h)
        return
    if args.report_from:
        print(report(remeasure(args.report_from, args.honest), args))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--model.preset", "tiny", "--data.batch_size", str(BATCH), "--data.seq_len", str(SEQ),
              "--run.num_threads", "1", "--train.num_rounds", str(args.rounds), "--diloco.inner_steps", str(args.h),
              "--data.eval_batches", "8", "--train.eval_every_rounds", "0", *args.peer_args.split()]
    runs = {f"honest-{args.honest}": ("", "")} | ({} if args.no_baselines else {f"honest-{args.honest + 1}": ("", "")})
    for row in filter(None, args.attacks.split(",")):
        hostility, outsider = split_row(row)
        runs["+".join(filter(None, [hostility and f"hostile {hostility}", outsider and f"outsider {outsider}"]))] = \
            (hostility, outsider)
    results: dict = {}
    started = time.monotonic()
    workdir = args.out / "runs"  # the peers' metrics and logs, kept for a look
    shutil.rmtree(workdir, ignore_errors=True)
    for i, (name, (hostility, outsider)) in enumerate(runs.items()):
        peers = [""] * (args.honest + 1) if name == f"honest-{args.honest + 1}" else \
            [""] * args.honest + hostile_peers(hostility)
        try:
            run = run_swarm(workdir, f"run{i}", peers, common, outsider, args.h, args.join_after,
                            tuple(args.hostile_args.split()))
        except RuntimeError as e:  # an outsider that did not start: the other rows still run
            print(f"{name}: not measured: {e}", flush=True)
            continue
        results[name] = measure(run, peers)
        print(f"{name} ({workdir / f'run{i}'}): eval loss {results[name]['eval_loss']:.4f}, join "
              f"{results[name]['join_s']}, died {results[name]['died']}, {time.monotonic() - started:.0f} s",
              flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (args.out / "report.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
