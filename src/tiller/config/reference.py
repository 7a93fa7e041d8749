"""The configuration reference, docs/config.md: every key of a run's YAML file as a dotted path,
with its type, default, range or choices and description, generated from the models.

    python -m tiller.config.reference           # rewrite docs/config.md
    python -m tiller.config.reference --check   # exit 1, naming the file, if it is stale

tests/test_config_docs.py regenerates it and fails when the checked-in file differs, and fails
on any key without a description (`sections` walks every model a Config can hold).
"""

from __future__ import annotations

import inspect
import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from tiller.config.base import Variant
from tiller.config.root import Config

DOCS = Path("docs") / "config.md"
COMMAND = "PYTHONPATH=src python -m tiller.config.reference"


@dataclass(frozen=True)
class Table:
    """One section's keys: `path` is its dotted path ("" at the top level); `empty` is said
    when it has none."""

    title: str
    about: str
    path: str
    model: type[BaseModel]
    fields: list[tuple[str, FieldInfo]]
    empty: str = "No keys of its own."


def sections(model: type[BaseModel] = Config, path: str = "", about: str = "") -> Iterator[Table]:
    """The tables of `model` at `path`: its own keys, then each sub-section's, depth first; a
    section with one type per variant gives a table of the keys every variant has, one of
    each variant's own keys, then their sub-sections."""
    yield _table(model, path, f"`{path}`" if path else "top level", about, list(model.model_fields))
    yield from _subsections(model, path, list(model.model_fields))


def _table(model: type[BaseModel], path: str, title: str, about: str, names: list[str],
           empty: str = "No keys of its own.") -> Table:
    fields = [(n, model.model_fields[n]) for n in names]
    return Table(title, about, path, model, [(n, f) for n, f in fields
                                              if not _models(f.annotation)], empty)


def _subsections(model: type[BaseModel], path: str, names: list[str]) -> Iterator[Table]:
    for name in names:
        f = model.model_fields[name]
        inner = _models(f.annotation)
        key = _join(path, name) + _container(f.annotation)
        if len(inner) == 1:
            yield from sections(inner[0], key, f.description or "")
        elif inner:
            yield from _variants(inner, key, f.description or "")


def _variants(family: list[type[BaseModel]], key: str, about: str) -> Iterator[Table]:
    with_keys = [v for v in family if v.model_fields]
    first = with_keys[0].model_fields
    shared = [n for n in first if all(
        n in v.model_fields and v.model_fields[n].annotation == first[n].annotation
        for v in with_keys)]
    own = {v: [n for n in v.model_fields if n not in shared] for v in family}
    choices = ", ".join(_chosen_by(v) for v in family)
    holders = "every variant" if len(with_keys) == len(family) else " and ".join(
        _chosen_by(v) for v in with_keys)
    yield _table(with_keys[0], key, f"`{key}`", f"{about}. One type per variant ({choices}); "
                 f"the keys of {holders}:", shared, "None: each key belongs to variants, "
                 "below.")
    for v in family:
        yield _table(v, key, f"`{key}`, with {_chosen_by(v)}", _doc(v), own[v])
    yield from _subsections(with_keys[0], key, shared)
    for v in family:
        yield from _subsections(v, key, own[v])


def _chosen_by(v: type[BaseModel]) -> str:
    return v.chosen_by if issubclass(v, Variant) else v.__name__


def _doc(model: type[BaseModel]) -> str:
    return " ".join((inspect.getdoc(model) or "").split("\n\n")[0].split())


def _models(t: Any) -> list[type[BaseModel]]:
    """The models a field of type `t` holds (itself, optional, in a list or dict, variants)."""
    if isinstance(t, type) and issubclass(t, BaseModel):
        return [t]
    return [m for a in get_args(t) for m in _models(a)]


def _container(t: Any) -> str:
    """How the key of a section held in a list or dict continues: rewards[].verifier,
    env.tools.executor.tools.<name>.timeout_s."""
    args = [a for a in get_args(t) if a is not type(None)]
    origin = get_origin(args[0] if get_origin(t) in (Union, types.UnionType) else t)
    return "[]" if origin is list else ".<name>" if origin is dict else ""


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def type_name(t: Any) -> str:
    """A field's type as a reader writes it: int, list of str, int or null, choice."""
    origin, args = get_origin(t), get_args(t)
    if origin is Literal:
        return "choice"
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is tuple:
        return f"[{', '.join(type_name(a) for a in args)}]"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}"
    if t is SecretStr:
        return "str (secret)"
    return getattr(t, "__name__", str(t))


def allowed(f: FieldInfo) -> str:
    """The range or choices of a field: >= 1, > 0 and <= 1, "sync" | "async", length >= 1."""
    parts = [f"{op} {_show(getattr(m, attr))}" for m in f.metadata for cls, attr, op in (
        (at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<"))
        if isinstance(m, cls)]
    parts += [f"length >= {m.min_length}" for m in f.metadata if isinstance(m, at.MinLen)]
    choices = [a for t in [f.annotation, *get_args(f.annotation)] if get_origin(t) is Literal
               for a in get_args(t)]
    if choices:
        parts.insert(0, " \\| ".join(_show(c) for c in choices))
    return " and ".join(parts)


def default(f: FieldInfo) -> str:
    if f.is_required():
        return "required"
    value = f.get_default(call_default_factory=True)
    return _show(value.model_dump(mode="json") if isinstance(value, BaseModel) else value)


def _show(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def render() -> str:
    """docs/config.md."""
    lines = [
        "# Configuration reference", "",
        "> For anyone writing or reading a run's YAML: every key, its type, default, range and "
        "what it does.", "",
        "Every key of a run's YAML file, by section: its type, default, range or choices, and "
        "what it does. Keys are dotted paths (`rl.algorithm.kl.beta`); each can be set in the "
        "file or on the command line (`tiller train CONFIG rl.steps=50`). `tiller config show "
        "CONFIG [key=value ...]` prints a config with every default filled in, as a run "
        "resolves it.", "",
        "A section whose keys depend on a choice (`engine.backend`, `rl.mode`, "
        "`rl.curriculum.mode`, `rl.judge`) has one type per variant: its keys are listed once "
        "for every variant, then per variant. A key of another variant is an error naming "
        "the key, its value and the choice it applies with, unless its value says nothing: "
        "null, an empty list, or that key's default in a variant that has it. Such a key is "
        "dropped, so a run's config.yaml saved before a section was split into variants "
        "(it holds every key of the section) still loads. For example, with "
        "`engine.backend: http`, `engine.max_batch_size: 128` (the embedded default) is "
        "dropped and `engine.max_batch_size: 64` is an error. So a config whose YAML sets "
        "one variant's keys runs on another with those keys overridden to null: "
        "configs/smollm2_calculator.yaml sets two embedded-engine keys, and runs on vLLM "
        "with `engine.backend=vllm engine.max_batch_size=null engine.cache_bytes=null` "
        "(the error names the override).",
        "", f"Generated from the config models by `{COMMAND}`; do not edit it by hand (a test "
        "checks that it is current).", ""]
    for table in sections():
        lines += [f"## {table.title}", ""]
        if table.about:
            lines += [_cell(table.about), ""]
        if not table.fields:
            lines += [table.empty, ""]
            continue
        lines += ["| key | type | default | range / choices | description |",
                  "|---|---|---|---|---|"]
        lines += [f"| `{_join(table.path, n)}` | {_cell(type_name(f.annotation))} | "
                  f"`{_cell(default(f))}` | {allowed(f)} | {_cell(f.description or '')} |"
                  for n, f in table.fields]
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        if not DOCS.is_file() or DOCS.read_text() != text:
            print(f"{DOCS} is out of date: regenerate it with `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    DOCS.write_text(text)
    print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
