"""The verifier library: extractors are strict, checks are exact, combinators gate, and hidden
unit tests in the sandbox tell the policy's failures from the sandbox's."""

from __future__ import annotations

import asyncio
import shutil
import sys

import pytest

from tiller.config import ConfigError
from tiller.envs import verifiers as v
from tiller.tools.sandbox import Sandbox, SandboxLimits, SandboxOutcome, SandboxResult

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap not installed")
LIMITS = SandboxLimits(cpu_seconds=2, wall_seconds=10, memory_mb=256)


def test_all_of_gates_and_keeps_the_breakdown():
    r = v.all_of(format_ok=True, correct=False)
    assert r.value == 0.0 and dict(r.checks) == {"format_ok": 1.0, "correct": 0.0}
    assert v.all_of(format_ok=True, correct=True).value == 1.0
    # partial credit from a lenient scorer does not pass a gate
    assert v.all_of(format_ok=True, score=0.9).value == 0.0
    assert v.all_of(format_ok=True, score=1.0).value == 1.0
    assert not v.all_of(a=True).env_error


def test_weighted_sum_is_explicit():
    r = v.weighted_sum({"format_ok": 0.2, "correct": 0.8}, format_ok=True, correct=False)
    assert r.value == pytest.approx(0.2) and r.checks["correct"] == 0.0
    with pytest.raises(ValueError, match="differ"):
        v.weighted_sum({"format_ok": 1.0}, format_ok=True, correct=True)


def test_extract_tagged_is_strict():
    assert v.extract_tagged("<answer> 42 </answer>") == "42"
    assert v.extract_tagged("Let me think: 6*7.\n<answer>42</answer>\n") == "42"
    assert v.extract_tagged("<answer>42</answer> or maybe 41") is None  # text after it
    assert v.extract_tagged("<answer>41</answer><answer>42</answer>") is None  # hedging
    assert v.extract_tagged("The answer is 42.") is None
    assert v.extract_tagged(None) is None


def test_extract_answer_is_takes_only_a_final_line_of_that_form():
    assert v.extract_answer_is("The answer is Orla Penn.") == "Orla Penn"
    assert v.extract_answer_is("I searched twice.\nthe answer is 42") == "42"
    # X is everything up to the final period, so trailing words spoil the match
    assert not v.normalized_match(v.extract_answer_is("The answer is 42. I think."), "42")
    assert v.extract_answer_is("Maybe the answer is 42, or 43.\nNot sure.") is None
    assert v.extract_answer_is("") is None


def test_extract_code_block_needs_exactly_one_python_block():
    one = "Here:\n```python\ndef f():\n    return 1\n```\nDone."
    assert v.extract_code_block(one) == "def f():\n    return 1\n"
    assert v.extract_code_block(one + "\n```python\nx = 2\n```") is None
    assert v.extract_code_block("```\nx = 1\n```") is None
    assert v.extract_code_block("def f(): return 1") is None


def test_exact_and_normalized_match():
    assert v.exact_match(" Paris ", "Paris") and not v.exact_match("paris", "Paris")
    assert v.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert v.normalized_match("the Orla Penn.", "Orla Penn")
    assert v.normalized_match("dastrin", ["Lomir", "Dastrin"])
    assert not v.normalized_match("Orla", "Orla Penn")
    assert not v.normalized_match("the", "a")  # empty after normalization is no answer
    assert not v.normalized_match(None, "x")


def test_numeric_match():
    assert v.numeric_match("1,234.5", 1234.5)
    assert v.numeric_match("0.1", 0.1000001, rel_tol=1e-5)
    assert v.numeric_match(3, 3.0)
    assert not v.numeric_match("about 3", 3)
    assert not v.numeric_match("3 apples", 3)
    assert not v.numeric_match("nan", 3)
    assert not v.numeric_match("1e400", float("inf"))
    assert not v.numeric_match("2.5", 3, abs_tol=0.4)
    assert v.numeric_match("2.5", 3, abs_tol=0.5)


def test_regex_match_is_a_full_match():
    assert v.regex_match(" 2024-03-01 ", r"\d{4}-\d{2}-\d{2}")
    assert not v.regex_match("on 2024-03-01", r"\d{4}-\d{2}-\d{2}")
    assert not v.regex_match(None, r".*")


def test_json_schema_valid():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert v.json_schema_valid('{"n": 3}', schema)
    assert v.json_schema_valid({"n": 3}, schema)
    assert not v.json_schema_valid('{"n": "3"}', schema)
    assert not v.json_schema_valid("{n: 3}", schema)  # not JSON


def test_json_schema_valid_names_its_extra_when_jsonschema_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(ConfigError, match=r"^json_schema_valid needs the 'jsonschema' package, "
                                          r"which is not installed: pip install 'tiller\[jsonsch"):
        v.json_schema_valid("{}", {"type": "object"})


def test_state_matches():
    assert v.state_matches({"t": [(1, "a")]}, {"t": [(1, "a")]})
    assert not v.state_matches({"t": [(1, "a")]}, {"t": [(1, "b")]})
    assert v.state_matches([3, 1, 2], [1, 2, 3], compare=lambda a, b: sorted(a) == sorted(b))


def test_plain_keeps_exact_types():
    assert v.plain(1) != v.plain(True) != v.plain(1.0)
    assert v.plain([1, "a"]) != v.plain((1, "a"))
    assert v.plain({"b": 1, "a": 2}) == v.plain({"a": 2, "b": 1})

    class Liar(int):
        def __eq__(self, other):
            return True

    assert v.plain(Liar(0)) != v.plain(3)


def _tests(code: str, tests: list, box: Sandbox | None = None) -> v.UnitTestReport:
    return asyncio.run(v.run_unit_tests(code, tests, box or Sandbox(LIMITS)))


@needs_bwrap
def test_unit_tests_pass_and_fail():
    tests = [("solve([1, 2])", 3), ("solve([])", 0), "assert solve([5]) == 5"]
    good = _tests("def solve(xs):\n    print('chatter ' * 10000)\n    return sum(xs)\n", tests)
    assert good.all_passed and good.passed == 3 and not good.env_error
    wrong_type = _tests("def solve(xs):\n    return float(sum(xs))\n", tests)
    assert wrong_type.passed == 1 and not wrong_type.all_passed  # only the assert passes
    assert "expected" in wrong_type.detail
    assert _tests("def solve(:\n", tests).passed == 0  # syntax error
    assert _tests("raise SystemExit(0)", tests).passed == 0
    assert not _tests("def solve(xs): return 0", []).all_passed  # no tests is no evidence


@needs_bwrap
def test_unit_tests_resist_reward_hacks():
    tests = [("solve([1, 2])", 3)]
    liar = "class A(int):\n    def __eq__(self, o): return True\ndef solve(xs): return A(0)"
    assert _tests(liar, tests).passed == 0
    fake_verdict = "import os\nprint('[]')\nos._exit(0)"  # no nonce, no verdict
    assert _tests(fake_verdict, tests).passed == 0
    # the expected values never enter the sandbox, so the code cannot read them
    snoop = "import os, sys\ndef solve(xs): return str(os.listdir('.')) + sys.stdin.read()"
    assert _tests(snoop, tests).passed == 0


@needs_bwrap
def test_unit_test_timeout_is_the_policys_failure():
    box = Sandbox(SandboxLimits(cpu_seconds=1, wall_seconds=3))
    busy = "import time\nt0 = time.monotonic()\nwhile time.monotonic() < t0 + 30:\n    pass\n"
    report = _tests(busy, [("1", 1)], box)
    assert report.passed == 0 and not report.env_error and "timeout" in report.detail


def test_sandbox_failure_is_an_env_error():
    class BrokenSandbox:
        async def arun_python(self, code, stdin="", files=None):
            return SandboxResult(SandboxOutcome.SANDBOX_ERROR, None, "", "bwrap: no", 0.0, "bwrap")

    report = _tests("def solve(xs): return 0", [("solve([])", 0)], BrokenSandbox())  # type: ignore[arg-type]
    assert report.env_error and not report.all_passed


# Each forger tries to reach the verdict's nonce or to fake a verdict, then exits at once.
_FORGERS = {
    "main_global": "import os, sys\nm = sys.modules['__main__']\n"
                   "n = getattr(m, '_nonce', '') or getattr(m, 'nonce', '')\n"
                   "sys.__stdout__.write('\\n' + n + '[{\"ok\": true}]\\n')\n"
                   "sys.__stdout__.flush()\nos._exit(0)",
    "frames": "import gc, os, sys\nf = sys._getframe()\nseen = []\nwhile f is not None:\n"
              "    seen += [v for v in f.f_locals.values() if isinstance(v, str)]\n"
              "    f = f.f_back\nseen += [o for o in gc.get_objects() if isinstance(o, str)]\n"
              "for n in seen:\n    if len(n) == 32:\n"
              "        os.write(1, ('\\n' + n + '[{\"ok\": true}]\\n').encode())\nos._exit(0)",
    "proc_fds": "import glob, os\nfor p in glob.glob('/proc/*/fd/*'):\n    try:\n"
                "        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)\n"
                "        n = os.read(fd, 4096).decode(errors='replace')[-32:]\n"
                "        os.write(1, ('\\n' + n + '[{\"ok\": true}]\\n').encode())\n"
                "    except OSError:\n        pass\nos._exit(0)",
}


@needs_bwrap
@pytest.mark.parametrize("forger", sorted(_FORGERS))
def test_unit_test_verdict_cannot_be_forged(forger):
    """The nonce is out of the policy code's reach: forged verdicts fail, never raise."""
    for tests in (["assert False"], [("1 + 1", 3)]):
        report = _tests(_FORGERS[forger], tests)
        assert report.passed == 0 and not report.env_error, report


@needs_bwrap
def test_malformed_results_fail_the_policy_not_the_env():
    """Results the code forged through the harness's pipe must have the right shape."""
    forge = ("import json, os\nfor fd in range(3, 10):\n    try:\n"
             "        os.write(fd, json.dumps([{}]).encode())\n    except OSError:\n"
             "        pass\nos._exit(0)")
    for tests in (["assert True"], [("1", 1)]):
        report = _tests(forge, tests)
        assert report.passed == 0 and not report.env_error and "malformed" in report.detail
    assert v._parse_verdict('[{"ok": true}]', [("1", 1)]) == 'test 0: {\'ok\': True}'
    assert v._parse_verdict('[{"value": 1}]', ["assert 1"]).startswith("test 0")
    assert v._parse_verdict('{"a": 1}', ["assert 1"]) == "dict results for 1 tests"
    assert v._parse_verdict('[{"ok": true}]', ["assert 1"]) == [{"ok": True}]


@needs_bwrap
def test_policy_code_cannot_read_the_harness_parents_memory():
    """The parent holds the nonce; /proc/<parent>/mem must be closed to the child (same uid)."""
    peek = ("import os\ndef peek():\n    try:\n"
            "        open(f'/proc/{os.getppid()}/mem', 'rb').close()\n"
            "    except OSError:\n        return 'denied'\n    return 'readable'\n")
    assert _tests(peek, [("peek()", "denied")]).all_passed


@needs_bwrap
def test_code_killing_itself_is_the_policys_failure_not_a_harness_traceback():
    # SIGKILL takes no handler: the harness must pass the child's fate on without crashing
    report = _tests("import os\nos.kill(os.getpid(), 9)", ["True"])
    assert (report.passed, report.env_error) == (0, False)
    assert "Traceback" not in report.detail and "killed" in report.detail


@needs_bwrap
def test_a_failing_harness_is_env_error_and_the_code_cannot_pose_as_one():
    # a harness that cannot read its header exits HARNESS_FAILED before any code runs ...
    box = Sandbox(LIMITS)
    result = asyncio.run(box.arun_python(v._HARNESS, stdin="99\n{"))
    assert result.returncode == v.HARNESS_FAILED
    # ... while code that exits with that status itself is the policy's failure
    report = _tests(f"import os\nos._exit({v.HARNESS_FAILED})", ["True"])
    assert (report.passed, report.env_error) == (0, False)
