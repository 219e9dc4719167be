"""TensorBoard and Weights & Biases: optional sinks of the training metrics that go to the JSONL files.

The trainer's :class:`~p2p_diloco.training.metrics.MetricsWriter` hands every event ("step", "round", "eval",
"sync", "summary") to each sink; :func:`pick_scalars` chooses the values worth plotting, under the same names in
both tools, at the event's inner step. Both are off by default. :func:`open_sinks` opens what the ``[metrics]``
section asks for (one TensorBoard writer and one W&B run per stage process); :func:`check_sinks` tells at peer
start, before training, that an enabled one lacks its package. Called by the trainer and the peer command.
"""

from __future__ import annotations

import importlib
import logging
import math
from pathlib import Path
from typing import Any, Optional, Protocol

from p2p_diloco.config import Config, ConfigError, MetricsConfig

logger = logging.getLogger(__name__)
PLOTTED: dict[str, dict[str, str]] = {
    "step": {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
             "tokens_per_s": "train/tokens_per_s"},
    "eval": {"eval_loss": "eval/loss"},
    "round": {"bytes_sent": "round/bytes_sent", "bytes_received": "round/bytes_received",
              "round_end_s": "round/round_end_s", "waited_s": "round/network_wait_s",
              "averaging_s": "round/averaging_s"},
    "summary": {"averaged_rounds": "summary/averaged_rounds", "fallback_rounds": "summary/fallback_rounds",
                "reloads": "summary/reloads", "resyncs": "summary/resyncs", "tokens": "summary/tokens",
                "bytes_sent": "summary/bytes_sent", "bytes_received": "summary/bytes_received",
                "network_wait_s": "summary/network_wait_s", "wall_s": "summary/wall_s"},
}
"""Event kind -> (event key -> plotted name). A round that applied an average or a fallback also gives
round/group_size, round/averaged and round/fallback (1 or 0); a reload or resync gives sync/reload or sync/resync."""


class MetricsSink(Protocol):
    """What :class:`~p2p_diloco.training.metrics.MetricsWriter` fans its events out to."""

    name: str

    def write(self, kind: str, event: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None  # a NaN loss (a stage without the head) or a missing eval is left out, not plotted as 0
    return float(value)


def event_step(event: dict[str, Any]) -> int:
    """The x axis of every plot: the inner step the event was written at (the summary's is its last)."""
    return int(event.get("inner_step", event.get("inner_steps", 0)))


def pick_scalars(kind: str, event: dict[str, Any]) -> dict[str, float]:
    """The plotted values of one metrics event, by plotted name (see :data:`PLOTTED`)."""
    picked = {name: _number(event.get(key)) for key, name in PLOTTED.get(kind, {}).items()}
    if kind == "round" and event.get("applied_round") is not None:  # the first round end of an overlap mode: none
        averaged = bool(event.get("averaged"))
        picked |= {"round/group_size": _number(event.get("group_size")), "round/averaged": float(averaged),
                   "round/fallback": float(not averaged)}
    if kind == "sync" and event.get("action") in ("reload", "resync"):
        picked[f"sync/{event['action']}"] = 1.0
    return {name: value for name, value in picked.items() if value is not None}


class _ScalarSink:
    """Picks the plotted values of each event and logs them at its inner step; also the wall time between rounds."""

    name = "metrics sink"

    def __init__(self):
        self._last_round_time: Optional[float] = None

    def write(self, kind: str, event: dict[str, Any]) -> None:
        values = pick_scalars(kind, event)
        if kind == "round" and isinstance(event.get("time"), (int, float)):
            if self._last_round_time is not None:
                values["round/wall_s"] = event["time"] - self._last_round_time
            self._last_round_time = event["time"]
        if values:
            self.log(event_step(event), values)

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError


class TensorBoardSink(_ScalarSink):
    """One TensorBoard event file folder (``torch.utils.tensorboard``'s writer), flushed every 10 s and at close."""

    name = "TensorBoard"

    def __init__(self, logdir: Path, description: str):
        super().__init__()
        writer_class = _require_tensorboard()
        self.logdir = Path(logdir)
        self.writer = writer_class(log_dir=str(self.logdir), flush_secs=10)
        self.writer.add_text("run", description)

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink(_ScalarSink):
    """One W&B run; every value is logged against ``inner_step`` (W&B's own step must only grow, and a reload
    can move a stage's inner step either way)."""

    name = "W&B"

    def __init__(self, cfg: MetricsConfig, *, folder: Path, name: str, group: str, tags: list[str],
                 config: dict[str, Any]):
        super().__init__()
        wandb = _require_wandb()
        folder.mkdir(parents=True, exist_ok=True)
        # console off: the CLI owns stdout and stderr (wandb would otherwise wrap them and print its banner)
        settings = wandb.Settings(console="off", silent=True)
        try:
            self.run = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, dir=str(folder), name=name,
                                  group=group, tags=tags, config=config, settings=settings, reinit="create_new")
        except Exception as e:  # no API key online, a server that does not answer: say so in one line
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"metrics.wandb_project: could not start a W&B run ({first_line})") from None
        self.run.define_metric("inner_step")
        self.run.define_metric("*", step_metric="inner_step")
        self.run_dir = Path(self.run.dir).parent  # <folder>/wandb/offline-run-<time>-<id> (its files/ inside)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values | {"inner_step": step})

    def close(self) -> None:
        self.run.finish()


def _require(module: str, key: str, package: str, extra: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{key}: {what} needs the {package} package, which is not installed: "
                          f"pip install '{package}' (or the p2p-diloco[{extra}] extra)") from None


def _require_tensorboard():
    """torch's SummaryWriter (it imports the tensorboard package, checked first: torch may have it cached)."""
    _require("tensorboard", "metrics.tensorboard_dir", "tensorboard>=2.10", "tensorboard", "TensorBoard logging")
    module = _require("torch.utils.tensorboard", "metrics.tensorboard_dir", "tensorboard>=2.10", "tensorboard",
                      "TensorBoard logging")
    return module.SummaryWriter


def _require_wandb():
    return _require("wandb", "metrics.wandb_project", "wandb>=0.19.10", "wandb", "W&B logging")


def check_sinks(cfg: MetricsConfig) -> None:
    """Raise a one-line ConfigError naming the key when an enabled sink's package is missing (at peer start)."""
    if cfg.tensorboard_dir:
        _require_tensorboard()
    if cfg.wandb_project:
        _require_wandb()


def open_sinks(cfg: Config, *, output_dir: Path, peer_name: str, stage_index: int,
               num_stages: int) -> list[MetricsSink]:
    """The sinks ``cfg.metrics`` turns on for one stage process (none by default); the caller closes them.

    Args:
        cfg: the whole config (the W&B run records it).
        output_dir: ``run.output_dir``: relative folders are under it.
        peer_name: the peer's name (peer id of its stage 0): runs are named after its end.
        stage_index, num_stages: which stage process this is.

    Raises:
        ConfigError: a sink's package is missing, or its W&B run cannot start.
    """
    metrics, tag = cfg.metrics, f"stage{stage_index}"
    sinks: list[MetricsSink] = []
    try:
        if metrics.tensorboard_dir:
            root = output_dir / metrics.tensorboard_dir  # an absolute tensorboard_dir stays as it is
            sink = TensorBoardSink(root / f"{tag}-{peer_name[-8:]}", f"run {cfg.run.run_id}, peer {peer_name}, "
                                   f"stage {stage_index} of {num_stages}")
            sinks.append(sink)
            logger.info(f"Stage {stage_index}: TensorBoard events in {sink.logdir} (tensorboard --logdir {root})")
        if metrics.wandb_project:
            name = f"{metrics.wandb_run_name or f'{cfg.run.run_id}-{peer_name[-8:]}'}-{tag}"
            config = {"peer": peer_name, "stage": stage_index, "num_stages": num_stages} | cfg.to_dict()
            sink = WandbSink(metrics, folder=output_dir, name=name, group=cfg.run.run_id,
                             tags=[tag, f"peer-{peer_name[-8:]}"], config=config)
            sinks.append(sink)
            upload = f"; upload it with `wandb sync {sink.run_dir}`" if metrics.wandb_mode == "offline" else ""
            logger.info(f"Stage {stage_index}: W&B run {name} ({metrics.wandb_mode}) in {sink.run_dir}{upload}")
    except Exception:
        for sink in sinks:
            sink.close()
        raise
    return sinks
