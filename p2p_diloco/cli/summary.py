"""Following a local swarm's peers through their metrics files, and its closing summary and loss plot.

Called by ``p2p-diloco swarm``. Reads only files the peers write (metrics JSONL, summary JSON).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from p2p_diloco.cli.console import format_bytes, format_loss
from p2p_diloco.training.metrics import read_metrics

logger = logging.getLogger(__name__)


class _Tail:
    """Reads the lines appended to a JSONL file since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, ""

    def new_events(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            data = f.read()
            self.offset = f.tell()
        lines = (self.partial + data).split("\n")
        self.partial = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]


class SwarmProgress:
    """One progress bar per peer (or a log line every 10 s when not on a terminal)."""

    def __init__(self, root: Path, names: list[str], cfg):
        self.total_steps = cfg.train.num_rounds * cfg.diloco.inner_steps
        last_stage = cfg.pipeline.stages - 1
        self.tails = {name: _Tail(root / name / f"metrics-stage{last_stage}.jsonl") for name in names}
        self.state = {name: {"step": 0, "round": 0, "loss": None} for name in names}  # None: none measured yet
        self.root, self.tty = root, sys.stderr.isatty()
        self.bars = {name: tqdm(total=self.total_steps, desc=name, position=i, unit="step", dynamic_ncols=True)
                     for i, name in enumerate(names)} if self.tty else {}
        self._last_line = time.monotonic()

    def refresh(self) -> None:
        for name, tail in self.tails.items():
            for event in tail.new_events():
                self._apply(name, event)
        if not self.tty and time.monotonic() - self._last_line > 10:
            self._last_line = time.monotonic()
            print("  " + " | ".join(f"{name}: round {s['round']}, step {s['step']}/{self.total_steps}, "
                                    f"loss {format_loss(s['loss'])}" for name, s in self.state.items()), flush=True)

    def _apply(self, name: str, event: dict) -> None:
        state = self.state[name]
        if event["kind"] == "step":
            state.update(step=event["inner_step"], round=event["round"], loss=float(event["loss"]))
            if name in self.bars:
                bar = self.bars[name]
                bar.update(state["step"] - bar.n)
                bar.set_postfix(round=state["round"], loss=format_loss(state["loss"]), refresh=False)
        elif event["kind"] == "round" and event.get("applied_round") is not None:
            text = f"averaged in a group of {event['group_size']}" if event["averaged"] \
                else f"fell back to its own pseudo-gradient ({event['fallback_reason']})"
            where = f" (fragment {event['fragment']})" if "fragment" in event else ""
            self.note(f"{name} round {event['applied_round']} applied{where}: {text}")
        elif event["kind"] == "eval" and event.get("eval_loss") is not None:
            self.note(f"{name} round {event['round']}: eval loss {float(event['eval_loss']):.4f}")

    def note(self, text: str) -> None:
        if self.bars:
            tqdm.write(text)
        else:
            print(text, flush=True)

    def peer_exited(self, name: str, code: int) -> None:
        if code == 0:
            self.note(f"{name} finished")
            return
        log = self.root / name / "console.log"
        tail = log.read_text(errors="replace").strip().splitlines()[-15:] if log.exists() else []
        self.note(f"{name} exited with code {code}; last lines of {log}:\n    " + "\n    ".join(tail))

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def _load_summaries(peer_dir: Path, num_stages: int) -> Optional[list[dict]]:
    paths = [peer_dir / f"summary-stage{j}.json" for j in range(num_stages)]
    if not all(p.exists() for p in paths):
        return None
    return [json.loads(p.read_text()) for p in paths]


def summarize_swarm(root: Path, num_peers: int, cfg, exit_codes: dict[str, int]) -> dict:
    """Print the closing table, write swarm-summary.json and loss.png; returns the summary."""
    num_stages = cfg.pipeline.stages
    rows, digests = [], [set() for _ in range(num_stages)]
    for i in range(num_peers):
        name = f"peer{i}"
        stages = _load_summaries(root / name, num_stages)
        if stages is None:
            rows.append({"peer": name, "finished": False, "exit_code": exit_codes.get(name)})
            continue
        for j, s in enumerate(stages):
            digests[j].add(s["anchor_sha256"])
        last = stages[-1]
        rows.append({
            "peer": name, "finished": True, "exit_code": exit_codes.get(name),
            "rounds": last["rounds_completed"], "averaged_rounds": last["averaged_rounds"],
            "fallback_rounds": last.get("fallback_rounds", 0), "reloads": sum(s.get("reloads", 0) for s in stages),
            "resyncs": sum(s.get("resyncs", 0) for s in stages), "joins": last.get("joins", 0),
            "leaves": last.get("leaves", 0),
            "loss_start": last["first_loss"], "loss_end": last["last_loss"],
            "eval_loss_start": last["eval_loss_start"], "eval_loss_final": last["eval_loss_final"],
            "bytes_sent": sum(s["bytes_sent"] for s in stages),
            "allreduce_bytes": sum(s["allreduce_bytes_equivalent"] for s in stages),
        })
    finished = [r for r in rows if r["finished"]]
    identical = bool(finished) and all(len(d) == 1 for d in digests)
    summary = {"peers": rows, "anchors_identical": identical, "num_stages": num_stages,
               "ok": len(finished) == num_peers and all(r["exit_code"] == 0 for r in rows)}
    summary["plot"] = _plot(root, num_peers, num_stages)
    (root / "swarm-summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary), flush=True)
    return summary


def format_summary(summary: dict) -> str:
    lines = ["", "peer     rounds  averaged  fallback  joins/leaves  reloads/resyncs  loss start -> end   "
             "eval loss (final anchor)  sent        per-step AllReduce   less"]
    for r in summary["peers"]:
        if not r["finished"]:
            lines.append(f"{r['peer']:<8} did not finish (exit code {r['exit_code']})")
            continue
        ratio = f"{r['allreduce_bytes'] / r['bytes_sent']:,.0f}x" if r["bytes_sent"] else "-"
        eval_text = f"{r['eval_loss_start']:.3f} -> {r['eval_loss_final']:.3f}" if r["eval_loss_final"] else "-"
        churn = f"{r.get('joins', 0)}/{r.get('leaves', 0)}"
        syncs = f"{r.get('reloads', 0)}/{r.get('resyncs', 0)}"
        lines.append(f"{r['peer']:<8} {r['rounds']:>6}  {r['averaged_rounds']:>8}  {r.get('fallback_rounds', 0):>8}  "
                     f"{churn:>12}  {syncs:>15}  {r['loss_start']:>6.3f} -> {r['loss_end']:<6.3f}   {eval_text:<24}  "
                     f"{format_bytes(r['bytes_sent']):>10}  {format_bytes(r['allreduce_bytes']):>18}   {ratio}")
    lines.append(f"anchors identical across peers: {'yes' if summary['anchors_identical'] else 'NO'}")
    if summary.get("plot"):
        lines.append(f"loss plot: {summary['plot']}")
    return "\n".join(lines)


def _plot(root: Path, num_peers: int, num_stages: int) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no loss plot")
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for i in range(num_peers):
        events = list(read_metrics(root / f"peer{i}" / f"metrics-stage{num_stages - 1}.jsonl"))
        steps = [(e["inner_step"], float(e["loss"])) for e in events if e["kind"] == "step"]
        evals = [(e["inner_step"], float(e["eval_loss"])) for e in events
                 if e["kind"] == "eval" and e.get("eval_loss") is not None]
        if steps:
            line, = ax.plot(*zip(*steps), alpha=0.6, label=f"peer{i} train loss")
            if evals:
                ax.plot(*zip(*evals), "o--", color=line.get_color(), label=f"peer{i} eval loss (anchor)")
    ax.set_xlabel("inner step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("p2p-diloco local swarm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = root / "loss.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return str(path)
