"""Options of the operations commands, parsed as the CLI does: NAT and relay shortcuts, metrics keys, and the
mistakes that `bootstrap` and `status` refuse before starting anything. No network: every case here ends before
a DHT would start."""

from __future__ import annotations

import pytest

from p2p_diloco.cli.common import config_from_args
from p2p_diloco.cli.main import build_parser, main
from p2p_diloco.config import split_overrides

BOOT = "/ip4/127.0.0.1/tcp/31337/p2p/QmX7HoVd7Cthwu6qmfMXPSXVcrpUP9encNo3v5SBbbpWGM"


def config_of(argv: list[str]):
    args, rest = build_parser().parse_known_args(argv)
    return config_from_args(args, split_overrides(rest))


@pytest.mark.parametrize("command", ["peer", "bootstrap"])
def test_nat_shortcuts_set_the_dht_keys(command):
    default = config_of([command]).dht
    assert (default.client_mode, default.use_relay, default.use_auto_relay) == (False, True, False)
    cfg = config_of([command, "--client-mode", "--no-relay", "--use-auto-relay"]).dht
    assert (cfg.client_mode, cfg.use_relay, cfg.use_auto_relay) == (True, False, True)


def test_metrics_keys_on_the_command_line():
    cfg = config_of(["peer", "--metrics.port", "9100", "--metrics.host", "0.0.0.0"])
    assert (cfg.metrics.port, cfg.metrics.host) == (9100, "0.0.0.0")


@pytest.mark.parametrize("argv, expected", [
    (["bootstrap", "--client-mode"], "dht.client_mode: a bootstrap node must accept incoming connections"),
    (["bootstrap", "--liveness-every", "0"], "--liveness-every: must be a positive number of seconds"),
    (["bootstrap", "--metrics.port", "65536"], "metrics.port: must be a TCP port"),
    (["status", "--initial-peers", BOOT], "run.run_id: which run? give --run-id"),
    (["status", "--run-id", "r1"], "dht.initial_peers: status needs the multiaddr of a running bootstrap node"),
    (["status", "--run-id", "r1", "--initial-peers", "/ip4/127.0.0.1/tcp/31337"], "has no /p2p/<peer id> part"),
    (["status", "--run-id", "bad id!", "--initial-peers", BOOT], "run.run_id: must be 1-64 letters"),
    (["status", "--run-id", "r1", "--initial-peers", BOOT, "--timeout", "0"], "--timeout: a positive number"),
    (["status", "--run-id", "r1", "--initial-peers", BOOT, "--timeout", "nan"], "--timeout: a positive number"),
    (["status", "--run-id", "r1", "--initial-peers", BOOT, "--serve", "65536"], "--serve: a port from 0 to 65535"),
    (["status", "--run-id", "r1", "--initial-peers", BOOT, "--serve", "0", "--json"], "--serve and --json: choose"),
])
def test_refused_before_anything_starts(argv, expected, capsys, monkeypatch):
    # `status` counts its --timeout from its process's start: here, pytest's, long before this test
    monkeypatch.setattr("p2p_diloco.cli.status.seconds_since_process_start", lambda: 0.0)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and expected in err[-1], err


def test_status_takes_run_and_peers_from_a_config_but_never_its_identity(tmp_path):
    from p2p_diloco.cli.status import status_config

    config = tmp_path / "peer.toml"
    config.write_text(f'[run]\nrun_id = "from-file"\n[dht]\ninitial_peers = ["{BOOT}"]\nidentity_path = "peer.id"\n'
                      '[metrics]\nport = 9100\n')
    args = build_parser().parse_args(["status", "--config", str(config)])
    cfg = status_config(args)
    assert (cfg.run.run_id, cfg.dht.initial_peers) == ("from-file", [BOOT])
    assert cfg.dht.client_mode and cfg.dht.identity_path is None and cfg.metrics.port is None
    args = build_parser().parse_args(["status", "--config", str(config), "--run-id", "other"])
    assert status_config(args).run.run_id == "other"  # the option wins


def test_every_user_error_class_is_where_the_cli_looks_for_it():
    """`main` tells a user's mistake in one line by these classes; a class renamed or moved would become a traceback."""
    import importlib

    from p2p_diloco.cli.main import USER_ERRORS, user_errors

    classes = [getattr(importlib.import_module(module), name) for module, name in USER_ERRORS]
    assert all(isinstance(c, type) and issubclass(c, Exception) for c in classes)
    assert set(user_errors()) == set(classes)  # all imported now: all caught


def assert_killed(pid: str) -> None:
    """The node's process ``pid`` is gone or a zombie within 5 s (the killed child is reaped by init once its
    parent is gone)."""
    import time

    for _ in range(50):
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the node's process {pid} is still running")


def _reader_with_a_child(then):
    """A reader for ``supervise`` that starts a process of its own (as hivemind's DHT does), tells its pid, then
    does ``then(send)``."""
    def read(send):
        import subprocess

        send({"child": subprocess.Popen(["sleep", "600"]).pid})
        return then(send)

    return read


def test_supervise_returns_the_readers_answer_with_its_events_and_kills_what_it_started():
    import time

    from p2p_diloco.cli.status import supervise

    events = []
    answer = supervise(_reader_with_a_child(lambda send: send({"phase": "reading"}) or {"report": [1, 2]}),
                       events.append, until=time.monotonic() + 60)
    assert answer == {"report": [1, 2]} and events[1:] == [{"phase": "reading"}], (answer, events)
    assert_killed(events[0]["child"])


def test_supervise_gives_up_at_its_bound_on_a_reader_that_overruns_and_kills_its_group():
    """A reader stuck past ``until`` (imports or a DHT call on a loaded machine): no answer at ``until``, with every
    event it sent before, and its process group killed."""
    import time

    from p2p_diloco.cli.status import supervise

    def stuck(send):
        send({"phase": "reading the run's records"})
        time.sleep(600)

    events, started = [], time.monotonic()
    assert supervise(_reader_with_a_child(stuck), events.append, until=started + 1.5) is None
    assert time.monotonic() - started < 1.5 + 2.5
    assert events[1:] == [{"phase": "reading the run's records"}]
    assert_killed(events[0]["child"])


def test_supervise_does_not_wait_for_a_reader_that_died():
    import time

    from p2p_diloco.cli.status import supervise

    def broken(send):
        raise RuntimeError("a bug in the reader")

    events, started = [], time.monotonic()
    assert supervise(_reader_with_a_child(broken), events.append, until=started + 60) is None
    assert time.monotonic() - started < 10
    assert_killed(events[0]["child"])


def test_status_that_gives_up_says_what_its_reader_reached(monkeypatch, capsys):
    """Past its deadline and the grace, `status` prints a JSON document and a one-line error naming the phase and
    the peers reached, from the reader's events, and exits 1."""
    import json
    import time

    from p2p_diloco.cli import status

    def stuck(args, send, started, deadline):
        send({"run_id": "r1", "initial_peers": [BOOT]})
        send({"joined": True, "phase": "reading the run's records"})
        send({"reachable": 2})
        time.sleep(600)

    monkeypatch.setattr(status, "_read_status", stuck)
    monkeypatch.setattr(status, "seconds_since_process_start", lambda: 0.0)
    monkeypatch.setattr(status, "ANSWER_GRACE_S", 0.5)
    started = time.monotonic()
    assert main(["status", "--run-id", "r1", "--initial-peers", BOOT, "--timeout", "1", "--json"]) == 1
    assert time.monotonic() - started < 1.5 + 2.5
    out, err = capsys.readouterr()
    message = "no records of run r1 within 1 s (still reading the run's records); 2 peer(s) reachable"
    assert json.loads(out) == {"run_id": "r1", "num_peers": 0, "num_processes": 0, "peers": [], "error": message}
    assert err.strip().splitlines()[-1] == f"error: {message} through {BOOT}: status gave up 0.5 s past its --timeout"


def test_a_deadline_counts_from_the_process_start():
    import subprocess
    import sys

    code = "import time; time.sleep(1.5); from p2p_diloco.cli.status import seconds_since_process_start; " \
           "print(seconds_since_process_start())"
    took = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout)
    assert 1.4 <= took < 30


def test_a_swarm_crowding_the_machine_gets_longer_timeouts_unless_given():
    """``p2p-diloco swarm --peers 16`` on 2 cores ended rounds 10 s apart and split them into groups of 2 to 12 with
    the demo's timeouts: past 4 peer processes a core it raises them, and the options given still win."""
    from argparse import Namespace

    from p2p_diloco.cli.swarm import _swarm_config, crowded_defaults

    assert crowded_defaults(8, 2) == [] and crowded_defaults(9, 2) != []
    args = Namespace(config=None, peers=64, stages=1)  # more than 4 a core on any machine this runs on
    cfg = _swarm_config(args, [("averaging.request_timeout_s", "4")])
    assert cfg.averaging.matchmaking_time_s == 15 and cfg.averaging.round_timeout_s == 90
    assert cfg.averaging.request_timeout_s == 4  # given: kept
    assert _swarm_config(Namespace(config=None, peers=2, stages=1), []).averaging.matchmaking_time_s == 10
