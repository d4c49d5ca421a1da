from meshloom.config.loader import ConfigError, help_text, load_config, to_dict
from meshloom.config.schema import (
    Config,
    DataConfig,
    JobConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
    ValidationConfig,
)

__all__ = [
    "Config", "ConfigError", "DataConfig", "JobConfig", "LRSchedulerConfig", "MetricsConfig",
    "ModelConfig", "OptimizerConfig", "ParallelismConfig", "TrainingConfig", "ValidationConfig", "help_text", "load_config", "to_dict",
]
