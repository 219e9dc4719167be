"""A LLaMA-style decoder that can be cut into pipeline stages, and its loss.

The model reads top to bottom like nanoGPT: RMSNorm, rotary embeddings, grouped-query attention
and a SwiGLU feed-forward, with no biases. The module layout follows torchtitan so that a pipeline
stage is the same class with some parts left out: ``tok_embeddings``, ``layers`` (an
``nn.ModuleDict`` keyed by the *global* block index) and ``norm`` + ``output``. A stage's parameter
names are therefore the full model's names, and every parameter is initialized from
``(init_seed, its name)`` alone, so stage j of every peer starts from the same values as the
matching slice of a full model.

Who calls this: :mod:`p2p_diloco.model.split` (stage models) and the trainer (``loss_fn``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from p2p_diloco.config.errors import ConfigError

INIT_STD = 0.02


@dataclass
class ModelArgs:
    """The concrete shape of one model (every value resolved, no presets)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        """Checks that the shape is buildable.

        Raises:
            ConfigError: naming the ``model.<field>`` key at fault.
        """
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name}: must be a positive integer, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise ConfigError(f"model.{name}: must be a positive number, got {value!r}")
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim: must be divisible by model.n_heads ({self.n_heads}), got {self.dim}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads: must divide model.n_heads ({self.n_heads}), got {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model.dim: dim / n_heads must be even for rotary embeddings, got {self.dim} / {self.n_heads}"
            )


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the rotary cos and sin tables, each (max_seq_len, head_dim // 2), fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (T, D/2)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the two halves of each head's channels by position-dependent angles.

    Args:
        x: queries or keys, (B, T, H, D).
        cos: (T, D // 2) table from :func:`rotary_tables`, already cut to T.
        sin: (T, D // 2) table, likewise.
    """
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, T, H, D/2) each
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, T, 1, D/2)
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # (B, T, H, D)
    return rotated.type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention: n_kv_heads key/value heads shared by n_heads queries."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, KV, D)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, KV, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|KV, T, D)
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep > 1:  # explicit repeat rather than enable_gqa, which older torch versions lack
            k = k.repeat_interleave(n_rep, dim=1)  # (B, H, T, D)
            v = v.repeat_interleave(n_rep, dim=1)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.wo(y)  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, C)


class TransformerBlock(nn.Module):
    """One pre-norm block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, C)
        return x + self.feed_forward(self.ffn_norm(x))  # (B, T, C)


class Transformer(nn.Module):
    """The decoder, or one pipeline stage of it.

    Args:
        args: the model shape.
        layer_ids: global indices of the blocks to build, increasing; default: all of them.
        first: build the token embedding; forward then takes token ids (B, T) instead of hidden states.
        last: build the final norm and the output head; forward then returns logits instead of hidden states.
        initialize: set every parameter by :meth:`init_weights`; False leaves them uninitialized, for a caller
            that loads all of them (``model.init_from``).
        device: where the parameters live; "meta" gives their names and shapes only, with no memory (a peer
            starts its DHT and averager processes from it, before the weights exist: forked, they share none).

    Raises:
        ValueError: layer_ids out of range or not increasing.
        ConfigError: tie_embeddings on a model that lacks the embedding or the head.
    """

    def __init__(
        self, args: ModelArgs, layer_ids: Sequence[int] | None = None, first: bool = True, last: bool = True,
        initialize: bool = True, device: str = "cpu",
    ) -> None:
        super().__init__()
        layer_ids = list(range(args.n_layers)) if layer_ids is None else [int(i) for i in layer_ids]
        _check_layer_ids(layer_ids, args.n_layers)
        if args.tie_embeddings and not (first and last):
            raise ConfigError(
                "model.tie_embeddings: needs the embedding and the output head in one model; "
                "it cannot be used with more than one pipeline stage"
            )
        self.args, self.layer_ids, self.first, self.last = args, layer_ids, first, last
        with torch.device("meta"):  # no memory and no global-RNG draws until init_weights fills them
            self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim) if first else None
            self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in layer_ids})
            self.norm = RMSNorm(args.dim, args.norm_eps) if last else None
            self.output = nn.Linear(args.dim, args.vocab_size, bias=False) if last else None
        if device != "meta":
            self.to_empty(device=device)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, D/2)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, D/2)
        if initialize and device != "meta":
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Sets every parameter from (init_seed, its full name) alone, whatever else this model holds.

        Norm scales start at one; other weights are N(0, 0.02), the residual output projections
        (``wo``, ``w2``) scaled by 1/sqrt(2 n_layers) as in GPT-2.
        """
        residual_std = INIT_STD / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():  # a tied weight comes once, as tok_embeddings.weight
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else INIT_STD
                param.copy_(seeded_normal(param.shape, std, self.args.init_seed, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs this model's part of the decoder.

        Args:
            x: token ids (B, T) int64 if this model is first, else hidden states (B, T, C).

        Returns:
            Logits (B, T, V) if this model is last, else hidden states (B, T, C).
        """
        T = x.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than model.max_seq_len ({self.args.max_seq_len})")
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T, C)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # (T, D/2)
        for block in self.layers.values():
            h = block(h, cos, sin)  # (B, T, C)
        if self.output is None:
            return h
        return self.output(self.norm(h))  # (B, T, V)


def _check_layer_ids(layer_ids: list[int], n_layers: int) -> None:
    if any(i < 0 or i >= n_layers for i in layer_ids):
        raise ValueError(f"layer_ids must lie in [0, {n_layers}), got {layer_ids}")
    if layer_ids != sorted(set(layer_ids)):
        raise ValueError(f"layer_ids must be strictly increasing, got {layer_ids}")


def param_seed(init_seed: int, name: str) -> int:
    """A 63-bit seed that depends only on the init seed and the parameter name (stable across runs)."""
    digest = hashlib.sha256(f"{init_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seeded_normal(shape: torch.Size, std: float, init_seed: int, name: str) -> torch.Tensor:
    """Draws N(0, std^2) values of the given shape from a generator of their own, as fp32 on CPU.

    Box-Muller in float64 rather than ``Tensor.normal_``: torch picks a different fp32 normal kernel
    per CPU instruction set, while peers on different machines must start from the same values
    (fp64 maths rounded to fp32 agrees across instruction sets but for vanishingly rare ties).
    The uniforms are drawn in fp32: a serial, exact kernel everywhere, and 5x faster than fp64 draws.
    """
    generator = torch.Generator(device="cpu").manual_seed(param_seed(init_seed, name))
    radius = torch.rand(shape, generator=generator).double()
    angle = torch.rand(shape, generator=generator).double()
    radius.neg_().add_(1.0).log_().mul_(-2.0).sqrt_()  # 1 - u lies in (0, 1], so the log is finite
    angle.mul_(2.0 * math.pi).cos_()
    return radius.mul_(angle).mul_(std).float()


def count_parameters(module: nn.Module) -> int:
    """Number of parameter values in a module (a tied weight counts once)."""
    return sum(p.numel() for p in module.parameters())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in fp32.

    Args:
        logits: (B, T, V), any float dtype.
        targets: (B, T) int64 token ids.
    """
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))  # (B*T, V) vs (B*T,)
