"""A small registry of metrics read at scrape time, rendered in the Prometheus text exposition format 0.0.4.

Values are not pushed: each metric has a function that reads the live value (a counter of the trainer's
summary, the stage's round) when ``/metrics`` is fetched, as Prometheus' own custom collectors do. Nothing
runs in the training loop, and nothing needs a lock beyond reading one number. Called by
:mod:`p2p_diloco.monitoring.nodes`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)
METRIC_KINDS = ("gauge", "counter")


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    help: str
    read: Callable[[], Optional[float]]
    """Returns the current value; None (or an exception) leaves the sample out of this scrape."""


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


class MetricsRegistry:
    """Metrics of one process, all with the same labels (e.g. ``run_id`` and ``stage``).

    Args:
        labels: label names and values added to every sample.
    """

    def __init__(self, labels: Optional[dict[str, str]] = None):
        self.labels = dict(labels or {})
        self.metrics: dict[str, Metric] = {}

    def add(self, name: str, kind: str, help: str, read: Callable[[], Optional[float]]) -> None:
        assert kind in METRIC_KINDS, kind
        assert kind != "counter" or name.endswith("_total"), f"counter {name} must end in _total"
        assert name not in self.metrics, f"metric {name} registered twice"
        self.metrics[name] = Metric(name, kind, help, read)

    def values(self) -> dict[str, float]:
        """Current values by name; metrics that cannot be read now are left out."""
        result = {}
        for metric in self.metrics.values():
            try:
                value = metric.read()
            except Exception as e:  # a broken reading must not break the whole scrape
                logger.debug(f"Could not read metric {metric.name}: {e!r}")
                continue
            if value is not None:
                result[metric.name] = float(value)
        return result

    def render(self) -> str:
        """The text exposition format: HELP, TYPE and one sample per metric."""
        labels = ",".join(f'{key}="{_escape_label(str(value))}"' for key, value in self.labels.items())
        suffix = f"{{{labels}}}" if labels else ""
        values = self.values()
        lines = []
        for metric in self.metrics.values():
            if metric.name not in values:
                continue
            lines.append(f"# HELP {metric.name} {metric.help}")
            lines.append(f"# TYPE {metric.name} {metric.kind}")
            lines.append(f"{metric.name}{suffix} {format_value(values[metric.name])}")
        return "\n".join(lines) + "\n"
