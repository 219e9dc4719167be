"""``p2p-diloco peer``: join a swarm (or start one) and train."""

from __future__ import annotations

import argparse
import json
import logging
import os

from p2p_diloco.cli.common import CONFIG_HELP, JOIN_BOUND_HELP, GracefulStop, add_config_arguments, config_from_args
from p2p_diloco.cli.logs import configure_logging

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "peer", help="join a swarm and train", allow_abbrev=False,
        description="Join a training swarm through its initial peers (or start a new one) and train: H inner "
        "AdamW steps on local data, then average pseudo-gradients with the peers found through the DHT and "
        "take an outer Nesterov step. Progress goes to the console and to <run.output_dir>/metrics-*.jsonl; with "
        "--metrics.port N each stage process j also serves /health and /metrics (Prometheus) on port N + j; "
        "--metrics.tensorboard_dir DIR and --metrics.wandb_project NAME also log to TensorBoard and W&B. "
        + JOIN_BOUND_HELP,
        epilog=CONFIG_HELP,
    )
    add_config_arguments(parser)
    pipe = parser.add_argument_group("pipeline (shortcuts for [pipeline] keys)")
    pipe.add_argument("--stages", type=int, metavar="P", help="pipeline stages inside this peer")
    pipe.add_argument("--replicas", type=int, metavar="D",
                      help="data-parallel replicas of the pipeline inside this peer (D x P processes; default 1)")
    pipe.add_argument("--stage-layers", metavar="N,N,...", help="blocks per stage, e.g. 3,3,2 (default: balanced)")
    pipe.add_argument("--schedule", choices=("gpipe", "1f1b"), help="pipeline schedule")
    pipe.add_argument("--microbatches", type=int, metavar="M", help="microbatches per inner step")
    parser.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints and start fresh")
    parser.add_argument("--output-dir", metavar="DIR", help="shortcut for --run.output_dir")
    parser.set_defaults(run=run)


def pipeline_overrides(args: argparse.Namespace) -> list[tuple[str, str]]:
    pairs = [("stages", "pipeline.stages"), ("replicas", "pipeline.replicas"),
             ("stage_layers", "pipeline.stage_layers"),
             ("schedule", "pipeline.schedule"), ("microbatches", "pipeline.microbatches"),
             ("output_dir", "run.output_dir")]
    overrides = [(key, str(getattr(args, attr))) for attr, key in pairs if getattr(args, attr, None) is not None]
    if args.no_resume:
        overrides.append(("checkpoint.resume", "false"))
    return overrides


def run(args: argparse.Namespace, overrides: list[tuple[str, str]]) -> int:
    from p2p_diloco.config import dump_config
    from p2p_diloco.monitoring.sinks import check_sinks

    cfg = config_from_args(args, overrides, extra=pipeline_overrides(args))
    check_sinks(cfg.metrics)  # TensorBoard or W&B asked for but not installed: say so before anything starts
    # (torch is imported only now: a mistyped option is told in a fraction of a second, not after torch's import)
    from p2p_diloco.pipeline import launched_as_stage
    from p2p_diloco.pipeline.launch import LAUNCHED_BY_US

    configure_logging(cfg.run.log_level)
    if cfg.run.num_threads:
        import torch

        torch.set_num_threads(cfg.run.num_threads)
    if cfg.pipeline.stages * cfg.pipeline.replicas > 1 and not launched_as_stage():
        from p2p_diloco.pipeline.launch import run_local_stages

        if cfg.model.init_from is not None:  # a folder that does not fit: one error here, before any stage starts
            from p2p_diloco.stage_process import check_init_from

            check_init_from(cfg)
        logger.info("Resolved config:\n" + dump_config(cfg))
        return run_local_stages(cfg)
    if not launched_as_stage() or (os.environ.get("RANK") == "0" and os.environ.get(LAUNCHED_BY_US) != "1"):
        logger.info("Resolved config:\n" + dump_config(cfg))
    return _run_this_stage(cfg)


def _run_this_stage(cfg) -> int:
    """Run this process's stage: the whole model (P = 1) or stage RANK of P (launched as a pipeline stage)."""
    from p2p_diloco.cli.console import ConsoleReporter
    from p2p_diloco.pipeline import PipelineContext
    from p2p_diloco.pipeline.launch import LAUNCHED_BY_US
    from p2p_diloco.stage_process import run_stage

    context = None
    if cfg.pipeline.stages * cfg.pipeline.replicas > 1:
        context = PipelineContext.from_environment(cfg.pipeline.stages, cfg.run.device, cfg.pipeline.timeout_s,
                                                   replicas=cfg.pipeline.replicas)
    if context is not None and context.replica_index > 0:  # a follower: inner steps only, replica 0 leads
        from p2p_diloco.pipeline.replicas import run_follower

        try:
            run_follower(cfg, context)
        finally:
            context.close()
        return 0
    is_last = context is None or context.is_last
    label = f"stage {context.stage_index}" if context is not None else f"peer {cfg.run.run_id}"
    reporter = ConsoleReporter(enabled=cfg.train.progress and is_last, label=label)
    stopper = None

    def hook(trainer) -> None:
        nonlocal stopper
        stopper = GracefulStop(trainer.request_stop).__enter__()

    try:
        summary = run_stage(cfg, pipeline=context, reporter=reporter, on_trainer=hook)
    finally:
        if stopper is not None:
            stopper.__exit__(None, None, None)
        if context is not None:
            context.close()
    if os.environ.get(LAUNCHED_BY_US) != "1":  # our launcher prints the whole peer's summary
        fields = {k: v for k, v in summary.__dict__.items() if k != "group_sizes"}
        print(json.dumps({"summary": fields}), flush=True)
    return 0
