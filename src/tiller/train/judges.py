"""Judges for `rl.judge.fn`: fn(task, trajectory) -> a score in [0, 1] that shapes the reward of
successful episodes (`tiller.train.shaping.judge_bonus`). A judge is a proxy, so a policy can
learn to please it without getting more answers right; the shaping never pays for a wrong
answer and `tiller.observe.health.JudgeHackingTrend` warns when that happens anyway.
"""

from __future__ import annotations

import re

from tiller.envs.base import Task
from tiller.rollout.trajectory import Status, Trajectory

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def grounded_answer(task: Task, trajectory: Trajectory) -> float:
    """A rubric on the messages of a tool-using episode, the mean of three checks:

    - answered: the episode ended on a plain assistant answer (no tool call) with text;
    - grounded: the answer's last number is the output of one of the episode's tool calls
      (the answer comes from the tools, not from the model's head);
    - clean: no tool call failed and none was malformed.

    Among correct answers it prefers the ones the tools produced. Like any judge it can be
    gamed: calling a tool on anything and quoting its output scores "grounded" whatever the
    question was.
    """
    final = trajectory.messages[-1] if trajectory.messages else {}
    text = str(final.get("content") or "")
    answered = (trajectory.status is Status.COMPLETED and final.get("role") == "assistant"
                and not final.get("tool_calls") and bool(text.strip()))
    numbers = _NUMBER.findall(text)
    outputs = {str(m.get("content", "")).strip() for m in trajectory.messages
               if m.get("role") == "tool"}
    grounded = answered and bool(numbers) and numbers[-1] in outputs
    clean = trajectory.tool_errors == 0 and trajectory.parse_errors == 0
    return (answered + grounded + clean) / 3
