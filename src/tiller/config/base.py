"""The base of every config section, and helpers the sections share."""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
