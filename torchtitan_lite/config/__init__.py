"""Job configuration: the schema (:mod:`.schema`) and its loading from TOML and the command line
(:mod:`.cli`)."""

from torchtitan_lite.config.cli import format_help, load_job_config
from torchtitan_lite.config.schema import (
    Checkpoint,
    JobConfig,
    LRScheduler,
    Optimizer,
    Profiling,
    validate_config,
)
from torchtitan_lite.errors import ConfigError

__all__ = ["Checkpoint", "ConfigError", "JobConfig", "LRScheduler", "Optimizer", "Profiling",
           "format_help", "load_job_config", "validate_config"]
