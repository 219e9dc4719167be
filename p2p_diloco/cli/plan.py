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
    if args.paper:
        if args.params is not None or args.preset is not None:
            raise ConfigError("--paper: sets the parameter count itself (107e9); drop --params/--preset")
        return paper_inputs(given)
    if args.params is not None and args.preset is not None:
        raise ConfigError("--params: give either --params or --preset, not both")
    if args.params is None and args.preset is None:
        raise ConfigError("--params: give the model size with --params N, --preset NAME or --paper")
    num_params = args.params if args.params is not None else preset_num_params(args.preset, args.vocab_size)
    if args.preset is not None and given.get("num_fragments", 1) > 1:
        from p2p_diloco.plan import preset_fragment_share

        given["fragment_share"] = preset_fragment_share(args.preset, args.vocab_size, given["num_fragments"])
    return replace(PlanInputs(num_params=num_params), **given)


def run(args: argparse.Namespace, overrides: list) -> int:
    from p2p_diloco.plan import make_plan, plan_as_dict
    from p2p_diloco.plan_text import format_plan

    plan = make_plan(inputs_from_args(args))
    print(json.dumps(plan_as_dict(plan)) if args.json else format_plan(plan))
    return 0
