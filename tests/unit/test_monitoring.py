"""The metrics registry's Prometheus text (prometheus_client's exposition of a per-process registry), the [metrics]
config section, and the status command's report. Pure: no sockets, no DHT."""

from __future__ import annotations

import json
import math
import re

import pytest

from p2p_diloco.cli.status_report import build_report, format_report, short_id
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.monitoring import MetricsRegistry
from p2p_diloco.swarm import ProgressRecord

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{((?:[a-zA-Z_]\w*="(?:[^"\\]|\\.)*",?)*)\})? (\S+)$')


def parse_exposition(text: str) -> dict[str, tuple[str, dict[str, str], float]]:
    """A strict reader of the text format: every sample has HELP and TYPE before it; returns name -> (type,
    labels, value)."""
    assert text.endswith("\n")
    result, meta = {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name, rest = line.split(" ", 3)
            meta.setdefault(name, {})[kind] = rest
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, _, labels, value = match.groups()
        assert set(meta.get(name, {})) == {"HELP", "TYPE"}, f"{name} lacks HELP or TYPE"
        assert meta[name]["TYPE"] in ("gauge", "counter")
        parsed = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels or ""))
        result[name] = (meta[name]["TYPE"], parsed, float(value))
    return result


def test_registry_renders_every_readable_metric_with_its_labels():
    state = {"round": 3, "loss": float("nan")}
    registry = MetricsRegistry({"run_id": "r1", "peer": 'odd"name\\'})
    registry.add("p2p_diloco_round", "gauge", "Rounds", lambda: state["round"])
    registry.add("p2p_diloco_loss", "gauge", "Loss", lambda: state["loss"])
    registry.add("p2p_diloco_bytes_sent_total", "counter", "Bytes", lambda: 12345678901)
    registry.add("p2p_diloco_missing", "gauge", "Not known yet", lambda: None)
    registry.add("p2p_diloco_broken", "gauge", "Raises", lambda: 1 / 0)
    parsed = parse_exposition(registry.render())
    assert set(parsed) == {"p2p_diloco_round", "p2p_diloco_loss", "p2p_diloco_bytes_sent_total"}
    assert parsed["p2p_diloco_round"] == ("gauge", {"run_id": "r1", "peer": 'odd\\"name\\\\'}, 3.0)
    assert math.isnan(parsed["p2p_diloco_loss"][2])
    assert parsed["p2p_diloco_bytes_sent_total"][:1] == ("counter",) and parsed["p2p_diloco_bytes_sent_total"][2] == \
        12345678901
    state["round"] = 4  # read at scrape time, not at registration
    assert parse_exposition(registry.render())["p2p_diloco_round"][2] == 4.0


def test_each_registry_is_its_own_and_not_prometheus_clients_global_one():
    """Two stage registries in one process (tests, in-process stages) with the same names never collide, and
    nothing lands in prometheus_client's default registry (which would also show the library's process metrics)."""
    import prometheus_client

    first, second = MetricsRegistry({"stage": "0"}), MetricsRegistry({"stage": "1"})
    first.add("p2p_diloco_round", "gauge", "Rounds", lambda: 1)
    second.add("p2p_diloco_round", "gauge", "Rounds", lambda: 2)
    assert parse_exposition(first.render())["p2p_diloco_round"] == ("gauge", {"stage": "0"}, 1.0)
    assert parse_exposition(second.render())["p2p_diloco_round"] == ("gauge", {"stage": "1"}, 2.0)
    assert "p2p_diloco_round" not in prometheus_client.generate_latest().decode()


def test_counters_must_end_in_total():
    with pytest.raises(AssertionError):
        MetricsRegistry().add("p2p_diloco_rounds", "counter", "x", lambda: 1)


@pytest.mark.parametrize("override, expected", [
    (("metrics.port", "70000"), "metrics.port: must be a TCP port"),
    (("metrics.port", "-1"), "metrics.port: must be a TCP port"),
    (("metrics.port", "http"), "metrics.port: expected an integer"),
    (("metrics.host", " "), "metrics.host: must not be empty"),
])
def test_metrics_config_errors_name_the_key(override, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(None, [override])


def test_metrics_are_off_by_default():
    cfg = load_config(None, [])
    assert cfg.metrics.port is None and cfg.metrics.host == "127.0.0.1"
    assert load_config(None, [("metrics.port", "9100")]).metrics.port == 9100


def record(peer: str, stage: int, num_stages: int, round_: int, tokens: float, loss: float, time: float,
           node: str = "") -> ProgressRecord:
    return ProgressRecord(peer=peer, stage=stage, num_stages=num_stages, round=round_, inner_step=round_ * 10 + 3,
                          tokens_per_s=tokens, loss=loss, time=time, node=node or f"{peer}-{stage}")


def test_report_sums_throughput_over_stage_0_and_takes_the_highest_round():
    peer_a, peer_b = "12D3KooWAAAAAAAAAAAAAAAAAAAA1111", "12D3KooWBBBBBBBBBBBBBBBBBBBB2222"
    records = [record(peer_a, 1, 2, 4, 1000.0, 2.5, 95.0), record(peer_a, 0, 2, 4, 1000.0, math.nan, 98.0),
               record(peer_b, 0, 2, 5, 250.0, math.nan, 99.0), record(peer_b, 1, 2, 5, 250.0, 2.25, 90.0)]
    report = build_report("r1", records, now=100.0)
    assert (report["num_peers"], report["num_processes"], report["current_round"]) == (2, 4, 5)
    assert report["tokens_per_s_total"] == 1250.0  # each peer once, not once per stage
    assert [(p["peer"], p["stage"]) for p in report["peers"]] == [(peer_a, 0), (peer_a, 1), (peer_b, 0), (peer_b, 1)]
    assert report["peers"][0]["loss"] is None and report["peers"][1]["loss"] == 2.5
    assert [p["last_seen_s"] for p in report["peers"]] == [2.0, 5.0, 1.0, 10.0]
    json.dumps(report, allow_nan=False)  # a valid JSON document: no NaN

    table = format_report(report).splitlines()
    assert table[0] == "run r1: 2 peer(s), 4 stage process(es)"
    row = table[2].split()
    assert row[:4] == [short_id(peer_a), "0/2", "4", "43"] and row[5] == "-"
    assert table[3].split()[5] == "2.500"
    assert table[-2] == "current round: 5"
    assert table[-1] == "total throughput: 1,250 tokens/s (sum over the peers' stage 0)"


def test_report_of_a_run_averaged_by_fragment_shows_each_process_with_its_fragments():
    """F = 3: peer a is one process holding 0-2, peer b two processes (0-1, 2). One row per stage process, its
    fragments listed, its round the lowest of theirs; throughput once per peer (the process holding fragment 0)."""
    peer_a, peer_b = "12D3KooWAAAAAAAAAAAAAAAAAAAA1111", "12D3KooWBBBBBBBBBBBBBBBBBBBB2222"
    records = [record(peer_a, f, 3, 4, 1000.0, 2.5 if f == 2 else math.nan, 95.0, node="a0") for f in range(3)]
    records[1] = record(peer_a, 1, 3, 3, 1000.0, math.nan, 97.0, node="a0")  # a fragment a round behind
    records += [record(peer_b, 0, 3, 5, 250.0, math.nan, 99.0, node="b0"),
                record(peer_b, 1, 3, 5, 250.0, math.nan, 99.0, node="b0"),
                record(peer_b, 2, 3, 5, 250.0, 2.25, 90.0, node="b1"),
                record(peer_b, 0, 2, 5, 250.0, 2.25, 90.0, node="stray")]  # not of this fragment count: left out
    report = build_report("r1", records, now=100.0, num_fragments=3)
    assert (report["num_peers"], report["num_processes"], report["num_fragments"]) == (2, 3, 3)
    assert [(p["peer"], p["fragments"], p["round"]) for p in report["peers"]] == \
        [(peer_a, [0, 1, 2], 3), (peer_b, [0, 1], 5), (peer_b, [2], 5)]
    assert report["tokens_per_s_total"] == 1250.0
    assert report["peers"][0]["loss"] == 2.5 and report["peers"][1]["loss"] is None
    assert report["peers"][0]["last_seen_s"] == 3.0  # its most recent record
    json.dumps(report, allow_nan=False)
    table = format_report(report).splitlines()
    assert table[2].split()[:3] == [short_id(peer_a), "0,1,2/3", "3"]
    assert table[4].split()[:2] == [short_id(peer_b), "2/3"]
    assert table[-1] == "total throughput: 1,250 tokens/s (sum over the peers' stage processes holding fragment 0)"


def test_short_id_keeps_the_distinctive_end():
    assert short_id("12D3KooWGNxvzgqC55PuaVZonwacGPxoBGAR6He6MkNseAYr91ND") == "...eAYr91ND"
    assert short_id("Qm1234") == "Qm1234"
