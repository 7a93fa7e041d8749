"""The base of every config section, the variants of a section whose keys depend on a choice,
and helpers the sections share."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Union, get_origin

from pydantic import BaseModel, ConfigDict, Discriminator, Tag, model_validator
from pydantic_core import PydanticCustomError

from tiller.errors import ConfigError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Variant(Section):
    """One variant of a section whose keys depend on a choice (`engine.backend`, `rl.mode`,
    `rl.curriculum.mode`, `rl.judge`): each variant is its own type holding only its own keys,
    and `variants` joins a family of them into the section's field type.

    A key of another variant of the family is a ConfigError naming the key, its value, the
    choice it applies with and how to drop it (`key=null`). Such a key left empty (null, []) or
    at that variant's default says nothing and is dropped: configs saved before the split hold
    every key of the section, and a config whose YAML sets one variant's keys runs on another
    with those keys overridden to null.

    The base a family shares (`RLConfig`, `EngineConfig`, ...) holds only the keys every
    variant has: given a variant's key in Python, it is a ConfigError naming the variant
    class to build instead."""

    where: ClassVar[str] = ""  # the section's dotted path, e.g. "engine"
    chosen_by: ClassVar[str] = ""  # how a user chooses this variant, e.g. "engine.backend: http"
    family: ClassVar[tuple[type[Variant], ...]] = ()

    @classmethod
    def now(cls) -> str:
        """What the config chose, said after an error (empty where the key names it)."""
        return f" ({cls.chosen_by.replace(': ', ' is ')})" if ": " in cls.chosen_by else ""

    @model_validator(mode="before")
    @classmethod
    def _keys_of_other_variants(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if cls not in cls.family:  # the family's base, built by hand
            _refuse_variant_keys(cls, data)
            return data
        kept = {}
        for key, value in data.items():
            owners = [] if key in cls.model_fields else [
                v for v in cls.family if key in v.model_fields]
            if not owners:  # its own key, or one no variant has (an extra-field error)
                kept[key] = value
            elif not _says_nothing(value, key, owners):
                raise ConfigError(f"config field {cls.where}.{key}: got {value!r}; it only "
                                  f"applies with {' or '.join(v.chosen_by for v in owners)}"
                                  f"{cls.now()}: leave it out, or drop it with "
                                  f"{cls.where}.{key}=null")
        return kept


def _refuse_variant_keys(base: type[Variant], data: dict[str, Any]) -> None:
    """A key of `data` that only variants below `base` have: a ConfigError naming the variant
    to build (the one the key's value chooses, for the key that chooses a variant)."""
    below, stack = [], list(base.__subclasses__())
    while stack:
        sub = stack.pop(0)
        below += [sub] if sub in sub.family else []
        stack += sub.__subclasses__()
    for key, value in data.items():
        owners = [v for v in below if key in v.model_fields and key not in base.model_fields]
        if not owners:
            continue
        chosen = [v for v in owners if get_origin(v.model_fields[key].annotation) is Literal
                  and v.model_fields[key].default == value]
        names = [f"{v.__name__}(...)" for v in chosen or owners]
        raise ConfigError(f"{base.__name__} has no field {key}; use "
                          f"{' or '.join(names)}, or load a YAML")


def _says_nothing(value: Any, key: str, owners: list[type[Variant]]) -> bool:
    return value is None or value == [] or any(
        value == v.model_fields[key].get_default(call_default_factory=True) for v in owners)


# every variant's tag: where a validation error's location holds one, it names the variant, not
# a key (`first_error` leaves it out)
TAGS: set[str] = set()


def variants(where: str, pick: Callable[[dict[str, Any]], type[Variant]],
             family: dict[str, type[Variant]]) -> Any:
    """The field type of section `where` with one type per variant: `family` maps how each is
    chosen ("engine.backend: http") to its type, `pick` chooses the type of a mapping."""
    for chosen_by, variant in family.items():
        variant.where, variant.chosen_by = where, chosen_by
        variant.family = tuple(family.values())
        TAGS.add(chosen_by)

    def tag(value: Any) -> str | None:
        variant = pick(value) if isinstance(value, dict) else type(value)
        return variant.chosen_by if variant in family.values() else None

    options = tuple(Annotated[v, Tag(chosen_by)] for chosen_by, v in family.items())
    return Annotated[Union[options], Discriminator(tag)]  # noqa: UP007 - a runtime tuple


def tagged(where: str, key: str, *family: type[Variant]) -> Any:
    """`variants` chosen by the value of `key` (a Literal field of each type, its default the
    value that chooses it); a mapping without `key` is the first type."""
    values = {v.model_fields[key].default: v for v in family}

    def pick(data: dict[str, Any]) -> type[Variant]:
        value = data.get(key, family[0].model_fields[key].default)
        if value not in values:
            raise ConfigError(f"config field {where}.{key}: got {value!r}; expected one of: "
                              f"{', '.join(values)}")
        return values[value]

    return variants(where, pick, {f"{where}.{key}: {value}": v for value, v in values.items()})


def registered(name: str, registry: Any) -> str:
    if name not in registry:
        raise PydanticCustomError(
            "unknown_name", "expected one of: {names}", {"names": ", ".join(sorted(registry))}
        )
    return name


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
