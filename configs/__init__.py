"""Typed pipeline configs (``configs.schema``) and their YAML presets (``configs/presets``)."""

from configs.loading import DEFAULT_PRESET, load_config, preset_names
from configs.schema import (
    ModelConfig,
    PipelineConfig,
    RopeScalingConfig,
    SamplingConfig,
    StageConfig,
)

__all__ = [
    "DEFAULT_PRESET",
    "ModelConfig",
    "PipelineConfig",
    "RopeScalingConfig",
    "SamplingConfig",
    "StageConfig",
    "load_config",
    "preset_names",
]
