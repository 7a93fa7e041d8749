"""Name -> function registries, so the config chooses an algorithm by name.

Adding an estimator or a loss is one function and one decorator:

    @ADVANTAGES.register("my_estimator")
    def my_estimator(rewards, group_index, eps=1e-6): ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Registry(dict[str, Callable[..., Any]]):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self[name] = fn
            return fn

        return add

    def __missing__(self, name: str) -> Callable[..., Any]:
        raise KeyError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self))}")


ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
KL_ESTIMATORS = Registry("KL estimator")
AGGREGATIONS = Registry("loss aggregation")
