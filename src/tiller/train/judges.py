"""Judges for `rl.judge`: fn(task, trajectory) -> a score in [0, 1] that shapes the reward of
successful episodes (`tiller.train.shaping.judge_bonus`). A judge is a proxy, so a policy can
learn to please it without getting more answers right; the shaping never pays for a wrong
answer and `tiller.observe.health.JudgeHackingTrend` warns when that happens anyway.

`grounded_answer` is a rubric (rl.judge.fn); `ModelJudge` is a frozen language model asked
whether the answer is correct (rl.judge.model).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoTokenizer

from tiller.envs.base import Task
from tiller.errors import ConfigError
from tiller.models import load_model
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


def final_answer(trajectory: Trajectory) -> str:
    """The text of the episode's last assistant message ("" when it ended on anything else)."""
    final = trajectory.messages[-1] if trajectory.messages else {}
    return str(final.get("content") or "") if final.get("role") == "assistant" else ""


def check_judge_model(path: str | Path) -> None:
    """rl.judge.model names a local Hugging Face model folder (ConfigError if not)."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"config field rl.judge.model: got {str(path)!r}; no Hugging Face "
                          "model there (expected a local folder with config.json)")


class ModelJudge:
    """A frozen Hugging Face causal LM as judge (rl.judge.model):

        score = P(yes | c) / (P(yes | c) + P(no | c)),   c = prompt(question, answer)

    where P(x | c) is the model's probability of every token of the continuation x after the
    context c, so the two words need not be single tokens. The question is the task's prompt,
    the answer the episode's final assistant text. Loaded once from a local path, on the
    policy's device, and never trained: pointed at the policy's start checkpoint it is the
    policy's own "is this correct?" likelihood (self-reflection) without reading weights the
    trainer is updating. A context longer than the model's is cut from the left (the answer
    and the question's end stay).
    """

    def __init__(self, path: str | Path, prompt: str, yes: str = " yes", no: str = " no",
                 device: torch.device | str = "cpu"):
        check_judge_model(path)
        # plain text in, so any causal LM's tokenizer will do: no chat template needed
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = load_model(path, torch.float32).to(device).eval()
        self.prompt, self.device = prompt, torch.device(device)
        enc = self.tokenizer.encode
        self.options = (enc(yes, add_special_tokens=False), enc(no, add_special_tokens=False))
        if not all(self.options) or self.options[0] == self.options[1]:
            raise ConfigError(f"config field rl.judge.model: the tokenizer at {str(path)!r} "
                              f"encodes {yes!r} as {self.options[0]} and {no!r} as "
                              f"{self.options[1]}; they must be distinct and non-empty")
        # the context's share of the model's window: the longer option must fit after it
        window = getattr(self.model.config, "max_position_embeddings", None)
        self.max_context = None if window is None else window - max(map(len, self.options))
        # a first token to predict the continuation from, should the prompt encode to nothing
        tok = self.tokenizer
        self.start = next((i for i in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
                           if i is not None), None)
        if self.start is None:
            raise ConfigError(f"config field rl.judge.model: the tokenizer at {str(path)!r} has "
                              "no bos, eos or pad token to start an empty context from")

    @torch.no_grad()
    def __call__(self, task: Task, trajectory: Trajectory) -> float:
        text = self.prompt.format(question=task.prompt, answer=final_answer(trajectory))
        context = self.tokenizer.encode(text, add_special_tokens=False) or [self.start]
        if self.max_context is not None:
            context = context[-self.max_context:]
        yes, no = self._logprobs(context)
        return float(torch.sigmoid(torch.tensor(yes - no)))

    def _logprobs(self, context: list[int]) -> list[float]:
        """log P(option | context) for each option, the sum of its tokens' log-probabilities,
        from one forward pass over both: rows padded on the right, which a causal model's
        earlier positions never see."""
        rows = [context + option for option in self.options]
        width = max(map(len, rows))
        ids = torch.tensor([r + [self.start] * (width - len(r)) for r in rows],
                           device=self.device)
        logp = torch.log_softmax(self.model(input_ids=ids).logits.float(), -1)
        n = len(context)
        return [float(sum(logp[i, n - 1 + j, tok] for j, tok in enumerate(option)))
                for i, option in enumerate(self.options)]
