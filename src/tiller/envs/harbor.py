"""Harbor-format tasks (`env.name: harbor`): a folder of Harbor tasks, run in tiller's sandbox.

The instruction is the prompt. The agent acts through one tool, `shell(command)`, which runs
the command with bash in the task's workdir (e.g. /app) inside tiller's bubblewrap sandbox
(`tiller.tools.sandbox`: no network, rlimits, a private uid). The workdir starts with the files
the task's Dockerfile copies (`tiller.envs.harbor_format` reads the folder and refuses, in one
line, a task that needs Docker) and its state carries from one command to the next: each call
starts a fresh sandbox, unpacks the workdir, runs the command, and packs the workdir again
(also after a timeout, as a terminal keeps what a killed command wrote). Links and FIFOs the
command made carry over too: unpacking happens inside the sandbox, where nothing may land
outside the workdir, and a packed workdir is kept only once it has unpacked there. Only the
workdir persists: files written elsewhere and background processes end with their command. A
command that breaks its runner (kills it), or leaves a workdir that cannot be kept (past
`workspace_mb`, unreadable), is the policy's tool_error, and the workdir stays as it was.

When the episode ends (a plain answer, or the turn limit), the task's tests grade the final
workdir as Harbor runs them: tests/ at /tests, test.sh run from the workdir with its output in
/logs/verifier/test-stdout.txt, and the reward read as Harbor's verifier reads it:
/logs/verifier/reward.json (an object of finite numbers; `reward_key` is the one trained on)
before /logs/verifier/reward.txt (one finite number). Whose fault a missing reward is (none
written, an unreadable one, the test runner broken or timed out):

- the policy's, when its commands changed the workdir and the tests do give a reward on the
  task's untouched workdir (a control run, once per task): reward 0, the check
  `tests_broken` = 1 (0 in every graded episode, so `check/tests_broken` is the rate), and a
  warning in the log;
- the environment's (env_error) when the tests give none on the untouched workdir either, or
  no command changed it, or the sandbox did not start: the grading itself is broken.

A command that fails, times out or breaks its runner is the policy's doing and is shown to it.
The shell tool goes through the run's tool stack (retries, faults, metrics; its executor
timeout is off unless the config sets one, which must then exceed the sandbox's own deadline,
`command_timeout_s` + 30 s: `shell_timeout`); record/replay and the cache are refused: the
tests grade the state the commands left, which a replayed or cached answer does not
reproduce.

The scripted expert runs the task's solution/solve.sh through the shell tool, then answers.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import random
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tiller.envs.actions import ParsedTurn
from tiller.envs.base import Task, ToolEnv, register_env
from tiller.envs.harbor_format import HarborTask, read_tasks
from tiller.envs.source_config import HarborConfig
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError
from tiller.tools.executor import ExecutorConfig, ToolPolicy
from tiller.tools.registry import ToolError, tool
from tiller.tools.sandbox import Sandbox, SandboxLimits, SandboxOutcome

if TYPE_CHECKING:
    from tiller.config import Config

logger = logging.getLogger(__name__)

MAX_REWARD_BYTES = 65536  # of reward.txt / reward.json the runner sends back
RUNNER_SLACK_S = 30.0  # past a command's (or the tests') timeout, for the runner to finish
TESTS_BROKEN = "tests_broken"  # the check saying whether the policy broke the tests (0 or 1)


@dataclass(frozen=True)
class HarborSource:
    train: list[HarborTask]
    heldout: list[HarborTask]

    def task(self, name: str) -> HarborTask:
        return next(t for t in [*self.train, *self.heldout] if t.name == name)


# Runs inside the sandbox (as main.py, with the sandbox's interpreter): unpack the workdir,
# run one command (mode shell) or the task's tests (mode verify), report as one JSON object.
# It makes itself non-dumpable first, so the command (same uid) cannot reach into it or its
# stdout; the command runs in its own session, killed with whatever it left running.
_RUNNER = r'''
import base64, ctypes, io, json, os, shutil, signal, subprocess, sys, tarfile, tempfile, threading
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
spec = json.loads(sys.stdin.read())
os.close(0)
work, keep = spec["workdir"], spec["keep"]  # the workdir: a tmpfs of its own, like /tests

def unpack(data, dest):  # links and FIFOs carry over; nothing may land outside dest
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="tar")

with open("state.tar", "rb") as f:
    unpack(f.read(), work)
os.remove("state.tar")
if os.path.isdir("tests"):  # into the mount, whose own mode is not ours to change
    for name in os.listdir("tests"):
        src = os.path.join("tests", name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, "/tests/" + name)
    for d in ("verifier", "agent", "artifacts"):
        os.makedirs("/logs/" + d)
env = {**os.environ, **spec["env"], "PWD": work}

def run(argv, timeout, log=None):  # the output's first and last `keep` bytes are kept
    out = open(log, "wb") if log else subprocess.PIPE
    proc = subprocess.Popen(argv, cwd=work, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    head, tail, total = bytearray(), bytearray(), [0]
    def pump():
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            total[0] += len(chunk)
            room = max(keep - len(head), 0)
            head.extend(chunk[:room])
            tail.extend(chunk[room:])
            del tail[:max(len(tail) - keep, 0)]
    reader = None if log else threading.Thread(target=pump, daemon=True)
    if reader: reader.start()
    try:
        proc.wait(timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # and whatever it left running
    except ProcessLookupError:
        pass
    proc.wait()
    if reader: reader.join(5)
    if log:
        out.close()
        with open(log, "rb") as f:
            f.seek(max(os.path.getsize(log) - keep, 0))
            tail[:], total[0] = f.read(), os.path.getsize(log)
    return {"exit": proc.returncode, "timed_out": timed_out,
            "cut": total[0] - len(head) - len(tail),
            "head": bytes(head).decode("utf-8", "replace"),
            "tail": bytes(tail).decode("utf-8", "replace")}

def read(path):
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read(spec["reward_bytes"]).decode("utf-8", "replace")

def pack():  # the workdir for the next command, kept only if it unpacks as that one will
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(work, arcname=".")
    state = buf.getvalue()
    if len(state) > spec["max_state"]:
        return None, (f"it grew past env.harbor.workspace_mb={spec['max_state'] >> 20}: "
                      f"{len(state) / 2**20:.1f} MB packed")
    unpack(state, tempfile.mkdtemp())
    return base64.b64encode(state).decode(), None

if spec["mode"] == "shell":
    report = run(["bash", "-c", spec["command"]], spec["timeout"])
    try:
        report["state"], report["state_error"] = pack()
    except (OSError, tarfile.TarError) as e:
        report["state"], report["state_error"] = None, f"{type(e).__name__}: {e}"
else:
    os.chmod("/tests/test.sh", 0o755)
    report = run(["/tests/test.sh"], spec["timeout"], log="/logs/verifier/test-stdout.txt")
    report["json"] = read("/logs/verifier/reward.json")
    report["txt"] = read("/logs/verifier/reward.txt")
sys.stdout.write(json.dumps(report))
'''


def pack(files: dict[str, bytes]) -> bytes:
    """A tar of `files` (relative paths), as the runner unpacks it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def harbor_rewards(report: dict[str, Any]) -> dict[str, float]:
    """The rewards as Harbor's verifier reads them: reward.json (checked first) is an object
    of finite numbers, reward.txt one finite number; ValueError naming what is wrong."""
    if report.get("json") is not None:
        try:
            rewards = json.loads(report["json"])
        except ValueError as e:
            raise ValueError(f"reward.json is not JSON: {e}") from None
        values = rewards.values() if isinstance(rewards, dict) else [rewards]
        if not isinstance(rewards, dict) or not rewards:
            raise ValueError(f"reward.json is not an object of named rewards: "
                             f"{report['json'][:100]!r}")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise ValueError(f"reward.json holds a value that is not a finite number: "
                             f"{report['json'][:100]!r}")
        return {k: float(v) for k, v in rewards.items()}
    if report.get("txt") is not None:
        if not report["txt"].strip():
            raise ValueError("reward.txt is empty")
        try:
            value = float(report["txt"])
        except ValueError:
            raise ValueError(f"reward.txt is not a number: {report['txt'][:100]!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"reward.txt holds {value}")
        return {"reward": value}
    raise ValueError("the tests wrote neither /logs/verifier/reward.json nor reward.txt")


def shown(report: dict[str, Any], timeout: float) -> str:
    """What the policy reads of a command: its output (its start and end when it is long,
    with how much was cut between them) and how it ended."""
    text = report["head"]
    if report["cut"]:
        text += f"\n[... {report['cut']} bytes of output cut ...]\n"
    text += report["tail"]
    end = (f"[timed out after {timeout:g}s]" if report["timed_out"]
           else f"[exit {report['exit']}]")
    return f"{text.rstrip()}\n{end}".lstrip()


def shell_timeout(executor: ExecutorConfig, command_timeout_s: float) -> None:
    """The shell tool's executor timeout may not fire before the sandbox's own deadline for a
    command (`command_timeout_s` + RUNNER_SLACK_S: the runner kills the command, then packs
    the workdir): a late answer would be an env_error, its sandbox left running. One the
    config sets must exceed that deadline; unset, it is turned off here (the config written
    to the run folder shows it), as the sandbox's deadline bounds every command, and the
    executor's would also count the wait for a free sandbox slot."""
    shell = executor.tools.get("shell")
    if not ("timeout_s" in executor.default.model_fields_set
            or (shell is not None and "timeout_s" in shell.model_fields_set)):
        executor.tools["shell"] = (shell or ToolPolicy()).model_copy(update={"timeout_s": None})
        logger.info("env harbor: the shell tool has no executor timeout (unset in the config); "
                    "the sandbox's deadline, command_timeout_s + %g s, bounds each command",
                    RUNNER_SLACK_S)
        return
    timeout, deadline = executor.policy("shell").timeout_s, command_timeout_s + RUNNER_SLACK_S
    if timeout is not None and timeout <= deadline:
        raise ConfigError(
            f"config field env.tools.executor: the shell tool's timeout_s is {timeout:g} s; env "
            f"harbor needs more than env.harbor.command_timeout_s + {RUNNER_SLACK_S:g} s = "
            f"{deadline:g} s (the sandbox's own deadline for a command) or none: set "
            f"env.tools.executor.tools={{shell: {{timeout_s: {deadline + 30:g}}}}}, or leave it "
            "unset")


@register_env
class HarborEnv(ToolEnv):
    """The tasks of `env.harbor`, one sandboxed workdir per episode; configured per run."""

    name: ClassVar[str] = "harbor"
    has_difficulty: ClassVar[bool] = False  # a task is a task at every env.difficulty
    settings: ClassVar[HarborConfig]
    source: ClassVar[HarborSource]
    controls: ClassVar[dict[str, str | None]]  # per task: why its initial workdir gets no reward

    def __init__(self, wrap: Any = None):
        self.harbor: HarborTask | None = None
        self.state = b""  # the workdir, packed
        self.changed = False  # whether a command of this episode changed it
        s = self.settings
        self.keep = s.output_chars // 2

        @tool
        async def shell(command: str) -> str:
            """Run a bash command in the task's environment and return its output.

            Args:
                command: the command (a bash script: several lines are fine); it runs in the
                    task's working directory, whose files persist between commands.
            """
            return await self._shell(command)

        super().__init__([shell], wrap=wrap)

    @classmethod
    def configure(cls, cfg: Config) -> type[HarborEnv]:
        """A subclass holding this run's tasks, every folder read and checked now."""
        s = cfg.env.harbor
        if s is None:
            raise ConfigError("config field env.harbor: env.name is harbor, so name the task "
                              "folder: {tasks: path/to/tasks}")
        tools = cfg.env.tools
        if tools.replay is not None:
            raise ConfigError("config field env.tools.replay: env harbor's tests grade the "
                              "workdir the shell commands changed, which replayed answers do "
                              "not reproduce; remove it")
        if tools.executor.policy("shell").cache:
            raise ConfigError("config field env.tools.executor: a cached shell answer would "
                              "skip the command's effect on the workdir; do not cache 'shell'")
        shell_timeout(tools.executor, s.command_timeout_s)
        if not hasattr(tarfile, "tar_filter"):  # the runner's unpacking needs it
            raise ConfigError("env.name=harbor needs tarfile's extraction filters (Python "
                              "3.10.12+, 3.11.4+ or 3.12+); this is Python "
                              f"{sys.version.split()[0]}")
        train = read_tasks(s.tasks, "config field env.harbor.tasks")
        heldout = read_tasks(s.eval, "config field env.harbor.eval") if s.eval else []
        names = [t.name for t in [*train, *heldout]]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"config field env.harbor: task name(s) {', '.join(twice)} "
                              "appear twice (train and eval tasks must differ)")
        return type("HarborEnv[tasks]", (cls,), {"settings": s, "controls": {},
                                                 "source": HarborSource(train, heldout)})

    @classmethod
    def start(cls, run_dir: Path) -> None:
        """One tiny sandboxed run per distinct workdir, with the mounts the tests get: the
        sandbox must work (bubblewrap: the tasks' absolute paths exist only there), and a
        workdir it cannot make fails here, in one line, rather than in every episode."""
        first: dict[str, HarborTask] = {}
        for task in [*cls.source.train, *cls.source.heldout]:
            first.setdefault(task.workdir, task)
        for workdir, task in first.items():
            r = cls._sandbox(task, verify=True).run_python("pass")
            if not r.ok:
                raise ConfigError(f"config field env.harbor: harbor task {task.name!r}: the "
                                  f"sandbox does not run with its workdir {workdir!r}: "
                                  f"{r.outcome.value} {' '.join(r.stderr.split())[-300:]}")

    @classmethod
    def _sandbox(cls, task: HarborTask, verify: bool) -> Sandbox:
        s = cls.settings
        timeout = task.verifier_timeout_s if verify else s.command_timeout_s
        mounts = [task.workdir, "/tests", "/logs"] if verify else [task.workdir]
        limits = SandboxLimits(  # tmpfs: the workdir, or /tmp's packed copy of it and tests
            cpu_seconds=timeout, wall_seconds=timeout + RUNNER_SLACK_S, memory_mb=s.memory_mb,
            max_file_mb=s.workspace_mb, tmpfs_mb=2 * s.workspace_mb + 64,
            max_output_bytes=2 * s.workspace_mb * (1 << 20) + 2 * s.output_chars + (1 << 20))
        try:
            return Sandbox(limits, mounts=mounts)
        except ConfigError as e:
            raise ConfigError(f"env.name=harbor: {e}") from e

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int, difficulty: int = 1,
                   heldout_fraction: float = 0.2) -> list[Task]:  # type: ignore[override]
        """train: `n` tasks in seeded shuffled passes over the train folder (a later pass's
        ids get `#<pass>`); heldout: the first `n` tasks of the eval folder."""
        if split == "heldout":
            return [cls._task(t, split, t.name) for t in cls.source.heldout[:n]]
        rows, out = cls.source.train, []
        for epoch in range(-(-n // len(rows))):
            order = list(range(len(rows)))
            random.Random(f"harbor/{seed}/{epoch}").shuffle(order)
            out += [cls._task(rows[i], split, rows[i].name + (f"#{epoch}" if epoch else ""))
                    for i in order]
        return out[:n]

    @classmethod
    def _task(cls, t: HarborTask, split: str, id: str) -> Task:
        return Task(id=f"harbor/{id}", prompt=t.instruction, answer=None, split=split,
                    system=cls.settings.system, metadata={"harbor": t.name})

    @classmethod
    def task_space(cls, split: str, difficulty: int,  # type: ignore[override]
                   heldout_fraction: float = 0.2) -> int | None:
        """The eval tasks (0 without env.harbor.eval); train tasks are drawn in passes."""
        return len(cls.source.heldout) if split == "heldout" else None

    @classmethod
    def expert_turn(cls, task: Task, messages: list[dict[str, Any]], rng: random.Random,
                    guess_prob: float) -> str:  # type: ignore[override]
        """solution/solve.sh through the shell tool, then "Done." (imperfect: only "Done.")."""
        harbor = cls.source.task(task.metadata["harbor"])
        if harbor.solve is None:
            raise ConfigError(f"harbor task {harbor.name!r} has no solution/solve.sh for the "
                              "scripted expert; set sft.enabled=false and "
                              "env.tools.gate.enabled=false, or give SFT conversations")
        if any(m["role"] == "assistant" for m in messages) or rng.random() < guess_prob:
            return "Done."
        call = {"name": "shell", "arguments": {"command": harbor.solve}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        self.harbor = self.source.task(task.metadata["harbor"])
        self.state, self.changed = pack(self.harbor.files), False
        return await super().reset(task, seed)

    async def _run(self, verify: bool, spec: dict[str, Any], files: dict[str, str | bytes],
                   state: bytes) -> dict[str, Any] | str:
        """The runner's report, or why there is none (the runner broke: the command's doing,
        as the sandbox started). A sandbox that did not start raises OSError (env_error)."""
        assert self.harbor is not None
        s = self.settings
        spec = {**spec, "workdir": self.harbor.workdir, "keep": self.keep,
                "reward_bytes": MAX_REWARD_BYTES, "max_state": s.workspace_mb << 20}
        box = self._sandbox(self.harbor, verify)
        r = await box.arun_python(_RUNNER, stdin=json.dumps(spec),
                                  files={"state.tar": state, **files})
        if r.outcome is SandboxOutcome.SANDBOX_ERROR:
            raise OSError(f"the sandbox did not start: {r.stderr.strip()[-300:]}")
        try:
            report = json.loads(r.stdout)
            if not isinstance(report, dict):
                raise ValueError("not an object")
            return report
        except ValueError:
            return (f"{r.outcome.value} (exit {r.returncode}) "
                    f"{' '.join(r.stderr.split())[-300:]}").rstrip()

    async def _shell(self, command: str) -> str:
        assert self.harbor is not None
        report = await self._run(False, {"mode": "shell", "command": command,
                                         "timeout": self.settings.command_timeout_s,
                                         "env": self.harbor.env}, {}, self.state)
        if isinstance(report, str):
            raise ToolError(f"the command broke the shell: {report}")
        text = shown(report, self.settings.command_timeout_s)
        if report["state_error"]:  # the policy's doing, shown to it; the workdir stays
            raise ToolError(f"{text}\n[the workdir could not be kept ({report['state_error']}"
                            "): the command's changes are discarded]")
        self.state, self.changed = base64.b64decode(report["state"]), True
        return text

    async def verify(self, final: ParsedTurn | None) -> Reward:
        """The task's tests on the final workdir, their reward files read as Harbor reads
        them. No usable reward is the policy's fault when its commands changed the workdir
        and the tests do give one on the task's untouched workdir (reward 0, `tests_broken`,
        logged); otherwise, or when the sandbox does not start, it is an env_error."""
        assert self.harbor is not None
        t = self.harbor
        try:
            graded = await self._grade(self.state)
            if isinstance(graded, Reward):
                return graded
            control = await self._control() if self.changed else None
        except OSError as e:  # the sandbox did not start
            return Reward(0.0, {}, env_error=True, error=f"harbor task {t.name}: {e}")
        if not self.changed or control is not None:  # the grading itself fails
            also = f"; on the task's initial workdir too: {control}" if control else ""
            return Reward(0.0, {}, env_error=True, error=f"harbor task {t.name}: {graded}{also}")
        logger.warning("harbor task %s: the tests gave no reward after the policy's commands "
                       "(%s), while they do on the task's initial workdir: the policy broke "
                       "them, reward 0", t.name, graded)
        return Reward(0.0, {TESTS_BROKEN: 1.0})

    async def _grade(self, state: bytes) -> Reward | str:
        """The tests' reward on the workdir `state`, or why there is none. OSError: the sandbox
        did not start."""
        assert self.harbor is not None
        t = self.harbor
        tests = {f"tests/{name}": data for name, data in t.tests.items()}
        report = await self._run(True, {"mode": "verify", "timeout": t.verifier_timeout_s,
                                        "env": {**t.env, **t.verifier_env}}, tests, state)
        if isinstance(report, str):
            return f"the test runner broke: {report}"
        try:
            rewards = harbor_rewards(report)
        except ValueError as e:
            ended = (f"timed out after {t.verifier_timeout_s:g}s" if report["timed_out"]
                     else f"exit {report['exit']}")
            return (f"{e}; test.sh {ended}, output ends: "
                    f"{' '.join(report['tail'].split())[-200:]!r}")
        key = self.settings.reward_key
        if key not in rewards and len(rewards) != 1:
            return (f"reward.json has no {key!r} (env.harbor.reward_key) among "
                    f"{', '.join(rewards)}")
        value = rewards[key] if key in rewards else next(iter(rewards.values()))
        return Reward(value, {**rewards, TESTS_BROKEN: 0.0})

    async def _control(self) -> str | None:
        """Why the tests give no usable reward on the task's untouched workdir (None: they
        do). Run once per task and run, when an episode first needs it."""
        assert self.harbor is not None
        name = self.harbor.name
        if name not in self.controls:
            graded = await self._grade(pack(self.harbor.files))
            self.controls[name] = None if isinstance(graded, Reward) else graded
        return self.controls[name]
