"""``p2p-diloco plan``: what a run past this machine would cost on the wire, and how much overlap hides.

Reads the options, resolves the parameter count (``--params``, ``--preset`` or ``--paper``) and prints
:func:`p2p_diloco.plan_text.format_plan` or, with ``--json``, one JSON object. The arithmetic lives in
:mod:`p2p_diloco.plan`; nothing here touches the network.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from p2p_diloco.config.sections import DiLoCoConfig

if TYPE_CHECKING:
    from p2p_diloco.plan import PlanInputs

# option dest -> PlanInputs field, for the options whose default depends on --paper
_GIVEN = {"peers": "num_peers", "bandwidth_mbit": "bandwidth_mbit", "step_time": "step_time_s", "h": "inner_steps",
          "bits_per_param": "bits_per_param", "allreduce_bits": "allreduce_bits", "latency_s": "latency_s",
          "latency_per_peer_s": "latency_per_peer_s", "stages": "num_stages", "overlap_steps": "overlap_steps",
          "fragments": "num_fragments"}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="estimate bytes, transfer time and compute utilization of a swarm run", allow_abbrev=False,
        description="Planning calculator for a run past this machine: bytes each peer sends per round, the "
        "round's transfer time, the H that hides it behind compute, the compute utilization of the modes none "
        "and delayed/eager, and the speedup over a vanilla AllReduce of fp32 gradients at every inner step. "
        "Steady state, no stragglers; MB = 10^6 bytes, Mbit/s = 10^6 bit/s.",
    )
    size = parser.add_argument_group("model size (one of)")
    size.add_argument("--params", type=float, metavar="N", help="parameter count, e.g. 107e9 or 1.1e9")
    size.add_argument("--preset", choices=("tiny", "small", "medium", "1b"), help="a model preset's parameter count")
    size.add_argument("--vocab-size", type=int, default=257, metavar="V",
                      help="vocabulary size for --preset (default 257, the byte tokenizer)")
    size.add_argument("--init-from", metavar="FOLDER",
                      help="a Hugging Face Llama folder's model (model.init_from): its config.json gives the shape")
    size.add_argument("--paper", action="store_true",
                      help="the DiLoCoX paper's setting (107e9 parameters, 1000 Mbit/s); the options below that "
                      "you give win, the others are stated assumptions: --peers 2 --stages 8 --step-time 10 --h 50 "
                      "--bits-per-param 32")
    swarm = parser.add_argument_group("swarm and training")
    swarm.add_argument("--peers", type=int, metavar="N", help="peers per averaging group (default 2)")
    swarm.add_argument("--stages", type=int, metavar="P",
                       help="pipeline stages per peer (default 1); they share the link, so the bytes are the same")
    swarm.add_argument("--bandwidth-mbit", type=float, metavar="B",
                       help="per-peer link rate in Mbit/s, full duplex (default 1000)")
    swarm.add_argument("--step-time", type=float, metavar="S", help="seconds of compute per inner step (default 1)")
    swarm.add_argument("--h", type=int, metavar="H", help=f"inner steps per round (default {DiLoCoConfig.inner_steps}, "
                       "this project's)")
    swarm.add_argument("--bits-per-param", type=float, metavar="b",
                       help="bits on the wire per parameter of the pseudo-gradient (default 32 = fp32; fp16 is 16)")
    swarm.add_argument("--allreduce-bits", type=float, metavar="b",
                       help="bits per parameter of the per-step AllReduce baseline (default 32)")
    swarm.add_argument("--latency-s", type=float, metavar="S",
                       help="fixed overhead per round for matchmaking etc., in seconds (default 0.5)")
    swarm.add_argument("--latency-per-peer-s", type=float, metavar="S",
                       help="overhead per round that grows with the group (matchmaking), in seconds per peer "
                       "(default 0; benchmarks/scale.py measured 0.7 s per peer on 2 busy cores)")
    swarm.add_argument("--overlap-steps", type=int, metavar="M",
                       help="delayed mode: the step of the next round at which a round's average is applied "
                       "(diloco.overlap_steps; default H/20)")
    swarm.add_argument("--fragments", type=int, metavar="F",
                       help="streaming sync: average the model in F fragments, one at a time, staggered over the "
                       "round (default 1: all at once); with --preset the largest fragment's share is the model's, "
                       "else 1/F")
    memory = parser.add_argument_group(
        "memory per process (with --preset or --init-from; the figures the peer checks at its start)")
    memory.add_argument("--batch-size", type=int, default=16, metavar="B", help="data.batch_size (default 16)")
    memory.add_argument("--seq-len", type=int, metavar="T", help="data.seq_len (default: the model's max_seq_len)")
    memory.add_argument("--microbatches", type=int, default=1, metavar="M", help="pipeline.microbatches (default 1)")
    memory.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe", help="pipeline.schedule")
    memory.add_argument("--mode", choices=("none", "delayed", "eager"), default="delayed", help="diloco.mode")
    memory.add_argument("--compression", default="adaptive",
                        help="averaging.compression ('none' keeps no error feedback; default adaptive)")
    memory.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the inner loop runs: cuda puts weights, gradients, AdamW and activations in "
                        "device memory and keeps the outer state in host memory (default cpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every number")
    parser.set_defaults(run=run, accepts_overrides=False)


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """The :class:`p2p_diloco.plan.PlanInputs` that the options describe.

    Raises:
        ConfigError: no model size, or two of them.
    """
    from dataclasses import replace

    from p2p_diloco.config import ConfigError
    from p2p_diloco.plan import PlanInputs, paper_inputs, preset_num_params

    given = {field: getattr(args, dest) for dest, field in _GIVEN.items() if getattr(args, dest) is not None}
    sizes = [name for name, value in (("--params", args.params), ("--preset", args.preset),
                                      ("--init-from", args.init_from)) if value is not None]
    if args.paper:
        if sizes:
            raise ConfigError(f"--paper: sets the parameter count itself (107e9); drop {sizes[0]}")
        return paper_inputs(given)
    if len(sizes) > 1:
        raise ConfigError(f"{sizes[0]}: give one of --params, --preset and --init-from, not {' and '.join(sizes)}")
    if not sizes:
        raise ConfigError("--params: give the model size with --params N, --preset NAME, --init-from FOLDER or "
                          "--paper")
    if args.init_from is not None:
        num_params = _num_params(_model_args(args))
    else:
        num_params = args.params if args.params is not None else preset_num_params(args.preset, args.vocab_size)
    if args.preset is not None and given.get("num_fragments", 1) > 1:
        from p2p_diloco.plan import preset_fragment_share

        given["fragment_share"] = preset_fragment_share(args.preset, args.vocab_size, given["num_fragments"])
    return replace(PlanInputs(num_params=num_params), **given)


def _model_args(args: argparse.Namespace):
    """The model's shape from --preset or --init-from (None for --params and --paper)."""
    from p2p_diloco.config import ModelConfig

    if args.init_from is not None:
        from p2p_diloco.model.init_from import open_init

        return open_init(ModelConfig(init_from=args.init_from))[1]
    if args.preset is not None:
        from p2p_diloco.model import ModelArgs
        from p2p_diloco.model.presets import PRESETS

        return ModelArgs(**PRESETS[args.preset], vocab_size=args.vocab_size)
    return None


def _num_params(model_args) -> int:
    from p2p_diloco.model.presets import estimate_num_params

    return estimate_num_params(model_args)


def memory_plan(args: argparse.Namespace):
    """The memory of every process of a peer of ``--stages`` stages, or None without a model shape.

    Raises:
        ConfigError: a bad batch, sequence length, microbatch count or split.
    """
    from p2p_diloco.config import ConfigError

    model_args = _model_args(args)
    if model_args is None:
        return None
    from p2p_diloco.memory import RunShape, peer_memory
    from p2p_diloco.model import balanced_split
    from p2p_diloco.model.split import stage_shapes

    seq_len = args.seq_len if args.seq_len is not None else model_args.max_seq_len
    for option, value in (("--batch-size", args.batch_size), ("--seq-len", seq_len),
                          ("--microbatches", args.microbatches)):
        if value < 1:
            raise ConfigError(f"{option}: must be a positive integer, got {value}")
    if args.batch_size % args.microbatches:
        raise ConfigError(f"--microbatches: must divide --batch-size ({args.batch_size}), got {args.microbatches}")
    split = balanced_split(model_args, args.stages or 1)
    run_shape = RunShape(args.batch_size, seq_len, args.microbatches, args.schedule, args.mode,
                         args.compression != "none", args.device)
    return peer_memory(stage_shapes(model_args, split), run_shape)


def run(args: argparse.Namespace, overrides: list) -> int:
    from p2p_diloco.plan import make_plan, plan_as_dict
    from p2p_diloco.plan_text import format_memory, format_plan, memory_as_dict

    plan = make_plan(inputs_from_args(args))
    memory = memory_plan(args)
    if args.json:
        out = plan_as_dict(plan)
        if memory is not None:
            out["memory"] = memory_as_dict(memory)
        print(json.dumps(out))
    else:
        print(format_plan(plan) + ("\n\n" + format_memory(memory) if memory is not None else ""))
    return 0
