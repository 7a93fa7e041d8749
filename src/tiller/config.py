"""The run configuration: one YAML file validated into typed models.

Every knob lives here with its default. A bad field fails with one message naming the field,
the value and what was expected; `key=value` overrides from the command line go through the
same validation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(Exception):
    """A configuration that cannot be used; the message says which field and why."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BuildConfig(_Section):
    """A tiny Qwen3 with random weights and a BPE tokenizer trained on the env's text."""

    vocab_size: int = Field(1024, ge=300, le=65536)
    hidden_size: int = Field(128, ge=16, le=4096)
    num_layers: int = Field(2, ge=1, le=64)
    num_heads: int = Field(4, ge=1, le=64)
    corpus_tasks: int = Field(400, ge=10, description="expert episodes the tokenizer trains on")


class ModelConfig(_Section):
    path: str | None = Field(None, description="local Hugging Face checkpoint to load")
    build: BuildConfig | None = Field(None, description="build a tiny model instead")
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.build is None):
            raise ValueError("set exactly one of model.path (load) or model.build (create)")
        return self


class EnvConfig(_Section):
    name: str = "calculator"
    difficulty: int = Field(2, ge=1, le=10)
    max_turns: int = Field(6, ge=1)
    max_episode_tokens: int = Field(512, ge=16)


class AgentConfig(_Section):
    loop: str = Field("tiller.agent_loop:run_episode", description="dotted path of the loop")


class SamplingConfig(_Section):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(48, ge=1)


class SFTConfig(_Section):
    enabled: bool = True
    tasks: int = Field(2000, ge=1, description="expert demonstrations (one per train task)")
    imperfect_fraction: float = Field(
        0.5, ge=0.0, le=1.0, description="share of demonstrations that guess without the tool"
    )
    epochs: int = Field(2, ge=1)
    batch_size: int = Field(64, ge=1)
    micro_batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)


class AlgorithmConfig(_Section):
    advantage: str = "grpo"
    policy_loss: str = "ppo_clip"
    aggregation: str = "token-mean"
    eps_low: float = Field(0.2, ge=0.0)
    eps_high: float = Field(0.2, ge=0.0)
    kl_beta: float = Field(0.0, ge=0.0, description="k3 KL to the reference; 0 = no reference")
    kl_estimator: str = "k3"


class RLConfig(_Section):
    steps: int = Field(30, ge=0)
    tasks_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    mini_batches: int = Field(1, ge=1, description="optimizer steps per rollout batch")
    micro_batch_size: int = Field(32, ge=1)
    algorithm: AlgorithmConfig = AlgorithmConfig()


class EvalConfig(_Section):
    tasks: int = Field(256, ge=1)
    temperature: float = Field(1.0, ge=0.0, description="1.0 = pass@1 of the sampling policy")


class LoggingConfig(_Section):
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "tiller"
    progress: bool = True


class Config(_Section):
    name: str = "run"
    seed: int = 0
    output_dir: str | None = None
    model: ModelConfig
    env: EnvConfig = EnvConfig()
    agent: AgentConfig = AgentConfig()
    sampling: SamplingConfig = SamplingConfig()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    max_batch_size: int = Field(128, ge=1, description="engine: episodes generated at once")


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key!r} is not a section")
        node = child
    node[leaf] = value


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "config"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    got = f" got {err['input']!r};" if "input" in err and not isinstance(err["input"], dict) else ""
    return f"config field {where}:{got} {err['msg']}{more}"


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML, apply `a.b=value` overrides (values parsed as YAML), validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        _set(data, key.strip(), yaml.safe_load(raw))
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_first_error(e)) from e
