"""Configuration: nested dataclasses, one section per component, loaded from TOML plus overrides."""

from p2p_diloco.config.errors import ConfigError
from p2p_diloco.config.network import AveragingConfig, DHTConfig
from p2p_diloco.config.parse import Config, describe_config, dump_config, load_config, split_overrides
from p2p_diloco.config.sections import (
    CheckpointConfig,
    DataConfig,
    DiLoCoConfig,
    InnerConfig,
    MetricsConfig,
    ModelConfig,
    PipelineConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "AveragingConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DHTConfig",
    "DataConfig",
    "DiLoCoConfig",
    "InnerConfig",
    "MetricsConfig",
    "ModelConfig",
    "PipelineConfig",
    "RunConfig",
    "TrainConfig",
    "describe_config",
    "dump_config",
    "load_config",
    "split_overrides",
]
