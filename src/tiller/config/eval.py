"""Evaluation: the sets, seeds and pass@k every evaluation runs."""

from __future__ import annotations

from pydantic import Field, model_validator

from tiller.config.base import Section
from tiller.errors import ConfigError


class EvalSetConfig(Section):
    """One named evaluation set: `tasks` tasks of an evaluation split at a difficulty."""

    name: str = Field(description="the set's name in the summary and in eval/<label>.jsonl "
                                  "(e.g. heldout, ood_difficulty, ood_templates)")
    split: str = Field("heldout", description="heldout, or an out-of-distribution split the "
                                              "env offers (e.g. calculator's ood_templates)")
    tasks: int | None = Field(None, ge=1, description="tasks in the set (default eval.tasks)")
    difficulty: int | None = Field(None, ge=1, le=10,
                                   description="default env.difficulty; higher = OOD")


class EvalConfig(Section):
    """What every evaluation (after SFT, after RL, `tiller eval`) runs (docs/evaluation.md)."""

    enabled: bool = Field(
        True, description="evaluation after SFT and after RL; false skips it (logged, and "
        "summary.json says \"heldout\": \"disabled\"), as does an env without a heldout "
        "split")
    tasks: int = Field(256, ge=1, description="tasks of the default heldout set, and of every "
                       "set in eval.sets that does not give its own")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature of evaluation "
                               "episodes: 1.0 = success of the sampling policy (pass@1), 0 = "
                               "greedy")
    samples_per_task: int = Field(1, ge=1, description="n samples per task (n >= pass_k)")
    pass_k: int = Field(1, ge=1, description="also report unbiased pass@k when k > 1")
    sets: list[EvalSetConfig] | None = Field(
        None, description="the sets every evaluation runs (default: one set, heldout, of "
                          "eval.tasks tasks at env.difficulty)")
    seeds: list[int] | None = Field(
        None, min_length=1, description="sampling seeds: each set is sampled once per seed "
        "(samples_per_task each), figures pool them with CIs over tasks and are also given "
        "per seed (default: the run's seed)")

    @model_validator(mode="after")
    def _enough_samples(self) -> EvalConfig:
        if self.pass_k > self.samples_per_task:
            raise ConfigError(f"config field eval.pass_k: got {self.pass_k}; pass@k needs "
                              f"eval.samples_per_task >= k, got {self.samples_per_task}")
        names = [s.name for s in self.sets or []]
        if self.sets is not None and (not names or len(set(names)) < len(names)):
            raise ConfigError(f"config field eval.sets: got names {names}; expected at least "
                              "one set, each name once")
        if self.seeds is not None and len(set(self.seeds)) < len(self.seeds):
            raise ConfigError(f"config field eval.seeds: got {self.seeds}; each seed once")
        return self

    def resolved_sets(self, difficulty: int) -> list[EvalSetConfig]:
        """The sets to run, each with its task count and difficulty filled in."""
        sets = self.sets or [EvalSetConfig(name="heldout")]
        return [s.model_copy(update={"tasks": s.tasks or self.tasks,
                                     "difficulty": s.difficulty or difficulty}) for s in sets]
