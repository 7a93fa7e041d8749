"""Errors a user can act on, each one line: what went wrong and what to change. This module
imports nothing from tiller, so every box can raise them without import cycles."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any


class ConfigError(Exception):
    """A configuration that cannot be used; the message says which field and why."""


class RunError(RuntimeError):
    """The run cannot learn (a broken engine, a step with nothing to train, no demonstrations):
    it stops with one line naming the cause instead of finishing without learning."""


IN_PROCESS = "<in-process>:"
_held: dict[str, Callable[..., Any]] = {}


def hold_callable(fn: Callable[..., Any]) -> str:
    """A name for `fn` that `import_dotted` resolves in this process only: for a callable
    passed in Python (tiller.Trainer) that has no importable dotted path (a lambda, a local
    function, one defined in __main__ or a notebook)."""
    name = f"{IN_PROCESS}{getattr(fn, '__qualname__', type(fn).__name__)}#{id(fn):x}"
    _held[name] = fn
    return name


class RunFolderError(Exception):
    """A run folder that `tiller report` or `tiller view` cannot read (missing, or a malformed
    file): the message names the file and, for a bad line, its number."""


_refused: str | None = None  # why import_dotted refuses every path now (None: it imports)


@contextmanager
def refusing_imports(why: str) -> Iterator[None]:
    """While the block runs, `import_dotted` refuses every path, in one line ending with
    `why` (a run folder's config is data: `tiller.trust`)."""
    global _refused
    before, _refused = _refused, why
    try:
        yield
    finally:
        _refused = before


def import_dotted(path: str, field: str) -> Callable[..., Any]:
    """The callable at `package.module:name` (or `package.module.name`) that config `field`
    names; a one-line ConfigError when it cannot be imported (whatever the import raised: a
    syntax error in the user's module too) or is not callable, or while `refusing_imports`."""
    if _refused is not None:
        raise ConfigError(f"config field {field}: got {path!r}; {_refused}")
    if path.startswith(IN_PROCESS):
        if path not in _held:
            raise ConfigError(f"config field {field}: got {path!r}, a callable that was passed "
                              "in Python to another process; a config to replay from the CLI "
                              "needs an importable package.module:function")
        return _held[path]
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name:
        raise ConfigError(f"config field {field}: got {path!r}; expected a dotted path "
                          "package.module:name")
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # the user's module may fail in any way while importing
        raise ConfigError(f"config field {field}: got {path!r}; cannot import it: "
                          f"{one_line(e)}") from e
    if not callable(fn):
        raise ConfigError(f"config field {field}: got {path!r}; expected a callable")
    return fn


def one_line(e: BaseException) -> str:
    """`Type: message` of an exception on one line (a user's error may span several)."""
    return " ".join(f"{type(e).__name__}: {e}".split())


def require_package(module: str, extra: str, needed_for: str, instead: str = "") -> ModuleType:
    """Import an optional package, or stop with one line naming the pip extra that installs it
    (`instead`: another way out, e.g. "set logging.wandb=false")."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        alternative = f" (or {instead})" if instead else ""
        raise ConfigError(f"{needed_for} needs the {module!r} package, which is not installed: "
                          f"pip install 'tiller[{extra}]'{alternative}") from e


class ModelLoadError(Exception):
    """A model or tokenizer path that cannot be loaded; the message says what to fix."""
