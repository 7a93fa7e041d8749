"""Plug-ins: environments, tools and hooks from packages outside tiller, named in the config.

`env.name` is looked up in three places, in order:

1. tiller's own registry (`ENVS`: `@register_env` classes, e.g. "calculator");
2. the `tiller.envs` entry-point group of the installed distributions, loaded only when asked
   for (a package declares `[project.entry-points."tiller.envs"] my_env = "mypkg.envs:MyEnv"`);
3. a dotted path `package.module:Class` (or `package.module.Class`).

Whatever is found must be a concrete `Env` subclass. Every way this can fail (unknown name,
unimportable module, an error while importing it, not an Env, abstract methods left) is one
ConfigError line naming `env.name`. Tool functions (`env.tools.functions`) are resolved by
`tiller.tools.registry.load_tools`; agent loops and key-step hooks by `import_dotted`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points

from tiller.envs.base import ENVS, Env, ToolEnv
from tiller.errors import ConfigError, import_dotted, one_line, require_package
from tiller.tools.registry import Tool

ENTRY_POINT_GROUP = "tiller.envs"
FIELD = "config field env.name"


def env_entry_points() -> dict[str, list[EntryPoint]]:
    """The installed distributions' `tiller.envs` entry points by name (not loaded)."""
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.value not in [e.value for e in found.get(ep.name, [])]:  # one dist seen twice
            found.setdefault(ep.name, []).append(ep)
    return found


def load_env_class(name: str) -> type[Env]:
    """The Env class `env.name` names: registered, an entry point, or a dotted path; its
    optional packages (`Env.requires`) checked."""
    if name in ENVS:
        cls = ENVS[name]
    elif name in (installed := env_entry_points()):
        cls = _load_entry_point(name, installed[name])
    elif ":" in name or "." in name:
        cls = import_dotted(name, "env.name")
    else:
        known = sorted({*ENVS, *installed})
        raise ConfigError(f"{FIELD}: unknown env {name!r}; choose one of: {', '.join(known)} "
                          f"(registered or installed under the {ENTRY_POINT_GROUP!r} entry "
                          "point), or give a dotted path package.module:Class")
    check_env_class(cls, name)
    for module, extra in cls.requires.items():
        require_package(module, extra, f"env.name={name}")
    return cls


def _load_entry_point(name: str, eps: list[EntryPoint]) -> type[Env]:
    if len(eps) > 1:
        raise ConfigError(f"{FIELD}: got {name!r}; {len(eps)} installed packages register an "
                          f"env of that name ({', '.join(e.value for e in eps)}): give the "
                          "dotted path of the one you mean instead")
    try:
        return eps[0].load()
    except Exception as e:  # the package's module may fail in any way while importing
        raise ConfigError(f"{FIELD}: got {name!r}; its entry point {eps[0].value!r} (group "
                          f"{ENTRY_POINT_GROUP!r}) cannot be loaded: {one_line(e)}") from e


def check_env_class(cls: object, name: str) -> None:
    """A usable env: an `Env` subclass with every abstract method implemented."""
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        what = cls.__name__ if isinstance(cls, type) else type(cls).__name__
        kind = "a class" if isinstance(cls, type) else "an object of type"
        raise ConfigError(f"{FIELD}: got {name!r}; it is {kind} {what}, not a subclass of "
                          "tiller.envs.Env")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ConfigError(f"{FIELD}: got {name!r}; {cls.__name__} leaves abstract methods of "
                          f"Env unimplemented: {missing}")


def env_label(cls: type[Env]) -> str:
    """The env's registered `name`, or its dotted path when a plug-in did not set one."""
    return getattr(cls, "name", None) or f"{cls.__module__}:{cls.__qualname__}"


def check_env_tools(cls: type[Env], tools: Sequence[Tool],
                    field: str = "env.tools.functions") -> None:
    """`env.tools.functions` (or the MCP tools, `field`) join a `ToolEnv`'s own tools; any
    other env cannot take them, and a name the env's own tools already use is a clash, not an
    override."""
    if not tools:
        return
    field = f"config field {field}"
    if not issubclass(cls, ToolEnv):
        raise ConfigError(f"{field}: env {env_label(cls)} is not a ToolEnv (its actions are "
                          "not tool calls), so it cannot take tools; remove them")
    own = set(cls().registry.tools)  # a bare instance: its tools, no run stack
    clash = sorted(own & {t.name for t in tools})
    if clash:
        raise ConfigError(f"{field}: tool name(s) {', '.join(clash)} are already tools of env "
                          f"{env_label(cls)}; rename yours (@tool(name=...))")
