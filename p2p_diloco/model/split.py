"""Cutting the decoder into pipeline stages: how many blocks each stage gets, and its model.

A split is a list of block counts, one per stage (e.g. ``[6, 5, 5, 6]``); stage ``j`` owns the
contiguous blocks after those of stages ``0..j-1``, stage 0 also the embedding and the last stage
the final norm and head. ``P = 1`` (``[n_layers]``) is the whole model.
Who calls this: the peer, when it builds its stage processes.
"""

from __future__ import annotations

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.memory import StageShape
from p2p_diloco.model.llama import ModelArgs, Transformer
from p2p_diloco.model.presets import block_num_params, embedding_num_params, head_num_params


def balanced_split(args: ModelArgs, num_stages: int) -> list[int]:
    """Blocks per stage that balance the parameter count of the stages.

    Every stage gets one block, then each further block goes to the stage that holds the fewest
    parameters so far (counting the embedding on stage 0 and the head on the last stage); on a tie,
    to the later stage, since under 1F1B the early stages hold the most activations. With equal
    blocks this greedy fill minimizes the largest stage. Deterministic.

    Raises:
        ConfigError: num_stages < 1 or more stages than blocks (naming ``pipeline.stages``).
    """
    if num_stages < 1:
        raise ConfigError(f"pipeline.stages: must be a positive integer, got {num_stages}")
    if num_stages > args.n_layers:
        raise ConfigError(
            f"pipeline.stages: {num_stages} stages need at least {num_stages} blocks, "
            f"but the model has {args.n_layers} (model.n_layers)"
        )
    counts = [1] * num_stages
    for _ in range(args.n_layers - num_stages):
        sizes = [_stage_size(args, counts, j) for j in range(num_stages)]
        smallest = min(range(num_stages), key=lambda j: (sizes[j], -j))
        counts[smallest] += 1
    return counts


def check_split(args: ModelArgs, stage_layers: list[int]) -> None:
    """Checks a user-given split.

    Raises:
        ConfigError: a stage without blocks, or counts that do not add up to ``model.n_layers``
            (naming ``pipeline.stage_layers``).
    """
    if not stage_layers:
        raise ConfigError("pipeline.stage_layers: must list at least one stage")
    if any(n < 1 for n in stage_layers):
        raise ConfigError(f"pipeline.stage_layers: every stage needs at least one block, got {stage_layers}")
    if sum(stage_layers) != args.n_layers:
        raise ConfigError(
            f"pipeline.stage_layers: {stage_layers} adds up to {sum(stage_layers)} blocks, "
            f"but the model has {args.n_layers} (model.n_layers)"
        )


def stage_layer_ids(stage_layers: list[int], stage_index: int) -> list[int]:
    """Global indices of the blocks of one stage, e.g. ``([3, 3, 2], 1) -> [3, 4, 5]``.

    Raises:
        ValueError: stage_index is not a stage of this split.
    """
    if not 0 <= stage_index < len(stage_layers):
        raise ValueError(f"stage_index must lie in [0, {len(stage_layers)}), got {stage_index}")
    start = sum(stage_layers[:stage_index])
    return list(range(start, start + stage_layers[stage_index]))


def stage_num_params(args: ModelArgs, stage_layers: list[int], stage_index: int) -> int:
    """Parameters of one stage, without building it."""
    return _stage_size(args, stage_layers, stage_index)


def build_stage_model(args: ModelArgs, stage_layers: list[int], stage_index: int,
                      initialize: bool = True, device: str = "cpu") -> Transformer:
    """Builds the model of one stage, its parameters named and initialized as in the full model (uninitialized
    with ``initialize`` False, for a caller that loads them all; names and shapes only on the "meta" ``device``).

    Raises:
        ConfigError: an invalid split, or tied embeddings with more than one stage.
        ValueError: stage_index is not a stage of this split.
    """
    check_split(args, stage_layers)
    layer_ids = stage_layer_ids(stage_layers, stage_index)
    return Transformer(
        args, layer_ids=layer_ids, first=stage_index == 0, last=stage_index == len(stage_layers) - 1,
        initialize=initialize, device=device,
    )


def _stage_size(args: ModelArgs, stage_layers: list[int], stage_index: int) -> int:
    size = stage_layers[stage_index] * block_num_params(args)
    if stage_index == 0:
        size += embedding_num_params(args)
    if stage_index == len(stage_layers) - 1:
        size += head_num_params(args)
    return size


def stage_shapes(args: ModelArgs, stage_layers: list[int]) -> list[StageShape]:
    """The shape of each stage of a split, for the memory estimate (:mod:`p2p_diloco.memory`)."""
    return [StageShape(stage_num_params(args, stage_layers, j), stage_layers[j], args.dim, args.ffn_dim,
                       args.n_heads, args.vocab_size, j == len(stage_layers) - 1) for j in range(len(stage_layers))]
