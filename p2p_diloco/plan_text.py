"""``p2p-diloco plan``'s table: a :class:`~p2p_diloco.plan.Plan` as text (the arithmetic: :mod:`p2p_diloco.plan`)."""

from __future__ import annotations

from p2p_diloco.memory import PeerMemory
from p2p_diloco.plan import PAPER, Plan


def format_bytes(num_bytes: float) -> str:
    """Decimal units (1 MB = 10^6 bytes), as link rates are quoted."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def format_seconds(seconds: float) -> str:
    """Seconds, with minutes or hours alongside when they read better."""
    if seconds >= 7200:
        return f"{seconds:,.1f} s ({seconds / 3600:,.1f} h)"
    if seconds >= 120:
        return f"{seconds:,.1f} s ({seconds / 60:,.1f} min)"
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.1f} %" if fraction >= 0.01 else f"{100 * fraction:.3f} %"


def _times(ratio: float) -> str:
    return f"{ratio:,.1f}x" if ratio < 1000 else f"{ratio:,.0f}x"


def _header(plan: Plan) -> list[str]:
    p = plan.inputs
    stages = f", {p.num_stages} stages per peer" if p.num_stages > 1 else ""
    lines = [f"Plan: {p.num_params:,.0f} parameters, {p.num_peers} peer{'s' * (p.num_peers > 1)} per group, "
             f"{p.bandwidth_mbit:g} Mbit/s per peer (full duplex){stages}"]
    lines += [f"  {note}" for note in p.notes]
    if p.num_stages > 1:
        lines.append(f"  the {p.num_stages} stages of a peer average their slices at once over its one link: the bytes "
                     f"and the transfer time are the same as with 1 stage (with a link per stage, divide them by "
                     f"{p.num_stages})")
    if plan.nothing_to_average:
        lines.append("  1 peer: nothing to average, so no traffic and no waiting; plan a swarm with --peers 2 or more")
    return lines


def _round_rows(plan: Plan) -> list[tuple[str, str, str]]:
    p = plan.inputs
    share = f"; {format_bytes(plan.bytes_per_stage_round)} per stage, the {p.num_stages} stages share the link" \
        if p.num_stages > 1 else ""
    hiding = plan.hiding_bits_per_param
    return [
        ("sent per peer per round", format_bytes(plan.bytes_per_round),
         f"{p.bits_per_param:g} bits/param; as much is received{share}"),
        ("transfer time per round", format_seconds(plan.transfer_s),
         f"bytes x 8 / {p.bandwidth_mbit:g} Mbit/s + {p.latency_s:g} s latency"
         + (f" + {p.latency_per_peer_s:g} s x {p.num_peers} peers" if p.latency_per_peer_s else "")),
        ("compute time per round", format_seconds(plan.compute_s), f"H = {p.inner_steps} x {p.step_time_s:g} s"),
        ("H that hides the transfer", f"{plan.min_inner_steps_to_hide:,}", "smallest H with transfer <= H x step time; "
         "a smaller H learns more per token"),
        ("bits/param that hide it", "none" if hiding is None else f"{hiding:.3g}",
         f"at H = {p.inner_steps}, now {p.bits_per_param:g}" + (" (the latency alone is longer)" * (hiding is None))),
    ]


def _utilization_rows(plan: Plan) -> list[tuple[str, str, str]]:
    p = plan.inputs
    hide = "the latency alone is longer" if plan.mbit_to_hide_delayed is None else \
        f"hidden from {plan.mbit_to_hide_delayed:,.0f} Mbit/s"
    return [
        ("none (blocking)", _percent(plan.utilization_none),
         f"waits {format_seconds(plan.wait_per_round_s_none)} per round"),
        ("delayed (overlap)", _percent(plan.utilization_delayed),
         f"waits {format_seconds(plan.wait_per_round_s_delayed)} per round: the average is applied "
         f"{plan.overlap_steps} steps into the next round ({hide})"),
        ("eager (overlap)", _percent(plan.utilization_eager),
         f"waits {format_seconds(plan.wait_per_round_s_eager)} per round: applied a whole round later"),
        ("vanilla AllReduce per step", _percent(plan.utilization_allreduce),
         f"{format_bytes(plan.allreduce_bytes_per_step)} per step at {p.allreduce_bits:g} bits = "
         f"{format_seconds(plan.allreduce_comm_s_per_step)}, not overlapped"),
    ]


def _streaming_rows(plan: Plan) -> list[tuple[str, str, str]]:
    p = plan.inputs
    share = p.fragment_share if p.fragment_share is not None else 1 / p.num_fragments
    hide = "the latency alone is longer than its window" if plan.mbit_to_hide_streaming is None else \
        f"hidden from {plan.mbit_to_hide_streaming:,.0f} Mbit/s"
    return [
        ("peak sent per averaging", format_bytes(plan.peak_bytes),
         f"the largest fragment, {share:.1%} of the model ({1 / share:.2f}x below all at once: "
         f"{format_bytes(plan.bytes_per_round)})"),
        ("delayed, streaming", _percent(plan.utilization_streaming),
         f"waits {format_seconds(plan.wait_per_round_s_streaming)} per round over {p.num_fragments} averagings, "
         f"each with {min(plan.overlap_steps, p.inner_steps // p.num_fragments)} steps to arrive ({hide})"),
    ]


def _comparison_rows(plan: Plan) -> list[tuple[str, str, str]]:
    rows = [("delayed over AllReduce", _times(plan.speedup_delayed),
             f"throughput ratio at the same compute (eager, or delayed with --overlap-steps H: "
             f"{_times(plan.speedup_eager)}; none: {_times(plan.speedup_none)})")]
    if plan.paper_speedup is not None:
        rows.append(("", "", f"{PAPER}: {plan.paper_speedup:g}x over vanilla AllReduce"))
    ratio = "n/a" if plan.bytes_ratio is None else _times(plan.bytes_ratio)
    rows.append(("bytes, AllReduce / DiLoCo", ratio, f"AllReduce over H = {plan.inputs.inner_steps} steps / one round"))
    return rows


def format_plan(plan: Plan) -> str:
    """The plan as a readable table with units, for the console."""
    sections = [("DiLoCo round", _round_rows(plan)), ("Compute utilization", _utilization_rows(plan)),
                ("Speedup", _comparison_rows(plan))]
    if plan.inputs.num_fragments > 1:
        sections.insert(2, (f"Streaming sync, {plan.inputs.num_fragments} fragments", _streaming_rows(plan)))
    if plan.nothing_to_average:
        sections = [("DiLoCo round", _round_rows(plan)[2:3]),
                    ("Compute utilization", [("every mode", _percent(1.0), "no communication")])]
    width = max(len(label) for _, rows in sections for label, _, _ in rows) + 2
    value_width = max(len(value) for _, rows in sections for _, value, _ in rows) + 2
    lines = _header(plan)
    for title, rows in sections:
        lines += ["", title]
        lines += [f"  {label:<{width}}{value:<{value_width}}{note}".rstrip() for label, value, note in rows]
    return "\n".join(lines)


def memory_as_dict(memory: PeerMemory) -> dict:
    """The memory plan as JSON: bytes per process of each stage, the peer's totals and the bare loop's."""
    return {"stages": [[{"role": p.role, "host_bytes": p.host, "device_bytes": p.device, "parts": p.parts}
                        for p in stage] for stage in memory.stages],
            "host_bytes": memory.host, "device_bytes": memory.device,
            "bare_host_bytes": memory.bare_host, "bare_device_bytes": memory.bare_device}


def format_memory(memory: PeerMemory) -> str:
    """The memory plan as a table: each process of each stage, host and device, and the peer against a bare loop."""
    on_device = memory.device > 0
    lines = ["Memory per process (peak; the peer checks the same figures against this machine at its start)"]
    for j, stage in enumerate(memory.stages):
        for p in stage:
            where = f"stage {j} " if len(memory.stages) > 1 else ""
            device = f"  device {format_bytes(p.device)}" if p.device else ""
            lines.append(f"  {where}{p.role:<10}host {format_bytes(p.host):>10}{device}")
    bare = memory.bare_device if on_device else memory.bare_host
    whole = memory.device if on_device else memory.host
    lines.append(f"  {'the peer':<10}host {format_bytes(memory.host):>10}"
                 + (f"  device {format_bytes(memory.device)}" if on_device else ""))
    lines.append(f"  {'bare loop':<10}{'device' if on_device else 'host'} {format_bytes(bare):>10}  "
                 f"(the same model in one plain PyTorch process; the peer {'on the device ' if on_device else ''}"
                 f"is {whole / bare:.2f}x)")
    training = memory.stages[0][0]
    lines.append("  stage 0's training process: " + ", ".join(f"{name} {format_bytes(b)}"
                                                            for name, b in training.parts.items()))
    return "\n".join(lines)
