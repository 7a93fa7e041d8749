"""A user's data files and the reward entries of `env.name: dataset`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tiller.config.base import Section, registered


class DataConfig(Section):
    """A user's data files (docs/datasets.md): JSONL, Parquet, or a Hugging Face `datasets`
    folder (save_to_disk) or .arrow file. `train`/`eval` are the tasks of `env.name: dataset`;
    `sft` is a file of conversations SFT trains on instead of the env's scripted expert."""

    train: str | None = Field(None, description="env dataset: the file of train prompts (one "
                              "task per row)")
    eval: str | None = Field(None, description="env dataset: the held-out file; unset: no "
                             "held-out split, the run skips the held-out evaluations")
    sft: str | None = Field(None, description="a file of conversations (messages column) SFT "
                            "trains on, loss on the assistant tokens; replaces the scripted "
                            "expert, so sft works for envs without one")
    prompt_column: str = Field("prompt", description="the column holding each row's prompt "
                               "(a string)")
    messages_column: str | None = Field(
        None, description="instead of prompt_column: a column of opening chat messages "
        "(ending with a user message), which makes the rows conversational")
    answer_column: str = Field("answer", description="the column library verifiers compare "
                               "with (optional where no verifier needs it)")
    tools_column: str = Field("tools", description="optional per-row column: a list of dotted "
                              "paths of tool functions the row's episode may call")
    metadata_columns: list[str] | None = Field(
        None, description="the columns passed to reward functions besides the answer (each "
        "required in every row); default: every column but the prompt")
    tools: list[str] = Field(default_factory=list, description="dotted paths "
                             "(package.module:function) of tools every row gets")
    system: str | None = Field(None, description="system prompt of string-prompt rows")
    sft_messages_column: str = Field("messages", description="the column of data.sft holding "
                                     "each conversation")


class RewardConfig(Section):
    """One entry of `rewards:`: a library verifier by name or a TRL-style reward function."""

    verifier: str | None = Field(None, description="a library verifier comparing the "
                                 "extracted answer with the answer column: exact_match, "
                                 "normalized_match, numeric_match or regex_match")
    function: str | None = Field(None, description="dotted path of fn(prompts, completions, "
                                 "**columns) -> list[float | None] (TRL's reward_funcs)")
    name: str | None = Field(None, description="the check's name in Reward.checks and the "
                             "logs (default: the verifier's or the function's name); not "
                             "judge, which is rl.judge's score's")
    weight: float = Field(1.0, description="the entry's value counts weight * value")
    gate: bool = Field(False, description="a necessary condition: the total is 0 unless this "
                       "entry's value is at least 1")
    extract: Literal["tagged", "answer_is", "text"] | None = Field(
        None, description="verifier only: how the answer is taken from the final turn: tagged "
        "(one final <answer>...</answer>, the default), answer_is ('The answer is X.'), text "
        "(the whole final answer)")

    @model_validator(mode="after")
    def _one_kind(self) -> RewardConfig:
        if (self.verifier is None) == (self.function is None):
            raise ValueError("set exactly one of verifier (a library check) or function (a "
                             "dotted path)")
        if self.verifier is not None:
            from tiller.envs.rewards import VERIFIERS

            registered(self.verifier, VERIFIERS)
        elif self.extract is not None:
            raise ValueError("extract applies to library verifiers only (a function gets the "
                             "whole completion)")
        return self
