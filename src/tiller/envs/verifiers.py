"""Verifiers: pure functions from an episode's outcome to a `Reward`.

A reward is gated, not summed: the default shape is 1 when every necessary check passes and 0
otherwise, with each check kept in `checks` so a learning curve can be explained. `env_error`
marks an episode the environment broke, which is not the policy's failure.

The library has three layers, each small enough to read at a glance:

* **extractors** pull the answer out of the final turn, strictly: an answer buried in longer
  text, or hedged between two answers, is no answer (`extract_tagged`, `extract_answer_is`,
  `extract_code_block`);
* **checks** compare one extracted answer or state with the target and return a bool
  (`exact_match`, `normalized_match`, `numeric_match`, `regex_match`, `json_schema_valid`,
  `state_matches`), or run hidden unit tests in the sandbox (`run_unit_tests`);
* **combinators** turn named checks into a `Reward`: `all_of` gates (the default),
  `weighted_sum` adds partial credit and is only for when it is explicitly wanted.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import secrets
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiller.errors import require_package
from tiller.tools.sandbox import Sandbox, SandboxLimits, SandboxOutcome

# the check a judge's score (rl.judge) is recorded under, beside the verifier's checks; no
# reward entry may take the name
JUDGE = "judge"


@dataclass(frozen=True)
class Reward:
    value: float
    checks: Mapping[str, float] = field(default_factory=dict)
    turn_rewards: tuple[float, ...] | None = None
    env_error: bool = False
    error: str | None = None  # with env_error: what broke (e.g. the scorer's exception)


# ---- combinators -------------------------------------------------------------------------


def all_of(**checks: bool | float) -> Reward:
    """1.0 only if every named check passes; the breakdown keeps each one.

    A check passes when it is True or a score of at least 1.0: partial credit (0.9 from a
    lenient scorer) fails the gate, which is the point of gating.
    """
    breakdown = {k: float(v) for k, v in checks.items()}
    return Reward(value=float(all(v >= 1.0 for v in breakdown.values())), checks=breakdown)


def weighted_sum(weights: Mapping[str, float], **checks: bool | float) -> Reward:
    """Σ weight·check, for when partial credit is wanted on purpose (shaping, curricula).

    Every check needs a weight and every weight a check, so a renamed check cannot silently
    drop out of the reward.
    """
    if set(weights) != set(checks):
        raise ValueError(f"weights {sorted(weights)} and checks {sorted(checks)} differ")
    breakdown = {k: float(v) for k, v in checks.items()}
    return Reward(value=sum(weights[k] * v for k, v in breakdown.items()), checks=breakdown)


# ---- extractors: strict, so an answer buried in longer text is no answer ------------------


def extract_tagged(text: str | None, tag: str = "answer") -> str | None:
    """The content of the one `<tag>...</tag>` that ends the text (reasoning may precede it).

    None if there is no such block, more than one (hedging), or anything after it.
    """
    if text is None or text.count(f"<{tag}>") != 1 or text.count(f"</{tag}>") != 1:
        return None
    m = re.search(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>\s*\Z", text, re.DOTALL)
    return m.group(1).strip() if m else None


_ANSWER_IS = re.compile(r"the answer is\s*:?\s+(.+?)\s*\.?\s*", re.IGNORECASE)


def extract_answer_is(text: str | None) -> str | None:
    """X from a last line that is exactly "The answer is X." (the period is optional)."""
    if not text or not text.strip():
        return None
    m = _ANSWER_IS.fullmatch(text.strip().splitlines()[-1].strip())
    return m.group(1) if m else None


_CODE_BLOCK = re.compile(r"```([\w+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code_block(text: str | None, lang: str = "python") -> str | None:
    """The body of the only fenced code block tagged `lang`; None if there is none or several."""
    if text is None:
        return None
    blocks = [body for tag, body in _CODE_BLOCK.findall(text) if tag.lower() == lang]
    return blocks[0] if len(blocks) == 1 else None


# ---- checks: each small and pure -----------------------------------------------------------


def exact_match(answer: str | None, target: str) -> bool:
    """Byte-for-byte equality after stripping surrounding whitespace."""
    return answer is not None and answer.strip() == target.strip()


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, drop punctuation and articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalized_match(answer: str | None, targets: str | Iterable[str]) -> bool:
    """True if the normalized answer equals any normalized target (and is not empty)."""
    if answer is None:
        return False
    norm = normalize_answer(answer)
    options = [targets] if isinstance(targets, str) else list(targets)
    return bool(norm) and any(norm == normalize_answer(t) for t in options)


_NUMBER = re.compile(
    r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d*)?([eE][-+]?\d+)?"  # 1,234.5e3
    r"|[-+]?\.\d+([eE][-+]?\d+)?"  # .5
)


def parse_number(text: str | None) -> float | None:
    """The number the whole text spells (thousands commas allowed), else None."""
    if text is None or not _NUMBER.fullmatch(text.strip()):
        return None
    return float(text.strip().replace(",", ""))


def numeric_match(
    answer: str | float | None, target: float, abs_tol: float = 1e-9, rel_tol: float = 1e-9
) -> bool:
    """|answer - target| within `abs_tol` or `rel_tol`·|target|; text must be only a number."""
    value = parse_number(answer) if isinstance(answer, str) or answer is None else float(answer)
    if value is None or not math.isfinite(value):
        return False
    return math.isclose(value, target, rel_tol=rel_tol, abs_tol=abs_tol)


def regex_match(answer: str | None, pattern: str | re.Pattern[str], flags: int = 0) -> bool:
    """The whole (stripped) answer matches `pattern`; a match inside it is not enough."""
    return answer is not None and re.fullmatch(pattern, answer.strip(), flags) is not None


def json_schema_valid(answer: str | Any, schema: Mapping[str, Any]) -> bool:
    """The answer (JSON text, or an already parsed value) is valid under `schema`."""
    jsonschema = require_package("jsonschema", "jsonschema", "json_schema_valid")

    if isinstance(answer, str):
        try:
            answer = json.loads(answer)
        except json.JSONDecodeError:
            return False
    validator_cls = jsonschema.validators.validator_for(schema)
    return validator_cls(schema).is_valid(answer)


def state_matches(
    final: Any, target: Any, compare: Callable[[Any, Any], bool] | None = None
) -> bool:
    """The env's final state equals the target state (or `compare(final, target)` says so)."""
    return bool(compare(final, target)) if compare is not None else final == target


# ---- unit tests in the sandbox --------------------------------------------------------------

UnitTest = str | tuple[str, Any]
"""A hidden test: `(expression, expected)`, e.g. `("solve([3, 1])", 4)`, compared on the host
with exact types; or statements (`"assert solve([3, 1]) == 4"`) that pass if nothing raises."""


@dataclass(frozen=True)
class UnitTestReport:
    """How the hidden tests went. `env_error`: the sandbox itself failed, so the policy's code
    never ran and the episode says nothing about the policy."""

    passed: int
    total: int
    env_error: bool = False
    detail: str = ""

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total and not self.env_error


def plain(value: Any) -> Any:
    """A JSON encoding of plain data that keeps exact types, so `1 == True == 1.0` and a
    subclass with a lying `__eq__` all compare unequal to the real thing."""
    t = type(value)
    if value is None or t in (bool, int, str):
        return [t.__name__, value]
    if t is float:
        return ["float", repr(value)]
    if t in (list, tuple):
        return [t.__name__, [plain(v) for v in value]]
    if t is dict:
        return ["dict", sorted(([plain(k), plain(v)] for k, v in value.items()), key=repr)]
    return ["unsupported", t.__name__]


# The harness is two processes. The parent reads the code and the tests (a length-prefixed JSON
# header on stdin, read without read-ahead), forks a child, and only then reads the nonce that
# marks its verdict line: the child, which runs the policy's code, never has the nonce in its
# memory, its stdin is closed before the parent reads the nonce, and it may only start once the
# nonce is read; its stdout/stderr go to /dev/null. It sends raw results to the parent through a
# pipe, and the parent writes the one verdict line. Expected values never enter the sandbox: the
# host compares each expression's value. The code can still forge the results it sends through
# the pipe (or lie with `__eq__`), which only fools statement tests: they are weaker evidence.
HARNESS_FAILED = 86  # the harness's own exit code when it (not the code under test) failed

_HARNESS = (
    "from __future__ import annotations\nimport ctypes, io, json, os, signal, sys\n\n"
    + f"HARNESS_FAILED = {HARNESS_FAILED}\n\n"
    + inspect.getsource(plain)
    + """

def _read_exact(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise EOFError("short header")
        data += chunk
    return data


def _header():
    size = b""
    while not size.endswith(b"\\n"):  # byte by byte: no read-ahead into the nonce
        byte = os.read(0, 1)
        if not byte:
            raise EOFError("no header")
        size += byte
    return json.loads(_read_exact(int(size)))


def _child(p, results_w, go_r):
    os.close(0)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.read(go_r, 1)  # the parent has read the nonce: nothing left on stdin
    os.close(go_r)
    sys.stdout = sys.stderr = io.StringIO()
    tests, ns = p["tests"], {"__name__": "solution"}
    try:
        exec(compile(p["code"], "solution.py", "exec"), ns)
    except BaseException as e:
        results = [{"error": f"solution: {type(e).__name__}: {e}"[:300]}] * len(tests)
    else:
        results = []
        for i, t in enumerate(tests):
            try:
                if isinstance(t, str):
                    exec(compile(t, f"test_{i}", "exec"), dict(ns))
                    results.append({"ok": True})
                else:
                    results.append({"value": plain(eval(t[0], dict(ns)))})
            except BaseException as e:
                results.append({"error": f"{type(e).__name__}: {e}"[:300]})
    data = json.dumps(results).encode()
    while data:
        data = data[os.write(results_w, data):]
    os._exit(0)


def _main():
    try:
        _setup_and_run()
    except BaseException:  # the harness itself failed, not the code under test
        os._exit(HARNESS_FAILED)


def _setup_and_run():
    p = _header()
    results_r, results_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(results_r)
        os.close(go_w)
        _child(p, results_w, go_r)
    os.close(results_w)
    os.close(go_r)
    # Not dumpable: the child (same uid) can no longer read or write our memory through
    # /proc/<pid>/mem, where the nonce is about to be.
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    nonce = sys.stdin.read().strip()  # the rest of stdin
    os.close(0)  # so the child cannot reopen it through /proc/<parent>/fd/0
    os.write(go_w, b"g")
    os.close(go_w)
    chunks = []
    while chunk := os.read(results_r, 1 << 16):
        chunks.append(chunk)
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):  # e.g. SIGXCPU: the sandbox reads the child's fate off ours
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these take no handler
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    if os.waitstatus_to_exitcode(status) != 0:
        os._exit(1)  # the code's own exit code may not pose as HARNESS_FAILED
    sys.stdout.write("\\n" + nonce + b"".join(chunks).decode(errors="replace") + "\\n")
    sys.stdout.flush()


_main()
"""
)


UNIT_TEST_LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=20)


async def run_unit_tests(
    code: str,
    tests: Sequence[UnitTest],
    sandbox: Sandbox | None = None,
    limits: SandboxLimits = UNIT_TEST_LIMITS,
) -> UnitTestReport:
    """Run `code`, then every test (each in a fresh copy of the code's namespace), in one
    sandboxed process; see `UnitTest` for the two kinds of test.

    A timeout, a crash or a missing verdict fails every test (the policy's code did it); a
    sandbox that could not start, or a harness that failed before running the code (exit
    status `HARNESS_FAILED`, which the code's own exit status is remapped away from), is an
    `env_error`.
    """
    box = sandbox or Sandbox(limits)
    nonce = secrets.token_hex(16)
    sent = [t if isinstance(t, str) else [t[0]] for t in tests]
    header = json.dumps({"code": code, "tests": sent})
    stdin = f"{len(header.encode())}\n{header}{nonce}"
    result = await box.arun_python(_HARNESS, stdin=stdin)
    total = len(tests)
    if result.outcome is SandboxOutcome.SANDBOX_ERROR or result.returncode == HARNESS_FAILED:
        return UnitTestReport(0, total, env_error=True, detail=result.stderr[-500:])
    verdicts = [ln for ln in result.stdout.splitlines() if ln.startswith(nonce)]
    if result.outcome is not SandboxOutcome.OK or len(verdicts) != 1:
        why = f"no verdict (sandbox outcome {result.outcome.value}): {result.stderr[-300:]}"
        return UnitTestReport(0, total, detail=why)
    results = _parse_verdict(verdicts[0][len(nonce) :], tests)
    if isinstance(results, str):
        return UnitTestReport(0, total, detail=f"malformed verdict: {results}")
    fails = []
    for i, (test, got) in enumerate(zip(tests, results, strict=True)):
        if "error" in got:
            fails.append(f"test {i}: {got['error']}")
        elif not isinstance(test, str) and got["value"] != json.loads(json.dumps(plain(test[1]))):
            fails.append(f"test {i}: {test[0]} gave {got['value']}, expected {plain(test[1])}")
    return UnitTestReport(total - len(fails), total, detail="\n".join(fails[:5]))


def _parse_verdict(text: str, tests: Sequence[UnitTest]) -> list[dict[str, Any]] | str:
    """The per-test results of a verdict line, or why they are malformed. The child that ran the
    policy's code wrote them, so their shape is checked strictly: one object per test, either
    `{"error": str}`, `{"ok": true}` for a statement test or `{"value": ...}` for an expression
    test. A malformed verdict fails every test (the policy's code wrote it), it never raises."""
    try:
        results = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e})"
    if not isinstance(results, list) or len(results) != len(tests):
        n = len(results) if isinstance(results, list) else type(results).__name__
        return f"{n} results for {len(tests)} tests"
    for i, (test, got) in enumerate(zip(tests, results, strict=True)):
        if not isinstance(got, dict) or len(got) != 1:
            return f"test {i}: {str(got)[:100]}"
        (kind, value), = got.items()
        valid = ((kind == "error" and isinstance(value, str))
                 or (kind == "ok" and value is True and isinstance(test, str))
                 or (kind == "value" and not isinstance(test, str)))
        if not valid:
            return f"test {i}: {str(got)[:100]}"
    return results
