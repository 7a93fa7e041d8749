"""The run configuration: one YAML file validated into typed models.

Every knob lives here with its default. A bad field fails with one message naming the field,
the value and what was expected; `key=value` overrides from the command line go through the
same validation.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tiller.envs.source_config import HarborConfig, OpenEnvConfig
from tiller.errors import ConfigError, import_dotted, require_package  # noqa: F401 (re-exported)
from tiller.tools.stack import ToolsConfig


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
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="engine weights and trainer compute (bf16 autocast); the "
        "trainer's master weights and optimizer stay float32")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the policy, engine, reference and critic run; auto = cuda "
        "when available, else cpu")
    chat_format: Literal["auto", "hermes", "qwen3", "qwen3.5", "llama3", "harmony"] = Field(
        "auto", description="the family whose tool-call and reasoning parser reads generated "
        "turns (rendering is always the tokenizer's own chat template); auto = detect from "
        "the template, hermes when nothing matches (docs/formats.md)")

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
    tools: ToolsConfig = Field(default_factory=ToolsConfig,
                               description="executor, fault injection, record/replay, gate")
    openenv: OpenEnvConfig | None = Field(None, description="env openenv: the OpenEnv server "
                                          "(url or command) and how the policy acts on it")
    harbor: HarborConfig | None = Field(None, description="env harbor: the folder of Harbor "
                                        "tasks and the sandbox they run in")


DEFAULT_LOOP = "tiller.rollout.agent_loop:run_episode"


class AgentConfig(_Section):
    loop: str = Field(DEFAULT_LOOP, description="dotted path of the loop")
    memory: Literal["full", "drop_oldest", "truncate_tool_output"] = Field(
        "full", description="what a long episode keeps in context (docs/environments.md, "
        "'Memory'): full: everything, truncated at env.max_episode_tokens; drop_oldest: when "
        "the next context would leave less than sampling.max_new_tokens of the budget, drop "
        "the oldest exchanges and go on in a new exact sequence; truncate_tool_output: cut "
        "each tool message to agent.tool_output_tokens before the model sees it. A custom "
        "agent.loop gets the policy as limits.memory and honours it only if it applies it; "
        "agent.program allows only full")
    tool_output_tokens: int | None = Field(
        None, ge=1, description="truncate_tool_output only (default 128): tokens kept of each "
        "tool message")
    program: str | None = Field(
        None, description="dotted path of a black-box agent program, `async def main(base_url, "
        "api_key, model, task)`, awaited per episode against tiller's OpenAI-compatible "
        "gateway (docs/gateway.md); replaces agent.loop")
    program_timeout_s: float = Field(
        300.0, gt=0, description="seconds one agent.program episode may run; past it the "
        "episode is aborted")
    reward: Literal["verifier", "program"] = Field(
        "verifier", description="agent.program's reward: the env's verifier on the model's "
        "last turn, or the number (or {'reward': x}) the program returns")
    history: Literal["stream", "template"] = Field(
        "stream", description="what the next turn's prompt holds: stream = the exact sampled "
        "ids plus the new messages (one exact sequence, reasoning kept); template = the chat "
        "template's re-rendering, which starts a new exact segment of the episode wherever it "
        "differs from the stream (docs/formats.md)")

    @model_validator(mode="after")
    def _memory_knobs(self) -> AgentConfig:
        if self.tool_output_tokens is not None and self.memory != "truncate_tool_output":
            raise ConfigError(f"config field agent.tool_output_tokens: got "
                              f"{self.tool_output_tokens}; it is only used with agent.memory: "
                              f"truncate_tool_output (agent.memory is {self.memory})")
        return self

    @model_validator(mode="after")
    def _program_fits(self) -> AgentConfig:
        if self.program is not None and self.loop != DEFAULT_LOOP:
            raise ConfigError(f"config field agent.program: got {self.program!r}; it replaces "
                              f"the agent loop, so agent.loop must stay the default (got "
                              f"{self.loop!r}): set one of them")
        if self.program is not None and self.memory != "full":
            raise ConfigError(f"config field agent.memory: got {self.memory!r}; it is tiller's "
                              "agent loop's memory, and agent.program keeps its own history "
                              "(a rewrite splits the episode): leave it 'full'")
        if self.program is not None and self.history != "stream":
            raise ConfigError(f"config field agent.history: got {self.history!r}; with "
                              "agent.program the gateway assembles the program's calls itself "
                              "(a rewritten history splits the episode): leave it 'stream'")
        if self.program is None and self.reward == "program":
            raise ConfigError("config field agent.reward: got 'program'; it needs an "
                              "agent.program whose return value is the reward")
        return self


class SamplingConfig(_Section):
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(48, ge=1)


class EngineConfig(_Section):
    """Where rollouts are generated: the embedded engine in this process, or `tiller serve`
    (or SGLang) servers over HTTP, which get the trainer's weights after every step."""

    backend: Literal["embedded", "http"] = Field(
        "embedded", description="embedded: a continuous-batching engine in this process; "
        "http: the servers in engine.urls, through SGLang's /generate contract")
    urls: list[str] = Field(
        default_factory=list, description="http: base URLs of the servers (e.g. "
        "http://127.0.0.1:30000); episodes stick to one, new episodes go to the least loaded")
    api_key: SecretStr | None = Field(
        None, description="http: bearer token the servers were started with (--api-key); "
        "default: the TILLER_API_KEY environment variable, if set (recommended: a key in the "
        "config file is kept out of dumps, config.yaml and wandb, but lives in the file)")
    weights_dir: str | None = Field(
        None, description="http: folder the trainer writes each weight version to, which "
        "must be below every server's --weights-root; default <run dir>/weights")
    request_timeout_s: float = Field(
        300.0, gt=0, description="http: seconds one generate or control request may take")
    max_retries: int = Field(
        2, ge=0, description="http: times a request that failed on a dead or unreachable "
        "server is retried on another (each counted and logged)")
    max_batch_size: int = Field(128, ge=1, description="embedded: rows decoded at once")
    cache_bytes: int = Field(
        1 << 30, ge=0, description="embedded: byte budget of the KV kept between turns and "
        "for shared prefixes (LRU); 0 turns reuse off, so every turn re-prefills")

    @field_serializer("api_key")
    def _hide_key(self, key: SecretStr | None) -> str | None:
        return None if key is None else "**********"  # dumps never carry the key

    @model_validator(mode="after")
    def _backend_fields(self) -> EngineConfig:
        if self.backend == "http" and not self.urls:
            raise ConfigError("config field engine.urls: engine.backend is http, so list at "
                              "least one server URL (start one with `tiller serve MODEL`)")
        if self.backend == "http":
            for name in ("max_batch_size", "cache_bytes"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ConfigError(f"config field engine.{name}: only used with "
                                      "engine.backend: embedded (set the servers' own limits "
                                      "with tiller serve's options)")
        if self.backend == "embedded":
            for name in ("urls", "api_key", "weights_dir"):
                if getattr(self, name):
                    raise ConfigError(f"config field engine.{name}: only used with "
                                      "engine.backend: http")
        return self


class WeightSyncConfig(_Section):
    """How the trainer's weights reach the engine after each optimizer step, and how the sync
    is checked (docs/engine.md, "Weight sync")."""

    mode: Literal["full", "delta", "auto"] | None = Field(
        None, description="full: every tensor; delta: only the elements whose engine-dtype "
        "value changed since the last sync (indices + values); auto: per sync, whichever is "
        "fewer bytes (logged as sync/kind). Default: full for the embedded engine (an "
        "in-memory copy is faster than building a delta), auto for engine.backend http")
    parity_tol: float = Field(
        0.05, gt=0, description="after every sync the engine and the trainer score a fixed "
        "probe sequence; a mean |logprob difference| above this is a WeightSyncError")
    parity_tokens: int = Field(
        64, ge=2, le=4096, description="length of the seeded probe sequence the parity check "
        "scores")
    timeout_s: float = Field(
        600.0, gt=0, description="seconds each wait of a sync (the update applied, the probe "
        "scored) may take on an engine or server before the sync fails naming it")


class SFTConfig(_Section):
    enabled: bool = Field(True, description="supervised fine-tuning before RL")
    tasks: int = Field(2000, ge=1, description="expert demonstrations (one per train task)")
    imperfect_fraction: float = Field(
        0.5, ge=0.0, le=1.0, description="share of demonstrations that guess without the tool"
    )
    difficulty: int | None = Field(
        None, ge=1, le=10, description="difficulty of the demonstrations' train tasks (default "
        "env.difficulty); lower than env.difficulty = demonstrations of only the easier part "
        "of the distribution RL trains on")
    epochs: int = Field(2, ge=1, description="passes over the demonstrations")
    batch_size: int = Field(64, ge=1, description="demonstrations per optimizer step")
    micro_batch_size: int = Field(32, ge=1, description="demonstrations per forward/backward "
                                  "(gradient accumulation up to batch_size)")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    warmup_steps: int = Field(20, ge=0, description="linear warmup steps")
    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="after warmup: cosine decay to 0, or constant")


class KLConfig(_Section):
    """KL(pi || pi_ref). beta = 0 means no reference model at all (no reference forward)."""

    beta: float = Field(0.0, ge=0.0)
    estimator: str | None = Field(
        None, description="k1 | k2 | k3 | abs | k1+ | k3+ (default k3); placement loss"
    )
    placement: Literal["loss", "reward"] | None = Field(
        None, description="loss: + beta * k per token; reward: - beta * k1 from the reward"
    )
    off_after: int | None = Field(None, ge=0, description="RL step from which beta is 0")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, name: str | None) -> str | None:
        from tiller.train.algorithms import KL_ESTIMATORS

        return name if name is None else _registered(name, KL_ESTIMATORS)


class DynamicSamplingConfig(_Section):
    """DAPO: drop zero-variance groups, refill with new groups up to `max_rounds` rounds."""

    enabled: bool = False
    max_rounds: int | None = Field(
        None, ge=1, description="generation rounds per step, the first one included (default 3)"
    )


class OverlongConfig(_Section):
    """Truncated episodes: `mask` them out of the loss, or `soft`-punish their length."""

    mode: Literal["none", "mask", "soft"] = "none"
    l_cache: int | None = Field(None, ge=1, description="soft buffer (default 20% of l_max)")


class CreditConfig(_Section):
    """Turn-level credit (used when the verifier gives `Reward.turn_rewards`) and key steps."""

    gamma_turn: float | None = Field(None, ge=0.0, le=1.0, description="default 1.0")
    turn_baseline: Literal["per_turn", "pooled"] | None = Field(
        None, description="group baseline per turn index, or pooled over turns (default per_turn)"
    )
    key_steps: str | None = Field(
        None, description="dotted path of fn(trajectory, tokenizer) -> 0/1 per token, "
        "multiplied into the loss mask"
    )


class CriticConfig(_Section):
    """The value model of the `gae` estimator (PPO)."""

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    value_lr: float = Field(1e-3, gt=0)
    value_clip: float = Field(0.2, gt=0)
    whiten: bool = Field(True, description="whiten GAE advantages over the batch's tokens")


def _registered(name: str, registry: Any) -> str:
    if name not in registry:
        raise PydanticCustomError(
            "unknown_name", "expected one of: {names}", {"names": ", ".join(sorted(registry))}
        )
    return name


def _estimator_takes(a: AlgorithmConfig, name: str) -> bool:
    """Whether the chosen advantage estimator declares input `name`."""
    from tiller.train.algorithms import ADVANTAGES

    return name in ADVANTAGES.inputs[a.advantage]


def _outcome_estimator(a: AlgorithmConfig) -> bool:
    """Turn-level credit wraps estimators of outcome rewards (those that declare `rewards`)."""
    return _estimator_takes(a, "rewards")


# An ignorable knob: (dotted name, is it used by this algorithm?, what uses it). A knob the final
# algorithm ignores must stay unset: setting it is an error naming it, never a silent no-op.
# The knobs of losses, estimators and aggregations come from their registry declarations
# (`_declared_knobs`); these are the others.
Ignorable = tuple[str, Callable[["AlgorithmConfig"], bool], str]
_IGNORABLE: list[Ignorable] = [
    ("kl.placement", lambda a: a.kl.beta > 0, "used only when kl.beta > 0"),
    ("kl.off_after", lambda a: a.kl.beta > 0, "used only when kl.beta > 0"),
    ("kl.estimator", lambda a: a.kl.beta > 0 and a.kl.placement != "reward",
     "used only when kl.beta > 0 and kl.placement is 'loss' (the reward penalty is k1)"),
    ("dynamic_sampling.max_rounds", lambda a: a.dynamic_sampling.enabled,
     "used only when dynamic_sampling.enabled is true"),
    ("overlong.l_cache", lambda a: a.overlong.mode == "soft",
     "used only when overlong.mode is 'soft'"),
    ("advantage_eps", lambda a: _estimator_takes(a, "eps"),
     "used only by estimators that divide by a std (grpo, reinforce_pp, gae)"),
    ("credit.gamma_turn", _outcome_estimator, "used only by outcome-reward estimators (a "
     "per-token estimator such as gae takes turn rewards per token, discounted by critic.gamma)"),
    ("credit.turn_baseline", _outcome_estimator,
     "used only by outcome-reward estimators (gae's baseline is its critic)"),
]

# Declared knobs that something outside the registries also reads: (is it used?, by what).
_ALSO_USED: dict[str, tuple[Callable[[AlgorithmConfig], bool], str]] = {
    "l_max": (lambda a: a.overlong.mode == "soft", "overlong.mode 'soft'"),
}


def _declared_knobs() -> list[Ignorable]:
    """One row per knob (the section, for a dotted knob) that a registered policy loss,
    advantage estimator, aggregation or off-policy correction declares: used iff the chosen
    entry declares it (or `_ALSO_USED` says so)."""
    from tiller.train.algorithms import ADVANTAGES, AGGREGATIONS, OFF_POLICY, POLICY_LOSSES

    rows: list[Ignorable] = []
    for field, registry in (("policy_loss", POLICY_LOSSES), ("advantage", ADVANTAGES),
                            ("aggregation", AGGREGATIONS), ("off_policy", OFF_POLICY)):
        roots = {knob.split(".")[0] for name in registry for knob in registry.knobs[name]}
        for knob in sorted(roots):
            also, also_who = _ALSO_USED.get(knob, (lambda a: False, ""))
            names = ", ".join(repr(n) for n in sorted(registry) if registry.declares(n, knob))
            also_by = f" and {also_who}" if also_who else ""
            rows.append((knob, _reads(field, registry, knob, also),
                         f"read only by {field} {names}{also_by}"))
    return rows


def _reads(field: str, registry: Any, knob: str, also: Callable[[AlgorithmConfig], bool]
           ) -> Callable[[AlgorithmConfig], bool]:
    """Is `knob` used: declared by the entry that `field` chooses, or `also` used."""
    return lambda a: registry.declares(getattr(a, field), knob) or also(a)


def _get(tree: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _pop(tree: dict[str, Any], dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.get(key) or {}
    tree.pop(leaf, None)


def _put(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set a dotted key unless the tree already holds a value there (fills defaults only)."""
    *parents, leaf = dotted.split(".")
    for key in parents:
        if tree.get(key) is None:
            tree[key] = {}
        tree = tree[key]
    if tree.get(leaf) is None:
        tree[leaf] = value


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class AlgorithmConfig(_Section):
    """Every estimator and loss of ALGORITHMS.md, chosen by name (see docs/algorithms.md).

    Resolution: the `preset` (if any) gives defaults, the user's keys override them; a knob the
    resulting algorithm ignores is an error if the user set it (a preset's own value is just
    dropped); unset knobs the algorithm uses get their defaults (e.g. the clip range is the
    chosen loss's own default, so `gspo` gets 3e-4 / 4e-4, never PPO's 0.2). The resolved
    config is what a run saves, and it loads back to itself.
    """

    preset: str | None = Field(None, description="grpo | dapo | dr_grpo | gspo | ppo | rloo | "
                               "reinforce_pp: a set of defaults for the knobs below")
    advantage: str = Field("grpo", description="grpo | dr_grpo | rloo | reinforce_pp | gae")
    policy_loss: str = Field("ppo_clip", description="ppo_clip | gspo | cispo | sapo")
    eps_low: float | None = Field(None, ge=0.0, description="clip range below 1 (ppo_clip, gspo; "
                                  "cispo's IS-weight bound); default: the loss's own")
    eps_high: float | None = Field(None, ge=0.0, description="clip range above 1 (ppo_clip, "
                                   "gspo; cispo's IS-weight bound); default: the loss's own")
    clip_ratio_c: float | None = Field(None, gt=1.0, description="dual clip (ppo_clip only)")
    tau_pos: float | None = Field(None, gt=0.0, description="sapo's gate temperature where "
                                  "A > 0 (default 1.0)")
    tau_neg: float | None = Field(None, gt=0.0, description="sapo's gate temperature where "
                                  "A < 0 (default 1.05)")
    entropy_coef: float = Field(0.0, ge=0.0, description="entropy bonus: L -= coef * H")
    advantage_eps: float | None = Field(
        None, gt=0.0, description="the epsilon in the advantage's denominator (std + eps) of "
        "the estimators that whiten: grpo, reinforce_pp, gae (default 1e-6)")
    aggregation: str = Field("token-mean", description="token-mean | seq-mean-token-mean | "
                             "seq-mean-token-sum | seq-mean-token-sum-norm | token-sum")
    l_max: int | None = Field(
        None, ge=1, description="max generated tokens per episode (default: the env's budget, "
        "min(env.max_turns * sampling.max_new_tokens, env.max_episode_tokens))"
    )
    off_policy: str = Field("none", description="off-policy correction, a weight on each "
                            "token's policy loss: none | tis | mis | seq_is | decoupled")
    is_cap: float | None = Field(None, gt=0.0, description="importance weight cap C of tis, "
                                 "seq_is and decoupled (default 2.0)")
    mis_low: float | None = Field(None, gt=0.0, lt=1.0, description="mis: tokens whose "
                                  "exp(logp_old - logp_rollout) is below this are removed "
                                  "(default 0.5)")
    mis_high: float | None = Field(None, gt=1.0, description="mis: tokens whose "
                                   "exp(logp_old - logp_rollout) is above this are removed "
                                   "(default 5.0)")
    kl: KLConfig = Field(default_factory=KLConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    credit: CreditConfig = Field(default_factory=CreditConfig)
    critic: CriticConfig | None = Field(None, description="advantage 'gae' only")

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, name: str) -> str:
        from tiller.train.algorithms import ADVANTAGES

        return _registered(name, ADVANTAGES)

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        from tiller.train.algorithms import POLICY_LOSSES

        return _registered(name, POLICY_LOSSES)

    @field_validator("aggregation")
    @classmethod
    def _known_aggregation(cls, name: str) -> str:
        from tiller.train.algorithms import AGGREGATIONS

        return _registered(name, AGGREGATIONS)

    @field_validator("off_policy")
    @classmethod
    def _known_off_policy(cls, name: str) -> str:
        from tiller.train.algorithms import OFF_POLICY

        return _registered(name, OFF_POLICY)

    @model_validator(mode="wrap")
    @classmethod
    def _resolve(cls, data: Any, handler: Callable[[Any], AlgorithmConfig]) -> AlgorithmConfig:
        if not isinstance(data, dict):  # an instance (already resolved) or an assignment
            return handler(data)
        from tiller.train.presets import PRESETS

        user = copy.deepcopy(data)
        if "tis_c" in user:  # removed in issue 9: say what replaced it, not just "extra field"
            raise ConfigError(f"config field rl.algorithm.tis_c: got {user['tis_c']!r}; it was "
                              "replaced by off_policy: tis with is_cap: C (the same weight "
                              "min(exp(logp_old - logp_rollout), C)); for tis_c: null, remove "
                              "it (off_policy: none is the default)")
        preset = user.get("preset")
        if preset is not None and preset not in PRESETS:
            raise ConfigError(f"config field rl.algorithm.preset: got {preset!r}; "
                              f"expected one of: {', '.join(PRESETS)}")
        base = copy.deepcopy(PRESETS.get(preset, {}))
        if "policy_loss" in user:  # a preset's clip range belongs to the preset's loss
            base.pop("eps_low", None), base.pop("eps_high", None)
        merged = _merge(base, user)
        typed = handler(merged)  # types and ranges first, so the rules below read clean values
        for knob, used, why in [*_declared_knobs(), *_IGNORABLE]:
            if _get(merged, knob) is None or used(typed):
                continue
            mine = _get(user, knob)
            if mine is not None:
                if isinstance(mine, dict):  # a section: name its first key
                    knob, mine = next(((f"{knob}.{k}", v) for k, v in mine.items()), (knob, mine))
                raise ConfigError(f"config field rl.algorithm.{knob}: got {mine!r}; the algorithm "
                                  f"ignores it: {why}")
            _pop(merged, knob)  # the preset's value for a part the overrides switched off
        typed = handler(merged)
        return handler(_fill_defaults(merged, typed))


def _fill_defaults(merged: dict[str, Any], a: AlgorithmConfig) -> dict[str, Any]:
    """The resolved values of the knobs this algorithm uses and the user left unset: the
    declared knobs of the policy loss and the off-policy correction get the function's own
    defaults (None stays unset: off)."""
    from tiller.train.algorithms import ADVANTAGES, OFF_POLICY, POLICY_LOSSES

    for registry, name in ((POLICY_LOSSES, a.policy_loss), (OFF_POLICY, a.off_policy)):
        params = inspect.signature(registry[name]).parameters
        for knob in registry.declared(name):
            if params[knob].default is not None:
                _put(merged, knob, params[knob].default)
    if a.kl.beta > 0:
        _put(merged, "kl.placement", "loss")
        if a.kl.placement in (None, "loss"):
            _put(merged, "kl.estimator", "k3")
    if a.dynamic_sampling.enabled:
        _put(merged, "dynamic_sampling.max_rounds", 3)
    if ADVANTAGES.declares(a.advantage, "critic"):
        merged["critic"] = merged.get("critic") or {}
    if _estimator_takes(a, "eps"):
        _put(merged, "advantage_eps", 1e-6)
    if _outcome_estimator(a):
        _put(merged, "credit.gamma_turn", 1.0)
        _put(merged, "credit.turn_baseline", "per_turn")
    return merged


class CurriculumConfig(_Section):
    """Which train tasks RL draws, kept in a success band (docs/curriculum.md): `difficulty`
    moves the env.difficulty the tasks are made at toward the level whose running success
    estimate is inside the band; `filter` draws tasks from a fixed pool at env.difficulty
    and skips those whose own estimate is outside it. Held-out eval stays at env.difficulty."""

    enabled: bool = Field(False, description="draw RL tasks through the curriculum")
    mode: Literal["difficulty", "filter"] = Field(
        "difficulty", description="difficulty: adapt the level tasks are made at; filter: "
        "skip pool tasks whose success estimate is outside the band")
    band: tuple[float, float] = Field(
        (0.3, 0.7), description="[low, high] success rate a task (or level) should have: "
        "above high it is too easy, below low too hard, to teach much")
    window: int = Field(8, ge=1, description="the running estimate is the mean success over "
                        "the last `window` finished groups of the level (or task)")
    min_groups: int = Field(
        2, ge=1, description="difficulty: groups finished at the current level since it was "
        "entered before it may move again; filter: groups of a task before it may be skipped")
    min_level: int | None = Field(
        None, ge=1, le=10, description="difficulty only: the lowest level (default 1); the "
        "highest is env.difficulty, the target")
    start: int | None = Field(None, ge=1, le=10, description="difficulty only: the level the "
                              "run starts at (default min_level)")
    pool: int | None = Field(None, ge=1, description="filter only: train tasks in the pool, "
                             "made at env.difficulty and drawn round-robin (default 64)")
    max_skips: int | None = Field(
        None, ge=1, description="filter only: draws in a row a task may be skipped before it "
        "is drawn anyway, to re-estimate it under the current policy (default 4)")

    @model_validator(mode="after")
    def _valid(self) -> CurriculumConfig:
        low, high = self.band
        if not 0.0 <= low < high <= 1.0:
            raise ConfigError(f"config field rl.curriculum.band: got {list(self.band)}; "
                              "expected [low, high] with 0 <= low < high <= 1")
        if self.min_groups > self.window:  # an estimate never holds more than `window`
            raise ConfigError(f"config field rl.curriculum.min_groups: got {self.min_groups}; "
                              f"expected at most rl.curriculum.window = {self.window}")
        other = {"difficulty": ("pool", "max_skips"), "filter": ("min_level", "start")}
        for name in other[self.mode]:
            if getattr(self, name) is not None:
                raise ConfigError(f"config field rl.curriculum.{name}: got "
                                  f"{getattr(self, name)!r}; it is not used with "
                                  f"rl.curriculum.mode: {self.mode}")
        if self.start is not None and self.start < (self.min_level or 1):
            raise ConfigError(f"config field rl.curriculum.start: got {self.start}; expected "
                              f"at least rl.curriculum.min_level = {self.min_level or 1}")
        return self


JUDGE_PROMPT = ("Question: {question}\nProposed answer: {answer}\nIs the proposed answer "
                "correct? Answer yes or no.\nAnswer:")


class JudgeConfig(_Section):
    """An optional judge score as a shaping term, paid only where the verifier says success
    (docs/algorithms.md, "Judge shaping"): a judge can be gamed, so it never pays for a wrong
    answer, and a detector warns when its score rises while success does not."""

    fn: str | None = Field(
        None, description="dotted path of fn(task, trajectory) -> float in [0, 1], e.g. "
        "tiller.train.judges:grounded_answer; null: no judge (or rl.judge.model)")
    model: str | None = Field(
        None, description="local path of a Hugging Face causal LM and tokenizer that judges "
        "instead of fn (tiller.train.judges.ModelJudge): the score is P(yes) / (P(yes) + "
        "P(no)) of its continuation after `prompt`; a frozen copy, e.g. the policy's start "
        "checkpoint for self-reflection")
    prompt: str = Field(
        JUDGE_PROMPT, description="rl.judge.model's prompt: {question} (the task's prompt) and "
        "{answer} (the episode's final assistant text) are filled in; the judge then scores "
        "the continuations ' yes' and ' no'")
    weight: float = Field(0.1, ge=0.0, description="reward = verifier + weight * judge on "
                          "successful episodes; the verifier's value elsewhere")
    window: int = Field(3, ge=1, description="hacking detector: RL steps per window; the last "
                        "window is compared with the one before it")
    margin: float = Field(0.05, ge=0.0, description="hacking detector: a judge-mean rise above "
                          "this while success rose by no more than this is suspected hacking")

    @model_validator(mode="after")
    def _valid(self) -> JudgeConfig:
        if self.fn is not None and self.model is not None:
            raise ConfigError(f"config field rl.judge.model: got {self.model!r} with rl.judge.fn "
                              f"{self.fn!r}; a run has one judge (unset one of them)")
        if self.model is None and self.prompt != JUDGE_PROMPT:
            raise ConfigError("config field rl.judge.prompt: it only applies with "
                              "rl.judge.model (the model judge); set one or unset the prompt")
        if not self.enabled:
            for name in ("weight", "window", "margin"):
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ConfigError(f"config field rl.judge.{name}: got "
                                      f"{getattr(self, name)!r}; it only applies with a judge "
                                      "(rl.judge.fn or rl.judge.model)")
        try:
            filled = self.prompt.format(question="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"config field rl.judge.prompt: {type(e).__name__}: {e}; only "
                              "{question} and {answer} are filled in (double other braces)"
                              ) from e
        if "{answer}" not in self.prompt or filled == self.prompt:
            raise ConfigError("config field rl.judge.prompt: it must contain {answer}, the "
                              "episode's final text the judge scores")
        return self

    @property
    def enabled(self) -> bool:
        return self.fn is not None or self.model is not None


class RLConfig(_Section):
    steps: int = Field(30, ge=0)
    tasks_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    mini_batches: int = Field(1, ge=1, description="optimizer steps per pass over the batch")
    ppo_epochs: int = Field(
        1, ge=1, description="passes over each rollout batch (logp_old fixed before the first); "
        "with mini_batches 1 and ppo_epochs 1 the ratio is 1 and clipping never acts")
    micro_batch_size: int = Field(32, ge=1)
    adam_betas: tuple[float, float] = Field(
        (0.9, 0.99), description="AdamW's (beta1, beta2) for RL, each in [0, 1)")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW's epsilon for RL (added to the "
                            "root of the second moment)")
    env_error_weight: float = Field(
        0.0, ge=0.0, le=1.0,
        description="0 drops env_error trajectories; w > 0 keeps them in their group with "
                    "their loss scaled by w (once: masks and normalizers are untouched)")
    max_idle_steps: int = Field(
        3, ge=0,
        description="consecutive RL steps allowed with nothing to train because dynamic "
                    "sampling filtered every group as zero-variance (each is skipped, logged "
                    "`skipped` = 1, with a warning); one more stops the run. A step whose "
                    "episodes were all dropped (env or engine failures) stops it at once")
    max_aborted_frac: float = Field(
        0.1, ge=0.0, le=1.0,
        description="fail the run when more than this share of a step's (or an eval's) "
                    "episodes aborted (engine or loop failure), naming the first error")
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description="sync: sample a step's groups, then train on them; one_step_off: sample "
                    "step k+1 while step k trains (data one step stale); async: keep episodes "
                    "running continuously and train on the first tasks_per_step groups that "
                    "finish, within rl.max_staleness (docs/async.md)")
    max_staleness: int | None = Field(
        None, ge=0,
        description="async only (default 4): the most weight versions a trained token may lag "
                    "the trainer (trainer version - the oldest version that sampled the "
                    "trajectory). The producer does not start episodes that would exceed it; "
                    "groups that still do are filtered (ledger filtered/stale)")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    reward_control: Literal["none", "random", "constant"] = Field(
        "none",
        description="the spurious-reward control (docs/evaluation.md): none trains on the "
                    "verifier's reward; random trains on the step's verifier rewards shuffled "
                    "across its trajectories (same mean and distribution, no link to what each "
                    "did); constant trains on rl.reward_control_value for every trajectory. "
                    "Logged success and every eval still use the verifier")
    reward_control_value: float | None = Field(
        None,
        description="reward_control constant only (default 0.0): the value every trajectory "
                    "trains on; under a group baseline (grpo, rloo, ...) every advantage is 0, "
                    "unless rl.algorithm.overlong.mode is soft: its length penalty is still "
                    "added per trajectory, so the advantages vary with length")
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig,
                                         description="which train tasks RL draws")
    judge: JudgeConfig = Field(default_factory=JudgeConfig,
                               description="judge shaping, gated behind the verifier")

    @property
    def updates_per_step(self) -> int:
        """Weight versions one RL step advances (optimizer steps)."""
        return self.mini_batches * self.ppo_epochs

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained token may lag: 0 in sync, one step in one_step_off."""
        if self.mode == "async":
            return 4 if self.max_staleness is None else self.max_staleness
        return self.updates_per_step if self.mode == "one_step_off" else 0

    @property
    def lag_steps(self) -> int:
        """How many RL steps ahead of the trainer the producer may start groups."""
        return self.staleness_bound // self.updates_per_step

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("expected two floats in [0, 1), e.g. [0.9, 0.99]")
        return betas

    @model_validator(mode="after")
    def _steps_have_rows(self) -> RLConfig:
        rows = self.tasks_per_step * self.group_size
        if self.mini_batches > rows:
            raise ConfigError(f"config field rl.mini_batches: got {self.mini_batches}; expected "
                              f"at most rl.tasks_per_step * rl.group_size = {rows}")
        if self.max_staleness is not None and self.mode != "async":
            raise ConfigError(f"config field rl.max_staleness: got {self.max_staleness}; it "
                              f"only applies with rl.mode: async (rl.mode is {self.mode})")
        if self.reward_control_value is not None and self.reward_control != "constant":
            raise ConfigError(f"config field rl.reward_control_value: got "
                              f"{self.reward_control_value}; it only applies with "
                              f"rl.reward_control: constant (it is {self.reward_control})")
        if self.reward_control != "none" and self.judge.enabled:
            field = "fn" if self.judge.fn is not None else "model"
            raise ConfigError(f"config field rl.judge.{field}: got "
                              f"{getattr(self.judge, field)!r}; the judge "
                              f"term is paid on the verifier's success, which would carry the "
                              f"signal rl.reward_control: {self.reward_control} removes (unset "
                              "one of them)")
        default = type(self).model_fields["max_idle_steps"].default
        if self.max_idle_steps != default and not self.algorithm.dynamic_sampling.enabled:
            raise ConfigError(f"config field rl.max_idle_steps: got {self.max_idle_steps}; it "
                              "only applies with rl.algorithm.dynamic_sampling.enabled: true")
        return self


class RolloutConfig(_Section):
    """How the rollout manager runs episodes during RL (docs/async.md)."""

    max_inflight: int | None = Field(
        None, ge=1,
        description="async only: the most episodes running at once (default: no bound but "
                    "the staleness one); at least rl.group_size, since a group starts whole")
    partial: Literal["continue", "abort_resume"] = Field(
        "continue",
        description="a turn being generated when new weights arrive: continue under the new "
                    "weights (each token records its version) or abort it and resume it "
                    "under the new weights (the tokens so far are kept, none is sampled twice)")
    batch_timeout_s: float = Field(
        1800.0, gt=0,
        description="the most the trainer waits for one step's groups before the run stops "
                    "with an error naming what it waited for")
    shutdown_timeout_s: float = Field(
        60.0, gt=0,
        description="at the end of RL, how long episodes still running get to wind down "
                    "(their requests are aborted) before they are cancelled; every one is "
                    "counted in the ledger either way")


class EvalSetConfig(_Section):
    """One named evaluation set: `tasks` tasks of an evaluation split at a difficulty."""

    name: str = Field(description="the set's name in the summary and in eval/<label>.jsonl "
                                  "(e.g. heldout, ood_difficulty, ood_templates)")
    split: str = Field("heldout", description="heldout, or an out-of-distribution split the "
                                              "env offers (e.g. calculator's ood_templates)")
    tasks: int | None = Field(None, ge=1, description="tasks in the set (default eval.tasks)")
    difficulty: int | None = Field(None, ge=1, le=10,
                                   description="default env.difficulty; higher = OOD")


class EvalConfig(_Section):
    enabled: bool = Field(
        True, description="evaluation after SFT and after RL; false skips it (logged, and "
        "summary.json says \"heldout\": \"disabled\"), as does an env without a heldout "
        "split")
    tasks: int = Field(256, ge=1, description="tasks of the default heldout set, and of every "
                       "set in eval.sets that does not give its own")
    temperature: float = Field(1.0, ge=0.0, description="1.0 = pass@1 of the sampling policy")
    samples_per_task: int = Field(1, ge=1, description="n samples per task (n >= pass_k)")
    pass_k: int = Field(1, ge=1, description="also report unbiased pass@k when k > 1")
    sets: list[EvalSetConfig] | None = Field(
        None, description="the sets every evaluation runs (default: one set, heldout, of "
                          "eval.tasks tasks at env.difficulty)")
    seeds: list[int] | None = Field(
        None, min_length=1, description="sampling seeds: each set is sampled once per seed "
        "(samples_per_task each), figures pool them with CIs over tasks and are also given "
        "per seed (default: the run's seed)")

    @model_validator(mode="after")
    def _enough_samples(self) -> EvalConfig:
        if self.pass_k > self.samples_per_task:
            raise ConfigError(f"config field eval.pass_k: got {self.pass_k}; pass@k needs "
                              f"eval.samples_per_task >= k, got {self.samples_per_task}")
        names = [s.name for s in self.sets or []]
        if self.sets is not None and (not names or len(set(names)) < len(names)):
            raise ConfigError(f"config field eval.sets: got names {names}; expected at least "
                              "one set, each name once")
        if self.seeds is not None and len(set(self.seeds)) < len(self.seeds):
            raise ConfigError(f"config field eval.seeds: got {self.seeds}; each seed once")
        return self

    def resolved_sets(self, difficulty: int) -> list[EvalSetConfig]:
        """The sets to run, each with its task count and difficulty filled in."""
        sets = self.sets or [EvalSetConfig(name="heldout")]
        return [s.model_copy(update={"tasks": s.tasks or self.tasks,
                                     "difficulty": s.difficulty or difficulty}) for s in sets]


class LoggingConfig(_Section):
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "tiller"
    progress: bool = True
    report: bool = Field(True, description="write RUN_DIR/report.html (plots of the run) when "
                         "`train` ends, also after an error; needs tiller[report] (matplotlib)")


class TracesConfig(_Section):
    """traces.sqlite: the run's episodes token by token (docs/traces.md)."""

    enabled: bool = Field(True, description="write traces.sqlite in the run folder")
    sample_rate: float = Field(
        1.0, ge=0.0, le=1.0, description="share of RL episodes kept, chosen by a hash of each "
        "episode's seed (the same episodes in every rl.mode; no RNG is drawn); every eval "
        "episode is kept")
    max_mb: float | None = Field(
        1024.0, gt=0, description="cap on the payload written (arrays, messages, tool calls), "
        "in MiB; RL episodes past it are dropped and counted (traces/dropped_cap), eval "
        "episodes are always written (traces/eval_over_cap counts those past it); null: no cap")
    queue_size: int = Field(
        1024, ge=1, description="items waiting for the background writer; when full, RL items "
        "are dropped and counted (traces/dropped_queue) rather than slow training, eval "
        "episodes wait for room (at most close_timeout_s)")
    close_timeout_s: float = Field(
        120.0, gt=0, description="the longest wait for the writer to drain at the end of a "
        "run (or for room in the queue, for an eval episode)")


class ObserveConfig(_Section):
    traces: TracesConfig = Field(default_factory=TracesConfig,
                                 description="token-level traces (traces.sqlite)")


class DataConfig(_Section):
    """A user's data files (docs/datasets.md): JSONL, Parquet, or a Hugging Face `datasets`
    folder (save_to_disk) or .arrow file. `train`/`eval` are the tasks of `env.name: dataset`;
    `sft` is a file of conversations SFT trains on instead of the env's scripted expert."""

    train: str | None = Field(None, description="env dataset: the file of train prompts (one "
                              "task per row)")
    eval: str | None = Field(None, description="env dataset: the held-out file; unset: no "
                             "held-out split, the run skips the held-out evaluations")
    sft: str | None = Field(None, description="a file of conversations (messages column) SFT "
                            "trains on, loss on the assistant tokens; replaces the scripted "
                            "expert, so sft works for envs without one")
    prompt_column: str = Field("prompt", description="the column holding each row's prompt "
                               "(a string)")
    messages_column: str | None = Field(
        None, description="instead of prompt_column: a column of opening chat messages "
        "(ending with a user message), which makes the rows conversational")
    answer_column: str = Field("answer", description="the column library verifiers compare "
                               "with (optional where no verifier needs it)")
    tools_column: str = Field("tools", description="optional per-row column: a list of dotted "
                              "paths of tool functions the row's episode may call")
    metadata_columns: list[str] | None = Field(
        None, description="the columns passed to reward functions besides the answer (each "
        "required in every row); default: every column but the prompt")
    tools: list[str] = Field(default_factory=list, description="dotted paths "
                             "(package.module:function) of tools every row gets")
    system: str | None = Field(None, description="system prompt of string-prompt rows")
    sft_messages_column: str = Field("messages", description="the column of data.sft holding "
                                     "each conversation")


class RewardConfig(_Section):
    """One entry of `rewards:`: a library verifier by name or a TRL-style reward function."""

    verifier: str | None = Field(None, description="a library verifier comparing the "
                                 "extracted answer with the answer column: exact_match, "
                                 "normalized_match, numeric_match or regex_match")
    function: str | None = Field(None, description="dotted path of fn(prompts, completions, "
                                 "**columns) -> list[float | None] (TRL's reward_funcs)")
    name: str | None = Field(None, description="the check's name in Reward.checks and the "
                             "logs (default: the verifier's or the function's name)")
    weight: float = Field(1.0, description="the entry's value counts weight * value")
    gate: bool = Field(False, description="a necessary condition: the total is 0 unless this "
                       "entry's value is at least 1")
    extract: Literal["tagged", "answer_is", "text"] | None = Field(
        None, description="verifier only: how the answer is taken from the final turn: tagged "
        "(one final <answer>...</answer>, the default), answer_is ('The answer is X.'), text "
        "(the whole final answer)")

    @model_validator(mode="after")
    def _one_kind(self) -> RewardConfig:
        if (self.verifier is None) == (self.function is None):
            raise ValueError("set exactly one of verifier (a library check) or function (a "
                             "dotted path)")
        if self.verifier is not None:
            from tiller.envs.rewards import VERIFIERS

            _registered(self.verifier, VERIFIERS)
        elif self.extract is not None:
            raise ValueError("extract applies to library verifiers only (a function gets the "
                             "whole completion)")
        return self


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
    engine: EngineConfig = EngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    observe: ObserveConfig = ObserveConfig()
    data: DataConfig = Field(default_factory=DataConfig,
                             description="data files: env dataset's rows, SFT conversations")
    rewards: list[RewardConfig] = Field(default_factory=list,
                                        description="env dataset: the reward entries")

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
        for name in ("min_level", "start"):
            level = getattr(c, name)
            if level is not None and level > self.env.difficulty:
                raise ConfigError(f"config field rl.curriculum.{name}: got {level}; expected "
                                  f"at most env.difficulty = {self.env.difficulty} (the "
                                  f"target, the highest level)")
        lowest = c.min_level or 1
        if c.enabled and c.mode == "difficulty" and lowest == self.env.difficulty:
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
