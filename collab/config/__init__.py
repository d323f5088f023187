"""The run config: YAML file, then CLI flags over it, then defaults; validated in one place.

Every section is a pydantic model with `extra="forbid"`, so a typo is an error that names the key instead of a
silently ignored setting. The training, checkpoint and run-wide checks are in collab.config.run, the averaging
section in collab.config.averaging, task-specific sections beside their task (collab/tasks/*_config.py); reading
a file, flags and the one-line errors in collab.config.loading. This package's names are the ones the rest of
collab imports.
"""

from collab.config.averaging import (COMPRESSIONS, GOSSIP_RULES, AveragingConfig, DiLoCoConfig, GossipConfig,
                                     join_request_timeout, round_timeout_caution)
from collab.config.loading import (DEFAULT_CONFIG_NAME, FIELD_TO_FLAG, FLAG_TO_FIELD, RUN_ID_PATTERN, check_run_id,
                                   configs_dir, describe_validation_error, load_config, resolve_config_path,
                                   shipped_config, shipped_config_names, user_settings)
from collab.config.run import TASK_CONFIGS, AutoTargetConfig, CheckpointConfig, RunConfig, TrainingConfig

__all__ = [
    "COMPRESSIONS", "GOSSIP_RULES", "AveragingConfig", "DiLoCoConfig", "GossipConfig", "join_request_timeout",
    "round_timeout_caution", "DEFAULT_CONFIG_NAME", "FIELD_TO_FLAG", "FLAG_TO_FIELD", "RUN_ID_PATTERN",
    "check_run_id", "configs_dir", "describe_validation_error", "load_config", "resolve_config_path",
    "shipped_config", "shipped_config_names", "user_settings", "TASK_CONFIGS", "AutoTargetConfig",
    "CheckpointConfig", "RunConfig", "TrainingConfig",
]
