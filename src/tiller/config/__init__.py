"""The run configuration: one YAML file validated into typed models, one module per box
(`model`, `env`, `engine`, `sft`, `rl` with `algorithm`, `rollout`, `eval`, `observe`,
`data`), the root `Config` and `load_config` in `root`. Everything is importable from here."""

from tiller.config.algorithm import (
    AlgorithmConfig,
    CreditConfig,
    CriticConfig,
    DynamicSamplingConfig,
    KLConfig,
    OverlongConfig,
)
from tiller.config.data import DataConfig, RewardConfig
from tiller.config.engine import EngineConfig, SamplingConfig, WeightSyncConfig
from tiller.config.env import DEFAULT_LOOP, AgentConfig, EnvConfig
from tiller.config.eval import EvalConfig, EvalSetConfig
from tiller.config.model import BuildConfig, ModelConfig, RuntimeConfig
from tiller.config.observe import LoggingConfig, ObserveConfig, TracesConfig
from tiller.config.rl import (
    JUDGE_PROMPT,
    STALE_OFF_POLICY,
    CurriculumConfig,
    JudgeConfig,
    RLConfig,
)
from tiller.config.rollout import RolloutConfig
from tiller.config.root import Config, load_config
from tiller.config.sft import SFTConfig
from tiller.errors import ConfigError

__all__ = [
    "DEFAULT_LOOP", "JUDGE_PROMPT", "STALE_OFF_POLICY", "AgentConfig", "AlgorithmConfig",
    "BuildConfig", "Config", "ConfigError", "CreditConfig", "CriticConfig", "CurriculumConfig",
    "DataConfig", "DynamicSamplingConfig", "EngineConfig", "EnvConfig", "EvalConfig",
    "EvalSetConfig", "JudgeConfig", "KLConfig", "LoggingConfig", "ModelConfig", "ObserveConfig",
    "OverlongConfig", "RLConfig", "RewardConfig", "RolloutConfig", "RuntimeConfig",
    "SFTConfig", "SamplingConfig", "TracesConfig", "WeightSyncConfig", "load_config",
]
