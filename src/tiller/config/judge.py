"""Judge shaping (`rl.judge`): no judge, a judge function or a judge model, one type each."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from tiller.config.base import Variant, variants
from tiller.errors import ConfigError

JUDGE_PROMPT = ("Question: {question}\nProposed answer: {answer}\nIs the proposed answer "
                "correct? Answer yes or no.\nAnswer:")


class NoJudgeConfig(Variant):
    """No judge: the reward is the verifier's."""


class JudgeConfig(Variant):
    """A judge score as a shaping term, paid only where the verifier says success
    (docs/algorithms.md, "Judge shaping"): a judge can be gamed, so it never pays for a wrong
    answer, and a detector warns when its score rises while success does not. The keys both
    judges have; `FnJudgeConfig` and `ModelJudgeConfig` add the judge itself."""

    weight: float = Field(0.1, ge=0.0, description="reward = verifier + weight * judge on "
                          "successful episodes; the verifier's value elsewhere")
    window: int = Field(3, ge=1, description="hacking detector: RL steps per window; the last "
                        "window is compared with the one before it")
    margin: float = Field(0.05, ge=0.0, description="hacking detector: a judge-mean rise above "
                          "this while success rose by no more than this is suspected hacking")


class FnJudgeConfig(JudgeConfig):
    """A judge function, e.g. a rubric (tiller.train.judges:grounded_answer)."""

    fn: str = Field(description="dotted path of fn(task, trajectory) -> float in [0, 1], e.g. "
                    "tiller.train.judges:grounded_answer")


class ModelJudgeConfig(JudgeConfig):
    """A frozen language model asked whether the answer is correct
    (`tiller.train.judges.ModelJudge`)."""

    model: str = Field(
        description="local path of a Hugging Face causal LM and tokenizer: the score is P(yes) "
        "/ (P(yes) + P(no)) of its continuation after `prompt`; a frozen copy, e.g. the "
        "policy's start checkpoint for self-reflection")
    prompt: str = Field(
        JUDGE_PROMPT, description="the judge's prompt: {question} (the task's prompt) and "
        "{answer} (the episode's final assistant text) are filled in; the judge then scores "
        "the continuations ' yes' and ' no'")

    @model_validator(mode="after")
    def _prompt_fills(self) -> ModelJudgeConfig:
        try:
            filled = self.prompt.format(question="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"config field rl.judge.prompt: {type(e).__name__}: {e}; only "
                              "{question} and {answer} are filled in (double other braces)"
                              ) from e
        if "{answer}" not in self.prompt or filled == self.prompt:
            raise ConfigError("config field rl.judge.prompt: it must contain {answer}, the "
                              "episode's final text the judge scores")
        return self


def _pick(data: dict[str, Any]) -> type[Variant]:
    fn, model = data.get("fn"), data.get("model")
    if fn is not None and model is not None:
        raise ConfigError(f"config field rl.judge.model: got {model!r} with rl.judge.fn {fn!r}; "
                          "a run has one judge (unset one of them)")
    return FnJudgeConfig if fn is not None else ModelJudgeConfig if model is not None else (
        NoJudgeConfig)


# the type of `rl.judge`: chosen by which of rl.judge.fn and rl.judge.model is set
AnyJudgeConfig = variants("rl.judge", _pick, {
    "neither rl.judge.fn nor rl.judge.model (no judge)": NoJudgeConfig,
    "rl.judge.fn": FnJudgeConfig, "rl.judge.model": ModelJudgeConfig})
