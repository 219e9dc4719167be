"""TensorBoard and W&B sinks of the metrics events: what they plot, read back from the files each tool writes
(TensorBoard's event files through its own EventAccumulator, an offline W&B run's transaction log through W&B's
protobuf records), a sink that fails, and the one-line error when an enabled sink's package is missing. No network:
W&B runs offline in a temporary folder."""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2p_diloco.cli.main import main
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.monitoring.sinks import check_sinks, open_sinks, pick_scalars
from p2p_diloco.training import MetricsWriter, read_metrics

PEER = "12D3KooWGNxvzgqC55PuaVZonwacGPxoBGAR6He6MkNseAYr91ND"


def write_events(writer: MetricsWriter) -> None:
    """A short stage's events as the trainer writes them: a NaN loss (a stage without the head) is not plotted."""
    writer.write("eval", round=0, inner_step=0, eval_loss=5.5)
    for step, loss in [(1, 5.25), (2, float("nan")), (3, 4.75)]:
        writer.write("step", inner_step=step, round=0, loss=loss, lr=1e-3 * step, grad_norm=0.5, tokens_per_s=100.0)
    writer.write("round", round_index=0, applied_round=0, tokens=96, waited_s=0.25, round_end_s=0.5, group_size=3,
                 averaged=True, bytes_sent=1000, bytes_received=2000, averaging_s=0.4, compression={"rank": 4},
                 inner_step=3)
    writer.write("round", round_index=1, applied_round=1, tokens=96, waited_s=1.0, round_end_s=1.5, group_size=1,
                 averaged=False, bytes_sent=0, bytes_received=0, averaging_s=0.0, fallback_reason="no group",
                 inner_step=6)
    writer.write("sync", action="reload", reason="behind", round=2, inner_step=6)
    writer.write("eval", round=2, inner_step=6, eval_loss=None)  # a stage without the head evaluates nothing
    writer.write("summary", inner_steps=6, averaged_rounds=1, fallback_rounds=1, reloads=1, resyncs=0, tokens=192,
                 bytes_sent=1000, bytes_received=2000, network_wait_s=1.25, wall_s=9.0, peer=PEER)


def sink_config(tmp_path, *pairs: tuple[str, str]):
    return load_config(None, [("run.run_id", "sinks-test"), ("run.output_dir", str(tmp_path)), *pairs])


def test_pick_scalars_plots_the_round_outcome_and_leaves_unknowns_out():
    assert pick_scalars("step", {"inner_step": 4, "loss": float("nan"), "lr": 0.1, "tokens_per_s": 5}) == \
        {"train/lr": 0.1, "train/tokens_per_s": 5.0}
    fell_back = {"applied_round": 3, "averaged": False, "group_size": 1, "bytes_sent": 10, "waited_s": 2.0}
    assert pick_scalars("round", fell_back) == {"round/group_size": 1.0, "round/averaged": 0.0,
                                                "round/fallback": 1.0, "round/bytes_sent": 10.0,
                                                "round/network_wait_s": 2.0}
    # the first round end of an overlap mode applies nothing: neither an average nor a fallback
    assert pick_scalars("round", {"applied_round": None, "averaged": False, "bytes_sent": 0}) == \
        {"round/bytes_sent": 0.0}
    assert pick_scalars("sync", {"action": "resync"}) == {"sync/resync": 1.0}
    assert pick_scalars("eval", {"eval_loss": None}) == {} and pick_scalars("resume", {"round": 3}) == {}


def test_tensorboard_event_files_hold_the_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = sink_config(tmp_path, ("metrics.tensorboard_dir", "tb"))
    sinks = open_sinks(cfg, output_dir=tmp_path, peer_name=PEER, stage_index=1, num_stages=2)
    with MetricsWriter(tmp_path / "metrics-stage1.jsonl", sinks) as writer:
        write_events(writer)
    assert writer.sinks == []  # closed with the writer
    (folder,) = (tmp_path / "tb").iterdir()
    assert folder.name == "stage1-eAYr91ND"  # one folder per stage process, named by stage and peer
    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = lambda tag: [(e.step, e.value) for e in events.Scalars(tag)]  # noqa: E731
    assert scalars("train/loss") == [(1, 5.25), (3, 4.75)]
    assert [step for step, _ in scalars("train/lr")] == [1, 2, 3]
    assert scalars("eval/loss") == [(0, 5.5)]
    assert scalars("round/fallback") == [(3, 0.0), (6, 1.0)] and scalars("round/group_size") == [(3, 3.0), (6, 1.0)]
    assert scalars("round/bytes_received") == [(3, 2000.0), (6, 0.0)]
    assert [step for step, _ in scalars("round/wall_s")] == [6]  # the time between the two round ends
    assert scalars("sync/reload") == [(6, 1.0)] and scalars("summary/fallback_rounds") == [(6, 1.0)]
    # the JSONL file is written as before, NaN and all
    assert [e["kind"] for e in read_metrics(tmp_path / "metrics-stage1.jsonl")].count("round") == 2


def wandb_records(path: Path) -> Iterator:
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header (":W&B", magic 0xBEE1,
    version), then LevelDB's log format: 32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first,
    3 middle, 4 last), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    offset, pending, block = 7, b"", 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a chunk header is padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if kind == 0:  # zero padding to the end of the block
            offset += block - offset % block
            continue
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def finished_records(log: Path, timeout: float = 60.0) -> list:
    """The records of a finished W&B run's transaction log, once its writer has written them all (the run's "exit"
    record, the last): W&B's service process writes the file after ``finish()`` returns, and beside two busy loops a
    test read it before the run's own records were in (a two-at-a-time busy make test)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = list(wandb_records(log))
        except Exception:  # a file still being written: its header or its last record not complete yet
            if time.monotonic() >= deadline:
                raise
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() >= deadline:
            return records
        time.sleep(0.2)


def wandb_history(log: Path) -> list[dict]:
    """The rows a W&B run logged, from its (finished) transaction log: plotted name -> value."""
    return [{(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            for record in finished_records(log) if record.WhichOneof("record_type") == "history"]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline with its own folders in tmp_path: nothing reaches the network or the home folder."""
    for name, sub in [("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")]:
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_wandb_offline_run_holds_the_metrics(tmp_path, offline_wandb):
    cfg = sink_config(tmp_path, ("metrics.wandb_project", "p2p-diloco-test"), ("metrics.wandb_mode", "offline"))
    sinks = open_sinks(cfg, output_dir=tmp_path, peer_name=PEER, stage_index=0, num_stages=1)
    with MetricsWriter(tmp_path / "metrics-stage0.jsonl", sinks) as writer:
        write_events(writer)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")
    records = finished_records(log)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.run_group, run.project) == ("sinks-test-eAYr91ND-stage0", "sinks-test",
                                                          "p2p-diloco-test")
    assert set(run.tags) == {"stage0", "peer-eAYr91ND"}
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["peer"] == PEER and config["stage"] == 0 and config["run"]["run_id"] == "sinks-test"
    history = wandb_history(log)
    losses = [(row["inner_step"], row["train/loss"]) for row in history if "train/loss" in row]
    assert losses == [(1, 5.25), (3, 4.75)]
    assert [(row["inner_step"], row["round/fallback"]) for row in history if "round/fallback" in row] == \
        [(3, 0.0), (6, 1.0)]
    assert any(row.get("summary/bytes_sent") == 1000 for row in history)


class Broken:
    name = "Broken"

    def __init__(self):
        self.closed = False

    def write(self, kind, event):
        raise OSError("disk full")

    def close(self):
        self.closed = True


def test_a_failing_sink_is_dropped_and_training_metrics_go_on(tmp_path, caplog):
    broken = Broken()
    with MetricsWriter(tmp_path / "m.jsonl", [broken]) as writer:
        writer.write("step", inner_step=1, loss=1.0)
        writer.write("step", inner_step=2, loss=0.5)
        assert writer.sinks == [] and broken.closed
    assert [e["inner_step"] for e in read_metrics(tmp_path / "m.jsonl")] == [1, 2]
    assert "Broken logging failed (OSError('disk full'))" in caplog.text


@pytest.mark.parametrize("key, module, expected", [
    ("metrics.tensorboard_dir", "tensorboard", "metrics.tensorboard_dir: TensorBoard logging needs the "
     "tensorboard>=2.10 package, which is not installed: pip install 'tensorboard>=2.10' (or the "
     "p2p-diloco[tensorboard] extra)"),
    ("metrics.wandb_project", "wandb", "metrics.wandb_project: W&B logging needs the wandb>=0.19.10 package, which "
     "is not installed: pip install 'wandb>=0.19.10' (or the p2p-diloco[wandb] extra)"),
])
def test_a_sink_without_its_package_is_a_one_line_error_at_peer_start(tmp_path, monkeypatch, capsys, key, module,
                                                                       expected):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    cfg = sink_config(tmp_path, (key, "x"))
    with pytest.raises(ConfigError) as error:
        check_sinks(cfg.metrics)
    assert str(error.value) == expected
    with pytest.raises(ConfigError, match="not installed"):
        open_sinks(cfg, output_dir=tmp_path, peer_name=PEER, stage_index=0, num_stages=1)
    # the peer command says so before it starts anything (no DHT, no data, no output folder)
    assert main(["peer", f"--{key}", "x", "--output-dir", str(tmp_path / "peer")]) == 2
    assert capsys.readouterr().err == f"error: {expected}\n"
    assert not (tmp_path / "peer").exists()


def test_sink_keys_are_off_by_default_and_checked():
    metrics = load_config(None, []).metrics
    assert (metrics.tensorboard_dir, metrics.wandb_project, metrics.wandb_mode) == ("", "", "offline")
    assert open_sinks(load_config(None, []), output_dir=Path("unused"), peer_name=PEER, stage_index=0,
                      num_stages=1) == []
    with pytest.raises(ConfigError, match="metrics.wandb_mode: must be one of offline, online, got 'cloud'"):
        load_config(None, [("metrics.wandb_mode", "cloud")])
    with pytest.raises(ConfigError, match="metrics.wandb_project: must not contain"):
        load_config(None, [("metrics.wandb_project", "team/project")])
