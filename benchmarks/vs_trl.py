"""tiller's RL step against Hugging Face TRL's GRPOTrainer on the same multi-turn tool work.

Both sides train the same model with GRPO on the calculator task: the same tasks in the
same order, the same ~800-token prompts (a tool manual of worked examples before the
calculator's system prompt; every step's prompt token ids are checked to be identical on both
sides), the calculator tool, group size, prompts per step, max new tokens per turn, turns,
completion budget, temperature (top-p 1, top-k off), lr, AdamW (betas 0.9/0.99, no weight
decay, grad norm clip 1, constant lr), token-mean PPO-clip loss (eps 0.2, no KL) on
group-normalized advantages, fp32, activation checkpointing on or off on both sides
(`--activation-checkpointing`; off unless given, where TRL's own default is on), and one
optimizer step per RL step over micro-batches of the same rows (`--micro-batch-size`).
tiller's trainer may also pack each micro-batch into one row (`--packing`, train.packing) and
close a micro-batch at a token budget (`--micro-batch-tokens`, train.micro_batch_tokens): GRPO
in TRL has neither, so its micro-batches are padded to their longest row (its default).

- tiller runs its real code path: `tiller.run.Run` + `tiller.controller.rl` (the continuous
  batching engine, KV kept across an episode's turns), timed from the run's metrics
  (`rollout_s`, `step_s`, `rollout_tokens` per step);
- TRL runs `GRPOTrainer(tools=[calculate])`: its tool loop calls HF `generate` once per turn
  on the rows that called a tool, each re-prefilling its whole conversation; timed around
  `_generate_and_score_completions` (rollout) and from step begin to step end (step).

"rollout" is generation plus tool calls and reward scoring (the tool takes microseconds);
"train" is the rest of the step. The sides alternate (tiller, TRL, TRL, tiller, ...) for
`--rounds` rounds of `--steps` steps in this process, with `--threads` torch threads;
the first `--warmup` steps of each run (default 1) are not counted. Prints a table of medians (also
`results.md` / `results.json` in the output folder) and the ratio TRL / tiller (above 1:
tiller is faster).

The model: `--model`, else the demo's SFT checkpoint (`runs/seeds/seed0/checkpoints/sft`,
made by the demo) when present, else the demo's SFT is run here. It learned on ~150-token
episodes and stops calling the tool behind an 800-token manual, so it is first adapted by a
short SFT on the expert's long-prompt episodes (`--adapt-tasks`: 64 steps of 16 by default,
about 8 minutes on one busy CPU core here); reuse the result with
`--model <printed path> --adapt-tasks 0`.

`--model` takes any local Hugging Face causal LM folder whose chat template renders the tool
schemas (the prompt-id check refuses one that renders them unlike tiller) and whose turns TRL
can parse: TRL's own parser for the templates it knows by their text, else, for ChatML turns
with Hermes `<tool_call>` JSON (tiller's template and SmolLM2's as `tiller models fetch`
installs it), TRL's Qwen3 parser, which reads that layout. SmolLM2-135M-Instruct as shipped
never writes a tool call; start from a checkpoint after the SmolLM2 recipe's SFT
(configs/smollm2_calculator.yaml), which does behind the manual, with no adaptation:

    # seconds-long smoke run: a tiny untrained model (it hardly calls the tool), short prompts
    .venv/bin/python benchmarks/vs_trl.py --quick
    # the comparison (needs TRL: pip install -e .[bench]; run it on a quiet machine)
    .venv/bin/python benchmarks/vs_trl.py
    # the 135M model (~900-token prompts in its tokens; tiller packs, 2,048-token micro-batches)
    .venv/bin/python benchmarks/vs_trl.py --model <smollm2 sft checkpoint> --adapt-tasks 0 \
        --tasks-per-step 2 --group-size 4 --micro-batch-size 2 --packing \
        --micro-batch-tokens 2048 --max-new-tokens 64 --lr 2e-6 --steps 1 --warmup 0 --rounds 2

Not matched, by the peer's design: TRL samples with its own RNG, so the episodes (and the
generated token counts: see "rollout ms/generated token") differ; a malformed tool call ends a
TRL episode (it is plain text to TRL's parser) where tiller answers with an error observation
and goes on; TRL's tool errors for arguments that do not fit the function read
`{'error': ...}`; and its completion budget counts every token after the prompt, while
tiller's `env.max_episode_tokens` counts the prompt too (set to the longest prompt plus the
budget, so the two bind at the same length up to the few tokens of prompt-length spread).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import random
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

# TRL warns on every trainer built with its experimental pieces; it says nothing to measure
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

from tiller.config import BuildConfig, load_config  # noqa: E402
from tiller.controller import rl, sft  # noqa: E402
from tiller.envs import calculator  # noqa: E402
from tiller.envs.actions import ParsedTurn  # noqa: E402
from tiller.envs.base import Task, register_env  # noqa: E402
from tiller.files import write_file  # noqa: E402
from tiller.models import build_env_model, load_model, load_tokenizer  # noqa: E402
from tiller.rollout.chat import ChatFormat  # noqa: E402
from tiller.run import Run  # noqa: E402
from tiller.runtime import apply_threads  # noqa: E402
from tiller.tools.registry import ToolError  # noqa: E402

CONFIG = "configs/calculator.yaml"
DEMO_SFT = Path("runs/seeds/seed0/checkpoints/sft")
# --quick: a tiny model built in seconds (untrained, so it rarely calls the tool) and short
# prompts; proves both sides run and the table is produced, says nothing about speed
QUICK = {"adapt_tasks": 0, "prompt_tokens": 160, "steps": 2, "rounds": 1, "tasks_per_step": 2,
         "group_size": 2, "max_new_tokens": 12, "max_turns": 3, "completion_budget": 64,
         "micro_batch_size": 4}
QUICK_BUILD = BuildConfig(vocab_size=600, hidden_size=64, num_layers=2, num_heads=4,
                          corpus_tasks=60)

# The long system prompt: the calculator's own system text after a tool manual of worked
# examples, `PREAMBLE` set once per invocation (sized to --prompt-tokens with the tokenizer)
PREAMBLE = ""


@register_env
class PaddedCalculatorEnv(calculator.CalculatorEnv):
    """The calculator with `PREAMBLE` before its system prompt: tiller reads tasks through the
    env registry, so this is how its real code path gets the long prompts."""

    name = "calculator_padded"

    @staticmethod
    def make_tasks(split: str, n: int, seed: int, difficulty: int = 2,
                   heldout_fraction: float = 0.2) -> list[Task]:
        tasks = calculator.make_tasks(split, n, seed, difficulty, heldout_fraction)
        return [dataclasses.replace(t, system=PREAMBLE + t.system) for t in tasks]


def manual(n_examples: int) -> str:
    """A deterministic tool manual: how the tool works, then worked examples in the task's
    own language (held-out problems, so never a train task's answer)."""
    rng = random.Random("vs_trl/manual")
    lines = ["# Calculator manual",
             "The calculate tool evaluates one operation 'a op b' with op in + - * per call. "
             "Feed each result into the next call; never compute in your head.", ""]
    for i, task in enumerate(calculator.make_tasks("heldout", n_examples, 7, 3)):
        problem = task.metadata["problem"]
        values = problem.results()
        calls = [f"calculate('{problem.a} * {problem.b}') = {values[0]}"]
        calls += [f"calculate('{values[k]} {op} {x}') = {values[k + 1]}"
                  for k, (op, x) in enumerate(problem.steps)]
        lines.append(f"Example {i + 1}: {calculator._text(problem, rng, calculator._TEMPLATES)} "
                     f"{'; '.join(calls)}. The answer is {values[-1]}.")
    return "\n".join(lines) + "\n\n"


def trl_tool() -> Any:
    """tiller's `calculate` as TRL wants a tool (a plain typed function with a docstring; the
    schema the chat template renders is the same), with tiller's text for a ToolError."""

    @functools.wraps(calculator.calculate.fn)
    def calculate(expression: str) -> str:
        try:
            return calculator.calculate.fn(expression)
        except ToolError as e:  # tiller's ToolEnv shows the model "error: <message>"
            return f"error: {e}"

    return calculate


def opening(task: Task) -> list[dict[str, str]]:
    """The messages an episode starts from, as tiller's ToolEnv.reset makes them."""
    return [{"role": "system", "content": task.system}, {"role": "user", "content": task.prompt}]


def prompt_ids_tiller(tokenizer: Any, task: Task) -> list[int]:
    env = PaddedCalculatorEnv()
    return ChatFormat(tokenizer, env.tool_schemas()).prompt_ids(opening(task))


def prompt_ids_trl(tokenizer: Any, task: Task) -> list[int]:
    out = tokenizer.apply_chat_template(opening(task), tools=[trl_tool()],
                                        add_generation_prompt=True,
                                        tokenize=True, return_dict=True)
    return list(out["input_ids"])


def size_preamble(tokenizer: Any, target: int) -> int:
    """Set `PREAMBLE` to the shortest manual that makes a typical prompt `target` tokens or
    more; returns the number of examples in it."""
    global PREAMBLE
    probe = calculator.make_tasks("train", 1, 0, 2)[0]
    for n in range(0, 400):
        PREAMBLE = manual(n) if n else ""
        if len(prompt_ids_tiller(tokenizer, dataclasses.replace(probe, system=PREAMBLE
                                                                 + probe.system))) >= target:
            return n
    raise SystemExit(f"error: --prompt-tokens {target}: 400 manual examples are not enough")


def rl_tasks(args: argparse.Namespace) -> list[Task]:
    """The train tasks of the tiller run, in its order (`Run.tasks("train", n, 3)`)."""
    return PaddedCalculatorEnv.make_tasks("train", args.steps * args.tasks_per_step,
                                          args.seed + 3, args.difficulty)


def check_prompts(tokenizer: Any, tasks: list[Task]) -> list[int]:
    """The two sides must prefill the same prompts: compare the ids of every task's prompt."""
    lengths = []
    for task in tasks:
        a, b = prompt_ids_tiller(tokenizer, task), prompt_ids_trl(tokenizer, task)
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                         min(len(a), len(b)))
            raise SystemExit(f"error: task {task.id}: tiller's and TRL's prompt ids differ at "
                             f"token {first} (lengths {len(a)} and {len(b)}); the sides would "
                             f"not do the same work")
        lengths.append(len(a))
    return lengths


# ---------------------------------------------------------------------------------- tiller


@contextlib.contextmanager
def cpu_clock() -> Any:
    """While it lasts, tiller's RL step rows also hold this process's CPU seconds (every
    thread: the engine's worker and the agent loop's included) for the step (`step_cpu_s`) and
    its rollout (`rollout_cpu_s`), on the clocks of its wall times: on a shared CPU the wall
    seconds count the other processes' load, the CPU seconds only this side's own work."""
    from tiller.observe.steps import StepRecorder

    begin, taken, end = StepRecorder.begin, StepRecorder.taken, StepRecorder.end

    def timed_begin(self: Any, step: int) -> None:
        begin(self, step)
        self.cpu0 = time.process_time()

    def timed_taken(self: Any, batch: Any) -> Any:
        out = taken(self, batch)
        self.metrics["rollout_cpu_s"] = time.process_time() - self.cpu0
        return out

    def timed_end(self: Any, rollouts: Any) -> None:
        end(self, rollouts)
        self.metrics["step_cpu_s"] = time.process_time() - self.cpu0

    StepRecorder.begin, StepRecorder.taken, StepRecorder.end = (timed_begin, timed_taken,
                                                                timed_end)
    try:
        yield
    finally:
        StepRecorder.begin, StepRecorder.taken, StepRecorder.end = begin, taken, end


def tiller_round(args: argparse.Namespace, model: Path, max_prompt: int, out: Path
                 ) -> list[dict[str, float]]:
    cfg = load_config(CONFIG, [
        f"model.path={model}", "model.build=null", "sft.enabled=false", "model.device=cpu",
        "env.name=calculator_padded", f"env.difficulty={args.difficulty}",
        f"env.max_turns={args.max_turns}",
        f"env.max_episode_tokens={max_prompt + args.completion_budget}",
        f"sampling.temperature={args.temperature}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"rl.steps={args.steps}", f"rl.tasks_per_step={args.tasks_per_step}",
        f"rl.group_size={args.group_size}", f"rl.lr={args.lr}",
        f"rl.micro_batch_size={args.micro_batch_size}", "rl.mini_batches=1", "rl.ppo_epochs=1",
        f"train.packing={str(args.packing).lower()}",
        f"train.micro_batch_tokens={args.micro_batch_tokens or 'null'}",
        f"train.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        f"seed={args.seed}", "logging.progress=false", "logging.tensorboard=false",
        f"runtime.threads={args.threads}"])
    run = Run(cfg, out)
    try:
        with cpu_clock():
            rl(run)
    finally:
        run.close()
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    return [{"step_s": r["step_s"], "rollout_s": r["rollout_s"],
             "train_s": r["step_s"] - r["rollout_s"], "step_cpu_s": r["step_cpu_s"],
             "rollout_cpu_s": r["rollout_cpu_s"],
             "train_cpu_s": r["step_cpu_s"] - r["rollout_cpu_s"], "tokens": r["rollout_tokens"],
             "turns": r["turns_mean"], "tool_calls": r["tool_calls_per_episode"],
             "reward": r["reward_mean"]} for r in rows if r["phase"] == "rl"]


# ------------------------------------------------------------------------------------- TRL


def set_response_template(tokenizer: Any) -> str:
    """Give TRL the parser of the model's generated turns: TRL's own for the chat templates it
    knows by their text; for one it does not know that writes Hermes `<tool_call>` JSON in
    ChatML turns (tiller's template, SmolLM2's as `tiller models fetch` installs it), TRL's
    Qwen3 parser, which reads exactly that layout. Returns which; refuses any other template.
    """
    from trl.chat_template_utils import add_response_schema, qwen3_template

    try:
        add_response_schema(tokenizer)
        return "TRL's own"
    except ValueError:  # a template TRL does not know by its text
        pass
    family = ChatFormat(tokenizer).family
    generation_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    if family not in ("hermes", "qwen3") or not generation_prompt.endswith(
            "<|im_start|>assistant\n"):
        raise SystemExit(f"error: TRL has no response parser for this chat template (tiller "
                         f"reads it as {family}); only ChatML templates with Hermes "
                         "<tool_call> JSON are mapped to one here")
    tokenizer.response_template = qwen3_template
    return "TRL's qwen3 (Hermes tool calls in ChatML)"



def trl_round(args: argparse.Namespace, model_dir: Path, tasks: list[Task], out: Path
              ) -> list[dict[str, float]]:
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    episodes: list[dict[str, float]] = []  # this rollout's episodes, filled by `reward`

    def reward(completions: list[list[dict]], answer: list[int], **_: Any) -> list[float]:
        """tiller's calculator verdict: 1 when the last turn is a tool-free 'The answer is N'
        with the right N. Also counts each episode's turns and tool calls for the table."""
        out = []
        for messages, want in zip(completions, answer, strict=True):
            last = messages[-1]
            final = (ParsedTurn(last.get("content") or "")
                     if last["role"] == "assistant" and not last.get("tool_calls") else None)
            out.append(float(calculator.final_answer(final) == want))
            episodes.append({"turns": sum(m["role"] == "assistant" for m in messages),
                             "tool_calls": sum(m["role"] == "tool" for m in messages),
                             "reward": out[-1]})
        return out

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that records each rollout's time, generated tokens and episodes."""

        rollouts: list[dict[str, float]]  # set before train()

        def _generate_and_score_completions(self, inputs: list[dict]) -> dict:
            t0, c0 = time.perf_counter(), time.process_time()
            batch = super()._generate_and_score_completions(inputs)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            mask = batch["completion_mask"]
            if batch.get("tool_mask") is not None:  # tool results are not generated tokens
                mask = mask * batch["tool_mask"]
            row = {k: statistics.fmean(e[k] for e in episodes) for k in episodes[0]}
            self.rollouts.append({"rollout_s": seconds, "rollout_cpu_s": cpu,
                                  "tokens": float(mask.sum()), **row})
            episodes.clear()
            return batch

    class StepClock(TrainerCallback):
        """Wall and CPU seconds from each optimizer step's first micro-batch to its end."""

        def __init__(self) -> None:
            self.steps: list[tuple[float, float]] = []
            self.t0 = self.c0 = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.steps.append((time.perf_counter() - self.t0, time.process_time() - self.c0))

    tokenizer = load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    set_response_template(tokenizer)
    rows = [{"prompt": opening(t), "answer": t.answer} for t in tasks]
    per_step = args.tasks_per_step * args.group_size
    config = GRPOConfig(
        output_dir=str(out), max_steps=args.steps, seed=args.seed, use_cpu=True,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=per_step // args.micro_batch_size,  # one optimizer step
        num_generations=args.group_size, shuffle_dataset=False,  # tiller's task order
        max_completion_length=args.completion_budget,
        max_tool_calling_iterations=args.max_turns - 1,  # generated turns = 1 + tool rounds
        generation_kwargs={"max_new_tokens": args.max_new_tokens},  # per turn, as tiller
        temperature=args.temperature, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,  # tiller's AdamW
        beta=0.0, num_iterations=1, epsilon=0.2, loss_type="dapo",  # token-mean PPO clip
        scale_rewards="group", bf16=False,  # fp32 as tiller's model.dtype
        activation_checkpointing=args.activation_checkpointing,  # TRL's default is on
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0)
    clock = StepClock()
    trainer = TimedGRPOTrainer(model=load_model(model_dir), reward_funcs=reward, args=config,
                               train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                               tools=[trl_tool()], callbacks=[clock])
    trainer.rollouts = []
    trainer.remove_callback(PrinterCallback)  # a dict of TRL's metrics per step: noise here
    trainer.train()
    if len(clock.steps) != args.steps or len(trainer.rollouts) != args.steps:
        raise SystemExit(f"error: TRL ran {len(clock.steps)} steps with {len(trainer.rollouts)} "
                         f"rollouts; expected {args.steps} of each (one generation per step)")
    return [{"step_s": step_s, "train_s": step_s - r["rollout_s"], "step_cpu_s": cpu,
             "train_cpu_s": cpu - r["rollout_cpu_s"], **r}
            for (step_s, cpu), r in zip(clock.steps, trainer.rollouts, strict=True)]


# ----------------------------------------------------------------------------------- table

COLUMNS = [("step_s", "s/step", "{:.3f}"), ("rollout_s", "rollout s/step", "{:.3f}"),
           ("train_s", "train s/step", "{:.3f}"), ("step_cpu_s", "CPU s/step", "{:.3f}"),
           ("rollout_cpu_s", "rollout CPU s/step", "{:.3f}"),
           ("train_cpu_s", "train CPU s/step", "{:.3f}"),
           ("tokens", "generated tokens/step", "{:.0f}"),
           ("rollout_ms_per_token", "rollout ms/generated token", "{:.2f}"),
           ("turns", "turns/episode", "{:.2f}"), ("tool_calls", "tool calls/episode", "{:.2f}"),
           ("reward", "reward", "{:.2f}")]


RATIOS = 8  # the columns the ratio row compares: times, CPU times, tokens, ms per token


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per-column medians over steps; rollout time per generated token too, since the sides
    sample different episodes (and so generate different numbers of tokens)."""
    rows = [{**r, "rollout_ms_per_token": 1000 * r["rollout_s"] / max(r["tokens"], 1)}
            for r in rows]
    return {k: statistics.median(r[k] for r in rows) for k, _, _ in COLUMNS}


def table(result: dict[str, dict[str, float]]) -> str:
    head = ["side", *(name for _, name, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for side in ("tiller", "trl"):
        if side in result:
            cells = [fmt.format(result[side][k]) for k, _, fmt in COLUMNS]
            lines.append(f"| {side} | " + " | ".join(cells) + " |")
    if {"tiller", "trl"} <= result.keys():
        t, p = result["tiller"], result["trl"]
        cells = [f"{p[k] / t[k]:.2f}x" if t[k] else "-" for k, _, _ in COLUMNS[:RATIOS]]
        lines.append("| TRL / tiller | " + " | ".join(cells) + " |"
                     + " |" * (len(COLUMNS) - RATIOS))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help=f"starting HF checkpoint, adapted unless --adapt-tasks 0 "
                   f"(default: {DEMO_SFT} if it exists, else the demo's SFT is run to make one)")
    p.add_argument("--adapt-tasks", type=int, default=1024,
                   help="expert episodes of SFT on the long prompts before the runs (0: none)")
    p.add_argument("--sides", default="tiller,trl", help="comma-separated: tiller, trl")
    p.add_argument("--steps", type=int, default=5, help="RL steps per run")
    p.add_argument("--warmup", type=int, default=1,
                   help="first steps of each run not counted (0: count every step; each "
                   "step's seconds are in results.json)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=32,
                   help="rows per forward/backward on both sides (tiller: rl.micro_batch_size)")
    p.add_argument("--packing", action="store_true",
                   help="tiller packs each micro-batch into one row (train.packing); TRL has no "
                   "packing in GRPO and pads each micro-batch to its longest row")
    p.add_argument("--micro-batch-tokens", type=int,
                   help="tiller also closes a micro-batch at this many tokens "
                   "(train.micro_batch_tokens); TRL has none: its micro-batches are rows only")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="both sides (train.activation_checkpointing; TRL's "
                   "activation_checkpointing)")
    p.add_argument("--prompt-tokens", type=int, default=800, help="prompt length to reach")
    p.add_argument("--max-new-tokens", type=int, default=48, help="per turn")
    p.add_argument("--max-turns", type=int, default=6, help="generated turns per episode")
    p.add_argument("--completion-budget", type=int, default=512,
                   help="tokens after the prompt per episode (generated + tool results)")
    p.add_argument("--difficulty", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run; defaults " +
                   ", ".join(f"{k}={v}" for k, v in QUICK.items()) + ", a tiny untrained model")
    p.add_argument("--out", help="output folder (default: runs/bench-vs-trl-<time>)")
    args = p.parse_args()
    if args.quick:  # the quick values as defaults: flags given still win
        p.set_defaults(**QUICK)
        args = p.parse_args()
    per_step = args.tasks_per_step * args.group_size
    if per_step % args.micro_batch_size and args.micro_batch_size < per_step:
        raise SystemExit(f"error: --micro-batch-size {args.micro_batch_size} must divide "
                         f"tasks-per-step x group-size = {per_step} (TRL accumulates whole "
                         "micro-batches into one optimizer step)")
    args.micro_batch_size = min(args.micro_batch_size, per_step)
    if not 0 <= args.warmup < args.steps:
        raise SystemExit(f"error: --warmup {args.warmup} must be at least 0 and below --steps "
                         f"{args.steps} (no step would be counted)")
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not args.sides or set(args.sides) - {"tiller", "trl"}:
        raise SystemExit(f"error: --sides {','.join(args.sides)}: choose from tiller, trl")
    return args


def model_path(args: argparse.Namespace, out: Path) -> Path:
    """--model, the demo's SFT checkpoint, or one made here (a tiny build for --quick, else
    the demo's own build and SFT)."""
    if args.model:
        return Path(args.model)
    if args.quick:
        return build_env_model(calculator.CalculatorEnv, out / "quick_model", QUICK_BUILD,
                               seed=args.seed, difficulty=args.difficulty,
                               max_turns=args.max_turns)
    if DEMO_SFT.is_dir():
        return DEMO_SFT
    print(f"no --model and no {DEMO_SFT}: running the demo's SFT ({CONFIG}) to make one",
          flush=True)
    run = Run(load_config(CONFIG, ["logging.progress=false", "logging.tensorboard=false",
                                   f"seed={args.seed}", f"runtime.threads={args.threads}"]),
              out / "sft")
    try:
        sft(run)
        return run.save("sft")
    finally:
        run.close()


def adapt(args: argparse.Namespace, base: Path, max_prompt: int, out: Path) -> Path:
    """A short SFT of `base` on the expert's episodes with the long prompts (tiller's own SFT,
    `sft.imperfect_fraction` as in the demo): a model trained on ~150-token episodes stops
    calling the tool behind an 800-token manual, which would leave no multi-turn work."""
    print(f"adapting {base} to the long prompts: SFT on {args.adapt_tasks} expert episodes",
          flush=True)
    run = Run(load_config(CONFIG, [
        f"model.path={base}", "model.build=null", "model.device=cpu",
        "env.name=calculator_padded", f"env.difficulty={args.difficulty}",
        f"env.max_turns={args.max_turns}",
        f"env.max_episode_tokens={max_prompt + args.completion_budget}",
        f"sft.tasks={args.adapt_tasks}", "sft.epochs=1", "sft.batch_size=16",
        "sft.micro_batch_size=8", "sft.lr=3e-3", "sft.warmup_steps=4", "sft.lr_schedule=constant",
        f"seed={args.seed}", "logging.progress=false", "logging.tensorboard=false",
        f"runtime.threads={args.threads}"]), out)
    try:
        sft(run)
        return run.save("sft")
    finally:
        run.close()


def write_results(out: Path, args: argparse.Namespace, model: Path, lengths: list[int],
                  steps: dict[str, list[dict[str, float]]]) -> str:
    """results.md (the table of the sides with counted steps so far) and results.json (every
    counted step), each by temp file + rename; returns the table."""
    result = {side: medians(rows) for side, rows in steps.items() if rows}
    md = table(result)
    write_file(out / "results.md", md + "\n", root=out)
    write_file(out / "results.json", json.dumps(
        {"args": {k: v for k, v in vars(args).items()}, "model": str(model),
         "prompt_tokens": [min(lengths), max(lengths)], "medians": result, "steps": steps},
        indent=2, default=str), root=out)
    return md


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or Path("runs") / f"bench-vs-trl-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    model = model_path(args, out)
    tokenizer = load_tokenizer(model)
    examples = size_preamble(tokenizer, args.prompt_tokens)
    tasks = rl_tasks(args)
    lengths = check_prompts(tokenizer, tasks)
    if args.adapt_tasks:
        model = adapt(args, model, max(lengths), out / "adapted")
        print(f"adapted model: {model} (reuse it with --model {model} --adapt-tasks 0)")
    print(f"model {model}; prompts {min(lengths)}..{max(lengths)} tokens ({examples} manual "
          f"examples), identical ids on both sides; {args.tasks_per_step} tasks x "
          f"{args.group_size} samples per step, {args.steps} steps x {args.rounds} rounds, "
          f"{torch.get_num_threads()} torch thread(s)", flush=True)

    steps: dict[str, list[dict[str, float]]] = {side: [] for side in args.sides}
    for r in range(args.rounds):
        order = args.sides if r % 2 == 0 else args.sides[::-1]  # ABBA: drift hits both
        for side in order:
            apply_threads(args.threads)  # whatever a previous side's libraries did
            t0 = time.perf_counter()
            rows = (tiller_round(args, model, max(lengths), out / f"tiller-{r}") if side == "tiller"
                    else trl_round(args, model, tasks, out / f"trl-{r}"))
            steps[side] += rows[args.warmup:]  # the first steps of a run warm up
            print(f"round {r + 1} {side}: {len(rows)} steps in {time.perf_counter() - t0:.1f}s, "
                  f"step s {[round(x['step_s'], 3) for x in rows]}", flush=True)
            # after every run: a long run stopped early keeps the table of the runs done
            md = write_results(out, args, model, lengths, steps)
    print(md)
    print(f"\nmedians over {args.rounds} x {args.steps - args.warmup} steps per side after "
          f"{args.warmup} warm-up step(s) per run; "
          f"results: {out / 'results.md'}")


if __name__ == "__main__":
    main()
