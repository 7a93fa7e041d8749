"""A run folder's config.yaml is data: what it may not ask for unless the user trusts it.

A run folder may come from a shared runs directory or a download, so whoever wrote its
`config.yaml` is not the user. `tiller train CONFIG` and `tiller eval CONFIG` use the file the
user names as it is; `tiller eval RUN_DIR` reads the folder's own config, and refuses, in one
line naming the field, each setting below unless the user passes `--trust-run-config`:

- code to import: a dotted path in `env.name` (a name neither registered nor an installed
  entry point), `env.tools.functions`, `agent.loop` (other than tiller's), `agent.program`,
  `rl.algorithm.credit.key_steps`, `rl.judge.fn`, `data.tools`, `rewards[].function`; a
  dotted path met later (a data row's tools column) is refused when it is read;
- model-written code run unsandboxed: `env.tools.sandbox.allow_unsafe_fallback`;
- commands started and servers the policy's calls go to: `env.tools.mcp`, `env.openenv`;
- files written outside the command's output folder: `env.tools.replay.path` (absolute or
  with `..`) and `engine.weights_dir`;
- the checkpoint, the prompts and the TILLER_API_KEY sent to other machines: `engine.urls`.

Overrides on the command line are the user's own: a field they set is not refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tiller.config import DEFAULT_LOOP, Config, FnJudgeConfig, HttpEngineConfig, VllmEngineConfig
from tiller.envs import ENVS
from tiller.errors import ConfigError, refusing_imports
from tiller.plugins import env_entry_points

FLAG = "--trust-run-config"
CODE = "names code to import"


def _names_code(env_name: str) -> bool:
    """`env.name` is a dotted path, not a registered env or an installed entry point."""
    return (":" in env_name or "." in env_name) and env_name not in ENVS \
        and env_name not in env_entry_points()


def _outside(path: str) -> bool:
    return Path(path).is_absolute() or ".." in Path(path).parts


def run_config_requests(cfg: Config) -> list[tuple[str, Any, str]]:
    """(field, value, what it asks for) of every setting above that `cfg` holds."""
    found: list[tuple[str, Any, str]] = [
        (field, value, CODE) for field, value in (
            ("env.name", cfg.env.name if _names_code(cfg.env.name) else None),
            ("env.tools.functions", cfg.env.tools.functions),
            ("agent.loop", cfg.agent.loop if cfg.agent.loop != DEFAULT_LOOP else None),
            ("agent.program", cfg.agent.program),
            ("rl.algorithm.credit.key_steps", cfg.rl.algorithm.credit.key_steps),
            ("rl.judge.fn", cfg.rl.judge.fn if isinstance(cfg.rl.judge, FnJudgeConfig) else None),
            ("data.tools", cfg.data.tools),
            ("rewards", [r.function for r in cfg.rewards if r.function is not None]),
        ) if value]
    if cfg.env.tools.mcp:
        found.append(("env.tools.mcp", [s.command or s.url for s in cfg.env.tools.mcp],
                      "starts those commands and sends the policy's tool calls to those "
                      "servers"))
    if cfg.env.openenv is not None:
        found.append(("env.openenv", cfg.env.openenv.command or cfg.env.openenv.url,
                      "starts that command or sends the policy's actions to that server"))
    if cfg.env.tools.sandbox.allow_unsafe_fallback:
        found.append(("env.tools.sandbox.allow_unsafe_fallback", True,
                      "runs model-written code unsandboxed when bubblewrap does not work"))
    replay = cfg.env.tools.replay
    if replay is not None and _outside(replay.path):
        found.append(("env.tools.replay.path", replay.path, "writes outside the output folder"))
    engine = cfg.engine
    if isinstance(engine, HttpEngineConfig):
        if engine.weights_dir is not None:
            found.append(("engine.weights_dir", engine.weights_dir,
                          "writes outside the output folder"))
        if engine.urls:  # none: engine.servers, `tiller serve` on loopback, started by tiller
            found.append(("engine.urls", engine.urls, "sends the checkpoint, the prompts and "
                          "TILLER_API_KEY to those servers"))
    if isinstance(engine, VllmEngineConfig):
        if engine.weights_dir is not None:
            found.append(("engine.weights_dir", engine.weights_dir,
                          "writes outside the output folder"))
        if engine.urls:
            found.append(("engine.urls", engine.urls, "sends the prompts to those servers"))
        elif engine.python is not None or engine.extra_args:
            found.append(("engine.python", [engine.python, *engine.extra_args],
                          "starts that program"))
    return found


@contextmanager
def untrusted_run_config(cfg: Config, path: str | Path, overrides: Sequence[str] = ()
                         ) -> Iterator[None]:
    """Refuse (one ConfigError line) the first setting of `cfg`, read from the run folder's
    `path`, that `run_config_requests` lists and the `overrides` do not set; then, while the
    block runs, refuse every dotted path imported (`refusing_imports`)."""
    ours = [o.partition("=")[0].strip() for o in overrides]
    why = (f"{path} is a run folder's config, read as data: it may not ask for that; pass "
           f"{FLAG} if you trust whoever wrote it")
    for field, value, what in run_config_requests(cfg):
        if not any(field == k or field.startswith(f"{k}.") for k in ours):
            raise ConfigError(f"config field {field}: got {value!r}, which {what}; {why}")
    with refusing_imports(f"it names code to import; {why}"):
        yield
