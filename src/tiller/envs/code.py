"""Code: write a Python function `solve` from a generated spec; hidden unit tests decide.

A spec is a pipeline of 1..`difficulty` small steps over a list of integers ("keep the
elements greater than 3, multiply each by 4, return the sum") or over a string ("reverse it,
remove every 'a', return its length"), so the instance space is large and compositional. The
reference implementation is generated with the spec; hidden tests call it on random inputs
drawn from the instance's own seed, and the expected outputs never reach the sandbox (the host
compares). The policy may try code with `run_python`; its final answer holds `solve` in one
```python block. Train and held-out are split by a hash of the spec.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from typing import Any

from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Task, ToolEnv, register_env
from tiller.envs.splits import draw_split, split_size, stable_id
from tiller.envs.verifiers import Reward, all_of, extract_code_block, run_unit_tests
from tiller.tools.registry import tool
from tiller.tools.sandbox import Sandbox, SandboxLimits, SandboxOutcome

SYSTEM = (
    "Write the Python function the user asks for. You may test code with run_python. "
    "End with the complete function in one ```python code block."
)
# (english with {p}, python line with {p}, the values p is drawn from) per step; the line
# rebinds xs or s.
_LIST_STEPS = {
    "keep_gt": ("keep only the elements greater than {p}",
                "xs = [x for x in xs if x > {p}]", range(-5, 11)),
    "keep_mult": ("keep only the elements divisible by {p}",
                  "xs = [x for x in xs if x % {p} == 0]", range(2, 6)),
    "mul": ("multiply every element by {p}", "xs = [x * {p} for x in xs]",
            range(2, 6)),
    "add": ("add {p} to every element", "xs = [x + {p} for x in xs]", range(-9, 10)),
    "abs": ("replace every element by its absolute value", "xs = [abs(x) for x in xs]", None),
    "largest": ("keep only the {p} largest elements, largest first (all if fewer)",
                "xs = sorted(xs, reverse=True)[:{p}]", range(1, 5)),
    "reverse": ("reverse the order of the elements", "xs = xs[::-1]", None),
    "dedupe": ("drop repeated values, keeping each first occurrence",
               "xs = list(dict.fromkeys(xs))", None),
}  # fmt: skip
_LIST_FINALS = {
    "sum": ("return the sum of the elements (0 if none)", "return sum(xs)", "int"),
    "count": ("return how many elements are left", "return len(xs)", "int"),
    "max": ("return the largest element (0 if none)", "return max(xs, default=0)", "int"),
    "list": ("return the resulting list", "return xs", "list[int]"),
}
_STR_STEPS = {
    "upper": ("convert it to upper case", "s = s.upper()", None),
    "reverse": ("reverse it", "s = s[::-1]", None),
    "remove": ("remove every {p!r}", "s = s.replace({p!r}, '')", "aeiost"),
    "caesar": ("shift every lowercase letter {p} places forward in the alphabet, z wrapping to a",
               "s = ''.join(chr((ord(c) - 97 + {p}) % 26 + 97) if 'a' <= c <= 'z' else c "
               "for c in s)", range(1, 26)),
    "rotate": ("move its first {p} characters to the end (unchanged if shorter)",
               "s = s[{p}:] + s[:{p}] if len(s) >= {p} else s", range(1, 5)),
    "no_digits": ("remove all digits", "s = ''.join(c for c in s if not c.isdigit())", None),
    "squeeze": ("collapse each run of equal characters into one",
                "s = ''.join(c for i, c in enumerate(s) if i == 0 or c != s[i - 1])", None),
}  # fmt: skip
_STR_FINALS = {
    "str": ("return the result", "return s", "str"),
    "len": ("return its length", "return len(s)", "int"),
    "vowels": ("return how many of its characters are in 'aeiou'",
               "return sum(c in 'aeiou' for c in s)", "int"),
}
_FAMILIES = {"list": (_LIST_STEPS, _LIST_FINALS, "xs", "list[int]"),
             "str": (_STR_STEPS, _STR_FINALS, "s", "str")}  # fmt: skip


def _draw(rng: random.Random, difficulty: int) -> tuple[str, tuple, str]:
    family = rng.choice(sorted(_FAMILIES))
    steps_table, finals, _, _ = _FAMILIES[family]
    steps = []
    for _ in range(rng.randint(1, difficulty)):
        name = rng.choice(sorted(steps_table))
        values = steps_table[name][2]
        steps.append((name, rng.choice(values) if values else None))
    return family, tuple(steps), rng.choice(sorted(finals))


def _key(spec: tuple[str, tuple, str]) -> str:
    return json.dumps(spec)


def _reference(spec: tuple[str, tuple, str]) -> str:
    family, steps, final = spec
    steps_table, finals, arg, arg_type = _FAMILIES[family]
    lines = [f"def solve({arg}: {arg_type}) -> {finals[final][2]}:"]
    lines += ["    " + steps_table[name][1].format(p=p) for name, p in steps]
    return "\n".join([*lines, "    " + finals[final][1], ""])


def _prompt(spec: tuple[str, tuple, str], example: Any, expected: Any) -> str:
    family, steps, final = spec
    steps_table, finals, arg, arg_type = _FAMILIES[family]
    what = "a list of integers" if family == "list" else "a string"
    todo = [steps_table[name][0].format(p=p) for name, p in steps] + [finals[final][0]]
    numbered = "\n".join(f"{i}. {t}" for i, t in enumerate(todo, 1))
    return (f"Write `solve({arg}: {arg_type}) -> {finals[final][2]}`. It takes {what}, then:\n"
            f"{numbered}\nExample: solve({example!r}) == {expected!r}")


def _random_input(family: str, rng: random.Random) -> Any:
    if family == "list":
        return [rng.randint(-12, 12) for _ in range(rng.randint(0, 9))]
    return "".join(rng.choice("aabeiostxyz0123 ") for _ in range(rng.randint(0, 12)))


def make_tasks(split: str, n: int, seed: int, difficulty: int = 2,
               heldout_fraction: float = 0.2, n_tests: int = 8) -> list[Task]:
    """`n` distinct tasks of `split`, reproducible from `seed`; the tests from the spec's key."""
    rng = random.Random(f"code/{split}/{seed}/{difficulty}")
    specs = draw_split(split, n, rng, lambda r: _draw(r, difficulty), _key, heldout_fraction)
    tasks = []
    for spec in specs:
        reference = _reference(spec)
        namespace: dict[str, Any] = {}
        exec(reference, namespace)  # our own generated code, run on the host to get answers
        test_rng = random.Random(_key(spec))
        inputs = [_random_input(spec[0], test_rng) for _ in range(n_tests + 1)]
        inputs[1] = [] if spec[0] == "list" else ""  # always test the empty input
        tests = [(f"solve({x!r})", namespace["solve"](x)) for x in inputs[1:]]
        tasks.append(Task(
            id=stable_id("code", _key(spec)), split=split, system=SYSTEM, answer=reference,
            prompt=_prompt(spec, inputs[0], namespace["solve"](inputs[0])),
            metadata={"spec": spec, "tests": tests, "example": inputs[0]},
        ))  # fmt: skip
    return tasks


def task_space(split: str, difficulty: int, heldout_fraction: float = 0.2) -> int:
    """Distinct specs of `split`: per family Σ_{k=1..d} (step variants)^k · finals (317 at
    difficulty 1), counted by hash up to difficulty 2, the expected share beyond."""
    def variants(table: dict) -> list[tuple[str, Any]]:
        return [(name, p) for name, (_, _, values) in sorted(table.items())
                for p in (values or [None])]

    if difficulty <= 2:
        keys = (_key((family, steps, final))
                for family, (table, finals, _, _) in sorted(_FAMILIES.items())
                for k in range(1, difficulty + 1)
                for steps in itertools.product(variants(table), repeat=k)
                for final in sorted(finals))
        return split_size(keys, split, heldout_fraction)
    total = sum(len(variants(table)) ** k * len(finals)
                for table, finals, _, _ in _FAMILIES.values() for k in range(1, difficulty + 1))
    return split_size(total, split, heldout_fraction)


def expert_turn(task: Task, messages: list[dict[str, Any]], rng: random.Random,
                guess_prob: float = 0.0) -> str:
    """Try the reference once with run_python, then answer with it. With `guess_prob` it
    skips the try and answers with the first step left out (a plausible, wrong solution)."""
    reference: str = task.answer
    if not any(m["role"] == "tool" for m in messages):
        if rng.random() < guess_prob:
            lines = reference.splitlines()
            return f"```python\n{chr(10).join(lines[:1] + lines[2:])}\n```"
        code = f"{reference}\nprint(solve({task.metadata['example']!r}))"
        return "<tool_call>\n" + json.dumps(
            {"name": "run_python", "arguments": {"code": code}}) + "\n</tool_call>"
    return f"```python\n{reference}```"


@register_env
class CodeEnv(ToolEnv):
    name = "code"

    make_tasks = staticmethod(make_tasks)
    task_space = staticmethod(task_space)
    expert_turn = staticmethod(expert_turn)

    def __init__(self, sandbox: Sandbox | None = None, **kwargs: Any):
        # backend "auto": without a working bubblewrap this refuses (a ConfigError) unless
        # the process allows the unsafe fallback (a run's config knob)
        self.sandbox = sandbox or Sandbox(SandboxLimits(cpu_seconds=2, wall_seconds=20))

        @tool
        async def run_python(code: str) -> str:
            """Run a Python program in a sandbox and return its output.

            Args:
                code: the program; print what you want to see.
            """
            r = await self.sandbox.arun_python(code)
            if r.outcome is SandboxOutcome.SANDBOX_ERROR:  # an OSError: env_error
                raise OSError(f"sandbox failed: {r.stderr[-300:]}")
            return f"[{r.outcome.value}]\n{r.stdout[-800:]}{r.stderr[-800:]}".rstrip()

        super().__init__([run_python], **kwargs)

    async def verify(self, final: ParsedTurn | None) -> Reward:
        assert self.task is not None
        code = extract_code_block(final.content) if final is not None else None
        if code is None:
            return all_of(format_ok=False, tests_pass=False)
        report = await run_unit_tests(code, self.task.metadata["tests"], self.sandbox)
        reward = all_of(format_ok=True, tests_pass=report.all_passed)
        return replace(reward, env_error=report.env_error)
