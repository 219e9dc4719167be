"""``p2p-diloco status``: who is training in a run, on which stage and round, how fast, read from the DHT.

A forked reader process starts a client-mode DHT node (it makes only outgoing connections and stores nothing) and
reads the run's progress records (:func:`p2p_diloco.swarm.fetch_progress`); the command, which imports neither torch
nor hivemind, prints a table or one JSON document and kills the reader with its node. So ``--timeout T`` holds on a
loaded machine, however long the reader's imports take. Exit code 1 when no peer of the run is found.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

from p2p_diloco.cli.logs import configure_logging
from p2p_diloco.cli.status_report import build_report, format_report, read_run
from p2p_diloco.cli.status_serve import serve
from p2p_diloco.config import ConfigError, load_config

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "status", help="show the peers of a run: stages, rounds, throughput, loss", allow_abbrev=False,
        description="Join the swarm as a client (outgoing connections only), read the progress records of a run "
        "from the DHT and print each stage process: its peer (id shortened), stage, round, inner step, tokens/s, "
        "last loss and when it last reported; then the current round (the highest) and the total throughput "
        "(sum of tokens/s over the peers' stage 0: each peer once, whatever its number of stages). In a run "
        "averaged by fragment (diloco.fragments), each stage process is shown with the fragments it holds. Exit code 1 "
        "when no peer of the run is found.",
    )
    parser.add_argument("--initial-peers", nargs="+", metavar="MADDR",
                        help="multiaddrs of a running bootstrap node or peer, ending in /p2p/<peer id>")
    parser.add_argument("--run-id", metavar="NAME", help="the run to show")
    parser.add_argument("--config", metavar="TOML",
                        help="take the run id and initial peers from a peer's config file (the options above win)")
    parser.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")
    parser.add_argument("--timeout", type=float, default=20.0, metavar="SECONDS",
                        help="give up after this long, counted from the command's start: joining the swarm and "
                        "reading the records share it, and the command exits within SECONDS + 10 whatever the "
                        "network does (exit code 1, saying how many peers it reached; default 20)")
    parser.add_argument("--serve", type=int, metavar="PORT",
                        help="serve a web page of the run on PORT (0: any free port; the address is printed) until "
                        "stopped (Ctrl-C): the table above with each peer's eval loss, rounds averaged, bytes sent and "
                        "bans, and the swarm's eval-loss curve; it reads the records again every few seconds, each "
                        "read bounded by --timeout, and the page refreshes itself from /api/status (JSON)")
    parser.add_argument("--serve-host", default="127.0.0.1", metavar="ADDR",
                        help="the address --serve listens on (default 127.0.0.1: this machine only)")
    parser.set_defaults(run=run)


ANSWER_GRACE_S = 5.0
"""How long past its deadline ``status`` waits for its reader's answer before it gives up, says what the reader had
reached and ends it: ``--timeout T`` exits within T + 10 s of the process start, the rest of the 10 s left for the
command's own start and exit on a loaded machine."""

_KILL_RESERVE_S = 3.0  # a node not ready in time is killed and reaped: leave it that long before the deadline
_ORPHAN_LIMIT_S = 10.0  # a reader whose command is gone ends itself this long past the command's deadline


NO_INITIAL_PEERS = "dht.initial_peers: status needs the multiaddr of a running bootstrap node or peer (--initial-peers)"


class StatusError(RuntimeError):
    """The run could not be read: no records within the timeout, or the swarm not reached (exit code 1)."""


class _Progress:
    """What ``status``'s reader has reached so far, for the message of a run that ends at its deadline."""

    def __init__(self, run_id: str, timeout_s: float):
        self.run_id, self.timeout_s = run_id, timeout_s
        self.phase = "importing its libraries"
        self.reachable: int | None = None
        self.joining_since_s: float | None = None  # seconds from the process start to the DHT node's start
        self.joined = False
        self.initial_peers: list[str] = []

    def update(self, event: dict) -> None:
        """Take one progress event of the reader (only the fields this class has)."""
        for name in ("run_id", "initial_peers", "phase", "reachable", "joining_since_s", "joined"):
            if name in event:
                setattr(self, name, event[name])

    def give_up_message(self, with_phase: bool = False) -> str:
        if self.reachable is not None:
            reachable = f"{self.reachable} peer(s) reachable"
        elif not self.joined:  # when it began to join tells a slow start (imports on a busy machine) from the network
            reachable = "no peer reached yet" if self.joining_since_s is None else \
                f"no peer reached yet (it began joining {self.joining_since_s:.0f} s after its start)"
        else:
            reachable = "joined the swarm (peers not counted in time)"
        phase = f" (still {self.phase})" if with_phase else ""
        return f"no records of run {self.run_id} within {self.timeout_s:g} s{phase}; {reachable}"


def run(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
    if not args.timeout > 0 or not math.isfinite(args.timeout):
        raise ConfigError(f"--timeout: a positive number of seconds, not {args.timeout!r}")
    if not args.run_id and not args.config:
        raise ConfigError("run.run_id: which run? give --run-id (or --config with the run's config file)")
    if not args.initial_peers and not args.config:
        raise ConfigError(NO_INITIAL_PEERS)
    started = time.monotonic() - seconds_since_process_start()
    deadline = started + args.timeout
    if args.serve is not None:
        return serve(status_config(args), args)
    # the config is checked in the reader: its addresses' check imports hivemind (and torch), which can take 15-20 s
    # on a loaded machine, and the bound must not wait for them
    progress = _Progress(args.run_id or f"of {args.config}", args.timeout)
    progress.initial_peers = list(args.initial_peers or [])
    answer = supervise(lambda send: _read_status(args, send, started, deadline), progress.update,
                       until=deadline + ANSWER_GRACE_S)
    through = f"through {', '.join(progress.initial_peers) or 'the initial peers of ' + str(args.config)}"
    if answer is None:  # the reader overran its deadline, or died: what it had reached is the answer
        if args.json:
            print(json.dumps({"run_id": progress.run_id, "num_peers": 0, "num_processes": 0, "peers": [],
                              "error": progress.give_up_message(with_phase=True)}, indent=2), flush=True)
        raise StatusError(f"{progress.give_up_message(with_phase=True)} {through}: status gave up "
                          f"{ANSWER_GRACE_S:g} s past its --timeout")
    if "usage" in answer:  # a bad option or config file
        raise ConfigError(answer["usage"])
    if "error" in answer:  # the network's answer, with time left (no initial peer reachable, ...)
        raise StatusError(answer["error"])
    report = answer["report"]
    if report["peers"] or args.json:  # scripts get a document either way, and the exit code
        if not report["peers"]:
            report["error"] = progress.give_up_message()
        print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    if not report["peers"]:
        raise StatusError(f"{progress.give_up_message()} {through}: check --run-id and that peers are running")
    return 0


def supervise(read: Callable[[Callable[[dict], None]], dict], on_event: Callable[[dict], None],
              until: float) -> dict | None:
    """Runs ``read(send)`` in a forked reader process and returns the dict it returns, or None when the reader has
    not returned by ``until`` (monotonic) or died. ``read`` may call ``send(event)`` with JSON-able progress dicts,
    passed to ``on_event`` as they come. The reader and everything it started (hivemind's DHT process, its p2pd
    daemon) form one process group, killed (SIGKILL) and the reader reaped before this returns: nothing a reader
    holds is worth a graceful exit, and the bound does not depend on how long torch's and hivemind's imports, or
    their shutdown, take on a loaded machine (this process imports neither)."""
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader
        os.close(readable)
        _reader_main(read, writable, until)
    os.close(writable)
    answer, buffer, ended = None, b"", False
    try:
        while answer is None and not ended and time.monotonic() < until + 0.5:
            # past ``until``, what the pipe already holds is still read (the last events say what was reached)
            if not select.select([readable], [], [], max(0.0, until - time.monotonic()))[0]:
                break
            chunk = os.read(readable, 1 << 16)
            ended = not chunk  # the reader exited, or died without an answer
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                message = json.loads(line)
                if "answer" in message:
                    answer = message["answer"]
                    break
                on_event(message["event"])
    finally:
        os.close(readable)
        _end_group(pid)
    return answer


def _reader_main(read: Callable, writable: int, until: float) -> None:
    """The reader process: its own process group (so its command can kill all it starts at once), a backstop that
    ends the group should its command be gone, then ``read`` and its answer on the pipe. Never returns."""
    code = 0
    try:
        os.setpgid(0, 0)
        backstop = threading.Timer(max(0.0, until - time.monotonic()) + _ORPHAN_LIMIT_S, os.killpg,
                                   args=(0, signal.SIGKILL))
        backstop.daemon = True
        backstop.start()
        with os.fdopen(writable, "wb", buffering=0) as channel:
            def send(event: dict) -> None:
                channel.write(json.dumps({"event": event}).encode() + b"\n")

            answer = read(send)
            channel.write(json.dumps({"answer": answer}).encode() + b"\n")
    except BaseException:  # a bug: its traceback on stderr, and no answer (the command says what was reached)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _end_group(pid: int, reap_s: float = 1.0) -> None:
    """Kills the reader's process group and reaps the reader if it is gone within ``reap_s``. A killed process
    still unmaps its memory before it can be reaped, which can take seconds for a reader in the middle of torch's
    imports on a loaded machine: past ``reap_s`` the command exits without it and init reaps it, as it does the
    reader's DHT process and daemon."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # the reader had not yet made its group: it alone
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    until = time.monotonic() + reap_s
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() >= until:
                return
        except ChildProcessError:
            return
        time.sleep(0.02)


def _read_status(args: argparse.Namespace, send: Callable[[dict], None], started: float, deadline: float) -> dict:
    """In the reader: {"report": the run's report} read before ``deadline`` (monotonic), its progress sent as it
    goes (times counted from ``started``, the command's process start); {"usage": why} for a bad option or config
    file, {"error": why} when the swarm answers that it cannot be joined."""
    configure_logging("WARNING")
    try:
        cfg = status_config(args)
        if not cfg.dht.initial_peers:
            raise ConfigError(NO_INITIAL_PEERS)
    except ConfigError as e:
        return {"usage": str(e)}
    send({"run_id": cfg.run.run_id, "initial_peers": cfg.dht.initial_peers})
    from p2p_diloco.hivemind_adapter.dht import get_dht_time
    from p2p_diloco.monitoring.nodes import PeerCounts
    from p2p_diloco.swarm import SwarmError, start_dht
    from p2p_diloco.swarm.discovery.records import run_record_validators

    def left() -> float:
        return max(1.0, deadline - time.monotonic())

    send({"phase": "joining the swarm", "joining_since_s": time.monotonic() - started})
    try:
        dht = start_dht(cfg.dht, record_validators=run_record_validators(cfg.run.run_id), check_identity_free=False,
                        ready_timeout_s=max(1.0, left() - _KILL_RESERVE_S))
    except SwarmError as e:
        if time.monotonic() < deadline - _KILL_RESERVE_S - 1.0:  # it failed with time left: the network's answer
            return {"error": str(e)}
        return {"report": build_report(cfg.run.run_id, [], get_dht_time())}  # out of time: "no records within T s"
    send({"joined": True, "phase": "reading the run's records"})
    send({"reachable": (PeerCounts(dht, timeout_s=min(2.0, left())).get() or (None,))[0]})
    records, fragments = read_run(dht, cfg.run.run_id, deadline)
    # (the node is not shut down: the command kills the reader's process group once it has the answer)
    return {"report": build_report(cfg.run.run_id, records, get_dht_time(), num_fragments=fragments)}


def seconds_since_process_start() -> float:
    """How long this process has run (interpreter start and imports included: a deadline counts from there); 0
    where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - int(after_name[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start time
    except (OSError, ValueError, IndexError):
        return 0.0


def status_config(args: argparse.Namespace):
    """The [run] and [dht] settings of a client-mode node: no identity, no fixed port, no metrics server."""
    overrides = [("dht.client_mode", "true"), ("dht.identity_path", "none"), ("dht.host_maddrs", "/ip4/0.0.0.0/tcp/0"),
                 ("dht.announce_maddrs", ""), ("metrics.port", "none"),
                 ("dht.startup_timeout_s", str(max(1.0, args.timeout)))]
    if args.initial_peers:
        overrides.append(("dht.initial_peers", ",".join(args.initial_peers)))
    if args.run_id:
        overrides.append(("run.run_id", args.run_id))
    elif not args.config:
        raise ConfigError("run.run_id: which run? give --run-id (or --config with the run's config file)")
    return load_config(args.config, overrides)
