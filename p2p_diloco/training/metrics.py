"""Per-peer metrics as JSON lines, one object per event ("step", "round", "eval", "summary").

Each line is flushed as it is written, so ``p2p-diloco swarm`` can follow a peer while it trains and a
crash loses at most the line being written. Each event also goes to the writer's sinks (TensorBoard, W&B: see
:mod:`p2p_diloco.monitoring.sinks`), if any. Called by the trainer; read by the swarm command and plots.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends metric events to ``path`` (JSONL) and hands each to ``sinks``.

    Args:
        path: the JSONL file.
        sinks: objects with ``name``, ``write(kind, event)`` and ``close()``; they close with the writer. A sink
            that fails is logged and dropped: a dashboard never stops training.
    """

    def __init__(self, path: str | Path, sinks: Sequence = ()):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        self.sinks = list(sinks)

    def write(self, kind: str, **values: Any) -> None:
        event = {"kind": kind, "time": round(time.time(), 3)} | values
        self._file.write(json.dumps({k: _jsonable(v) for k, v in event.items()}) + "\n")
        for sink in list(self.sinks):
            try:
                sink.write(kind, event)
            except Exception as e:  # any failure of a third-party logger: a dashboard never stops training
                logger.warning(f"{sink.name} logging failed ({e!r}); it gets no more metrics in this run")
                self.sinks.remove(sink)
                self._close_sink(sink)

    def close(self) -> None:
        """Close the file and the sinks (again: nothing)."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            self._close_sink(sink)

    @staticmethod
    def _close_sink(sink) -> None:
        try:
            sink.close()
        except Exception as e:  # the JSONL file is the record; a sink's end is best effort
            logger.warning(f"Could not close {sink.name} logging: {e!r}")

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf
    return value


def read_metrics(path: str | Path) -> Iterator[dict]:
    """Events of a metrics file; a torn last line (the writer crashed mid-line) is skipped."""
    try:
        with open(path) as f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return
