"""Planning arithmetic for a run past this machine: bytes, transfer time and compute utilization per round.

Owns the formulas behind ``p2p-diloco plan``: what one DiLoCo round costs on the wire with the butterfly
all-reduce of :mod:`p2p_diloco.swarm.averaging.allreduce`, how much of it the overlap modes of
:mod:`p2p_diloco.round.stage` hide, and how that compares with a vanilla data-parallel AllReduce of
the gradients at every inner step. Pure arithmetic (no torch, no hivemind at import), so that it can
plan a 100B-parameter run on a laptop. Who calls this: :mod:`p2p_diloco.cli.plan`.

The model, in steady state (the first round and stragglers are not modelled):

- Butterfly all-reduce over N peers: each peer reduces 1/N of the vector; it sends (N-1)/N of its
  contribution to the other reducers and its reduced part's average to the N-1 others, so it sends
  ``2 (N-1)/N * B`` and receives as much, with ``B = num_params * bits_per_param / 8`` bytes. The link is
  full duplex: a round's transfer takes ``bytes * 8 / bandwidth + latency``.
- P pipeline stages average their slices in parallel over the peer's one link: the per-peer total and
  the transfer time do not depend on P.
- Mode ``none`` waits for the transfer at each round end: utilization ``compute / (compute + transfer)``.
- Mode ``delayed`` averages round r while round r+1 trains and applies it ``diloco.overlap_steps`` M steps into
  round r+1 (default H/20), waiting there for what is left: ``wait = max(0, transfer - M * step)``, utilization
  ``compute / (compute + wait)``. Mode ``eager`` applies it at the end of round r+1: a round costs
  ``max(compute, transfer)``, utilization ``compute / max(compute, transfer)``.
- Streaming sync of F fragments (:mod:`p2p_diloco.model.fragments`): each fragment is averaged on its own,
  staggered H/F steps apart; what one averaging sends is the largest fragment's share s of the round's bytes
  (1/F for even fragments), so the peak bytes fall by 1/s, and in ``delayed`` each of the F averagings has
  ``min(M, H/F)`` steps to arrive: ``wait = F * max(0, s * bytes * 8 / bandwidth + latency - min(M, H/F) * step)``.
- Vanilla AllReduce: a ring all-reduce of the gradients at every inner step, ``2 (N-1)/N * num_params *
  allreduce_bits / 8`` bytes per peer per step, not overlapped with the backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.sections import DiLoCoConfig, default_overlap_steps

PAPER = "DiLoCoX paper (arXiv 2506.21263)"
PAPER_NUM_PARAMS = 107e9
PAPER_BANDWIDTH_MBIT = 1000.0
PAPER_SPEEDUP = 357.0

# Our assumptions for what the paper does not state in a form we can use, as (field, value, why).
# The paper's example infrastructure is 2 decentralized clusters, each PP=8 (its Figure 1), and its run
# used 160 A800 GPUs, i.e. 80 per cluster. The step time is ours: 6 * 107e9 FLOPs per token, ~155k tokens
# per inner step per cluster, 80 A800 at 312 TFLOP/s bf16 and 40% MFU -> ~10 s. H = 50 (a round of about
# 8 minutes of compute at that step time). Bits stay fp32 (no
# compression) so that the table shows what overlap alone buys; the paper's 357x includes its adaptive low-rank
# + low-bit compression, see "bits/param that hide" for that budget.
PAPER_ASSUMPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("num_peers", 2, "2 decentralized clusters, as in the paper's Figure 1"),
    ("num_stages", 8, "PP = 8 per cluster, as in the paper's Figure 1 (does not change the bytes)"),
    ("step_time_s", 10.0, "our guess: ~155k tokens per inner step on 80 A800s at 40% MFU; the paper gives none"),
    ("inner_steps", 50, "a round of about 8 minutes of compute at that step time"),
    ("bits_per_param", 32.0, "fp32, no compression: overlap alone; the paper's 357x also compresses"),
)

# the CLI option that sets each input, for error messages
OPTIONS = {
    "num_params": "--params", "num_peers": "--peers", "bandwidth_mbit": "--bandwidth-mbit",
    "step_time_s": "--step-time", "inner_steps": "--h", "bits_per_param": "--bits-per-param",
    "allreduce_bits": "--allreduce-bits", "latency_s": "--latency-s", "num_stages": "--stages",
    "latency_per_peer_s": "--latency-per-peer-s",
    "overlap_steps": "--overlap-steps", "num_fragments": "--fragments", "fragment_share": "--fragments",
}


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is computed from; every field has the CLI option of the same meaning."""

    num_params: float
    """Parameters of the whole model (all stages together)."""
    num_peers: int = 2
    """Peers in one averaging group (N)."""
    bandwidth_mbit: float = 1000.0
    """Per-peer link rate in Mbit/s (10^6 bit/s), full duplex."""
    step_time_s: float = 1.0
    """Seconds of compute per inner step."""
    inner_steps: int = DiLoCoConfig.inner_steps
    """Inner steps per round (H); default this project's."""
    bits_per_param: float = 32.0
    """Bits on the wire per parameter of the pseudo-gradient (32 = fp32, 16 = fp16)."""
    allreduce_bits: float = 32.0
    """Bits per parameter of the per-step AllReduce baseline."""
    latency_s: float = 0.5
    """Fixed overhead per round (matchmaking, group assembly), added to the transfer."""
    latency_per_peer_s: float = 0.0
    """Overhead per round that grows with the group: this much per peer of the group is added to ``latency_s``.
    Matchmaking time grows with N (``benchmarks/scale.py`` measures it: BENCHMARKS.md, "Scale")."""
    num_stages: int = 1
    """Pipeline stages per peer (P); they share the peer's link."""
    overlap_steps: Optional[int] = None
    """delayed mode: the inner step of round r+1 at which round r's average is applied (None: H/20, the config's
    default ``diloco.overlap_steps``)."""
    num_fragments: int = 1
    """Streaming sync: fragments averaged one at a time (1: the whole model at once)."""
    fragment_share: Optional[float] = None
    """The largest fragment's share of the model's parameters (None: 1/F, even fragments)."""
    compare_to_paper: bool = False
    """Show the DiLoCoX paper's reported speedup next to ours."""
    notes: tuple[str, ...] = ()
    """Assumptions to state with the result."""


@dataclass(frozen=True)
class Plan:
    """Every number of a plan; bytes are per peer, sent (the same amount is received)."""

    inputs: PlanInputs
    nothing_to_average: bool
    bytes_per_round: float
    bytes_per_stage_round: float
    transfer_s: float
    compute_s: float
    min_inner_steps_to_hide: int
    hiding_bits_per_param: Optional[float]
    utilization_none: float
    utilization_delayed: float
    utilization_eager: float
    wait_per_round_s_none: float
    wait_per_round_s_delayed: float
    wait_per_round_s_eager: float
    overlap_steps: int
    """delayed mode's M, resolved."""
    mbit_to_hide_delayed: Optional[float]
    """The link rate at which delayed mode never waits (None: the latency alone is longer than its window)."""
    peak_bytes: float
    """What one peer sends in one averaging: a round's bytes, or with streaming sync the largest fragment's."""
    wait_per_round_s_streaming: float
    utilization_streaming: float
    mbit_to_hide_streaming: Optional[float]
    allreduce_bytes_per_step: float
    allreduce_comm_s_per_step: float
    utilization_allreduce: float
    speedup_delayed: float
    speedup_eager: float
    """eager, or delayed with ``overlap_steps = H`` (DiLoCoX's one-step delay): the whole round hides the transfer."""
    speedup_none: float
    bytes_ratio: Optional[float]
    paper_speedup: Optional[float] = None


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, int | float) and not isinstance(value, bool) else repr(value)


def _require_number(inputs: PlanInputs, name: str, minimum: float, inclusive: bool) -> None:
    value = getattr(inputs, name)
    is_number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or value < minimum or (value == minimum and not inclusive):
        kind = "a non-negative number" if inclusive and minimum == 0 else "a positive number"
        raise ConfigError(f"{OPTIONS[name]}: must be {kind}, got {_show(value)}")


def validate_inputs(inputs: PlanInputs) -> None:
    """Checks that every input is a usable number.

    Raises:
        ConfigError: naming the CLI option of the first bad input.
    """
    for name in ("num_peers", "inner_steps", "num_stages", "num_fragments"):
        value = getattr(inputs, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{OPTIONS[name]}: must be an integer >= 1, got {_show(value)}")
    for name in ("num_params", "bandwidth_mbit", "step_time_s", "bits_per_param", "allreduce_bits"):
        _require_number(inputs, name, 0, inclusive=False)
    _require_number(inputs, "latency_s", 0, inclusive=True)
    _require_number(inputs, "latency_per_peer_s", 0, inclusive=True)
    if inputs.overlap_steps is not None and (isinstance(inputs.overlap_steps, bool) or not isinstance(
            inputs.overlap_steps, int) or not 1 <= inputs.overlap_steps <= inputs.inner_steps):
        raise ConfigError(f"--overlap-steps: must be an integer between 1 and --h ({inputs.inner_steps}), got "
                          f"{_show(inputs.overlap_steps)}")
    if inputs.num_fragments > inputs.inner_steps:
        raise ConfigError(f"--fragments: streaming {inputs.num_fragments} fragments needs --h >= "
                          f"{inputs.num_fragments} (one fragment per step at most), got {inputs.inner_steps}")
    share = inputs.fragment_share
    if share is not None and not (isinstance(share, float) and 1 / inputs.num_fragments - 1e-12 <= share <= 1):
        raise ConfigError(f"--fragments: the largest fragment's share must lie in [1/F, 1], got {_show(share)}")
    if inputs.num_params < 1:
        raise ConfigError(f"--params: must be at least 1 parameter, got {_show(inputs.num_params)}")


def allreduce_bytes(num_params: float, num_peers: int, bits_per_param: float) -> float:
    """Bytes one peer sends (and receives) in an all-reduce of ``num_params`` values over ``num_peers``.

    Butterfly and ring all-reduce move the same amount: ``2 (N-1)/N`` times one contribution.
    """
    return 2 * (num_peers - 1) / num_peers * num_params * bits_per_param / 8


def min_inner_steps_to_hide(transfer_s: float, step_time_s: float) -> int:
    """The smallest H >= 1 with ``transfer_s <= H * step_time_s``: the round's compute covers its transfer."""
    steps = max(1, math.ceil(transfer_s / step_time_s))
    while steps * step_time_s < transfer_s:  # guard against rounding in the division
        steps += 1
    while steps > 1 and (steps - 1) * step_time_s >= transfer_s:
        steps -= 1
    return steps


def round_latency_s(inputs: PlanInputs) -> float:
    """A round's overhead besides the transfer: ``latency_s`` plus ``latency_per_peer_s`` per peer of the group."""
    return inputs.latency_s + inputs.latency_per_peer_s * inputs.num_peers


def hiding_bits_per_param(inputs: PlanInputs) -> Optional[float]:
    """The most bits per parameter whose transfer fits in one round of compute; None if none does."""
    budget_s = inputs.inner_steps * inputs.step_time_s - round_latency_s(inputs)
    if inputs.num_peers == 1 or budget_s <= 0:
        return None
    bits_per_s = inputs.bandwidth_mbit * 1e6
    return budget_s * bits_per_s / (2 * (inputs.num_peers - 1) / inputs.num_peers * inputs.num_params)


def make_plan(inputs: PlanInputs) -> Plan:
    """Computes every number of the plan from its inputs.

    Raises:
        ConfigError: an input is not usable (the message names its CLI option).
    """
    validate_inputs(inputs)
    bits_per_s = inputs.bandwidth_mbit * 1e6
    alone = inputs.num_peers == 1  # no group to average with: no round traffic, no matchmaking
    sent = allreduce_bytes(inputs.num_params, inputs.num_peers, inputs.bits_per_param)
    latency_s = round_latency_s(inputs)
    transfer_s = 0.0 if alone else sent * 8 / bits_per_s + latency_s
    compute_s = inputs.inner_steps * inputs.step_time_s
    utilization_none = compute_s / (compute_s + transfer_s)
    overlap = inputs.overlap_steps or default_overlap_steps(inputs.inner_steps)
    wait_delayed = max(0.0, transfer_s - overlap * inputs.step_time_s)
    utilization_eager = compute_s / max(compute_s, transfer_s)
    F = inputs.num_fragments
    share = inputs.fragment_share if inputs.fragment_share is not None else 1 / F
    window_s = min(overlap, inputs.inner_steps // F) * inputs.step_time_s  # streaming: each fragment's window
    fragment_s = 0.0 if alone else share * sent * 8 / bits_per_s + latency_s
    wait_streaming = F * max(0.0, fragment_s - window_s)
    ar_sent = allreduce_bytes(inputs.num_params, inputs.num_peers, inputs.allreduce_bits)
    ar_comm_s = ar_sent * 8 / bits_per_s
    utilization_allreduce = inputs.step_time_s / (inputs.step_time_s + ar_comm_s)
    return Plan(
        inputs=inputs,
        nothing_to_average=alone,
        bytes_per_round=sent,
        bytes_per_stage_round=sent / inputs.num_stages,
        transfer_s=transfer_s,
        compute_s=compute_s,
        min_inner_steps_to_hide=min_inner_steps_to_hide(transfer_s, inputs.step_time_s),
        hiding_bits_per_param=hiding_bits_per_param(inputs),
        utilization_none=utilization_none,
        utilization_delayed=compute_s / (compute_s + wait_delayed),
        utilization_eager=utilization_eager,
        wait_per_round_s_none=transfer_s,
        wait_per_round_s_delayed=wait_delayed,
        wait_per_round_s_eager=max(0.0, transfer_s - compute_s),
        overlap_steps=overlap,
        mbit_to_hide_delayed=_mbit_to_hide(sent, overlap * inputs.step_time_s, latency_s, alone),
        peak_bytes=share * sent,
        wait_per_round_s_streaming=wait_streaming,
        utilization_streaming=compute_s / (compute_s + wait_streaming),
        mbit_to_hide_streaming=_mbit_to_hide(share * sent, window_s, latency_s, alone),
        allreduce_bytes_per_step=ar_sent,
        allreduce_comm_s_per_step=ar_comm_s,
        utilization_allreduce=utilization_allreduce,
        speedup_delayed=compute_s / (compute_s + wait_delayed) / utilization_allreduce,
        speedup_eager=utilization_eager / utilization_allreduce,
        speedup_none=utilization_none / utilization_allreduce,
        bytes_ratio=None if alone else ar_sent * inputs.inner_steps / sent,
        paper_speedup=PAPER_SPEEDUP if inputs.compare_to_paper else None,
    )


def _mbit_to_hide(num_bytes: float, window_s: float, latency_s: float, alone: bool) -> Optional[float]:
    """The link rate (Mbit/s) that sends ``num_bytes`` within ``window_s`` after the latency; None if none can."""
    if alone:
        return 0.0
    if window_s <= latency_s:
        return None
    return num_bytes * 8 / (window_s - latency_s) / 1e6


def paper_inputs(given: Mapping[str, Any]) -> PlanInputs:
    """The DiLoCoX paper's setting (107e9 parameters over 1 Gbit/s), with ``given`` values taking precedence.

    Args:
        given: PlanInputs field values the user chose (e.g. ``{"step_time_s": 4.0}``); the fields of
            ``PAPER_ASSUMPTIONS`` not in it take our documented assumptions, stated in ``notes``.

    Raises:
        ConfigError: ``given`` sets the parameter count or the bandwidth, which the paper fixes.
    """
    for name in ("num_params", "bandwidth_mbit"):
        if name in given:
            raise ConfigError(f"{OPTIONS[name]}: --paper fixes it (107e9 parameters, 1000 Mbit/s); drop one of them")
    values = dict(given)
    notes = [f"{PAPER} setting: 107e9 parameters, 1000 Mbit/s per peer"]
    for name, value, why in PAPER_ASSUMPTIONS:
        if name not in values:
            values[name] = value
            notes.append(f"assumed {OPTIONS[name]} {value:g}: {why}")
    return replace(PlanInputs(num_params=PAPER_NUM_PARAMS, bandwidth_mbit=PAPER_BANDWIDTH_MBIT),
                   compare_to_paper=True, notes=tuple(notes), **values)


def preset_num_params(preset: str, vocab_size: int) -> int:
    """Parameters of a model preset (``tiny``, ``small``, ``medium``, ``1b``) for a vocabulary size.

    Raises:
        ConfigError: unknown preset or a vocabulary size below 1.
    """
    # these import torch: only when a preset is asked for
    from p2p_diloco.model.llama import ModelArgs
    from p2p_diloco.model.presets import PRESETS, estimate_num_params

    if preset not in PRESETS:
        raise ConfigError(f"--preset: must be one of {', '.join(PRESETS)}, got {preset!r}")
    if vocab_size < 1:
        raise ConfigError(f"--vocab-size: must be an integer >= 1, got {vocab_size}")
    return estimate_num_params(ModelArgs(**PRESETS[preset], vocab_size=vocab_size))


def preset_fragment_share(preset: str, vocab_size: int, num_fragments: int) -> float:
    """The largest of ``num_fragments`` fragments of a preset's model (model/fragments.py), as a share of it.

    Raises:
        ConfigError: unknown preset, or more fragments than the model has parts.
    """
    import itertools

    from p2p_diloco.model.fragments import fragment_parts, part_sizes
    from p2p_diloco.model.llama import ModelArgs
    from p2p_diloco.model.presets import PRESETS

    preset_num_params(preset, vocab_size)  # the same checks
    args = ModelArgs(**PRESETS[preset], vocab_size=vocab_size)
    try:
        parts = fragment_parts(args, num_fragments)
    except ConfigError as e:
        raise ConfigError(f"--fragments: {str(e).split(': ', 1)[1]}") from None
    sizes, ends = part_sizes(args), list(itertools.accumulate([0] + parts))
    return max(sum(sizes[ends[i]:ends[i + 1]]) for i in range(len(parts))) / sum(sizes)


def plan_as_dict(plan: Plan) -> dict[str, Any]:
    """The plan as one flat JSON-ready dict: the inputs under ``inputs``, every output at the top level."""
    out = {f.name: getattr(plan, f.name) for f in fields(plan) if f.name != "inputs"}
    out["inputs"] = {f.name: getattr(plan.inputs, f.name) for f in fields(plan.inputs)}
    out["inputs"]["notes"] = list(plan.inputs.notes)
    return out
