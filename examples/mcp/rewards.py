"""The example's reward function (TRL's reward_funcs signature), named in config.yaml as
`rewards:correct` with this folder on PYTHONPATH."""

from __future__ import annotations


def correct(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the final answer is the row's answer (case and surrounding space ignored).
    The episodes have tools, so each completion is the list of messages after the prompt."""
    out = []
    for completion, target in zip(completions, answer, strict=True):
        final = completion[-1]["content"] if isinstance(completion, list) else completion
        out.append(float(final.strip().rstrip(".").lower() == str(target).lower()))
    return out
