"""Model size presets, their resolution from the ``[model]`` config section, and parameter counts.

The counts are computed from the shape alone, without building anything, so that a peer can plan
a pipeline split of a model that does not fit in its memory. They equal
:func:`p2p_diloco.model.llama.count_parameters` of the built model.
Who calls this: the CLI and the peer (building the model), :mod:`p2p_diloco.model.split`.
"""

from __future__ import annotations

from typing import Any

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.sections import ModelConfig
from p2p_diloco.model.llama import ModelArgs

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.92M parameters with the 257-token byte vocabulary.
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384, max_seq_len=128),
    # ~25.7M in the blocks (plus 2 * 512 * vocab in the embedding and head).
    "small": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1408, max_seq_len=256),
    # ~206M in the blocks (plus 2 * 1024 * vocab).
    "medium": dict(dim=1024, n_layers=16, n_heads=16, n_kv_heads=16, ffn_dim=2816, max_seq_len=512),
    # The TinyLlama-1.1B shape: 1.10e9 with a 32000-token vocabulary.
    "1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, max_seq_len=2048),
}

_OVERRIDABLE = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")


def model_args_from_config(cfg: ModelConfig, vocab_size: int) -> ModelArgs:
    """Resolves the ``[model]`` section into a concrete shape.

    Args:
        cfg: the model section; fields that are not None override the preset's values.
        vocab_size: the data's vocabulary size, used unless ``cfg.vocab_size`` is set.

    Raises:
        ConfigError: unknown preset, or a shape that cannot be built (naming the key).
    """
    if cfg.preset_name not in PRESETS:
        raise ConfigError(f"model.preset: must be one of {', '.join(PRESETS)}, got {cfg.preset!r}")
    values = dict(PRESETS[cfg.preset_name])
    for name in _OVERRIDABLE:
        if getattr(cfg, name) is not None:
            values[name] = getattr(cfg, name)
    return ModelArgs(
        **values,
        vocab_size=cfg.vocab_size if cfg.vocab_size is not None else vocab_size,
        tie_embeddings=cfg.tie_embeddings,
        init_seed=cfg.init_seed,
    )


def block_num_params(args: ModelArgs) -> int:
    """Parameters of one transformer block: attention, SwiGLU and two norm scales."""
    q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    attention = args.dim * q_dim + 2 * args.dim * kv_dim + q_dim * args.dim
    feed_forward = 3 * args.dim * args.ffn_dim
    return attention + feed_forward + 2 * args.dim


def embedding_num_params(args: ModelArgs) -> int:
    """Parameters of the token embedding."""
    return args.vocab_size * args.dim


def head_num_params(args: ModelArgs) -> int:
    """Parameters of the final norm and the output head; the head adds none when tied to the embedding."""
    return args.dim + (0 if args.tie_embeddings else args.vocab_size * args.dim)


def estimate_num_params(args: ModelArgs) -> int:
    """Parameters of the whole model, without building it."""
    return embedding_num_params(args) + args.n_layers * block_num_params(args) + head_num_params(args)
