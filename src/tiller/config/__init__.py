"""The run configuration: one YAML file validated into typed models, one module per box
(`model`, `env`, `engine`, `sft`, `rl` with `algorithm`, `curriculum` and `judge`, `rollout`,
`eval`, `observe`, `data`), the root `Config` and `load_config` in `root`. A section whose
keys depend on a choice (engine.backend, rl.mode, rl.curriculum.mode, rl.judge) has one type
per variant (`base.Variant`): `XConfig` is what the variants share, `AnyXConfig` the field
type. Everything is importable from here."""

from tiller.config.algorithm import (
    AlgorithmConfig,
    CreditConfig,
    CriticConfig,
    DynamicSamplingConfig,
    KLConfig,
    OverlongConfig,
)
from tiller.config.checkpoint import CheckpointConfig
from tiller.config.cluster import ClusterConfig
from tiller.config.curriculum import (
    AnyCurriculumConfig,
    CurriculumConfig,
    DifficultyCurriculumConfig,
    FilterCurriculumConfig,
)
from tiller.config.data import DataConfig, RewardConfig
from tiller.config.engine import (
    AnyEngineConfig,
    EmbeddedEngineConfig,
    EngineConfig,
    HttpEngineConfig,
    SamplingConfig,
    VllmEngineConfig,
    WeightSyncConfig,
)
from tiller.config.env import DEFAULT_LOOP, AgentConfig, EnvConfig
from tiller.config.eval import EvalConfig, EvalSetConfig
from tiller.config.judge import (
    JUDGE_PROMPT,
    AnyJudgeConfig,
    FnJudgeConfig,
    JudgeConfig,
    ModelJudgeConfig,
    NoJudgeConfig,
)
from tiller.config.model import BuildConfig, LoRAConfig, ModelConfig, RuntimeConfig
from tiller.config.observe import LoggingConfig, ObserveConfig, TracesConfig
from tiller.config.rl import (
    STALE_OFF_POLICY,
    AnyRLConfig,
    AsyncRLConfig,
    OneStepOffRLConfig,
    RLConfig,
    SyncRLConfig,
)
from tiller.config.rollout import RolloutConfig
from tiller.config.root import Config, dump_config, load_config
from tiller.config.sft import SFTConfig
from tiller.config.train import TrainConfig
from tiller.errors import ConfigError

__all__ = [
    "DEFAULT_LOOP", "JUDGE_PROMPT", "STALE_OFF_POLICY", "AgentConfig", "AlgorithmConfig",
    "AnyCurriculumConfig", "AnyEngineConfig", "AnyJudgeConfig", "AnyRLConfig", "AsyncRLConfig",
    "BuildConfig", "CheckpointConfig", "ClusterConfig", "Config",
    "ConfigError", "CreditConfig", "CriticConfig", "CurriculumConfig", "DataConfig",
    "DifficultyCurriculumConfig", "DynamicSamplingConfig", "EmbeddedEngineConfig",
    "EngineConfig", "EnvConfig", "EvalConfig", "EvalSetConfig", "FilterCurriculumConfig",
    "FnJudgeConfig", "HttpEngineConfig", "JudgeConfig", "KLConfig", "LoRAConfig", "LoggingConfig",
    "ModelConfig", "ModelJudgeConfig", "NoJudgeConfig", "ObserveConfig", "OneStepOffRLConfig",
    "OverlongConfig", "RLConfig", "RewardConfig", "RolloutConfig", "RuntimeConfig", "SFTConfig",
    "SamplingConfig", "SyncRLConfig", "TracesConfig", "TrainConfig", "VllmEngineConfig",
    "WeightSyncConfig", "dump_config", "load_config",
]
