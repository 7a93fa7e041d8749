"""Name -> function registries, so the config chooses an algorithm by name.

Adding an estimator or a loss is one function and one decorator that declares the config knobs
it reads (dotted paths into `AlgorithmConfig`; the keyword is the last part of the path) and,
where the caller offers a choice of data, the inputs it takes:

    @POLICY_LOSSES.register("my_loss", knobs=("eps_high",))
    def my_loss(logp, logp_old, advantages, mask, eps_high=0.2): ...

    @ADVANTAGES.register("my_estimator", inputs=("rewards", "group_index"))
    def my_estimator(rewards, group_index): ...

The declarations drive two things: callers pass exactly the declared knobs and inputs
(`knob_values`, `call`), and a knob the chosen entry does not declare is an ignored-knob error in
the config (`resolve`, which `config.AlgorithmConfig` calls). Functions take no `**_`, so a
misspelled keyword is a TypeError, not a silent no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Registry(dict[str, Callable[..., Any]]):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.knobs: dict[str, tuple[str, ...]] = {}  # name -> the config knobs it reads
        self.inputs: dict[str, tuple[str, ...]] = {}  # name -> the data it takes by keyword

    def register(
        self, name: str, knobs: tuple[str, ...] = (), inputs: tuple[str, ...] = ()
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self[name] = fn
            self.knobs[name] = knobs
            self.inputs[name] = inputs
            return fn

        return add

    def call(self, name: str, config: Any, /, **available: Any) -> Any:
        """Call entry `name` with exactly its declared inputs, picked from `available`, and its
        declared knobs, read from `config`. A declared input that is missing or None is a
        ValueError naming it (e.g. `gae` without the critic's values)."""
        self.declared(name)
        missing = [k for k in self.inputs[name] if available.get(k) is None]
        if missing:
            raise ValueError(f"{self.kind} {name!r} needs {', '.join(missing)}")
        inputs = {k: available[k] for k in self.inputs[name]}
        return self[name](**inputs, **self.knob_values(name, config))

    def knob_values(self, name: str, config: Any) -> dict[str, Any]:
        """The keyword arguments of entry `name`: each declared knob's value in `config`
        (dotted paths walk sub-sections), keyed by the path's last part."""
        out = {}
        for knob in self.declared(name):
            value = config
            for part in knob.split("."):
                value = getattr(value, part)
            out[knob.rsplit(".", 1)[-1]] = value
        return out

    def declares(self, name: str, knob: str) -> bool:
        """Whether entry `name` reads `knob` or a knob inside the section `knob`."""
        return any(k == knob or k.startswith(f"{knob}.") for k in self.declared(name))

    def declared(self, name: str) -> tuple[str, ...]:
        """The knobs entry `name` reads (an unknown name is a KeyError listing the known ones)."""
        if name not in self:
            self.__missing__(name)
        return self.knobs[name]

    def __missing__(self, name: str) -> Callable[..., Any]:
        raise KeyError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(sorted(self))}")


ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
KL_ESTIMATORS = Registry("KL estimator")
AGGREGATIONS = Registry("loss aggregation")
OFF_POLICY = Registry("off-policy correction")
