"""The root of the run configuration, `Config`, and `load_config`: one YAML file validated
into typed models.

Every knob lives in this package with its default, one module per box. A bad field fails
with one message naming the field, the value and what was expected; `key=value` overrides
from the command line go through the same validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from tiller.config.base import TAGS, Section
from tiller.config.checkpoint import CheckpointConfig
from tiller.config.cluster import ClusterConfig
from tiller.config.curriculum import DifficultyCurriculumConfig
from tiller.config.data import DataConfig, RewardConfig
from tiller.config.engine import (
    AnyEngineConfig,
    EmbeddedEngineConfig,
    SamplingConfig,
    WeightSyncConfig,
)
from tiller.config.env import AgentConfig, EnvConfig
from tiller.config.eval import EvalConfig
from tiller.config.model import ModelConfig, RuntimeConfig
from tiller.config.observe import LoggingConfig, ObserveConfig
from tiller.config.rl import AnyRLConfig, SyncRLConfig
from tiller.config.rollout import RolloutConfig
from tiller.config.sft import SFTConfig
from tiller.config.train import TrainConfig
from tiller.errors import ConfigError


class Config(Section):
    """A run: every section below, each with its defaults (docs/config.md lists every key)."""

    name: str = Field("run", description="the run's name: the default run folder is "
                      "runs/<name>-<YYYYmmdd-HHMMSS>")
    seed: int = Field(0, description="seeds task generation, sampling, initialisation and "
                      "shuffling (Python, NumPy, torch): the same seed repeats a run on the "
                      "same machine")
    output_dir: str | None = Field(None, description="the run folder; default "
                                   "runs/<name>-<YYYYmmdd-HHMMSS> (--output-dir wins over both)")
    model: ModelConfig = Field(description="the policy: a local checkpoint (model.path) or a "
                               "tiny model built here (model.build); required")
    env: EnvConfig = Field(EnvConfig(), description="the environment episodes run in: its "
                           "tasks, turn and token limits, and tools")
    agent: AgentConfig = Field(AgentConfig(), description="what acts in the env: tiller's "
                               "agent loop (or your own) or a black-box program, and what it "
                               "keeps in context")
    sampling: SamplingConfig = Field(SamplingConfig(), description="how each turn is sampled: "
                                     "temperature, truncation, length (evaluation uses "
                                     "eval.temperature)")
    sft: SFTConfig = Field(SFTConfig(), description="supervised fine-tuning before RL")
    train: TrainConfig = Field(TrainConfig(), description="the trainer: its ranks over "
                               "torch.distributed, and the memory and speed of its passes "
                               "(packing, token budget, chunked logprobs, checkpointing)")
    cluster: ClusterConfig = Field(ClusterConfig(), description="where the run's parts run: "
                                   "local processes or a Ray cluster")
    rl: AnyRLConfig = Field(SyncRLConfig(), description="reinforcement learning: steps, batch "
                            "shape, optimizer, algorithm, curriculum, judge; the schedule "
                            "(rl.mode) chooses the type")
    eval: EvalConfig = Field(EvalConfig(), description="evaluation after SFT and after RL: the "
                             "sets, seeds and pass@k")
    logging: LoggingConfig = Field(LoggingConfig(), description="metrics backends, progress "
                                   "bars and report.html")
    engine: AnyEngineConfig = Field(EmbeddedEngineConfig(), description="what generates "
                                    "rollouts; engine.backend chooses the type")
    rollout: RolloutConfig = Field(RolloutConfig(), description="how episodes run during RL: "
                                   "in-flight bound, turns spanning a weight update, timeouts")
    weight_sync: WeightSyncConfig = Field(WeightSyncConfig(), description="how the trainer's "
                                          "weights reach the engine after each optimizer "
                                          "step, and how that is checked")
    observe: ObserveConfig = Field(ObserveConfig(), description="traces.sqlite: the run's "
                                   "episodes token by token")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="resumable checkpoints during RL "
                                         "(docs/resume.md)")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig,
                                   description="CPU threads of this process and the processes "
                                   "it starts")
    data: DataConfig = Field(default_factory=DataConfig,
                             description="your data files: the rows of env.name: dataset, "
                             "SFT conversations (docs/datasets.md)")
    rewards: list[RewardConfig] = Field(default_factory=list,
                                        description="env.name: dataset only: the reward "
                                        "entries, summed (weighted, gated) into the reward")

    @property
    def l_max(self) -> int:
        """Max generated tokens per episode: rl.algorithm.l_max, or the episode's budget (the
        token budget bounds each sequence, so with drop_oldest memory only the turns do)."""
        budget = self.env.max_turns * self.sampling.max_new_tokens
        if self.agent.memory != "drop_oldest":
            budget = min(budget, self.env.max_episode_tokens)
        return self.rl.algorithm.l_max or budget

    @property
    def l_cache(self) -> int:
        """DAPO's soft-overlong buffer: overlong.l_cache, or 20% of l_max (4096 of 20480)."""
        return self.rl.algorithm.overlong.l_cache or max(1, round(0.2 * self.l_max))

    @property
    def managed_servers(self) -> int:
        """The engine servers tiller starts (engine.servers of http or vllm with no
        engine.urls); 0 when it attaches or the engine is embedded."""
        e = self.engine
        return e.servers if e.backend in ("http", "vllm") and not e.urls else 0

    @property
    def server_threads(self) -> int | str:
        """Threads of each managed server: engine.threads (vllm) or runtime.threads (`tiller
        serve`). Under cluster.backend ray it is also the CPUs each server's placement bundle
        reserves, so there `auto` is 1."""
        threads = self.engine.threads if self.engine.backend == "vllm" else self.runtime.threads
        return 1 if threads == "auto" and self.cluster.backend == "ray" else threads

    @property
    def server_gpus(self) -> int:
        """GPUs each managed server's placement bundle reserves under cluster.backend ray:
        engine.gpus of vLLM servers tiller starts, else 0 (`tiller serve` runs on CPU)."""
        e = self.engine
        ray = self.cluster.backend == "ray" and bool(self.managed_servers)
        return e.gpus if ray and e.backend == "vllm" else 0

    @model_validator(mode="after")
    def _rollout_fits_rl(self) -> Config:
        inflight = self.rollout.max_inflight
        if inflight is not None and self.rl.mode != "async":
            raise ConfigError(f"config field rollout.max_inflight: got {inflight}; it only "
                              f"applies with rl.mode: async (rl.mode is {self.rl.mode})")
        if self.rollout.partial != "continue" and self.rl.mode == "sync":
            raise ConfigError(f"config field rollout.partial: got {self.rollout.partial}; in "
                              "rl.mode: sync no episode runs while weights change (use "
                              "one_step_off or async)")
        if inflight is not None and inflight < self.rl.group_size:
            raise ConfigError(f"config field rollout.max_inflight: got {inflight}; expected at "
                              f"least rl.group_size = {self.rl.group_size} (a group starts "
                              f"whole)")
        return self

    @model_validator(mode="after")
    def _ranks_fit(self) -> Config:
        if self.train.world_size > 1 and self.model.device == "cuda":  # auto: check_cluster
            raise ConfigError(gloo_only(self.train.world_size, "cuda"))
        # not the default (a dumped config holds every field: it must load again)
        if self.train.world_size == 1 and self.train.rank_timeout_s != TrainConfig.model_fields[
                "rank_timeout_s"].default:
            raise ConfigError(f"config field train.rank_timeout_s: got "
                              f"{self.train.rank_timeout_s}; it only applies with "
                              f"train.world_size > 1")
        return self

    @model_validator(mode="after")
    def _parts_fit(self) -> Config:
        """weight_sync.shards per_rank: sharded ranks writing parts a tiller serve can read."""
        if self.weight_sync.shards == "gathered":
            return self
        why = ("train.world_size is 1 (nothing is sharded)" if self.train.world_size == 1 else
               f"engine.backend {self.engine.backend} (only tiller serve, engine.backend "
               f"http, applies per-rank parts; vLLM and SGLang load full checkpoints)"
               if self.engine.backend != "http" else
               "model.lora (every rank holds the base whole; rank 0's merged model is synced)"
               if self.model.lora is not None else
               "cluster.address (the ranks write their parts into the run folder, which ranks "
               "on other nodes cannot reach)" if self.cluster.address is not None else None)
        if why is not None:
            raise ConfigError(f"config field weight_sync.shards: got per_rank with {why}; use "
                              f"weight_sync.shards: gathered")
        return self

    @model_validator(mode="after")
    def _cluster_fits(self) -> Config:
        c = self.cluster
        store_set = c.object_store_mb != ClusterConfig.model_fields["object_store_mb"].default
        if store_set and (c.backend == "local" or c.address is not None):
            raise ConfigError(f"config field cluster.object_store_mb: got {c.object_store_mb}; "
                              f"it sizes a local Ray instance (cluster.backend: ray without "
                              f"cluster.address)")
        if c.backend == "local":
            for name in ("address", "num_cpus"):
                if getattr(c, name) is not None:
                    raise ConfigError(f"config field cluster.{name}: got {getattr(c, name)!r}; "
                                      f"it only applies with cluster.backend: ray")
            if c.rollout_workers != 1:
                raise ConfigError(f"config field cluster.rollout_workers: got "
                                  f"{c.rollout_workers}; it only applies with cluster.backend: "
                                  f"ray")
            if getattr(self.engine, "gpus", 0):
                raise ConfigError(f"config field engine.gpus: got {self.engine.gpus}; it "
                                  f"reserves GPUs only with cluster.backend: ray (with local "
                                  f"every server sees the run's CUDA_VISIBLE_DEVICES): leave it "
                                  f"0")
            return self
        if self.agent.program is not None:
            raise ConfigError("config field cluster.backend: got 'ray' with agent.program; an "
                              "agent program's gateway runs in the run's process only (use "
                              "cluster.backend: local)")
        replay = self.env.tools.replay
        if replay is not None:
            raise ConfigError(f"config field env.tools.replay: got mode {replay.mode}; under "
                              f"cluster.backend: ray each rollout worker has its own tool stack, "
                              f"so one replay file is not shared (use cluster.backend: local)")
        if c.address is not None and c.num_cpus is not None:
            raise ConfigError(f"config field cluster.num_cpus: got {c.num_cpus}; it sizes a "
                              f"local Ray instance, and cluster.address connects to a running "
                              f"cluster")
        return self

    @model_validator(mode="after")
    def _servers_can_do_it(self) -> Config:
        """vLLM and SGLang load full checkpoints only; SGLang reports untruncated logprobs,
        vLLM (--logprobs-mode processed_logprobs) those of the truncated distribution."""
        if self.engine.backend not in ("vllm", "sglang"):
            return self
        if self.weight_sync.mode not in (None, "full"):
            raise ConfigError(f"config field weight_sync.mode: got {self.weight_sync.mode}; "
                              f"engine.backend {self.engine.backend} loads full checkpoints "
                              f"only: set full")
        if self.engine.backend == "vllm":
            if self.sampling.logprobs == "untruncated":
                raise ConfigError("config field sampling.logprobs: got 'untruncated'; vLLM "
                                  "(--logprobs-mode processed_logprobs) reports logprobs of the "
                                  "distribution after top-k / top-p: set sampling.logprobs: "
                                  "sampled")
            return self
        if self.sampling.truncates and self.sampling.logprobs != "untruncated":
            raise ConfigError("config field sampling.logprobs: SGLang reports logprobs of "
                              "softmax(logits / T) before top-k / top-p: with sampling.top_k "
                              "or sampling.top_p on, set sampling.logprobs: untruncated")
        return self

    @model_validator(mode="after")
    def _memory_fits(self) -> Config:
        if (self.agent.memory == "drop_oldest"
                and self.sampling.max_new_tokens >= self.env.max_episode_tokens):
            raise ConfigError(f"config field agent.memory: drop_oldest needs room for a turn "
                              f"after the kept context: sampling.max_new_tokens "
                              f"({self.sampling.max_new_tokens}) must be below "
                              f"env.max_episode_tokens ({self.env.max_episode_tokens})")
        return self

    @model_validator(mode="after")
    def _curriculum_fits_env(self) -> Config:
        c = self.rl.curriculum
        if not isinstance(c, DifficultyCurriculumConfig):
            return self
        for name in ("min_level", "start"):
            level = getattr(c, name)
            if level is not None and level > self.env.difficulty:
                raise ConfigError(f"config field rl.curriculum.{name}: got {level}; expected "
                                  f"at most env.difficulty = {self.env.difficulty} (the "
                                  f"target, the highest level)")
        lowest = c.min_level or 1
        if c.enabled and lowest == self.env.difficulty:
            raise ConfigError(f"config field rl.curriculum.mode: got 'difficulty' with a single "
                              f"level (rl.curriculum.min_level {lowest} = env.difficulty), so "
                              f"there is nothing to adapt: expected rl.curriculum.min_level "
                              f"below env.difficulty, or rl.curriculum.mode: filter")
        return self

    @model_validator(mode="after")
    def _overlong_fits(self) -> Config:
        if self.rl.algorithm.overlong.mode == "soft" and self.l_cache >= self.l_max:
            raise ConfigError(f"config field rl.algorithm.overlong.l_cache: got {self.l_cache}; "
                              f"expected less than l_max = {self.l_max}")
        return self


    @model_validator(mode="after")
    def _source_fits_env(self) -> Config:
        for name in ("openenv", "harbor"):  # each source's section (a plug-in may subclass)
            if getattr(self.env, name) is not None and self.env.name != name \
                    and ":" not in self.env.name:
                raise ConfigError(f"config field env.{name}: only used with env.name: {name} "
                                  f"(env.name is {self.env.name})")
        return self

    @model_validator(mode="after")
    def _data_fits_env(self) -> Config:
        data = self.data
        # a plug-in env given data is a subclass of the dataset env (checked once it is
        # imported, by the run): it takes data.* and rewards as the dataset env does
        plugin = ":" in self.env.name and (data.train is not None or bool(self.rewards))
        dataset = self.env.name == "dataset" or plugin
        if dataset and data.train is None:
            raise ConfigError("config field data.train: env.name is dataset, so name the file "
                              "of train prompts (JSONL, Parquet or a datasets folder)")
        if dataset and not self.rewards:
            raise ConfigError("config field rewards: env.name is dataset, so list at least one "
                              "reward entry (a verifier by name or a function by dotted path)")
        if dataset and self.env.tools.functions:
            raise ConfigError(f"config field env.tools.functions: got "
                              f"{self.env.tools.functions}; the dataset env's tools are per row: "
                              "list them in data.tools (every row) or the rows' tools column")
        if dataset and self.agent.program is not None:
            raise ConfigError(f"config field agent.program: got {self.agent.program!r}; the "
                              "dataset env's reward functions score the conversation its own "
                              "loop records, which an agent program does not give it")
        if not dataset:
            for name in ("train", "eval", "messages_column", "metadata_columns", "tools",
                         "system"):
                if getattr(data, name):
                    raise ConfigError(f"config field data.{name}: only used with env.name: "
                                      f"dataset (env.name is {self.env.name})")
            if self.rewards:
                raise ConfigError("config field rewards: only used with env.name: dataset (env "
                                  f"{self.env.name} scores episodes with its own verifier)")
        if data.sft is not None:
            for name in ("tasks", "imperfect_fraction", "difficulty"):
                if getattr(self.sft, name) != SFTConfig.model_fields[name].default:
                    raise ConfigError(f"config field sft.{name}: used only for scripted-expert "
                                      "demonstrations; data.sft gives the conversations")
        return self


def gloo_only(world_size: int, device: str) -> str:
    return (f"config field train.world_size: got {world_size} with model.device {device}; "
            f"trainer ranks use gloo, so they run on CPU only (NCCL is not built): set "
            f"model.device=cpu")


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key!r} is not a section")
        node = child
    node[leaf] = value


def first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"] if p not in TAGS) or "config"
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    got = f" got {err['input']!r};" if "input" in err and not isinstance(err["input"], dict) else ""
    return f"config field {where}:{got} {err['msg']}{more}"


def dump_config(cfg: Config) -> str:
    """`cfg` as YAML, every key with its value or default in the models' order (api_key
    masked): what a run writes to its config.yaml and `tiller config show` prints."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


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
        raise ConfigError(first_error(e)) from e
