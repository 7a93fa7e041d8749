"""The Python API, `tiller.Trainer`, over the same config models as `tiller train`
(docs/datasets.md):

    tiller.Trainer.from_config("configs/calculator.yaml", rl={"steps": 5}, seed=1).train()
    tiller.Trainer(model={"build": {}}, data="train.jsonl", reward=my_reward,
                   tools=[my_tool], rl={"steps": 20}).train()

Overrides are keyword arguments named after the top-level config fields; a dict merges into
its section (nested dicts into subsections), anything else replaces the value. The result is
validated by `tiller.config.Config`, so a bad value is the same one-line ConfigError as on
the command line.

Callables (a reward function, a tool, an env class) need no dotted path here: an importable
one is written to the config as `package.module:name`; any other (a lambda, a local function,
one defined in `__main__` or a notebook) is held in this process (`errors.hold_callable`), and
a config.yaml saved from such a run cannot be replayed from the CLI: it names the callable
`<in-process>:...`, which the CLI refuses with one line.

Nothing here imports torch until a run starts (`import tiller` stays fast).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiller.errors import ConfigError, hold_callable

if TYPE_CHECKING:
    from tiller.config import Config

    ConfigLike = str | Path | dict[str, Any] | Config


def dotted_name(fn: Callable[..., Any]) -> str:
    """`module:name` when importing it gives `fn` back, else a name held in this process."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and name.isidentifier():
        try:
            if getattr(importlib.import_module(module), name, None) is fn:
                return f"{module}:{name}"
        except Exception:  # not importable by name (e.g. a module built in memory): hold it
            pass
    return hold_callable(fn)


def _as_dict(config: ConfigLike) -> dict[str, Any]:
    from tiller.config import Config, HttpEngineConfig, load_config

    if isinstance(config, dict):
        return copy.deepcopy(config)
    cfg = config if isinstance(config, Config) else load_config(config)
    data = cfg.model_dump()
    # dumps hide the key; the run needs it
    if isinstance(cfg.engine, HttpEngineConfig) and cfg.engine.api_key is not None:
        data["engine"]["api_key"] = cfg.engine.api_key.get_secret_value()
    return data


def build_config(config: ConfigLike, overrides: dict[str, Any]) -> Config:
    """`config` (a YAML path, a dict or a Config) with `overrides` merged in, validated."""
    from pydantic import ValidationError

    from tiller.config import Config
    from tiller.config.base import merge
    from tiller.config.root import first_error

    try:
        return Config.model_validate(merge(_as_dict(config), overrides))
    except ValidationError as e:
        raise ConfigError(first_error(e)) from e


def _reward_entry(r: Any) -> dict[str, Any]:
    from tiller.envs.rewards import VERIFIERS

    if callable(r):
        return {"function": dotted_name(r)}
    if isinstance(r, str):
        return {"verifier": r} if r in VERIFIERS else {"function": r}
    if isinstance(r, dict):
        fn = r.get("function")
        return {**r, "function": dotted_name(fn)} if callable(fn) else dict(r)
    raise ConfigError(f"tiller.Trainer(reward=...): got {type(r).__name__}; expected a function, "
                      "a verifier name, a dotted path or a rewards entry dict")


def _env_name(env: Any) -> str:
    """An env class is registered by its name (this process), a string is taken as it is."""
    from tiller.envs import ENVS, Env, register_env

    if isinstance(env, str):
        return env
    if inspect.isclass(env) and issubclass(env, Env):
        if ENVS.get(env.name, env) is not env:
            raise ConfigError(f"tiller.Trainer(env=...): env name {env.name!r} is already "
                              f"registered for {ENVS[env.name].__qualname__}; give the class "
                              "another `name`")
        register_env(env)
        return env.name
    raise ConfigError(f"tiller.Trainer(env=...): got {type(env).__name__}; expected an env "
                      "name or an Env subclass")


class Trainer:
    """A run built from keyword arguments, or from a config with overrides (`from_config`);
    `train()` runs it. `config` is the validated `Config`.

    model: a local checkpoint path, or a `model` section dict ({"build": {...}}).
    env: an env name, an Env subclass (registered by its `name` in this process) or an `env`
        section dict; the name defaults to `dataset` when `data` is given.
    data: the train file (str or Path), or a `data` section dict.
    tools: tool functions (or dotted paths): every dataset row gets them (`data.tools`), any
        other env adds them to its own (`env.tools.functions`).
    reward: one or a list of reward functions, verifier names, dotted paths or `rewards` entry
        dicts (`weight`, `gate`, `name`).
    config: any other top-level config field, e.g. rl={"steps": 20}, sft={"enabled": False}.
    """

    def __init__(self, model: str | Path | dict[str, Any], env: Any = None, *,
                 data: str | Path | dict[str, Any] | None = None,
                 tools: Sequence[Callable[..., Any] | str] = (), reward: Any = None,
                 output_dir: str | Path | None = None, **config: Any):
        tree: dict[str, Any] = copy.deepcopy(config)
        tree["model"] = dict(model) if isinstance(model, dict) else {"path": str(model)}
        section = dict(env) if isinstance(env, dict) else {} if env is None else {
            "name": _env_name(env)}
        if "name" not in section and data is not None:
            section["name"] = "dataset"
        if section:
            tree["env"] = section
        names = [t if isinstance(t, str) else dotted_name(t) for t in tools]
        if names and tree.get("env", {}).get("name", "calculator") != "dataset":
            # another env's extra tools: env.tools.functions (a dataset's are per row)
            env = tree.setdefault("env", {})
            env["tools"] = {**(env.get("tools") or {}), "functions": names}
            names = []
        section = dict(tree.get("data", {}))
        if data is not None:
            section.update(data if isinstance(data, dict) else {"train": str(data)})
        if names:
            section["tools"] = names
        if section:
            tree["data"] = section
        if reward is not None:
            many = reward if isinstance(reward, (list, tuple)) else [reward]
            tree["rewards"] = [_reward_entry(r) for r in many]
        self.config = build_config(tree, {})
        self.output_dir = output_dir

    @classmethod
    def from_config(cls, config: ConfigLike, /, output_dir: str | Path | None = None,
                    **overrides: Any) -> Trainer:
        """The run of `config` (a YAML path, a dict or a Config) with `overrides` merged in,
        validated exactly as `tiller train` validates it."""
        trainer = cls.__new__(cls)
        trainer.config, trainer.output_dir = build_config(config, overrides), output_dir
        return trainer

    def train(self) -> dict[str, Any]:
        """The whole pipeline (`tiller train`), a fresh run: an `output_dir` that holds a
        run's record already is refused in one line; returns the run summary (also written to
        the run folder's summary.json)."""
        from tiller import controller

        return controller.train(self.config, self.output_dir)
