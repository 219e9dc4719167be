"""What a peer's processes need in memory, before anything is built: the planner's figure and the start-up check.

A peer is, per pipeline stage, a training process, an averager process, a DHT node and its p2p daemon
(docs/design.md, "What a peer holds"). With P = one fp32 copy of the stage's parameters, the estimate adds:

- training process: a runtime base, the inner loop (weights, gradients, AdamW's two moments and its step's
  temporaries: 18 bytes per parameter), the activations of what is in flight in one forward and backward, and the
  outer state (anchor, outer momentum, round start phi0 outside mode ``none``, error feedback when compressing, the
  round's contribution, eager's own outer state) plus its half of the buffers it shares with the averager;
- averager process: a runtime base, its half of the shared buffers (the contribution in flight and the residual) and
  hivemind's parts of the all-reduce;
- DHT node and p2p daemon: constants.

On CUDA the inner loop and the activations are device memory; the outer state stays fp32 in host memory.

The constants were fitted to ``benchmarks/sizes.py``'s peak proportional set sizes (PSS) on CPU at tiny, small and
medium (2 peers, batch 2 x 128), which checks them against this estimate in every run (its ``plan`` columns): the
peer's total within 15% of the measured peak at the three sizes. The device figures are this arithmetic alone,
not measured on a GPU. Pure arithmetic: no torch, no hivemind.
Who calls this: ``p2p-diloco plan`` (:mod:`p2p_diloco.cli.plan`) and the peer's start (:func:`check_fits`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

GB = 1e9

# fitted on CPU (benchmarks/sizes.py; BENCHMARKS.md, "Memory and speed by size")
# (a peer's processes share their libraries' pages, so each one's share of them is smaller than a lone process's)
TRAINING_BASE = 0.22 * GB  # python, torch and hivemind imported, the data's memory maps, the metrics
AVERAGER_BASE = 0.08 * GB
DHT_NODE = 0.10 * GB
P2P_DAEMON = 0.07 * GB
BARE_BASE = 0.36 * GB  # a lone process with torch imported (the bare loop)
CUDA_CONTEXT = 0.6 * GB  # device memory of a CUDA context and its kernels (not measured here)
INNER_BYTES = 18.0  # weights, gradients, AdamW's two moments (16) and its step's temporaries (about 2)
SHARED_BYTES = 8.0  # the averager's shared buffers: the contribution in flight, then its average; the residual
AVERAGER_OWN_BYTES = 6.0  # hivemind's all-reduce parts beside the shared buffers, at their peak
# bytes of saved activations per token and block, as a multiple of 4 * (16 dim + 4 ffn): the tensors a block keeps
# for its backward, with attention through SDPA (which keeps no seq_len x seq_len probabilities); fitted at small and
# medium (the same factor at both)
ACTIVATION_FACTOR = 0.49


@dataclass(frozen=True)
class StageShape:
    """The shape of one pipeline stage and of what it trains on."""

    num_params: int
    """Parameters of this stage (or of the whole model for P = 1)."""
    num_blocks: int
    """Transformer blocks on this stage."""
    dim: int
    ffn_dim: int
    n_heads: int
    vocab_size: int
    has_head: bool
    """Whether this stage computes the logits (the last one)."""


@dataclass(frozen=True)
class RunShape:
    """What the estimate needs of the run's settings."""

    batch_size: int
    seq_len: int
    microbatches: int = 1
    schedule: str = "gpipe"
    mode: str = "delayed"
    compressing: bool = True
    device: str = "cpu"
    """'cpu' or 'cuda'."""


@dataclass(frozen=True)
class ProcessMemory:
    """One process's estimated peak: host memory (PSS) and device memory, in bytes."""

    role: str
    host: float
    device: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    """What the figure is made of (host and device together), for the planner's table."""


@dataclass(frozen=True)
class PeerMemory:
    """Every process of a peer, stage by stage, and the bare loop of the same model for comparison."""

    stages: list[list[ProcessMemory]]
    bare_host: float
    bare_device: float

    @property
    def host(self) -> float:
        return sum(p.host for stage in self.stages for p in stage)

    @property
    def device(self) -> float:
        return sum(p.device for stage in self.stages for p in stage)

    def stage_host(self, index: int) -> float:
        return sum(p.host for p in self.stages[index])

    def stage_device(self, index: int) -> float:
        return sum(p.device for p in self.stages[index])


def outer_bytes(run: RunShape) -> dict[str, float]:
    """Bytes per parameter of the outer state the training process keeps, by name."""
    parts = {"anchor": 4.0, "outer momentum": 4.0, "round contribution": 4.0}
    if run.mode != "none":
        parts["round start phi0"] = 4.0
    if run.compressing:
        parts["error feedback"] = 4.0
    if run.mode == "eager":
        parts["eager anchor and momentum"] = 8.0
    return parts


def activation_bytes(stage: StageShape, run: RunShape, stage_index: int, num_stages: int) -> float:
    """Saved activations of the microbatches this stage holds at once: one (gradient accumulation) for P = 1; every
    microbatch under GPipe; up to P - stage_index under 1F1B."""
    micro = max(1, run.batch_size // max(1, run.microbatches))
    if num_stages == 1:
        in_flight = 1
    elif run.schedule == "1f1b":
        in_flight = min(run.microbatches, num_stages - stage_index)
    else:
        in_flight = run.microbatches
    tokens = micro * run.seq_len * in_flight
    per_block = 4 * (16 * stage.dim + 4 * stage.ffn_dim) * ACTIVATION_FACTOR
    logits = 4 * 3 * stage.vocab_size if stage.has_head else 0  # logits, their softmax and its gradient
    return tokens * (stage.num_blocks * per_block + logits)


def stage_processes(stage: StageShape, run: RunShape, stage_index: int = 0,
                    num_stages: int = 1) -> list[ProcessMemory]:
    """The four processes of one stage of a peer."""
    n = stage.num_params
    acts = activation_bytes(stage, run, stage_index, num_stages)
    inner = INNER_BYTES * n
    outer = {name: b * n for name, b in outer_bytes(run).items()}
    shared_half = SHARED_BYTES / 2 * n
    parts = {"runtime": TRAINING_BASE, "weights, gradients, AdamW": inner, "activations": acts, **outer,
             "shared averager buffers (half)": shared_half}
    if run.device == "cuda":
        device = inner + acts + CUDA_CONTEXT
        parts["CUDA context"] = CUDA_CONTEXT
        host = TRAINING_BASE + sum(outer.values()) + shared_half
    else:
        device, host = 0.0, TRAINING_BASE + inner + acts + sum(outer.values()) + shared_half
    training = ProcessMemory("training", host, device, parts)
    averager = ProcessMemory("averager", AVERAGER_BASE + (SHARED_BYTES / 2 + AVERAGER_OWN_BYTES) * n, 0.0,
                             {"runtime": AVERAGER_BASE, "shared averager buffers (half)": shared_half,
                              "all-reduce parts": AVERAGER_OWN_BYTES * n})
    return [training, averager, ProcessMemory("dht", DHT_NODE), ProcessMemory("p2pd", P2P_DAEMON)]


def follower_process(stage: StageShape, run: RunShape, stage_index: int = 0, num_stages: int = 1) -> ProcessMemory:
    """A replica d > 0 of a stage (p2p_diloco.pipeline.replicas): the inner loop only, no outer state, no swarm."""
    n = stage.num_params
    acts = activation_bytes(stage, run, stage_index, num_stages)
    inner = INNER_BYTES * n
    parts = {"runtime": TRAINING_BASE, "weights, gradients, AdamW": inner, "activations": acts}
    if run.device == "cuda":
        return ProcessMemory("replica", TRAINING_BASE, inner + acts + CUDA_CONTEXT, parts)
    return ProcessMemory("replica", TRAINING_BASE + inner + acts, 0.0, parts)


def bare_loop(stages: list[StageShape], run: RunShape) -> tuple[float, float]:
    """(host, device) of a bare PyTorch loop of the whole model (one process, the same batch): the baseline."""
    n = sum(s.num_params for s in stages)
    whole = StageShape(n, sum(s.num_blocks for s in stages), stages[0].dim, stages[0].ffn_dim, stages[0].n_heads,
                       stages[0].vocab_size, True)
    acts = activation_bytes(whole, run, 0, 1)
    if run.device == "cuda":
        return BARE_BASE, INNER_BYTES * n + acts + CUDA_CONTEXT
    return BARE_BASE + INNER_BYTES * n + acts, 0.0


def peer_memory(stages: list[StageShape], run: RunShape, replicas: int = 1) -> PeerMemory:
    """Every process of a peer of ``len(stages)`` stages and ``replicas`` data-parallel replicas of them (the bare
    loop: one replica)."""
    bare_host, bare_device = bare_loop(stages, run)
    return PeerMemory([stage_processes(s, run, j, len(stages))
                       + [follower_process(s, run, j, len(stages))] * (replicas - 1) for j, s in enumerate(stages)],
                      bare_host, bare_device)


def available_host_memory() -> Optional[float]:
    """Bytes this process could still allocate: /proc/meminfo's MemAvailable, lowered to the cgroup's limit (a
    container's ``--memory``) less what the cgroup uses; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            found.append(int(limit) - usage)
        break
    return float(min(found)) if found else None


def shortfall(need: float, available: Optional[float]) -> bool:
    return available is not None and need > available


def fit_advice(num_stages: int, device: str) -> str:
    """What to change when a peer does not fit, for the error message."""
    more = f"--pipeline.stages {num_stages * 2} across machines or devices (torchrun)"
    other = "--run.device cuda" if device == "cpu" else "a device with more memory"
    return (f"use {more}, a smaller --data.batch_size (or more --pipeline.microbatches), or {other}; "
            "--run.check_memory false starts anyway")


def format_gb(num_bytes: float) -> str:
    return f"{num_bytes / GB:.2f} GB"


def describe(memory: PeerMemory, stage_indices: Optional[list[int]] = None) -> str:
    """One line: the estimated host (and device) need of the given stages' processes, by role."""
    indices = stage_indices if stage_indices is not None else list(range(len(memory.stages)))
    by_role: dict[str, float] = {}
    for j in indices:
        for p in memory.stages[j]:
            by_role[p.role] = by_role.get(p.role, 0.0) + p.host
    return ", ".join(f"{role} {num_bytes / GB:.2f}" for role, num_bytes in by_role.items())


def env_local_processes() -> int:
    """Stage processes of this peer on this machine under torchrun (LOCAL_WORLD_SIZE), 1 otherwise."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1
