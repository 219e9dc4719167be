"""Operating a swarm with real processes: bootstrap nodes that know each other and survive losing one, identity
files and their lock, `p2p-diloco status`, the /health and /metrics endpoints (prometheus_client), and
interoperability with stock hivemind nodes (the `hivemind-dht` script, a plain `hivemind.DHT`)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import pytest

from tests.integration.conftest import LOOPBACK, cli, wait_for_file
from tests.integration.test_churn import wait_until
from tests.integration.test_cli import assert_one_line_error
from tests.integration.test_swarm import applied, events, peer_args

pytestmark = pytest.mark.timeout(300)
NOT_FOUND = "check --run-id and that peers are running"
# `status --timeout` counts from the process start, and beside training swarms and two busy loops on 2 cores, in a new
# virtual environment whose files are not in the page cache yet, the interpreter's imports and the DHT node's start
# took over 60 s in fresh-clone runs: the tests that need an answer give it this long (the bound itself is tested in
# test_bounds.py)
LOADED_STATUS_TIMEOUT_S = 150


def start_bootstrap(processes, tmp_path, name: str, *extra: str) -> list[str]:
    """A bootstrap node named ``name`` (identity ``<name>.id``); returns its multiaddrs once it is up."""
    proc = processes.start(name, "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path",
                           str(tmp_path / f"{name}.id"), "--maddrs-file", str(tmp_path / f"{name}.maddrs"), *extra)
    return wait_for_file(tmp_path / f"{name}.maddrs", proc).split()


def run_cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout)


def run_clis(*commands: list[str], timeout: float = LOADED_STATUS_TIMEOUT_S + 30,
             ) -> list[subprocess.CompletedProcess]:
    """Several CLI commands run at once (each joins the DHT: a few seconds of waiting apiece), in order."""
    procs = [subprocess.Popen(cli(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in commands]
    results = []
    try:
        for args, proc in zip(commands, procs):
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def free_ports(count: int) -> int:
    """A port P such that P .. P + count - 1 are free now (stage j of a peer serves metrics on P + j)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            others = [socket.socket() for _ in range(count - 1)]
            try:
                for i, sock in enumerate(others, 1):
                    sock.bind(("127.0.0.1", port + i))
                return port
            except OSError:
                continue
            finally:
                for sock in others:
                    sock.close()
    raise AssertionError("no consecutive free ports")


def http_get(url: str) -> tuple[int, str, str]:
    """(status, content type, body) of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def scrape(port: int) -> dict[str, float]:
    """The samples of /metrics by name (labels dropped); checks that every value is a number."""
    code, content_type, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert code == 200 and content_type.startswith("text/plain; version=0.0.4"), (code, content_type)
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = re.fullmatch(r"(\w+)(?:\{.*\})? (\S+)", line).groups()
            samples[name] = float(value)  # raises on anything that is not a number
    return samples


def node_id(log: str, stage: int = 0) -> str:
    """The DHT peer id a stage process printed when its node came up."""
    return re.search(rf"Stage {stage}: DHT node up; others can join through: \S+/p2p/(\w+)", log).group(1)


def averaged_since(tmp_path, name: str, since: float) -> list[dict]:
    """Rounds averaged with others (group of 2 or more) and applied after wall-clock time ``since``."""
    return [e for e in applied(tmp_path, name) if e["averaged"] and e["group_size"] >= 2 and e["time"] > since]


# ---------------------------------------------------------------------------------------------- bootstrap nodes

def test_two_bootstrap_nodes_one_killed_swarm_goes_on_and_newcomer_joins_through_the_other(tmp_path, processes):
    """Bootstrap nodes A and B know each other (B starts with A as initial peer). Peer p1 knows only A, p2 only B:
    they meet through the bootstrap nodes and average. A is killed with SIGKILL: p1 and p2 still average, and a new
    peer p3 that knows only B joins and averages with them; p3 runs in client mode (a peer behind NAT that nobody
    can dial)."""
    boot_a = start_bootstrap(processes, tmp_path, "boot-a")
    boot_b = start_bootstrap(processes, tmp_path, "boot-b", "--initial-peers", *boot_a)
    rounds, h = 200, 5  # more than the test needs: every peer is still training when it ends
    processes.start("p1", *peer_args(tmp_path, "p1", boot_a, "two-boot", rounds, h, wait_for=2))
    processes.start("p2", *peer_args(tmp_path, "p2", boot_b, "two-boot", rounds, h, wait_for=2))
    logs = lambda: processes.log("p1")[-2000:] + processes.log("p2")[-2000:]  # noqa: E731
    wait_until(lambda: averaged_since(tmp_path, "p1", 0) and averaged_since(tmp_path, "p2", 0), 120, log=logs)

    os.killpg(processes.procs["boot-a"].pid, signal.SIGKILL)
    processes.procs["boot-a"].wait()
    killed_at = time.time()
    processes.start("p3", *peer_args(tmp_path, "p3", boot_b, "two-boot", rounds, h, "--client-mode"))
    wait_until(lambda: averaged_since(tmp_path, "p1", killed_at) and averaged_since(tmp_path, "p2", killed_at), 120,
               proc=processes.procs["p1"], log=logs)
    wait_until(lambda: averaged_since(tmp_path, "p3", killed_at), 150, proc=processes.procs["p3"],
               log=lambda: processes.log("p3")[-3000:])
    for name in ("p1", "p2", "p3"):
        assert processes.procs[name].poll() is None, f"{name} exited: {processes.log(name)[-2000:]}"
    assert processes.procs["boot-b"].poll() is None


def test_identity_held_by_a_running_node_is_refused_and_freed_when_it_dies(tmp_path, processes):
    """A second node on the identity of a running node of this machine is refused (exit 1, a message naming the
    holder's pid), although the two would never meet in a swarm; once the holder is killed, even with SIGKILL, the
    identity can be used again and gives the same peer id."""
    maddrs = start_bootstrap(processes, tmp_path, "first")
    identity = tmp_path / "first.id"
    holder = processes.procs["first"].pid
    # no --initial-peers: the two would never meet in a swarm, so hivemind's own check could not see it
    result = run_cli("bootstrap", "--identity-path", str(identity), "--host-maddrs", LOOPBACK)
    assert result.returncode == 1
    assert_one_line_error(result.stderr, f"identity file {identity} is in use by another running node on this "
                                         f"machine (pid {holder}")
    before = identity.read_bytes()

    os.killpg(holder, signal.SIGKILL)
    processes.procs["first"].wait()
    again = processes.start("again", "bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(identity),
                            "--maddrs-file", str(tmp_path / "again.maddrs"))
    maddrs_again = wait_for_file(tmp_path / "again.maddrs", again).split()
    assert maddrs_again[0].rsplit("/p2p/", 1)[1] == maddrs[0].rsplit("/p2p/", 1)[1]
    assert identity.read_bytes() == before


def test_peer_refuses_an_identity_readable_by_its_group_and_leaves_it_alone(tmp_path):
    from p2p_diloco.swarm import ensure_identity

    identity, mode = tmp_path / "peer.id", 0o640
    ensure_identity(identity)
    identity.chmod(mode)
    before = identity.read_bytes()
    result = run_cli("peer", "--host-maddrs", LOOPBACK, "--identity-path", str(identity), "--output-dir",
                     str(tmp_path / "p"), "--model.preset", "tiny", "--data.seq_len", "64")
    assert result.returncode == 1
    assert_one_line_error(result.stderr, f"run `chmod 600 {identity}`")
    assert identity.read_bytes() == before and (identity.stat().st_mode & 0o777) == mode


async def _store_at(_dht, node, peer, subkey):
    """Runs in a DHT's process: store one entry under ``subkey`` straight at ``peer`` (a stock node's own storage
    would raise first, on the subkeys that the bounded node refuses)."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils import get_dht_time

    value = node.protocol.serializer.dumps(1)
    answer = await node.protocol.call_store(peer, [DHTID.generate(source="ops-key")], [value], get_dht_time() + 60,
                                            subkeys=[subkey])
    return None if answer is None else list(answer)  # (a protobuf container does not pickle back to the caller)


def test_bootstrap_metrics_health_and_liveness(tmp_path, processes):
    """A bootstrap node with --metrics.port: /health is 200 with JSON, /metrics counts the DHT node that joined
    it, the liveness line says the same; a second node on that port is refused with a message naming the key;
    SIGTERM stops the first with exit code 0 and closes the port."""
    import hivemind

    port = free_ports(1)
    maddrs = start_bootstrap(processes, tmp_path, "boot", "--metrics.port", str(port), "--liveness-every", "1")
    code, content_type, body = http_get(f"http://127.0.0.1:{port}/health")
    assert code == 200 and content_type == "application/json"
    health = json.loads(body)
    assert health["status"] == "ok" and health["role"] == "bootstrap" and health["node"] in maddrs[0]
    assert scrape(port)["p2p_diloco_peers_seen"] == 0

    other = hivemind.DHT(initial_peers=maddrs, host_maddrs=[LOOPBACK], start=True)
    try:
        wait_until(lambda: scrape(port)["p2p_diloco_peers_seen"] >= 1, 30)
        samples = scrape(port)
        assert samples["p2p_diloco_connected_peers"] >= 1 and samples["p2p_diloco_uptime_seconds"] > 0
        assert samples["p2p_diloco_dht_refused_entries_total"] == 0
        # the node's storage bound: an entry it keeps is counted, one it refuses (a text subkey beside a bytes one
        # under the same key: hivemind's heap cannot order them) too
        from hivemind.p2p import PeerID

        boot_id = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
        assert other.run_coroutine(partial(_store_at, peer=boot_id, subkey=b"a")) == [True]
        assert other.run_coroutine(partial(_store_at, peer=boot_id, subkey="a")) == [False]
        wait_until(lambda: scrape(port)["p2p_diloco_dht_refused_entries_total"] >= 1, 30)
        assert scrape(port)["p2p_diloco_dht_kept_bytes"] > 0
        wait_until(lambda: re.search(r"alive: [1-9]\d* peer\(s\) in the routing table, [1-9]\d* connected, uptime "
                                     r"\d+ s, keeps \d+\.\d MiB of others' DHT entries \([1-9]\d* refused\)",
                                     processes.log("boot")), 30)
    finally:
        other.shutdown()
    assert http_get(f"http://127.0.0.1:{port}/nothing")[0] == 404
    result = run_cli("bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(tmp_path / "second.id"),
                     "--metrics.port", str(port))
    assert result.returncode == 2
    assert_one_line_error(result.stderr, f"metrics.port: cannot serve metrics on 127.0.0.1:{port}")

    proc = processes.procs["boot"]
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, processes.log("boot")[-2000:]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)


def test_metrics_server_serves_prometheus_client_and_health_on_one_port():
    """In-process, no node: /metrics is prometheus_client's exposition of this registry alone (text 0.0.4 by
    default, OpenMetrics for a scraper that asks), /health is 200 while ok and 503 otherwise (also when the report
    cannot be made), other paths 404, and close() frees the port."""
    from prometheus_client.parser import text_string_to_metric_families

    from p2p_diloco.config import MetricsConfig
    from p2p_diloco.monitoring import MetricsRegistry, MetricsServer

    state = {"round": 2, "status": "ok"}
    registry = MetricsRegistry({"run_id": "r1", "stage": "0"})
    registry.add("p2p_diloco_round", "gauge", "Rounds finished", lambda: state["round"])
    registry.add("p2p_diloco_bytes_sent_total", "counter", "Bytes sent", lambda: 12345678901)

    def health() -> dict:
        if state["status"] is None:
            raise RuntimeError("the DHT process is gone")
        return {"status": state["status"], "round": 2}

    server = MetricsServer(MetricsConfig(port=0), registry, health)
    url = server.url
    try:
        assert scrape(server.port) == {"p2p_diloco_round": 2.0, "p2p_diloco_bytes_sent_total": 12345678901.0}
        families = {f.name: f for f in text_string_to_metric_families(http_get(f"{url}/metrics")[2])}
        assert {name: f.type for name, f in families.items()} == {"p2p_diloco_round": "gauge",
                                                                   "p2p_diloco_bytes_sent": "counter"}
        assert families["p2p_diloco_round"].samples[0].labels == {"run_id": "r1", "stage": "0"}
        state["round"] = 3  # read when scraped
        assert scrape(server.port)["p2p_diloco_round"] == 3.0
        openmetrics = urllib.request.Request(f"{url}/metrics",
                                             headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(openmetrics, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
            assert response.read().decode().endswith("# EOF\n")

        assert http_get(f"{url}/health") == (200, "application/json", '{"status": "ok", "round": 2}\n')
        state["status"] = "stopping"
        assert http_get(f"{url}/health")[0] == 503
        state["status"] = None  # the report itself fails: still an answer, and not "ok"
        code, content_type, body = http_get(f"{url}/health")
        assert (code, content_type, json.loads(body)["status"]) == (503, "application/json", "down")
        assert http_get(f"{url}/nothing")[0] == 404
    finally:
        server.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/health", timeout=5)


# ---------------------------------------------------------------------------------------------- see the swarm

def last_round(tmp_path, name: str, stage: int) -> int:
    steps = events(tmp_path, name, "step", stage)
    return steps[-1]["round"] if steps else -1


def test_status_and_metrics_of_a_running_swarm(tmp_path, processes, bootstrap):
    """Run A: one peer of 2 pipeline stages with metrics on; run B: one single-stage peer. `status` of run A lists
    exactly A's two stage processes, with their stages and rounds, as a table and as JSON; run B shows B's peer;
    an unknown run exits 1 with the message. Each stage of A serves /health and /metrics on port + stage."""
    port = free_ports(2)
    alone = ["--averaging.round_timeout_s", "5"]  # lone peers: each round waits this long for a group
    processes.start("a", *peer_args(tmp_path, "a", bootstrap, "status-a", 200, 5, "--stages", "2",
                                    "--metrics.port", str(port), *alone))
    processes.start("b", *peer_args(tmp_path, "b", bootstrap, "status-b", 200, 5, *alone))
    wait_until(lambda: last_round(tmp_path, "a", 1) >= 1 and last_round(tmp_path, "b", 0) >= 1, 150,
               proc=processes.procs["a"], log=lambda: processes.log("a") + processes.log("b"))
    peer_a, peer_b = node_id(processes.log("a"), 0), node_id(processes.log("b"), 0)

    low = last_round(tmp_path, "a", 0)
    loaded = ["--timeout", str(LOADED_STATUS_TIMEOUT_S)]
    result, of_b, of_none = run_clis(["status", "--initial-peers", *bootstrap, "--run-id", "status-a", "--json",
                                      *loaded],
                                     ["status", "--initial-peers", *bootstrap, "--run-id", "status-b", *loaded],
                                     ["status", "--initial-peers", *bootstrap, "--run-id", "no-such-run", *loaded])
    high = last_round(tmp_path, "a", 0) + 1  # a record can run one round ahead of the last logged step
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [(p["peer"], p["stage"], p["num_stages"]) for p in report["peers"]] == [(peer_a, 0, 2), (peer_a, 1, 2)]
    assert report["num_peers"] == 1 and report["num_processes"] == 2
    for p in report["peers"]:
        assert low <= p["round"] <= high and p["inner_step"] >= 5 * p["round"], (low, high, p)
        assert 0 <= p["last_seen_s"] < 60 and p["tokens_per_s"] > 0
    assert report["current_round"] == max(p["round"] for p in report["peers"])
    assert report["tokens_per_s_total"] == report["peers"][0]["tokens_per_s"]  # stage 0 only
    assert report["peers"][0]["loss"] is None and report["peers"][1]["loss"] > 0  # the loss lives on the last stage

    result = of_b
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "run status-b: 1 peer(s), 1 stage process(es)"
    assert lines[2].split()[:2] == ["..." + peer_b[-8:], "0/1"]
    assert peer_a[-8:] not in result.stdout
    assert re.search(r"^current round: [1-9]\d*$", result.stdout, re.M)
    assert re.search(r"^total throughput: [\d,]+ tokens/s \(sum over the peers' stage 0\)$", result.stdout, re.M)

    result = of_none
    assert result.returncode == 1 and result.stdout == ""
    assert_one_line_error(result.stderr, f"no records of run no-such-run within {LOADED_STATUS_TIMEOUT_S} s; ")
    assert re.search(rf"; [1-9]\d* peer\(s\) reachable through {re.escape(bootstrap[0])}: {NOT_FOUND}",
                     result.stderr), result.stderr

    for stage in (0, 1):
        code, _, body = http_get(f"http://127.0.0.1:{port + stage}/health")
        health = json.loads(body)
        assert code == 200 and health["status"] == "ok", health
        assert (health["role"], health["peer"], health["stage"], health["num_stages"]) == ("peer", peer_a, stage, 2)
        before = last_round(tmp_path, "a", stage)
        samples = scrape(port + stage)
        assert before <= samples["p2p_diloco_round"] <= last_round(tmp_path, "a", stage) + 1
        assert samples["p2p_diloco_inner_step"] >= 5 * samples["p2p_diloco_round"]
        assert samples["p2p_diloco_tokens_per_second"] > 0 and samples["p2p_diloco_uptime_seconds"] > 0
        # a lone peer: every applied round is its own pseudo-gradient; the round in flight is not applied yet
        assert samples["p2p_diloco_round"] - 2 <= samples["p2p_diloco_fallback_rounds_total"] <= \
            samples["p2p_diloco_round"]
        assert samples["p2p_diloco_averaged_rounds_total"] == 0 and samples["p2p_diloco_bytes_sent_total"] == 0
        assert samples["p2p_diloco_resyncs_total"] == 0 and samples["p2p_diloco_peers_seen"] >= 1
        assert ("p2p_diloco_loss" in samples) == (stage == 1)
    assert scrape(port + 1)["p2p_diloco_loss"] > 0


# ---------------------------------------------------------------------------------------------- interoperability

def stock_dht_node(processes, tmp_path) -> list[str]:
    """hivemind's own `hivemind-dht` console script as a subprocess; returns its multiaddrs from its log."""
    script = Path(sys.executable).parent / "hivemind-dht"
    assert script.exists(), f"hivemind's console script is missing: {script}"
    log = open(tmp_path / "stock.log", "w")
    proc = subprocess.Popen([str(script), "--host_maddrs", LOOPBACK, "--identity_path", str(tmp_path / "stock.id")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    processes.procs["stock"] = proc
    found: list[str] = []

    def printed() -> bool:
        text = re.sub(r"\x1b\[[0-9;]*m", "", (tmp_path / "stock.log").read_text())
        found[:] = re.findall(r"Full list of visible multiaddresses: (.*)$", text, re.M)[:1]
        return bool(found)

    wait_until(printed, 60, proc=proc, log=lambda: (tmp_path / "stock.log").read_text())
    return found[0].split()


def test_our_nodes_join_through_a_stock_hivemind_dht_node(tmp_path, processes):
    """A stock `hivemind-dht` node is the only initial peer of our bootstrap node and of our peer; a client that
    knows only our bootstrap node reads the peer's (signed) progress record: all are one DHT. (Reading a run's
    records takes a node that checks signatures from its start, hence start_dht; plain hivemind clients are
    tested below.)"""
    from p2p_diloco.config import DHTConfig
    from p2p_diloco.swarm import fetch_progress, start_dht

    stock = stock_dht_node(processes, tmp_path)
    ours = start_bootstrap(processes, tmp_path, "boot", "--initial-peers", *stock)
    processes.start("p", *peer_args(tmp_path, "p", stock, "interop", 200, 5))
    client = start_dht(DHTConfig(initial_peers=list(ours), host_maddrs=[LOOPBACK], client_mode=True))
    records = []
    try:  # the peer publishes its record as soon as its node is up, before its first step
        wait_until(lambda: records.extend(fetch_progress(client, "interop")) or records, 120,
                   proc=processes.procs["p"], log=lambda: processes.log("p"))
    finally:
        client.shutdown()
    assert [(r.peer, r.stage, r.num_stages) for r in records] == [(node_id(processes.log("p")), 0, 1)]
    assert processes.procs["stock"].poll() is None and processes.procs["boot"].poll() is None


def test_stock_hivemind_clients_store_and_get_through_our_bootstrap_node(bootstrap):
    """Two plain `hivemind.DHT` clients (client mode: they hold no records) bootstrap from our node alone; what one
    stores, the other gets: the record can only live on our node."""
    import hivemind
    from hivemind.utils import get_dht_time

    writer = hivemind.DHT(initial_peers=bootstrap, host_maddrs=[LOOPBACK], client_mode=True, start=True)
    try:
        reader = hivemind.DHT(initial_peers=bootstrap, host_maddrs=[LOOPBACK], client_mode=True, start=True)
        try:
            assert writer.store("interop-key", {"hello": "swarm"}, expiration_time=get_dht_time() + 60)
            found = reader.get("interop-key", latest=True)
            assert found is not None and found.value == {"hello": "swarm"}
            assert reader.get("interop-missing-key", latest=True) is None
        finally:
            reader.shutdown()
    finally:
        writer.shutdown()
