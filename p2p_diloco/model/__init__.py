"""The model: a LLaMA-style decoder that splits into pipeline stages, its presets and parameter counts.

``Transformer`` is the full model or one stage of it (same parameter names, same init);
``presets`` resolves the ``[model]`` config section and counts parameters without building;
``split`` chooses and builds the stages of a pipeline.
"""

from p2p_diloco.model.llama import (
    Attention,
    FeedForward,
    ModelArgs,
    RMSNorm,
    Transformer,
    TransformerBlock,
    count_parameters,
    loss_fn,
)
from p2p_diloco.model.presets import (
    PRESETS,
    block_num_params,
    embedding_num_params,
    estimate_num_params,
    head_num_params,
    model_args_from_config,
)
from p2p_diloco.model.split import (
    balanced_split,
    build_stage_model,
    check_split,
    stage_layer_ids,
    stage_num_params,
)

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "balanced_split",
    "block_num_params",
    "build_stage_model",
    "check_split",
    "count_parameters",
    "embedding_num_params",
    "estimate_num_params",
    "head_num_params",
    "loss_fn",
    "model_args_from_config",
    "stage_layer_ids",
    "stage_num_params",
]
