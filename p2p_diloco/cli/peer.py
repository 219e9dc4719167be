"""``p2p-diloco peer``: join a swarm (or start one) and train."""

from __future__ import annotations

import argparse
import json
import logging

from p2p_diloco.cli.common import CONFIG_HELP, GracefulStop, add_config_arguments, config_from_args

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "peer", help="join a swarm and train", allow_abbrev=False,
        description="Join a training swarm through its initial peers (or start a new one) and train: H inner "
        "AdamW steps on local data, then average pseudo-gradients with the peers found through the DHT and "
        "take an outer Nesterov step. Progress goes to the console and to <run.output_dir>/metrics-*.jsonl.",
        epilog=CONFIG_HELP,
    )
    add_config_arguments(parser)
    pipe = parser.add_argument_group("pipeline (shortcuts for [pipeline] keys)")
    pipe.add_argument("--stages", type=int, metavar="P", help="pipeline stages inside this peer")
    pipe.add_argument("--stage-layers", metavar="N,N,...", help="blocks per stage, e.g. 3,3,2 (default: balanced)")
    pipe.add_argument("--schedule", choices=("gpipe", "1f1b"), help="pipeline schedule")
    pipe.add_argument("--microbatches", type=int, metavar="M", help="microbatches per inner step")
    parser.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints and start fresh")
    parser.add_argument("--output-dir", metavar="DIR", help="shortcut for --run.output_dir")
    parser.set_defaults(run=run)


def pipeline_overrides(args: argparse.Namespace) -> list[tuple[str, str]]:
    pairs = [("stages", "pipeline.stages"), ("stage_layers", "pipeline.stage_layers"),
             ("schedule", "pipeline.schedule"), ("microbatches", "pipeline.microbatches"),
             ("output_dir", "run.output_dir")]
    overrides = [(key, str(getattr(args, attr))) for attr, key in pairs if getattr(args, attr, None) is not None]
    if args.no_resume:
        overrides.append(("checkpoint.resume", "false"))
    return overrides


def run(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
    from p2p_diloco.cli.console import ConsoleReporter
    from p2p_diloco.cli.main import configure_logging
    from p2p_diloco.config import dump_config

    cfg = config_from_args(args, overrides, extra=pipeline_overrides(args))
    configure_logging(cfg.run.log_level)
    logger.info("Resolved config:\n" + dump_config(cfg))
    if cfg.run.num_threads:
        import torch

        torch.set_num_threads(cfg.run.num_threads)
    if cfg.pipeline.stages > 1:
        from p2p_diloco.cli.pipeline_launch import run_pipeline_peer

        return run_pipeline_peer(cfg)
    from p2p_diloco.peer import run_stage

    reporter = ConsoleReporter(enabled=cfg.train.progress, label=f"peer {cfg.run.run_id}")
    stopper = None

    def hook(trainer) -> None:
        nonlocal stopper
        stopper = GracefulStop(trainer.request_stop).__enter__()

    try:
        summary = run_stage(cfg, reporter=reporter, on_trainer=hook)
    finally:
        if stopper is not None:
            stopper.__exit__(None, None, None)
    print(json.dumps({"summary": {k: v for k, v in summary.__dict__.items() if k != "group_sizes"}}))
    return 0
