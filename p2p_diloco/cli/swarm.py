"""``p2p-diloco swarm``: a bootstrap node and N peer processes on 127.0.0.1, with progress and a summary.

The demo of the whole system on one machine: every process is a real ``p2p-diloco`` process talking
through hivemind over loopback sockets. Progress is read from the peers' metrics files; the summary
(per peer losses, rounds, bytes against per-step AllReduce, anchor agreement) is printed, saved as
``swarm-summary.json`` and plotted to ``loss.png`` in the swarm folder.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from p2p_diloco.cli.common import CONFIG_HELP
from p2p_diloco.cli.logs import configure_logging
from p2p_diloco.config import ConfigError, dump_config, load_config
from p2p_diloco.process import die_with_parent, stop_groups

logger = logging.getLogger(__name__)

# Defaults of the demo: a tiny model that clearly learns in about 3 minutes with 3 peers on 2 CPU cores.
DEMO_DEFAULTS = [
    ("run.run_id", "local-swarm"), ("model.preset", "tiny"), ("data.batch_size", "16"), ("data.seq_len", "128"),
    ("diloco.inner_steps", "40"), ("train.num_rounds", "10"), ("train.log_every", "5"), ("inner.lr", "3e-3"),
    ("inner.warmup_steps", "20"), ("averaging.matchmaking_time_s", "10"), ("averaging.request_timeout_s", "3"),
    ("averaging.round_timeout_s", "60"), ("checkpoint.every_rounds", "0"), ("train.progress", "false"),
]
# Timeouts of a crowded machine (more than PEERS_PER_CORE peer processes a core, as the crowded tests use): 16 peers
# on 2 busy cores end a round up to 10 s apart and answer a join request in seconds, and with the demo's timeouts
# their rounds split into groups of 2 to 12 (benchmarks/scale.py; BENCHMARKS.md, "Scale")
PEERS_PER_CORE = 4
CROWDED_DEFAULTS = [
    ("averaging.matchmaking_time_s", "15"), ("averaging.request_timeout_s", "6"), ("averaging.round_timeout_s", "90"),
    ("averaging.allreduce_timeout_s", "90"), ("averaging.next_chunk_timeout_s", "20"),
]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
SAMPLE_PROMPT = "def "  # the demo trains on Python source


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "swarm", help="run a bootstrap node and N peers on this machine (demo)", allow_abbrev=False,
        description="Start a bootstrap node and N peer processes on 127.0.0.1 that train the tiny model on the "
        "built-in corpus (the Python standard library's source) and average through hivemind. Shows progress, "
        "then a summary: loss at start and end per peer, eval loss of the final anchor, rounds, bytes sent "
        "against a per-step fp32 AllReduce, and whether all anchors are identical. Writes loss.png. With "
        "--data.seed S, peer i samples its data windows with seed S + i (reproducible runs).",
        epilog=CONFIG_HELP + " Overrides apply to every peer.",
    )
    parser.add_argument("--peers", type=int, default=3, metavar="N", help="number of peers (default 3)")
    parser.add_argument("--stages", type=int, default=1, metavar="P", help="pipeline stages per peer (default 1)")
    parser.add_argument("--config", metavar="TOML", help="config file for the peers (demo defaults otherwise)")
    parser.add_argument("--output-dir", type=Path, metavar="DIR",
                        help="swarm folder (default runs/swarm-<time>)")
    parser.add_argument("--peer-timeout", type=float, default=3600.0, metavar="SECONDS",
                        help="stop peers still running after this long (default 3600)")
    parser.add_argument("--sample-tokens", type=int, default=160, metavar="N",
                        help="end with N tokens that peer0's final anchor writes (default 160; 0: no sample)")
    parser.set_defaults(run=run, accepts_overrides=True)


def run(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
    from p2p_diloco.monitoring.sinks import check_sinks

    if args.peers < 1:
        raise ConfigError(f"--peers: must be at least 1, got {args.peers}")
    if args.sample_tokens < 0:
        raise ConfigError(f"--sample-tokens: must be at least 0, got {args.sample_tokens}")
    root = args.output_dir or Path("runs") / time.strftime("swarm-%Y%m%d-%H%M%S")
    cfg = _swarm_config(args, overrides)
    check_sinks(cfg.metrics)  # every peer would stop on it: say so once, before anything starts
    from p2p_diloco.cli.summary import summarize_swarm  # (imports torch: after the checks, which are then at once)

    configure_logging(cfg.run.log_level)
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "swarm.toml"
    config_path.write_text(dump_config(cfg))
    _prepare_data_once(cfg)
    print(f"Swarm folder: {root}  (bootstrap + {args.peers} peer(s) x {cfg.pipeline.stages} stage(s))", flush=True)
    if not args.config and crowded_defaults(args.peers * args.stages, os.cpu_count() or 1):
        raised = ", ".join(f"{key.removeprefix('averaging.')} {value}" for key, value in CROWDED_DEFAULTS)
        print(f"{args.peers * args.stages} peer processes on {os.cpu_count()} cores: the timeouts of a crowded "
              f"machine unless given ({raised})", flush=True)
    processes: dict[str, subprocess.Popen] = {}
    stopped_by = None
    _stop_on_signals()
    try:
        processes["bootstrap"] = _start_bootstrap(root, cfg.run.run_id)
        maddrs = _wait_for_maddrs(root / "bootstrap.maddrs", processes["bootstrap"])
        print(f"Bootstrap node up at {maddrs[0]}", flush=True)
        threads = max(1, (os.cpu_count() or 1) // (args.peers * cfg.pipeline.stages))
        for i in range(args.peers):
            seed = None if cfg.data.seed is None else cfg.data.seed + i
            processes[f"peer{i}"] = _start_peer(root, i, config_path, maddrs, threads, seed)
        exit_codes = _follow(root, processes, cfg, args.peer_timeout)
    except KeyboardInterrupt as e:
        stopped_by = e.args[0] if isinstance(e, Stopped) else signal.SIGINT
        print(f"\n{'Interrupted' if stopped_by == signal.SIGINT else f'Stopped ({stopped_by.name})'}: stopping the "
              "peers (they checkpoint first)...", flush=True)
        exit_codes = {}
    finally:
        _stop_all(processes)
    summary = summarize_swarm(root, args.peers, cfg, exit_codes)
    if exit_codes and args.sample_tokens:
        print_sample(root / "peer0", max_new_tokens=args.sample_tokens)
    if stopped_by is not None:
        return 128 + stopped_by  # as a shell reports a command its signal ended
    return 0 if summary["ok"] else 1


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a service manager's stop, a closed terminal): the swarm stops its peers as on Ctrl-C."""


def _stop_on_signals() -> None:
    """SIGTERM and SIGHUP raise :class:`Stopped` in the main thread, once: a second one while the peers stop is
    ignored, so their stop (a checkpoint each, then SIGKILL past its grace) is never cut short, and no peer is left
    running without its swarm."""
    def stop(signum: int, frame) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signal.Signals(signum))

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def print_sample(peer_dir: Path, prompt: str = SAMPLE_PROMPT, max_new_tokens: int = 160) -> None:
    """Print what the final anchor of a peer writes after ``prompt`` (the demo's corpus is Python source)."""
    import torch

    from p2p_diloco.cli.export import checkpoint_tokenizer
    from p2p_diloco.model.sample import build_model, sample
    from p2p_diloco.training.state.anchor import load_peer_anchor

    try:
        anchor = load_peer_anchor(peer_dir)
        tokenizer = checkpoint_tokenizer(anchor.data_path, anchor.config_path, None, anchor.args.vocab_size)
        model = build_model(anchor.args, anchor.tensors, torch.device("cpu"))
        text = tokenizer.decode(sample(model, tokenizer.encode(prompt), max_new_tokens, temperature=0.7, top_k=40,
                                       stop_id=tokenizer.eot_id))
    except Exception as e:  # noqa: BLE001 (the demo's result stands without its sample)
        logger.warning(f"No sample from {peer_dir}: {e}")
        return
    print(f"\nWhat {peer_dir.name}'s final anchor writes (p2p-diloco generate {peer_dir} --prompt {prompt!r}):\n"
          f"{'-' * 60}\n{prompt}{text}\n{'-' * 60}", flush=True)


def _swarm_config(args: argparse.Namespace, overrides: list[tuple[str, str]]):
    base = [] if args.config else list(DEMO_DEFAULTS) + crowded_defaults(args.peers * args.stages, os.cpu_count() or 1)
    if any(key == "model.init_from" for key, _ in overrides):  # the folder gives the shape: no preset beside it
        base = [(key, value) for key, value in base if key != "model.preset"]
    forced = [("pipeline.stages", str(args.stages)), ("dht.host_maddrs", LOOPBACK)]
    if args.peers > 1:
        forced += [("averaging.target_group_size", str(args.peers)), ("train.wait_for_peers", str(args.peers))]
    return load_config(args.config, base + forced + list(overrides))


def crowded_defaults(num_processes: int, num_cores: int) -> list[tuple[str, str]]:
    """The demo's timeouts raised for a machine with more than :data:`PEERS_PER_CORE` peer processes a core (the
    options given still win)."""
    return list(CROWDED_DEFAULTS) if num_processes > PEERS_PER_CORE * num_cores else []


def _prepare_data_once(cfg) -> None:
    """Prepare the built-in corpus before starting N peers, so they do not all wait on the lock."""
    from p2p_diloco.data import resolve_data_path

    resolve_data_path(cfg.data)


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2p_diloco", *args]


def _start_bootstrap(root: Path, run_id: str) -> subprocess.Popen:
    log = open(root / "bootstrap.log", "w")
    return subprocess.Popen(  # with the run's id, the bootstrap node checks the run's record schemas too
        _command("bootstrap", "--host-maddrs", LOOPBACK, "--identity-path", str(root / "bootstrap.id"),
                 "--maddrs-file", str(root / "bootstrap.maddrs"), "--run-id", run_id),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
    )


def _wait_for_maddrs(path: Path, process: subprocess.Popen, timeout_s: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().split()
        if process.poll() is not None:
            log = (path.parent / "bootstrap.log").read_text()[-2000:]
            raise RuntimeError(f"the bootstrap node exited with code {process.returncode}:\n{log}")
        time.sleep(0.2)
    raise RuntimeError(f"the bootstrap node did not report its addresses within {timeout_s:.0f} s")


def _start_peer(root: Path, index: int, config_path: Path, maddrs: list[str], threads: int,
                data_seed: int | None) -> subprocess.Popen:
    """Peer ``index``; with ``data.seed`` set, it samples with seed data.seed + index (own windows, reproducible)."""
    peer_dir = root / f"peer{index}"
    peer_dir.mkdir(parents=True, exist_ok=True)
    log = open(peer_dir / "console.log", "w")
    return subprocess.Popen(
        _command("peer", "--config", str(config_path), "--initial-peers", *maddrs,
                 "--output-dir", str(peer_dir), "--run.num_threads", str(threads),
                 *(["--data.seed", str(data_seed)] if data_seed is not None else [])),
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
    )


def _follow(root: Path, processes: dict[str, subprocess.Popen], cfg, timeout_s: float) -> dict[str, int]:
    """Show progress until every peer exits; returns their exit codes."""
    from p2p_diloco.cli.summary import SwarmProgress

    peers = {name: p for name, p in processes.items() if name != "bootstrap"}
    progress = SwarmProgress(root, list(peers), cfg)
    deadline = time.monotonic() + timeout_s
    exit_codes: dict[str, int] = {}
    try:
        while len(exit_codes) < len(peers):
            progress.refresh()
            for name, process in peers.items():
                if name not in exit_codes and process.poll() is not None:
                    exit_codes[name] = process.returncode
                    progress.peer_exited(name, process.returncode)
            if time.monotonic() > deadline:
                progress.note(f"peers still running after {timeout_s:.0f} s: stopping them")
                break
            time.sleep(0.5)
        progress.refresh()
    finally:
        progress.close()
    return exit_codes


def _stop_all(processes: dict[str, subprocess.Popen], grace_s: float = 60.0) -> None:
    """SIGTERM every process still running (peers checkpoint and exit), then SIGKILL what remains."""
    stop_groups(list(processes.values()), grace_s)
