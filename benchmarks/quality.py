"""Learning quality: eval loss at equal tokens per worker, for every way of training, side by side.

K workers run the project's real round code (:class:`~p2p_diloco.round.stage.Stage`: inner AdamW with the
peer's schedule and clipping, pseudo-gradients, error feedback, the outer optimizer, the delayed and eager
rules) on the real data sampler; their averaging is :class:`~p2p_diloco.training.simulate.ExactGroup` (the real
compression policy, codecs, PowerSGD reducer and robust combine, no network), so long horizons cost CPU time
only. Rows, each at the same tokens per worker:

- ``alone``: one worker, plain AdamW (what a volunteer gets without any swarm);
- ``alone-diloco``: one p2p-diloco peer with nobody to average with (outer steps on its own progress);
- ``<mode>/<compression>``: K workers in ``none`` (blocking DiLoCo), ``delayed`` and ``eager`` mode;
- ``data-parallel``: per-step data parallel with the same global batch (K x batch) and steps: the ceiling.

For each row: final eval loss of the anchor (mean and spread over seeds) on ``--eval-batches`` held-out
batches, its change against the better alone row, the fraction of the gap between alone and data parallel
it closes, bytes per worker per round, and rounds that fell back. A delayed row's point of the curve for a round is
taken when that round's average lands in its anchor, ``diloco.overlap_steps`` into the next round, at the tokens
trained by then (at the round's end its anchor still lacks it). Curves (eval loss against tokens per worker)
go to ``quality.png``; raw results to ``quality.json`` and the table to ``quality_report.txt`` in ``--out``.

    python benchmarks/quality.py --quick                       # a few minutes
    python benchmarks/quality.py --seeds 0,1 --out runs/quality # tiny, K = 4, H = 50, 30 rounds
    python benchmarks/quality.py --preset wan --rows none/none,delayed/adaptive,eager/adaptive ...
    python benchmarks/quality.py --set diloco.outer_lr=0.5 ...  # any config override, every row
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from p2p_diloco.config import load_config  # noqa: E402
from p2p_diloco.config.network import COMPRESSIONS  # noqa: E402
from p2p_diloco.data import WindowSampler, eval_batches  # noqa: E402
from p2p_diloco.model import build_stage_model, model_args_from_config  # noqa: E402
from p2p_diloco.model.fragments import FragmentView, fragment_parts, split_parameters  # noqa: E402
from p2p_diloco.round.fragments import Fragments  # noqa: E402
from p2p_diloco.stage_setup import load_data  # noqa: E402
from p2p_diloco.training import LocalExecutor, Stage  # noqa: E402
from p2p_diloco.training.simulate import ExactGroup  # noqa: E402

# the 3.35M-parameter model of benchmarks/wan.py: matrices large enough for low rank to engage
WAN_MODEL = [("model.preset", "small"), ("model.dim", "256"), ("model.n_layers", "4"), ("model.n_heads", "8"),
             ("model.n_kv_heads", "8"), ("model.ffn_dim", "704")]
ALL_ROWS = ("alone", "alone-diloco", "none/none", "none/adaptive", "delayed/none", "delayed/adaptive",
            "delayed/adaptive@2", "delayed-H/adaptive", "eager/none", "eager/adaptive", "data-parallel")
"""``mode/compression@N``: the round's average arrives N inner steps into the next round (default: --arrival-steps,
H); delayed applies it then or at diloco.overlap_steps, whichever comes first. ``delayed-H``: overlap_steps = H.
``mode/compression~F``: streaming sync of F fragments (model/fragments.py), one fragment averaged at a time."""
SPARSELOCO_OUTER = [("diloco.outer_momentum", "0"), ("diloco.outer_lr", "1.0"), ("diloco.outer_lr_group_exponent", "0")]
"""Rows of compression ``sparseloco``: theta <- theta - alpha * mean of the sparse contributions, alpha = 1 for any
group, no outer momentum (arXiv 2508.15706, Algorithm 1)."""
MODES = ("none", "delayed", "delayed-H", "eager")
"""Any ``mode/compression`` with a mode of these and a compression of ``averaging.compression`` is a row too."""


@dataclass
class RowResult:
    name: str
    seed: int
    curve: list = field(default_factory=list)  # (tokens per worker, eval loss)
    final: float = float("nan")
    bytes_per_round: float = 0.0
    peak_bytes: float = 0.0
    """The largest payload of one averaging (all-at-once: a round's; streaming: one fragment's)."""
    fallbacks: int = 0
    wall_s: float = 0.0


class Setting:
    """Data, model shape and configs of one benchmark setting."""

    def __init__(self, args: argparse.Namespace, extra: list | None = None):
        self.args = args
        overrides = [("model.preset", "tiny"), ("data.batch_size", str(args.batch)), ("data.seq_len", str(args.seq)),
                     ("diloco.inner_steps", str(args.h)), ("train.num_rounds", str(args.rounds))]
        if args.preset == "wan":
            overrides += WAN_MODEL
        elif args.preset != "tiny":
            overrides[0] = ("model.preset", args.preset)
        self.sets = [tuple(item.split("=", 1)) for item in args.set]
        overrides += self.sets
        self.overrides = overrides
        overrides = overrides + list(extra or [])
        self.cfg = load_config(None, overrides)
        self.data = load_data(self.cfg, max_seq_len=args.seq)
        self.model_args = model_args_from_config(self.cfg.model, self.data.train.vocab_size)
        self.eval_data = eval_batches(self.data.eval, args.seq, args.batch, args.eval_batches)
        self.tokens_per_step = args.batch * args.seq
        self.device = torch.device(args.device)

    def config(self, mode: str, compression: str):
        """``delayed-H``: delayed with overlap_steps = H (DiLoCoX's whole-round delay)."""
        whole = [("diloco.overlap_steps", str(self.args.h))] if mode == "delayed-H" else []
        # SparseLoCo's outer step is the paper's (its error feedback plays the momentum), unless --set says otherwise
        paper = SPARSELOCO_OUTER if compression == "sparseloco" else []
        return load_config(None, self.overrides + paper + self.sets + whole + [
            ("diloco.mode", mode.removesuffix("-H")), ("averaging.compression", compression)])

    def model(self, seed: int):
        """The model of every worker of a run with this seed (init seed: model.init_seed + seed)."""
        args = self.model_args
        args.init_seed = self.cfg.model.init_seed + seed
        return build_stage_model(args, [args.n_layers], 0).to(self.device)

    def sampler(self, seed: int, worker: int, batch: int | None = None) -> WindowSampler:
        """Worker ``worker``'s windows: seed 1000 seed + data.seed + worker (peer i of ``p2p-diloco swarm
        --data.seed S`` samples with S + i: seed 0 of the simulation draws the same windows)."""
        base = 1000 * seed + (self.cfg.data.seed or 0)
        return WindowSampler(self.data.train, self.args.seq, batch or self.args.batch, base + worker)


def evaluate(executor: LocalExecutor, units: Fragments | None, eval_data) -> float:
    """Eval loss of the anchor (every fragment's), or of the working params with ``units`` None."""
    with units.anchor_weights() if units is not None else contextlib.nullcontext():
        return executor.evaluate(eval_data)


def inner_step(units: Fragments, executor: LocalExecutor, sampler) -> float:
    """One inner step as the peer's trainer takes it (the same holder of the units): forward/backward, the total
    norm over every unit, clipped AdamW, and in delayed mode the merge of the previous round's average when due."""
    inputs, targets = sampler.next_batch()
    loss = executor.forward_backward(inputs.to(executor.device), targets.to(executor.device))
    units.inner_update(torch.linalg.vector_norm(units.grad_norms(), 2))
    units.merge_due()
    return loss


def worker_units(model, parts: list[int], averagers: dict, cfg, total_steps: int, rounds: int) -> Fragments:
    """One worker's units as a peer's stage process holds them: the whole model as one stage (F = 1), or one stage
    per fragment over a view of its parameters, with the fragments' rounds staggered (streaming sync)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    held = split_parameters(named, parts)
    if len(held) == 1:
        units = [(None, model, 0)]
    else:
        units = [((f, len(held)), FragmentView(params), f) for f, params in held.items()]
    fragments = Fragments([Stage(view, stage_index=0, num_stages=1, inner_cfg=cfg.inner, diloco_cfg=cfg.diloco,
                                 total_steps=total_steps, averager=averagers.get(f), fragment=fragment)
                           for fragment, view, f in units])
    fragments.stagger(rounds)
    return fragments


def run_plain(setting: Setting, seed: int, workers: int, name: str) -> RowResult:
    """Plain AdamW on ``workers`` x batch per step (1: alone; K: per-step data parallel), the inner schedule."""
    args, started = setting.args, time.monotonic()
    cfg = setting.config("none", "none")
    model = setting.model(seed)
    stage = worker_units(model, fragment_parts(setting.model_args, 1), {}, cfg, args.rounds * args.h, args.rounds)
    executor = LocalExecutor(model, setting.device)
    samplers = [setting.sampler(seed, k) for k in range(workers)]

    class Joined:  # the K workers' batches of one step, as one batch (exactly the mean of their gradients)
        def next_batch(self):
            batches = [s.next_batch() for s in samplers]
            return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])

    joined, result = Joined(), RowResult(name, seed)
    result.curve.append((0, evaluate(executor, None, setting.eval_data)))
    for r in range(args.rounds):
        for _ in range(args.h):
            inner_step(stage, executor, joined)
        if (r + 1) % args.eval_every == 0 or r + 1 == args.rounds:
            result.curve.append(((r + 1) * args.h * setting.tokens_per_step,
                                 evaluate(executor, None, setting.eval_data)))
    result.final, result.wall_s = result.curve[-1][1], time.monotonic() - started
    return result


def run_diloco(setting: Setting, seed: int, workers: int, mode: str, compression: str, name: str,
               arrival_steps: int | None = None, fragments: int = 1) -> RowResult:
    """K workers of p2p-diloco's round code, averaging through an exact in-process group.

    ``fragments`` F > 1: streaming sync, as a peer runs it (:class:`~p2p_diloco.round.fragments.Fragments`): each
    worker's model is F fragments, each its own :class:`Stage` with its own group, their rounds staggered, averaged
    one at a time; every fragment's last round ends on the run's last step. Each fragment's bandwidth budget is 1/F
    of the round's compute (it must be sent before the next fragment's turn). F = 1 is the all-at-once round."""
    args, started = setting.args, time.monotonic()
    cfg = setting.config(mode, compression)
    models = [setting.model(seed) for _ in range(workers)]
    parts = fragment_parts(setting.model_args, fragments)
    shapes = split_parameters([(n, tuple(p.shape)) for n, p in models[0].named_parameters() if p.requires_grad],
                              parts)
    groups = {f: ExactGroup(workers, [shape for _, shape in named], cfg.averaging,
                            seed=f"quality{seed}" + (f"f{f}" if f else ""),
                            arrival_steps=arrival_steps or args.arrival_steps or args.h)
              for f, named in shapes.items()} if workers > 1 else {}
    units = [worker_units(m, parts, {f: g.view(k) for f, g in groups.items()}, cfg, args.rounds * args.h,
                          args.rounds) for k, m in enumerate(models)]
    executors = [LocalExecutor(m, setting.device) for m in models]
    samplers = [setting.sampler(seed, k) for k in range(workers)]
    result, payload = RowResult(name, seed), []
    result.curve.append((0, evaluate(executors[0], units[0], setting.eval_data)))

    def end_all(i: int, end) -> list:
        reports = [None] * workers
        errors = []

        def one(k):
            try:
                reports[k] = end(units[k].stages[i], k)
            except BaseException as e:  # re-raised below
                errors.append(e)
        threads = [threading.Thread(target=one, args=(k,)) for k in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return reports

    count = len(units[0].stages)
    compute = [[0.0] * count for _ in range(workers)]  # each worker's compute since each fragment's round end

    def end_round(i: int, step: int) -> None:
        """Unit ``i`` of every worker ends its round after inner ``step``, all at once (they average together)."""
        tokens = [Fragments.round_tokens(u.stages[i], step, setting.tokens_per_step) for u in units]
        reports = end_all(i, lambda stage, k: stage.end_round(tokens[k], workers, compute_s=compute[k][i] / count))
        for k in range(workers):
            compute[k][i] = 0.0
        _account(result, reports, payload)
        _check_identical([u.stages[i] for u in units], name, step)

    # delayed mode: a round's average lands in the anchor a few steps into the next round (the merge); its point of
    # the curve is taken then, at the tokens trained by then, not at the round end, where the anchor still lacks it
    merges = mode in ("delayed", "delayed-H") and count == 1
    awaiting_merge = False
    for r in range(args.rounds):
        for step in range(r * args.h + 1, (r + 1) * args.h + 1):
            for k in range(workers):
                t0 = time.monotonic()
                inner_step(units[k], executors[k], samplers[k])
                spent = args.step_s or time.monotonic() - t0
                compute[k] = [c + spent for c in compute[k]]
            for i in units[0].ending_early(r, step):  # streaming: these fragments' rounds end a few steps early
                end_round(i, step)
            if awaiting_merge and units[0].stages[0].pending is None:
                result.curve.append((step * setting.tokens_per_step,
                                     evaluate(executors[0], units[0], setting.eval_data)))
                awaiting_merge = False
        for i in units[0].ending(r):
            end_round(i, (r + 1) * args.h)
        if (r + 1) % args.eval_every == 0 or r + 1 == args.rounds:
            if r + 1 == args.rounds and mode != "none":
                for i in range(count):
                    _account(result, end_all(i, lambda stage, k: stage.flush()), payload)
                    _check_identical([u.stages[i] for u in units], name, (r + 1) * args.h)
            elif merges:
                awaiting_merge = True
                continue
            result.curve.append(((r + 1) * args.h * setting.tokens_per_step,
                                 evaluate(executors[0], units[0], setting.eval_data)))
    result.final, result.wall_s = result.curve[-1][1], time.monotonic() - started
    events_per_round = len(payload) / args.rounds if payload else 0
    result.bytes_per_round = statistics.mean(payload) * events_per_round if payload else 0.0
    result.peak_bytes = max(payload, default=0.0)
    return result


def _account(result: RowResult, reports, payload: list) -> None:
    report = reports[0]
    if report is None or report.applied_round is None:
        return
    outcome = report.outcome
    if outcome.fallback_reason:
        result.fallbacks += 1
    elif outcome.compression.get("payload_bytes"):
        payload.append(outcome.compression["payload_bytes"])


def _check_identical(stages: list[Stage], name: str, r: int) -> None:
    """Every worker holds the same anchor after every round, as real peers of one group do (bit for bit)."""
    for stage in stages[1:]:
        if not all(torch.equal(a, b) for a, b in zip(stage.anchor, stages[0].anchor)):
            raise AssertionError(f"{name}: anchors differ after round {r}")


_SETTING: Setting | None = None  # the setting of --jobs' forked workers


def _run_task(task: tuple[int, str]) -> RowResult:
    seed, row = task
    return run_row(_SETTING, row, seed)


def run_row(setting: Setting, row: str, seed: int) -> RowResult:
    K = setting.args.workers
    if row == "alone":
        return run_plain(setting, seed, 1, row)
    if row == "data-parallel":
        return run_plain(setting, seed, K, row)
    if row == "alone-diloco":
        return run_diloco(setting, seed, 1, "none", "none", row)
    scheme, arrival, fragments = parse_row(row)
    mode, compression = scheme.split("/")
    return run_diloco(setting, seed, K, mode, compression, row, arrival, fragments)


def parse_row(row: str) -> tuple[str, int | None, int]:
    """``mode/compression[~F][@N]`` -> (mode/compression, N or None, F); ValueError if malformed."""
    rest, at, arrival = row.partition("@")
    scheme, tilde, fragments = rest.partition("~")
    if (at and not (arrival.isdigit() and int(arrival) >= 1)) or (tilde and not (fragments.isdigit() and
                                                                               int(fragments) >= 1)):
        raise ValueError(row)
    return scheme, int(arrival) if at else None, int(fragments) if tilde else 1


def fidelity(setting: Setting, modes: list[str], out: Path) -> str:
    """A real swarm (``p2p-diloco swarm``: bootstrap node, 3 peer processes, hivemind over loopback) against the
    simulation of the same run (seeds, data windows, config): final eval losses side by side."""
    import subprocess

    args, lines = setting.args, []
    lines.append(f"fidelity: real 3-peer swarm vs simulation, same config {setting.overrides}")
    for mode in modes:
        folder = out / f"fidelity-swarm-{mode}"
        overrides = [("run.run_id", f"fidelity-{mode}"), ("diloco.mode", mode),
                     ("data.eval_batches", str(args.eval_batches)), ("train.eval_every_rounds", "0"),
                     *setting.overrides]
        if setting.cfg.data.seed is None:
            overrides.append(("data.seed", "0"))
        command = [sys.executable, "-m", "p2p_diloco", "swarm", "--peers", "3", "--output-dir", str(folder)]
        for key, value in overrides:
            command += [f"--{key}", value]
        started = time.monotonic()
        subprocess.run(command, check=True, stdout=open(out / f"fidelity-swarm-{mode}.log", "w"),
                       stderr=subprocess.STDOUT)
        summary = json.loads((folder / "swarm-summary.json").read_text())
        real = [float(p["eval_loss_final"]) for p in summary["peers"]]
        averaged = [p.get("averaged_rounds") for p in summary["peers"]]
        swarm_s = time.monotonic() - started
        sim = run_diloco(Setting(args, extra=overrides), 0, 3, mode, setting.cfg.averaging.compression,
                         f"{mode}/sim")
        gap = statistics.mean(real) / sim.final - 1
        lines.append(f"  {mode:<8} swarm {statistics.mean(real):.4f} (peers {', '.join(f'{x:.4f}' for x in real)}; "
                     f"rounds averaged {averaged}; {swarm_s:.0f} s)  simulation {sim.final:.4f} ({sim.wall_s:.0f} s)"
                     f"  difference {gap:+.2%}")
        print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def mean_curve(runs: list[RowResult]) -> list[tuple[float, float]]:
    """The seeds' mean eval loss at each point of the curve (every seed of a row evaluates at the same tokens)."""
    tokens = [t for t, _ in runs[0].curve]
    return [(t, statistics.mean(r.curve[i][1] for r in runs)) for i, t in enumerate(tokens)]


def tokens_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """Tokens per worker at which ``curve`` first reaches ``target`` (linear between its points), None if never."""
    for (t0, l0), (t1, l1) in zip([curve[0]] + curve, curve):
        if l1 <= target:
            return t1 if l0 <= target or l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def summarize(results: dict[str, list[RowResult]]) -> list[dict]:
    """Per row: mean and spread of the final loss over seeds, against alone and data parallel; the tokens per worker
    it took to reach the alone row's final loss, and the speedup that is (alone's tokens over the row's)."""
    finals = {row: [r.final for r in rs] for row, rs in results.items()}
    mean = {row: statistics.mean(v) for row, v in finals.items()}
    alone = min((mean[r] for r in ("alone", "alone-diloco") if r in mean), default=None)
    alone_row = min((r for r in ("alone", "alone-diloco") if r in mean), key=mean.get, default=None)
    alone_tokens = tokens_to_reach(mean_curve(results[alone_row]), alone) if alone_row else None
    dp = mean.get("data-parallel")
    reference = mean.get("none/none")
    table = []
    for row, values in finals.items():
        entry = dict(row=row, mean=mean[row], spread=(max(values) - min(values)) if len(values) > 1 else 0.0,
                     seeds=len(values), finals=values,
                     bytes_per_round=statistics.mean(r.bytes_per_round for r in results[row]),
                     peak_bytes=statistics.mean(r.peak_bytes for r in results[row]),
                     fallbacks=sum(r.fallbacks for r in results[row]),
                     wall_s=statistics.mean(r.wall_s for r in results[row]))
        if alone is not None:
            entry["vs_alone"] = mean[row] / alone - 1
            entry["tokens_to_alone"] = tokens_to_reach(mean_curve(results[row]), alone)
            if entry["tokens_to_alone"] and alone_tokens:
                entry["speedup"] = alone_tokens / entry["tokens_to_alone"]
            if dp is not None and alone > dp:
                entry["gap_closed"] = (alone - mean[row]) / (alone - dp)
        if reference is not None:
            entry["vs_none_fp32"] = mean[row] / reference - 1
        table.append(entry)
    return table


def report_text(table: list[dict], args, command: str) -> str:
    lines = [f"# {command}", f"# preset {args.preset}, K = {args.workers}, H = {args.h}, {args.rounds} rounds, batch "
             f"{args.batch} x seq {args.seq}, {args.eval_batches} eval batches, seeds {args.seeds}, "
             f"overrides {args.set or 'none'}" + (f", {args.step_s:g} s of compute claimed per step" if args.step_s
                                                   else ""),
             f"# tokens per worker: {args.rounds * args.h * args.batch * args.seq:,}",
             "row                 eval loss (mean +- spread)   vs alone   gap closed   vs none/fp32   bytes/round  "
             "peak/averaging  fallbacks  wall s  tokens to alone's loss  speedup"]
    for e in table:
        gap = f"{e['gap_closed']:10.0%}" if "gap_closed" in e else f"{'-':>10}"
        vs_alone = f"{e['vs_alone']:+8.2%}" if "vs_alone" in e else f"{'-':>8}"
        vs_none = f"{e['vs_none_fp32']:+11.2%}" if "vs_none_fp32" in e else f"{'-':>11}"
        speedup = f"{e['speedup']:6.2f}x" if "speedup" in e else f"{'-':>7}"
        lines.append(f"{e['row']:<19} {e['mean']:.4f} +- {e['spread']:.4f}           "
                     f"{vs_alone}   {gap}   {vs_none}"
                     f"   {e['bytes_per_round'] / 1e6:9.3f} MB  {e['peak_bytes'] / 1e6:11.3f} MB  {e['fallbacks']:9d}"
                     f"  {e['wall_s']:6.0f}  {_tokens(e.get('tokens_to_alone')):>22}  {speedup}")
    lines.append("gap closed: (alone - row) / (alone - data-parallel), alone = the better of the two alone rows")
    lines.append("tokens to alone's loss: tokens per worker at which the row's mean curve first reaches the alone "
                 "row's final eval loss (linear between the curve's points; - never); speedup: alone's tokens over the "
                 "row's, at equal compute per worker")
    lines.append("peak/averaging: the largest payload one peer sends in one averaging (all at once: a whole round's; "
                 "~F: one fragment's)")
    return "\n".join(lines) + "\n"


def _tokens(tokens: float | None) -> str:
    return "-" if tokens is None else f"{tokens:,.0f}"


def plot(results: dict[str, list[RowResult]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for row, rs in results.items():
        tokens = [t for t, _ in rs[0].curve]
        losses = [statistics.mean(r.curve[i][1] for r in rs) for i in range(len(tokens))]
        style = "--" if row.startswith(("alone", "data")) else "-"
        ax.plot([t / 1e6 for t in tokens[1:]], losses[1:], style, label=row)
    ax.set_xlabel("tokens per worker (M)")
    ax.set_ylabel("eval loss of the anchor")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SETTING_KEYS = ("preset", "workers", "h", "rounds", "batch", "seq", "eval_batches", "arrival_steps", "eval_every",
                "set", "device", "step_s")


def previous_results(folder: Path, args, parser) -> dict[tuple[int, str], RowResult]:
    """The results of an earlier run of the same setting (``--resume-from``), by (seed, row)."""
    path = folder / "quality.json"
    try:
        previous = json.loads(path.read_text())
        recorded, results = previous["args"], previous["results"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--resume-from {folder}: cannot read {path}: {e}")
    differs = [k for k in SETTING_KEYS if recorded.get(k) != str(getattr(args, k))]
    if differs:
        parser.error(f"--resume-from {folder}: another setting (" +
                     ", ".join(f"{k} {recorded.get(k)} there, {getattr(args, k)} here" for k in differs) + ")")
    done = {}
    for row, entries in results.items():
        for entry in entries:
            result = RowResult(**entry)
            done[(result.seed, row)] = result
    print(f"taken from {path}: {len(done)} results", flush=True)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     epilog="Rows: " + ", ".join(ALL_ROWS) + "; any mode/compression row with ~F "
                                     "(streaming sync of F fragments) and/or @N (its average arriving N steps into "
                                     "the next round)")
    parser.add_argument("--quick", action="store_true",
                        help="a few-minute version: K = 4, H = 20, 8 rounds, small batches")
    parser.add_argument("--preset", default="tiny", help="tiny, small, medium or wan (the WAN benchmark's 3.35M model)")
    parser.add_argument("--workers", type=int, default=4, metavar="K")
    parser.add_argument("--h", type=int, default=50, help="inner steps per round (default 50)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="batch per worker per step (default 8)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--arrival-steps", type=int, default=None, metavar="N",
                        help="delayed mode: a round's average arrives N inner steps into the next round (the network's "
                        "time; default H, a whole round: the worst case, as on a slow link)")
    parser.add_argument("--step-s", type=float, default=None, metavar="S",
                        help="the compute each worker claims per inner step, in seconds: with "
                        "--set averaging.assumed_bandwidth_mbit=L, the link and round of compute the compression "
                        "budget is planned for, the same on any machine (default: the step's measured time, which "
                        "follows this machine's load)")
    parser.add_argument("--eval-every", type=int, default=3, help="rounds between points of the curves")
    parser.add_argument("--seeds", default="0", help="comma-separated; each seed changes init and data windows")
    parser.add_argument("--rows", default=",".join(ALL_ROWS))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, every row")
    parser.add_argument("--fidelity", metavar="MODES", help="instead of the table: real 3-peer swarms "
                        "(p2p-diloco swarm) in these modes (comma-separated) against their simulation")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--jobs", type=int, default=1, help="rows run side by side in this many processes")
    parser.add_argument("--out", type=Path, default=Path("runs") / time.strftime("quality-%Y%m%d-%H%M%S"))
    parser.add_argument("--resume-from", type=Path, metavar="DIR", help="take the (seed, row) results already in "
                        "DIR/quality.json (an earlier or interrupted run of the same setting) instead of running "
                        "them again: add seeds or rows to a table")
    args = parser.parse_args()
    if args.quick:  # its values are defaults: options given with it still win
        parser.set_defaults(h=20, rounds=8, batch=4, seq=64, eval_batches=16, eval_every=2)
        args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = args.rows.split(",")
    def known(row: str) -> bool:  # a row of ALL_ROWS, or mode/compression with ~F (F >= 1) and/or @N (N >= 1)
        try:
            scheme, _, _ = parse_row(row)
        except ValueError:
            return False
        mode, _, compression = scheme.partition("/")
        return row in ALL_ROWS or scheme in ALL_ROWS or mode in MODES and compression in COMPRESSIONS
    unknown = [r for r in rows if not known(r)]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ALL_ROWS)}")
    too_fine = [r for r in rows if parse_row(r)[2] > args.h]
    if too_fine:
        parser.error(f"rows {too_fine}: streaming F fragments needs --h >= F (one fragment per step at most)")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/quality.py " + " ".join(sys.argv[1:])
    # an unreadable or mismatched --resume-from fails before the data and models are loaded
    done = previous_results(args.resume_from, args, parser) if args.resume_from and not args.fidelity else {}
    setting = Setting(args)
    if args.fidelity:
        text = f"# {command}\n" + fidelity(setting, args.fidelity.split(","), args.out)
        (args.out / "fidelity_report.txt").write_text(text)
        print(text)
        return
    tasks = [(seed, row) for seed in args.seeds for row in rows]
    tasks = [(seed, row) for seed, row in tasks if (seed, row) not in done]
    if args.jobs > 1:  # rows in forked worker processes, one torch thread each unless --threads says more
        global _SETTING
        _SETTING = setting
        torch.set_num_threads(args.threads or 1)
        pool = multiprocessing.get_context("fork").Pool(args.jobs)
        finished = pool.imap_unordered(_run_task, tasks)
    else:
        pool, finished = None, (run_row(setting, row, seed) for seed, row in tasks)
    for result in finished:
        done[(result.seed, result.name)] = result
        print(f"seed {result.seed} {result.name:<19} eval loss {result.final:.4f}  fallbacks {result.fallbacks}  "
              f"{result.bytes_per_round / 1e6:.3f} MB/round  {result.wall_s:.0f} s", flush=True)
        results = {row: [done[(seed, row)] for seed in args.seeds if (seed, row) in done] for row in rows}
        (args.out / "quality.json").write_text(json.dumps(
            {"command": command, "args": {k: str(v) for k, v in vars(args).items()},
             "results": {r: [vars(x) for x in rs] for r, rs in results.items() if rs}}, indent=1))
    if pool is not None:
        pool.close()
        pool.join()
    results = {row: [done[(seed, row)] for seed in args.seeds] for row in rows}
    table = summarize(results)
    text = report_text(table, args, command)
    (args.out / "quality_report.txt").write_text(text)
    plot(results, args.out / "quality.png", text.splitlines()[1][2:])
    print(text)


if __name__ == "__main__":
    main()
