"""Configuration sections: one dataclass per component, built once at the edge and passed down.

Every field has a docstring under it (shown by ``p2p-diloco peer --help-config``). Each section
checks its own values in ``validate()`` and raises :class:`ConfigError` naming the key.
Who calls this: :mod:`p2p_diloco.config.parse` (loading) and every component (reading its section).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from p2p_diloco.config.checks import non_negative, positive, require

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
AVERAGING_MODES = ("none", "delayed", "eager")
ROUND_ENDS = ("swarm", "steps")
SCHEDULES = ("gpipe", "1f1b")
MODEL_PRESETS = ("tiny", "small", "medium", "1b")
DEFAULT_PRESET = "tiny"
WANDB_MODES = ("offline", "online")


@dataclass
class RunConfig:
    run_id: str = "p2p-diloco-demo"
    """Name of the training run; peers only average with peers of the same run_id."""
    output_dir: str = "runs/peer"
    """Folder for this peer's metrics, resolved config and checkpoints."""
    device: str = "auto"
    """'auto' (CUDA if available, else CPU), 'cpu', 'cuda' or 'cuda:N'."""
    seed: int = 0
    """Seed of the local random number generators (not of the data sampler or the model init)."""
    log_level: str = "INFO"
    """Python logging level for the library."""
    num_threads: Optional[int] = None
    """CPU threads for torch in this process; default: torch's choice."""
    check_memory: bool = True
    """Before it builds its model, the peer estimates the memory its processes need (``p2p-diloco plan`` prints the
    same figures) and stops with what to change if this machine's available memory (or the device's) is short;
    false starts anyway."""

    def validate(self) -> None:
        require(
            bool(RUN_ID_PATTERN.match(self.run_id)),
            "run.run_id",
            f"must be 1-64 letters, digits, '-' or '_', starting with a letter or digit; got {self.run_id!r}",
        )
        require(bool(self.output_dir), "run.output_dir", "must not be empty")
        require(
            self.device in ("auto", "cpu", "cuda") or bool(re.fullmatch(r"cuda:\d+", self.device)),
            "run.device",
            f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}",
        )
        require(self.num_threads is None or self.num_threads > 0, "run.num_threads",
                 f"must be a positive integer, got {self.num_threads!r}")
        require(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "run.log_level",
                 f"must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")


@dataclass
class ModelConfig:
    preset: Optional[str] = None
    """Model size preset: tiny (~1M parameters), small (~25M), medium (~200M) or 1b; default tiny (none with
    init_from)."""
    dim: Optional[int] = None
    """Hidden size; default from the preset."""
    n_layers: Optional[int] = None
    """Number of transformer blocks; default from the preset."""
    n_heads: Optional[int] = None
    """Attention heads; default from the preset."""
    n_kv_heads: Optional[int] = None
    """Key/value heads (grouped-query attention); default from the preset."""
    ffn_dim: Optional[int] = None
    """SwiGLU hidden size; default from the preset."""
    max_seq_len: Optional[int] = None
    """Longest sequence the rotary tables cover; default from the preset."""
    vocab_size: Optional[int] = None
    """Vocabulary size; default: the data's vocabulary (meta.json)."""
    tie_embeddings: bool = False
    """Share the input embedding with the output head (refused with more than one pipeline stage)."""
    init_seed: int = 0
    """Seed of the parameter init; every peer of a run must use the same one (unused with init_from)."""
    init_from: Optional[str] = None
    """Start from a local Hugging Face LlamaForCausalLM folder instead of random weights: config.json, the weights
    (model.safetensors, or the shards of model.safetensors.index.json; fp32, fp16 or bf16, trained in fp32) and a
    tokenizer.json that must be the data's. The shape comes from config.json: leave preset and the shape keys unset
    (a different value is an error). Each pipeline stage reads only its own tensors; the loaded weights are the
    round-0 anchor (a resumed checkpoint still wins). Every peer of the run must load the same weights: their
    sha256 (tensors' names, dtypes, shapes and bytes, cached in run.output_dir/init_from.json) is part of the
    config fingerprint. `p2p-diloco export` writes such a folder."""

    @property
    def preset_name(self) -> str:
        """The preset in force: the one given, else tiny."""
        return self.preset or DEFAULT_PRESET

    def validate(self) -> None:
        require(self.preset is None or self.preset in MODEL_PRESETS, "model.preset",
                 f"must be one of {', '.join(MODEL_PRESETS)}, got {self.preset!r}")
        require(self.init_from is None or bool(self.init_from.strip()), "model.init_from",
                 "must be a model folder (or unset)")
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "vocab_size"):
            value = getattr(self, name)
            require(value is None or value > 0, f"model.{name}", f"must be a positive integer, got {value!r}")


@dataclass
class DataConfig:
    path: str = "builtin"
    """A shards folder made by `p2p-diloco prepare-data`, or 'builtin' (the Python standard library's source)."""
    cache_dir: str = "~/.cache/p2p-diloco"
    """Where the built-in corpus is prepared on first use."""
    seq_len: Optional[int] = None
    """Tokens per training window; default: the model's max_seq_len."""
    batch_size: int = 16
    """Sequences per inner step (split into pipeline microbatches when there are several)."""
    seed: Optional[int] = None
    """Seed of this peer's window sampler; default: derived from the peer id, so peers see different windows."""
    eval_batches: int = 4
    """Batches of the held-out split used for each evaluation."""

    def validate(self) -> None:
        require(bool(self.path), "data.path", "must not be empty")
        require(self.seq_len is None or self.seq_len > 1, "data.seq_len", f"must be > 1, got {self.seq_len!r}")
        require(self.batch_size > 0, "data.batch_size", f"must be a positive integer, got {self.batch_size!r}")
        require(self.eval_batches >= 0, "data.eval_batches", f"must be >= 0, got {self.eval_batches!r}")


@dataclass
class InnerConfig:
    lr: float = 3e-3
    """Peak learning rate of the inner AdamW."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warmup, in inner steps."""
    total_steps: Optional[int] = None
    """Length of the cosine schedule in inner steps; default: train.num_rounds * diloco.inner_steps."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def validate(self) -> None:
        positive(self.lr, "inner.lr")
        require(0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio!r}")
        require(self.warmup_steps >= 0, "inner.warmup_steps", f"must be >= 0, got {self.warmup_steps!r}")
        require(self.total_steps is None or self.total_steps > 0, "inner.total_steps",
                 f"must be a positive integer, got {self.total_steps!r}")
        non_negative(self.weight_decay, "inner.weight_decay")
        require(0 <= self.beta1 < 1, "inner.beta1", f"must be in [0, 1), got {self.beta1!r}")
        require(0 <= self.beta2 < 1, "inner.beta2", f"must be in [0, 1), got {self.beta2!r}")
        positive(self.eps, "inner.eps")
        non_negative(self.grad_clip, "inner.grad_clip")


def default_overlap_steps(inner_steps: int) -> int:
    """delayed mode's default ``diloco.overlap_steps`` for H inner steps: H // 20, at least 1 (see that field)."""
    return max(1, inner_steps // 20)


@dataclass
class DiLoCoConfig:
    inner_steps: int = 20
    """H: inner steps per round (outer step). A smaller H learns more per token at proportionally more bytes per token
    (tiny model, 4 peers, 1,500 steps, merged H // 20 steps in: H = 10 closed 79% of the gap between one peer alone
    and per-step data parallel, H = 20 66%, H = 50 42%), and on a 10 Mbit/s link with the 3.35M-parameter model
    H = 20 reached every target loss sooner in time than H = 40 (BENCHMARKS.md, "How often the swarm averages"). A
    larger model or a slower link needs a larger H: take the smallest H whose transfer the link hides
    (`p2p-diloco plan`, "H that hides the transfer")."""
    outer_lr: float = 0.7
    """Learning rate of the outer Nesterov SGD for an average of 2 peers (and for a round that fell back)."""
    outer_lr_group_exponent: float = 0.0
    """How the outer step grows with the group that averaged a round: a group of g peers takes outer_lr * (g / 2) **
    a, g capped at diloco.outer_lr_largest_group; every member of a group sees the same g. 0 (the default): the same
    step for any group. 0.5 (0.7 for a pair, 0.86 for three, 0.99 for four or more) learned 2-3% better on the tiny
    model over 30 rounds with 4 and 8 peers, and 1% worse on the 3.35M-parameter model and 6-12% worse on runs of
    8-20 rounds (docs/design.md 2.3; BENCHMARKS.md, "The outer step against the group size")."""
    outer_lr_largest_group: int = 4
    """With diloco.outer_lr_group_exponent > 0, the largest group whose size still raises the outer step (larger groups
    take its step): where the tiny model's best outer lr stopped growing (BENCHMARKS.md, "The outer step against the
    group size"); a crowd of identities joining one group cannot raise the step past it."""
    outer_momentum: float = 0.5
    """Momentum of the outer SGD. 0.5 learned best on the tiny model over 30 rounds of H = 50, against 0, 0.25 and 0.8
    at the same steady-state step lr / (1 - momentum) and against DiLoCo's 0.9 (BENCHMARKS.md, "The outer step
    against the group size")."""
    nesterov: bool = True
    """Use Nesterov momentum in the outer step."""
    mode: str = "delayed"
    """How averaging overlaps training: 'none' (blocking DiLoCo), 'delayed' (round r averages in the background
    while round r+1 trains; its average is applied as soon as it arrives, at the latest overlap_steps into round
    r+1, and the local progress is rebased on it) or 'eager' (arXiv 2502.12996: applied at the end of round r+1,
    and meanwhile each peer steps its own copy of the outer state with its fresh contribution standing in for
    its stale one; experimental: with the default outer step it ended +15% eval loss against 'delayed' and +7%
    against one peer alone in benchmarks/quality.py, tiny, K = 4, H = 50, 30 rounds)."""
    overlap_steps: Optional[int] = None
    """delayed mode: the latest inner step of round r+1 at which round r's average is applied; a peer whose
    average has not arrived by then waits for it (Streaming DiLoCo's tau). None: H // 20, at least 1
    (:func:`default_overlap_steps`). Each step taken before the merge is a stale step, and each cost about 1% of
    eval loss at H = 20 (tiny model, 4 peers: +1.2%, +1.9% and +3.1% against blocking DiLoCo in the same
    compression at 1, 2 and 4 steps; 25M-parameter model on a GPU: -0.1% at 1, +3.7% at 2): H // 20 reaches H // 10's
    final loss with 2-5% fewer tokens on the tiny model and 15% fewer on the 25M one, and a step less of overlap
    costs at most one step's wait a round (BENCHMARKS.md, "How often the swarm averages"). H is DiLoCoX's
    whole-round delay: the most communication hidden, but the model learns worse than blocking DiLoCo, and over long
    runs worse than one peer alone (BENCHMARKS.md, "Learning quality")."""
    round_end: str = "swarm"
    """When a peer ends its round: 'swarm' (after inner_steps steps, or as soon as another peer of the run has
    ended the round, whichever comes first: peers of unequal speed end each round together, the fastest after
    inner_steps steps, each contributing the tokens it trained, weighted by them) or 'steps' (every peer trains
    exactly inner_steps steps; a slower peer reaches the round end late and may miss its group)."""
    fragments: int = 0
    """The unit of averaging. 0: the pipeline stage (every peer of the run must use the same pipeline split). F >= 1:
    F fragments, slices of the model defined by its shape alone (embedding, runs of blocks, head; see
    docs/design.md 2.11), each averaged on its own with every peer that holds it, so peers of any pipeline split
    train one model together; a stage boundary must fall on a fragment boundary. Part of the run's config
    fingerprint; pipeline.stages and pipeline.stage_layers then are not."""
    streaming: bool = True
    """With diloco.fragments F >= 2: streaming sync (Streaming DiLoCo, arXiv 2501.18512): fragment f ends its rounds
    (F - 1 - f) * inner_steps // F steps before the regular round end, so one fragment is on the wire at a time and
    the peak bytes in flight fall by about F (the last round of every fragment ends on the run's last step).
    benchmarks/quality.py finds the same eval loss as all at once (BENCHMARKS.md, "Streaming sync"), and a
    newcomer's arrival fails no more fragment-rounds than all at once (benchmarks/newcomer_rounds.py). False: every
    fragment ends its rounds on the regular round end (all at once). No effect with F < 2."""

    @property
    def merge_step(self) -> int:
        """The inner step of round r+1 by which delayed mode applies round r's average (overlap_steps resolved)."""
        return self.overlap_steps if self.overlap_steps is not None else default_overlap_steps(self.inner_steps)

    def validate(self) -> None:
        require(self.inner_steps > 0, "diloco.inner_steps", f"must be a positive integer, got {self.inner_steps!r}")
        positive(self.outer_lr, "diloco.outer_lr")
        require(math.isfinite(self.outer_lr_group_exponent) and 0 <= self.outer_lr_group_exponent <= 1,
                "diloco.outer_lr_group_exponent", f"must be in [0, 1], got {self.outer_lr_group_exponent!r}")
        require(isinstance(self.outer_lr_largest_group, int) and 2 <= self.outer_lr_largest_group <= 64,
                "diloco.outer_lr_largest_group", f"must be an integer in [2, 64], got {self.outer_lr_largest_group!r}")
        require(0 <= self.outer_momentum < 1, "diloco.outer_momentum",
                 f"must be in [0, 1), got {self.outer_momentum!r}")
        require(self.overlap_steps is None or 1 <= self.overlap_steps <= self.inner_steps, "diloco.overlap_steps",
                 f"must be between 1 and diloco.inner_steps ({self.inner_steps}), got {self.overlap_steps!r}")
        require(self.mode in AVERAGING_MODES, "diloco.mode",
                 f"must be one of {', '.join(AVERAGING_MODES)}, got {self.mode!r}")
        require(isinstance(self.fragments, int) and not isinstance(self.fragments, bool) and self.fragments >= 0,
                 "diloco.fragments", f"must be 0 (average by pipeline stage) or a fragment count >= 1, "
                 f"got {self.fragments!r}")
        require(not (self.streaming and self.fragments > self.inner_steps), "diloco.fragments",
                 f"streaming {self.fragments} fragments needs diloco.inner_steps >= {self.fragments} (one fragment "
                 f"per step at most), got {self.inner_steps}; or set diloco.streaming false")
        require(self.round_end in ROUND_ENDS, "diloco.round_end",
                 f"must be one of {', '.join(ROUND_ENDS)}, got {self.round_end!r}")


@dataclass
class TrainConfig:
    num_rounds: int = 20
    """Stop after this many rounds. 0: load (or initialize) the model, evaluate it, write its checkpoint and stop
    (e.g. to export a model.init_from folder as a run starts from it)."""
    log_every: int = 10
    """Write a metrics line every this many inner steps."""
    eval_every_rounds: int = 1
    """Evaluate the anchor on the held-out split every this many rounds (0: only at the end)."""
    progress: bool = True
    """Show a progress bar on the console."""
    wait_for_peers: int = 1
    """Before the first inner step, wait until this many peers of the run (this one included) are training, so
    that a swarm started together averages from its first round (bounded by wait_for_peers_timeout_s)."""
    wait_for_peers_timeout_s: float = 120.0
    """Start anyway after waiting this long for the peers of wait_for_peers."""
    state_timeout_s: float = 120.0
    """Give up downloading a stage's state from peers after this long (and try again after the next round)."""
    anchor_digest: bool = True
    """Log a sha256 of the anchor after every round (equal digests = bit-identical anchors); costs ~1 s/GB."""
    slowdown: float = 1.0
    """Make this peer this many times slower than it is (it sleeps after each inner step): for tests and
    benchmarks of swarms with peers of unequal speed. 1 = full speed."""

    def validate(self) -> None:
        require(self.num_rounds >= 0, "train.num_rounds", f"must be >= 0, got {self.num_rounds!r}")
        require(self.log_every > 0, "train.log_every", f"must be a positive integer, got {self.log_every!r}")
        require(self.wait_for_peers >= 1, "train.wait_for_peers", f"must be >= 1, got {self.wait_for_peers!r}")
        positive(self.wait_for_peers_timeout_s, "train.wait_for_peers_timeout_s")
        positive(self.state_timeout_s, "train.state_timeout_s")
        require(self.eval_every_rounds >= 0, "train.eval_every_rounds",
                 f"must be >= 0, got {self.eval_every_rounds!r}")
        require(isinstance(self.slowdown, (int, float)) and math.isfinite(self.slowdown) and self.slowdown >= 1,
                 "train.slowdown", f"must be a number >= 1, got {self.slowdown!r}")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint folder; default: <run.output_dir>/checkpoints."""
    every_rounds: int = 5
    """Write a checkpoint every this many rounds (and at the end); 0: only at the end."""
    keep: int = 3
    """Keep this many most recent checkpoints."""
    resume: bool = True
    """Resume from the latest checkpoint in the folder if there is one (--no-resume: start fresh)."""

    def validate(self) -> None:
        require(self.every_rounds >= 0, "checkpoint.every_rounds", f"must be >= 0, got {self.every_rounds!r}")
        require(self.keep >= 1, "checkpoint.keep", f"must be >= 1, got {self.keep!r}")


@dataclass
class PipelineConfig:
    stages: int = 1
    """P: pipeline stages inside this peer (one process each)."""
    replicas: int = 1
    """D: data-parallel replicas of the pipeline inside this peer (a cluster's devices: D x P processes). Each
    stage's replicas average their gradients at every inner step (torch DDP); replica 0 of each stage alone takes part
    in the swarm and gives the others its weights when they change outside the inner step."""
    stage_layers: Optional[list[int]] = None
    """Blocks per stage, e.g. [3, 3, 2]; default: balanced by parameter count."""
    schedule: str = "gpipe"
    """Pipeline schedule: 'gpipe' or '1f1b'."""
    microbatches: int = 1
    """Microbatches per inner step (must divide data.batch_size)."""
    timeout_s: float = 1800.0
    """Give up on a stage of this peer that does not answer for this long (a dead one is noticed at once)."""

    def validate(self) -> None:
        require(self.stages >= 1, "pipeline.stages", f"must be a positive integer, got {self.stages!r}")
        require(self.replicas >= 1, "pipeline.replicas", f"must be a positive integer, got {self.replicas!r}")
        require(self.schedule in SCHEDULES, "pipeline.schedule",
                 f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        require(self.microbatches >= 1, "pipeline.microbatches", f"must be >= 1, got {self.microbatches!r}")
        positive(self.timeout_s, "pipeline.timeout_s")
        if self.stage_layers is not None:
            require(len(self.stage_layers) == self.stages, "pipeline.stage_layers",
                     f"has {len(self.stage_layers)} entries but pipeline.stages is {self.stages}")
            require(all(n >= 1 for n in self.stage_layers), "pipeline.stage_layers",
                     f"every stage needs at least one block, got {self.stage_layers}")


@dataclass
class MetricsConfig:
    port: Optional[int] = None
    """Serve GET /metrics (Prometheus text format, by prometheus_client) and GET /health (JSON) over HTTP on this
    port; default: off. 0: any free port (logged). Stage j of a pipelined peer serves on port + j; a bootstrap node
    on the port."""
    host: str = "127.0.0.1"
    """Address the metrics server listens on; '0.0.0.0' lets a Prometheus on another machine (or outside a
    container) scrape it."""
    tensorboard_dir: str = ""
    """Also write the training metrics (loss, eval loss, lr, tokens/s, bytes sent and received, round times, group
    size, fallbacks) as TensorBoard event files in this folder, one subfolder per stage process
    (stage<j>-<end of the peer id>); relative to run.output_dir; empty: off. Needs the tensorboard package
    (the [tensorboard] extra)."""
    wandb_project: str = ""
    """Also log the same metrics to this Weights & Biases project, one W&B run per stage process, grouped by
    run.run_id, its files in <run.output_dir>/wandb; empty: off. Needs the wandb package (the [wandb] extra)."""
    wandb_mode: str = "offline"
    """'offline': W&B runs stay on this machine (upload them later with `wandb sync <run.output_dir>/wandb/
    offline-run-*`); 'online': streamed to the W&B server (needs `wandb login` or WANDB_API_KEY)."""
    wandb_run_name: str = ""
    """Name of this peer's W&B runs, to which -stage<j> is added; default: <run.run_id>-<end of the peer id>."""

    def validate(self) -> None:
        require(self.port is None or 0 <= self.port <= 65535, "metrics.port",
                 f"must be a TCP port (0-65535, 0: any free port), got {self.port!r}")
        require(bool(self.host.strip()), "metrics.host", "must not be empty (e.g. 127.0.0.1 or 0.0.0.0)")
        require(self.wandb_mode in WANDB_MODES, "metrics.wandb_mode",
                 f"must be one of {', '.join(WANDB_MODES)}, got {self.wandb_mode!r}")
        require(not re.search(r"[/\\#?%:]", self.wandb_project), "metrics.wandb_project",
                 f"must not contain / \\ # ? % or : (W&B project names), got {self.wandb_project!r}")
