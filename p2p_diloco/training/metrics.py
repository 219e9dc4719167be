"""Per-peer metrics as JSON lines, one object per event ("step", "round", "eval", "summary").

Each line is flushed as it is written, so ``p2p-diloco swarm`` can follow a peer while it trains and a
crash loses at most the line being written. Called by the trainer; read by the swarm command and plots.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Appends metric events to ``path`` (JSONL)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def write(self, kind: str, **values: Any) -> None:
        event = {"kind": kind, "time": round(time.time(), 3)}
        event.update({k: _jsonable(v) for k, v in values.items()})
        self._file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

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
