"""The curriculum (`rl.curriculum`): which train tasks RL draws, one type per mode."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tiller.config.base import Variant, tagged
from tiller.errors import ConfigError


class CurriculumConfig(Variant):
    """Which train tasks RL draws, kept in a success band (docs/curriculum.md): `difficulty`
    moves the env.difficulty the tasks are made at toward the level whose running success
    estimate is inside the band; `filter` draws tasks from a fixed pool at env.difficulty
    and skips those whose own estimate is outside it. Held-out eval stays at env.difficulty.
    The keys every mode has; `DifficultyCurriculumConfig` and `FilterCurriculumConfig` add
    their own."""

    enabled: bool = Field(False, description="draw RL tasks through the curriculum; false: "
                          "every RL task is made at env.difficulty")
    band: tuple[float, float] = Field(
        (0.3, 0.7), description="[low, high] success rate a task (or level) should have: "
        "above high it is too easy, below low too hard, to teach much")
    window: int = Field(8, ge=1, description="the running estimate is the mean success over "
                        "the last `window` finished groups of the level (or task)")
    min_groups: int = Field(
        2, ge=1, description="difficulty: groups finished at the current level since it was "
        "entered before it may move again; filter: groups of a task before it may be skipped")

    @model_validator(mode="after")
    def _valid(self) -> CurriculumConfig:
        low, high = self.band
        if not 0.0 <= low < high <= 1.0:
            raise ConfigError(f"config field rl.curriculum.band: got {list(self.band)}; "
                              "expected [low, high] with 0 <= low < high <= 1")
        if self.min_groups > self.window:  # an estimate never holds more than `window`
            raise ConfigError(f"config field rl.curriculum.min_groups: got {self.min_groups}; "
                              f"expected at most rl.curriculum.window = {self.window}")
        return self


MODE = ("difficulty: adapt the level tasks are made at; filter: skip pool tasks whose success "
        "estimate is outside the band")


class DifficultyCurriculumConfig(CurriculumConfig):
    """Tasks made at a level that moves between min_level and env.difficulty (the target)
    toward the one whose success estimate is inside the band."""

    mode: Literal["difficulty"] = Field("difficulty", description=MODE)
    min_level: int | None = Field(
        None, ge=1, le=10, description="the lowest level (default 1); the highest is "
        "env.difficulty, the target")
    start: int | None = Field(None, ge=1, le=10, description="the level the run starts at "
                              "(default min_level)")

    @model_validator(mode="after")
    def _starts_inside(self) -> DifficultyCurriculumConfig:
        if self.start is not None and self.start < (self.min_level or 1):
            raise ConfigError(f"config field rl.curriculum.start: got {self.start}; expected "
                              f"at least rl.curriculum.min_level = {self.min_level or 1}")
        return self


class FilterCurriculumConfig(CurriculumConfig):
    """Tasks from a fixed pool made at env.difficulty, drawn round-robin; a task whose success
    estimate is outside the band is skipped (counted)."""

    mode: Literal["filter"] = Field("filter", description=MODE)
    pool: int | None = Field(None, ge=1, description="train tasks in the pool, made at "
                             "env.difficulty and drawn round-robin (default 64)")
    max_skips: int | None = Field(
        None, ge=1, description="draws in a row a task may be skipped before it is drawn "
        "anyway, to re-estimate it under the current policy (default 4)")


# the type of `rl.curriculum`: chosen by rl.curriculum.mode (default difficulty)
AnyCurriculumConfig = tagged("rl.curriculum", "mode", DifficultyCurriculumConfig,
                             FilterCurriculumConfig)
