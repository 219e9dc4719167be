"""The metrics of one process, read at scrape time, as a ``prometheus_client`` collector.

Values are not pushed: each metric has a function that reads the live value (a counter of the trainer's
summary, the stage's round) when ``/metrics`` is fetched, as a custom collector of ``prometheus_client``.
Nothing runs in the training loop, and nothing needs a lock beyond reading one number. Each registry has its
own ``CollectorRegistry`` (not the library's global one), so that several in one process never collide.
Called by :mod:`p2p_diloco.monitoring.nodes`; served by :mod:`p2p_diloco.monitoring.server`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)
FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}


@dataclass(frozen=True)
class LiveMetric:
    name: str
    kind: str
    help: str
    read: Callable[[], Optional[float]]
    """Returns the current value; None (or an exception) leaves the sample out of this scrape."""


class MetricsRegistry:
    """Metrics of one process, all with the same labels (e.g. ``run_id`` and ``stage``).

    Args:
        labels: label names and values added to every sample.
    """

    def __init__(self, labels: Optional[dict[str, str]] = None):
        self.labels = {key: str(value) for key, value in (labels or {}).items()}
        self.metrics: dict[str, LiveMetric] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        """What ``/metrics`` serves: this registry's collector only."""
        self.registry.register(self)

    def add(self, name: str, kind: str, help: str, read: Callable[[], Optional[float]]) -> None:
        assert kind in FAMILIES, kind
        assert kind != "counter" or name.endswith("_total"), f"counter {name} must end in _total"
        assert name not in self.metrics, f"metric {name} registered twice"
        self.metrics[name] = LiveMetric(name, kind, help, read)

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

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol: one family with one sample per readable metric."""
        values = self.values()
        for metric in self.metrics.values():
            if metric.name in values:
                # a counter family takes the name without _total and the exposition adds it back
                family = FAMILIES[metric.kind](metric.name, metric.help, labels=list(self.labels))
                family.add_metric(list(self.labels.values()), values[metric.name])
                yield family

    def render(self) -> str:
        """What ``GET /metrics`` shows (the Prometheus text format 0.0.4)."""
        return generate_latest(self.registry).decode()
