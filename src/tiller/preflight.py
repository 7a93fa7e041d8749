"""Every check a run makes at start-up, so a config that cannot work stops with one line
(ConfigError) before the work it would waste. `tiller.run.Run` calls them in this order:

1. `check_run(cfg)`, before anything is built: the env class and whether it takes data.* and
   rewards, its rows, an SFT source, data.sft's conversations, the logging backends, every task
   list against the env's task space (and the curriculum's levels), then the code the config
   names (agent loop or program, key steps, judge function, judge model folder). An off-policy
   correction that cannot see top-k/top-p truncation is warned about.
2. `check_tools(env_cls, tools)`, once the tool stack is open (a bad replay path, the
   sandbox policy and the MCP servers' start are the stack's own checks): the env's tools
   against the stack's; then the env's own server (`Env.start`: openenv), before any work.
3. `check_model(cfg, tokenizer, model, limits)`, once the model is loaded: the chat template
   round trip and the context (`check_rollout_setup`), and model.dropout.
4. The engine's first weights, checked like every later sync's (`WeightSync.check_parity`).

Beside them: `check_report` (train's logging.report) and `check_evaluable` (`tiller eval`).
The engine's own checks (an HTTP engine's servers), the trace file's schema and `tiller serve`'s
options are made where those are opened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tiller.config import Config, FnJudgeConfig, ModelJudgeConfig
from tiller.envs import Env, Task
from tiller.envs.dataset import Conversation, DatasetEnv, read_conversations
from tiller.errors import ConfigError, require_package
from tiller.gateway.program import load_program
from tiller.models import dropout_rates
from tiller.observe.metrics import check_backends
from tiller.plugins import check_env_tools, env_label, load_env_class
from tiller.rollout.agent_loop import EpisodeLimits, check_rollout_setup, load_episode_fn
from tiller.rollout.curriculum import check_curriculum
from tiller.tools.stack import ToolStack
from tiller.train.judges import check_judge_model
from tiller.train.lora import require_peft
from tiller.train.shaping import JudgeFn, KeyStepFn, load_judge, load_key_steps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checked:
    """What `check_run` loaded while checking: the configured env class, data.sft's
    conversations and the code the config names (each None when not named)."""

    env_cls: type[Env]
    sft_conversations: list[Conversation]
    episode_fn: Callable[..., Any]
    program: Callable[..., Any] | None
    key_steps: KeyStepFn | None
    judge: JudgeFn | None  # rl.judge.fn; rl.judge.model loads with the models


def check_run(cfg: Config) -> Checked:
    """Every check that needs only the config, in the order a run makes them."""
    env_cls = get_env(cfg.env.name)
    check_env_data(cfg, env_cls)
    env_cls = env_cls.configure(cfg)  # a dataset env reads its rows
    check_sft_source(cfg, env_cls)
    # every row checked now, before any work
    conversations = read_conversations(cfg.data) if cfg.data.sft else []
    check_backends(cfg.logging.tensorboard, cfg.logging.wandb)
    if cfg.model.lora is not None:
        require_peft()
    check_task_counts(cfg, env_cls)
    warn_blind_correction(cfg)
    episode_fn = load_episode_fn(cfg.agent.loop)
    program = load_program(cfg.agent.program) if cfg.agent.program else None
    key_steps = load_key_steps(cfg.rl.algorithm.credit.key_steps)
    judge = cfg.rl.judge  # rl.judge.model loads with the models
    judge_fn = load_judge(judge.fn) if isinstance(judge, FnJudgeConfig) else None
    if isinstance(judge, ModelJudgeConfig):
        check_judge_model(judge.model)
    return Checked(env_cls, conversations, episode_fn, program, key_steps, judge_fn)


def check_tools(env_cls: type[Env], tools: ToolStack) -> None:
    """The env's tools against the tool stack's functions and its MCP servers' tools
    (`plugins.check_env_tools`)."""
    check_env_tools(env_cls, tools.functions)
    check_env_tools(env_cls, tools.mcp_tools, "env.tools.mcp")


def check_model(cfg: Config, tokenizer: Any, model: Any, limits: EpisodeLimits) -> None:
    """The loaded model and tokenizer can run the config's episodes (`check_rollout_setup`),
    and model.dropout=keep has dropout to keep (the model's, or model.lora.dropout)."""
    check_rollout_setup(tokenizer, model.config, limits)
    lora_dropout = cfg.model.lora is not None and cfg.model.lora.dropout > 0
    if cfg.model.dropout == "keep" and not dropout_rates(model) and not lora_dropout:
        raise ConfigError("config field model.dropout: got 'keep'; this model has no "
                          "dropout (no dropout module or attention_dropout above 0), so "
                          "there is nothing to keep: remove it")


def check_report(cfg: Config) -> None:
    """logging.report needs matplotlib: checked before any work, so a report that cannot be
    written is one line now rather than a missing file at the end."""
    if cfg.logging.report:
        require_package("matplotlib", "report", "logging.report=true",
                        instead="set logging.report=false")


def check_evaluable(cfg: Config) -> None:
    """`tiller eval` needs a set to evaluate."""
    no_eval = heldout_disabled(cfg, get_env(cfg.env.name).configure(cfg))
    if no_eval:
        raise ConfigError(f"tiller eval has nothing to evaluate: {no_eval}")


def get_env(name: str) -> type[Env]:
    """The env class of `env.name`: registered, an installed entry point or a dotted path
    (`tiller.plugins`)."""
    return load_env_class(name)


def check_env_data(cfg: Config, env_cls: type[Env]) -> None:
    """data.* and rewards go to the dataset env, or to a plug-in env that subclasses it (the
    config cannot tell before the plug-in is imported)."""
    given = cfg.data.train is not None or bool(cfg.rewards)
    if given and not issubclass(env_cls, DatasetEnv):
        raise ConfigError(f"config field data.train: env {cfg.env.name} is not the dataset env "
                          "or a subclass of it (tiller.envs.dataset.DatasetEnv), so it cannot "
                          "take data.* or rewards; its own verifier scores its episodes")


def heldout_disabled(cfg: Config, env_cls: type[Env]) -> str | None:
    """Why the run has no held-out evaluation (eval.enabled false, or an env without a
    heldout split: not in `Env.splits`, or a `task_space` of 0), or None when it has one."""
    if not cfg.eval.enabled:
        return "eval.enabled is false"
    if "heldout" not in env_cls.splits:
        return f"env {env_label(env_cls)} has no heldout split (splits: {env_cls.splits})"
    if env_cls.task_space("heldout", cfg.env.difficulty) == 0:
        return (f"env {env_label(env_cls)} has no heldout tasks at "
                f"env.difficulty={cfg.env.difficulty}")
    return None


def rl_task_count(cfg: Config) -> int:
    """Train tasks RL draws: dynamic sampling may take up to max_rounds times a plain run's."""
    alg = cfg.rl.algorithm
    rounds = (alg.dynamic_sampling.max_rounds or 1) if alg.dynamic_sampling.enabled else 1
    return max(cfg.rl.steps * cfg.rl.tasks_per_step * rounds, 1)


def rl_task_reserve(cfg: Config) -> int:
    """Train tasks RL may draw: `rl_task_count`, twice that in async (the reserve)."""
    return rl_task_count(cfg) * (2 if cfg.rl.mode == "async" else 1)


def rl_train_tasks(cfg: Config, env_cls: type[Env]) -> Iterator[Task]:
    """The train tasks RL samples (without a curriculum): the same `rl_task_count` tasks in
    every mode; async goes on with a reserve as large, drawn only if needed (groups filtered
    as stale give their place to new ones)."""
    n, d = rl_task_count(cfg), cfg.env.difficulty
    yield from env_cls.make_tasks("train", n, cfg.seed + 3, d)
    if cfg.rl.mode == "async":
        yield from env_cls.make_tasks("train", n, cfg.seed + 5, d)  # 4 is the tool gate's


def check_task_counts(cfg: Config, env_cls: type[Env]) -> None:
    """Every task list the run will draw fits the env's task space, checked before any work:
    drawing more distinct tasks than exist would otherwise fail only after the model build."""
    d = cfg.env.difficulty
    no_eval = heldout_disabled(cfg, env_cls)
    wants = [("eval.tasks", "heldout", cfg.eval.tasks)] if cfg.eval.sets is None else []
    for s in cfg.eval.resolved_sets(d) if cfg.eval.sets is not None else []:
        if s.split not in env_cls.eval_splits:
            raise ConfigError(f"config field eval.sets ({s.name}).split: got {s.split!r}; env "
                              f"{env_cls.name} offers: {', '.join(env_cls.eval_splits)}")
        space = env_cls.task_space(s.split, s.difficulty)
        if space is not None and s.tasks > space:
            raise ConfigError(f"config field eval.sets ({s.name}).tasks: got {s.tasks}; env "
                              f"{env_cls.name} has only {space} {s.split} tasks at "
                              f"difficulty {s.difficulty}")
    if no_eval:
        wants = []
    if cfg.model.build is not None:
        wants.append(("model.build.corpus_tasks", "train", cfg.model.build.corpus_tasks))
    wants = [(*w, "env.difficulty", d) for w in wants]
    if cfg.sft.enabled and cfg.data.sft is None:
        sft_d = cfg.sft.difficulty or d
        wants.append(("sft.tasks", "train", cfg.sft.tasks,
                      "sft.difficulty" if cfg.sft.difficulty else "env.difficulty", sft_d))
    if cfg.rl.steps > 0:
        wants.append(("rl.steps × rl.tasks_per_step", "train", rl_task_count(cfg),
                      "env.difficulty", d))
    for field, split, n, d_field, diff in wants:
        space = None if env_cls.repeats_tasks else env_cls.task_space(split, diff)
        if space is not None and n > space:
            raise ConfigError(f"config field {field}: got {n}; env {env_label(env_cls)} has only "
                              f"{space} {split} tasks at {d_field}={diff}: ask for at most "
                              f"{space} or pick an {d_field} with more")
    check_curriculum(cfg, env_cls, rl_task_reserve(cfg))


def check_sft_source(cfg: Config, env_cls: type[Env]) -> None:
    """SFT needs demonstrations: the env's scripted expert or the conversations of data.sft."""
    if cfg.sft.enabled and cfg.data.sft is None and not env_cls.has_expert:
        raise ConfigError(f"config field sft.enabled: env {cfg.env.name} has no scripted "
                          "expert to demonstrate; give SFT conversations in data.sft (a "
                          "messages JSONL), or set sft.enabled=false")


def warn_blind_correction(cfg: Config) -> None:
    """One warning when RL trains with top-k / top-p truncation, untruncated logprobs and an
    off-policy correction: the behaviour logprob it divides by is not the probability the
    token was drawn with (lower by the log of the kept mass), so its weights stay near 1 on
    off-policy data."""
    s, alg = cfg.sampling, cfg.rl.algorithm
    if cfg.rl.steps and s.truncates and s.logprobs == "untruncated" and alg.off_policy != "none":
        log.warning("sampling.logprobs is untruncated with top_k %d / top_p %g: off_policy %s "
                    "cannot see the truncation (its behaviour logprob is not the one tokens "
                    "were drawn with); use sampling.logprobs: sampled where the engine reports "
                    "it (tiller's engines do)", s.top_k, s.top_p, alg.off_policy)
