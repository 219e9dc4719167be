"""Console progress of a training process: a progress bar of inner steps, a line per round and eval."""

from __future__ import annotations

import logging
import sys
from contextlib import ExitStack

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from p2p_diloco.round.outcome import RoundReport


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(num_bytes) < 1000 or unit == "TB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError("unreachable")


def format_loss(loss: float | None) -> str:
    """A loss for a progress line: ``-`` until one is measured."""
    return "-" if loss is None else f"{loss:.3f}"


def describe_round(report: RoundReport) -> str:
    """One line: which round's average was applied, and how it went."""
    if report.applied_round is None:
        return f"round {report.round_index}: averaging it in the background while round {report.round_index + 1} trains"
    which = f"round {report.applied_round}" if report.applied_round == report.round_index \
        else f"round {report.round_index} ended; applied round {report.applied_round}"
    outcome = report.outcome
    if outcome.averaged:
        wait = f", waited {report.waited_s:.1f} s" if report.applied_round != report.round_index else ""
        stats = outcome.compression
        codec = ""
        if stats:
            rank = f"rank {stats['rank']} + " if stats.get("rank") else ""
            codec = f" ({rank}{'/'.join(stats.get('codecs', []))}, error {stats.get('compression_error', 0):.1%})"
        return (f"{which}: averaged with {outcome.group_size - 1} other peer(s) in {outcome.averaging_s:.1f} s, "
                f"sent {format_bytes(outcome.bytes_sent)}{codec}{wait}")
    return f"{which}: own pseudo-gradient only ({outcome.fallback_reason})"


class ConsoleReporter:
    """Progress bar when ``enabled`` and attached to a terminal (else plain log lines), plus round lines."""

    def __init__(self, enabled: bool = True, label: str = ""):
        self.enabled = enabled and sys.stderr.isatty()
        self.label = label
        self.bar = None
        self._stack = ExitStack()
        self._log = logging.getLogger("p2p_diloco.progress")

    def on_start(self, total_steps: int, done_steps: int) -> None:
        if self.enabled:
            self._stack.enter_context(logging_redirect_tqdm())
            self.bar = tqdm(total=total_steps, initial=done_steps, desc=self.label or "training", unit="step",
                            dynamic_ncols=True)

    def on_step(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=format_loss(loss), tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def on_round(self, report: RoundReport) -> None:
        self._write(describe_round(report))

    def on_eval(self, round_index: int, loss: float) -> None:
        if loss is not None:
            self._write(f"round {round_index}: eval loss of the anchor {loss:.4f}")

    def _write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            self._log.info(f"{self.label}: {text}" if self.label else text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._stack.close()
