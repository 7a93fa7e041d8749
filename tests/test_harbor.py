"""Harbor-format tasks (`env.name: harbor`) in tiller's bubblewrap sandbox: the three example
tasks (examples/harbor/tasks) graded by their own tests at 1.0 for the scripted expert (their
solve.sh through the shell tool) and near 0 for a random policy; the workdir carries between
commands and nothing else does; rewards read as Harbor reads them; a task that needs Docker or
misses its tests is one line naming it before any work; a tiny run trains on them."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import pytest
from helpers import TextActor, rl_rows

from tiller.config import load_config
from tiller.controller import train
from tiller.envs.harbor import HarborEnv, harbor_rewards
from tiller.envs.harbor_format import read_tasks
from tiller.envs.verifiers import Reward
from tiller.errors import ConfigError
from tiller.observe.evaluation import is_success
from tiller.rollout.agent_loop import EpisodeLimits, run_episode
from tiller.rollout.collect import collect_expert
from tiller.run import Run
from tiller.tools.sandbox import Sandbox
from tiller.tools.stack import ToolStack

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "harbor" / "config.yaml"
TASKS = ROOT / "examples" / "harbor" / "tasks"
LIMITS = EpisodeLimits(max_turns=4, max_episode_tokens=4096)


def harbor(tmp_path: Path, tasks: Path = TASKS, **settings) -> type[HarborEnv]:
    section = json.dumps({"tasks": str(tasks), **settings})
    cls = HarborEnv.configure(load_config(EXAMPLE, [f"env.harbor={section}"]))
    cls.start(tmp_path)
    return cls


def shell(command: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'shell', 'arguments': {'command': command}})}" \
           "\n</tool_call>"


def play(cls, tokenizer, turns, name="write-file"):
    task = next(t for t in cls.make_tasks("train", 3, 0) if t.metadata["harbor"] == name)
    return asyncio.run(run_episode(cls(), task, TextActor(tokenizer, turns), tokenizer, seed=0,
                                   limits=LIMITS))


RANDOM_COMMANDS = ["ls", "cat notes.txt", "pwd", "echo hello > greeting.txt", "python3 calc.py",
                   "sqlite3 shop.db .tables", "echo 0 > answer.txt", "rm -f calc.py"]
ENDLESS_LOOP = "printf 'while True:\\n    pass\\n' > calc.py"  # test.sh then times out
HOSTILE_COMMANDS = ["ln -s /usr/bin/python3 py", "mkfifo pipe", ENDLESS_LOOP,
                    "sleep 5"]  # past command_timeout_s=2


def quick_tasks(tmp_path: Path) -> Path:
    """The example tasks with a 5 s verifier timeout (a broken test run ends sooner)."""
    folder = tmp_path / "quick"
    shutil.copytree(TASKS, folder)
    for toml in folder.glob("*/task.toml"):
        toml.write_text(toml.read_text().replace("timeout_sec = 60.0", "timeout_sec = 5.0", 1))
    return folder


def stacked(cls: type[HarborEnv], tmp_path: Path, *overrides: str) -> ToolStack:
    """The run's tool stack for `cls`'s config: executor (its derived shell timeout), faults,
    metrics, as a run builds it."""
    cfg = load_config(EXAMPLE, [f"env.harbor={json.dumps(cls.settings.model_dump())}",
                                *overrides])
    HarborEnv.configure(cfg)
    return ToolStack(cfg.env.tools, tmp_path)


def test_the_expert_solves_every_example_task(tmp_path, tokenizer):
    cls = harbor(tmp_path)
    tasks = cls.make_tasks("train", 3, seed=0)
    assert sorted(t.metadata["harbor"] for t in tasks) == ["fix-bug", "sqlite-query",
                                                           "write-file"]
    experts = collect_expert(cls, tasks, tokenizer, guess=0.0, limits=LIMITS, seed=0)
    for t in experts:
        assert t.status.value == "completed" and t.reward.value == 1.0, (t.task_id, t.info)
        [(_, result)] = t.tool_results
        assert result.content == "[exit 0]"
    assert next(t for t in experts if t.task_id.endswith("sqlite-query")).reward.checks == {
        "reward": 1.0, "answered": 1.0, "tests_broken": 0.0}  # reward.json: named rewards



@pytest.mark.slow
def test_a_random_policy_with_hostile_commands_scores_none_and_is_never_env_error(tmp_path,
                                                                                  tokenizer):
    """Plausible commands, junk, and hostile ones (links, a FIFO, an endless loop written into
    the code, a sleep past the command timeout) through the run's tool stack under its default
    executor settings: nothing the policy does is an env_error, and it scores near 0."""
    cls = harbor(tmp_path, tasks=quick_tasks(tmp_path), command_timeout_s=2)
    stack = stacked(cls, tmp_path)
    tasks = cls.make_tasks("train", 3, seed=0)

    def args(rng: random.Random, junk: str) -> dict:  # hostile half the time, else plausible
        pool = HOSTILE_COMMANDS if rng.random() < 0.5 else [*RANDOM_COMMANDS, junk]
        return {"command": rng.choice(pool)}

    async def randoms():
        return await asyncio.gather(*(
            run_episode(cls(wrap=stack.wrapper(f"ep{i}")), t,
                        TextActor(tokenizer, tools=["shell"], make_args=args), tokenizer,
                        seed=i, limits=LIMITS) for i, t in enumerate(tasks * 10)))

    try:
        rand = asyncio.run(randoms())
    finally:
        stack.close()
    commands = [r.call.arguments.get("command") for t in rand for _, r in t.tool_results]
    assert len(commands) >= 10  # the random policy did run commands, hostile ones among them
    assert set(HOSTILE_COMMANDS) <= set(commands), set(commands)
    assert all(t.env_errors == 0 for t in rand), [t.info for t in rand if t.env_errors]
    assert sum(map(is_success, rand)) / len(rand) <= 0.05
    # the endless loop in calc.py: its tests time out, the policy's fault (reward 0)
    broke = [t for t in rand if t.reward.checks.get("tests_broken")]
    assert broke and all(t.task_id.endswith("fix-bug") and t.reward == Reward(
        0.0, {"tests_broken": 1.0}) and ENDLESS_LOOP in [r.call.arguments["command"] for _, r in
                                                         t.tool_results if r.outcome.value == "ok"]
                         for t in broke)


@pytest.mark.slow
def test_hostile_commands_are_the_policys_doing(tmp_path, tokenizer):
    """Each hostile command's outcome, through the run's tool stack: links and a FIFO carry
    over, a sleep past command_timeout_s is the policy's timed-out command (not the
    executor's env_error), and an endless loop in the code makes the tests time out: reward
    0, tests_broken, never an env_error."""
    cls = harbor(tmp_path, tasks=quick_tasks(tmp_path), command_timeout_s=2)
    stack = stacked(cls, tmp_path)
    task = next(t for t in cls.make_tasks("train", 3, 0) if t.metadata["harbor"] == "fix-bug")
    try:
        traj = asyncio.run(run_episode(
            cls(wrap=stack.wrapper("ep")), task,
            TextActor(tokenizer, [shell(c) for c in HOSTILE_COMMANDS] + ["Done."]), tokenizer,
            seed=0, limits=EpisodeLimits(max_turns=6, max_episode_tokens=4096)))
        stats = stack.stats()
    finally:
        stack.close()
    assert [(r.outcome.value, r.content) for _, r in traj.tool_results] == [
        ("ok", "[exit 0]"), ("ok", "[exit 0]"), ("ok", "[exit 0]"),
        ("ok", "[timed out after 2s]")]
    assert traj.status.value == "completed" and traj.env_errors == 0
    assert traj.reward.value == 0.0 and traj.reward.checks == {"tests_broken": 1.0}
    assert stats["tool_timeouts/shell"] == 0.0 and stats["ok_rate/shell"] == 1.0


@pytest.mark.slow
def test_a_sleep_past_the_default_command_timeout_is_the_policys(tmp_path, tokenizer):
    """Under every default timeout (command_timeout_s 30, the executor's untouched), a command
    that outlives the command timeout is killed by the sandbox and shown to the policy; the
    executor does not fire first (an env_error, its sandbox left running)."""
    cls = harbor(tmp_path)
    assert cls.settings.command_timeout_s == 30
    stack = stacked(cls, tmp_path)
    task = next(t for t in cls.make_tasks("train", 3, 0) if t.metadata["harbor"] == "write-file")
    try:
        traj = asyncio.run(run_episode(
            cls(wrap=stack.wrapper("ep")), task,
            TextActor(tokenizer, [shell("echo hello harbor > greeting.txt; sleep 40"),
                                  "Done."]), tokenizer, seed=0, limits=LIMITS))
    finally:
        stack.close()
    [(_, result)] = traj.tool_results
    assert (result.outcome.value, result.content) == ("ok", "[timed out after 30s]")
    assert traj.env_errors == 0 and traj.reward.value == 1.0


def test_the_workdir_carries_between_commands_and_nothing_else_does(tmp_path, tokenizer):
    cls = harbor(tmp_path)
    traj = play(cls, tokenizer, [
        shell("echo kept > /app/x && chmod +x /app/x && mkdir -p d/e && echo gone > /tmp/y "
              "&& (sleep 60 &) && pwd && cat notes.txt"),
        shell("cat /app/x; test -x /app/x && echo executable; ls d; cat /tmp/y; "
              "pgrep sleep || echo no-sleep; echo $HOME"),
        "Done."])
    first, second = (r.content for _, r in traj.tool_results)
    assert first == "/app\nThe greeting goes in greeting.txt, next to this file.\n[exit 0]"
    assert second.splitlines() == ["kept", "executable", "e",
                                   "cat: /tmp/y: No such file or directory", "no-sleep", "/tmp",
                                   "[exit 0]"]
    assert traj.reward.value == 0.0 and traj.env_errors == 0  # graded: no greeting.txt


def test_a_command_that_times_out_or_breaks_its_runner_is_the_policys(tmp_path, tokenizer):
    cls = harbor(tmp_path, command_timeout_s=1, output_chars=200)
    traj = play(cls, tokenizer, [
        shell("echo hello harbor > greeting.txt; sleep 30"),  # timed out: its write stays
        shell("echo broken > greeting.txt; kill -9 $PPID"),  # its runner killed: discarded
        shell("seq 1 30000"),  # long output: its start and its end, what was cut said
        "Done."])
    timed_out, broken, long = (r for _, r in traj.tool_results)
    assert (timed_out.outcome.value, timed_out.content) == ("ok", "[timed out after 1s]")
    assert broken.outcome.value == "tool_error"
    assert broken.content == "the command broke the shell: killed (exit -9)"
    output = "".join(f"{i}\n" for i in range(1, 30001)).encode()
    cut = len(output) - 200  # output_chars=200: the first 100 and the last 100 bytes kept
    assert long.content == (f"{output[:100].decode()}\n[... {cut} bytes of output cut ...]\n"
                            f"{output[-100:].decode().rstrip()}\n[exit 0]")
    assert long.content.endswith("29999\n30000\n[exit 0]")
    assert traj.env_errors == 0 and traj.reward.value == 1.0  # the timed-out write was kept


def test_links_and_fifos_the_policy_makes_carry_over_and_grading_still_works(tmp_path,
                                                                              tokenizer):
    """An absolute symlink, one pointing out of the workdir, a FIFO and a hard link are
    carried from command to command (each unpacked inside the sandbox, nothing outside the
    workdir), and the tests grade the final workdir as usual."""
    cls = harbor(tmp_path)
    traj = play(cls, tokenizer, [
        shell("ln -s /usr/bin/env e && ln -s ../../etc/hostname up && ln -s /tmp t && "
              "mkfifo pipe && ln notes.txt hard && echo made"),
        shell("./e echo linked; readlink up t; test -p pipe && echo fifo; cat hard"),
        shell("echo hello harbor > greeting.txt"),
        "Done."])
    made, seen, wrote = (r for _, r in traj.tool_results)
    assert [r.outcome.value for r in (made, seen, wrote)] == ["ok", "ok", "ok"]
    assert seen.content.splitlines() == [
        "linked", "../../etc/hostname", "/tmp", "fifo",
        "The greeting goes in greeting.txt, next to this file.", "[exit 0]"]
    assert traj.status.value == "completed" and traj.env_errors == 0
    assert traj.reward.value == 1.0


def test_a_workdir_that_cannot_be_kept_is_the_commands_tool_error(tmp_path, tokenizer):
    """Past workspace_mb (or unreadable to its runner), the command's changes are discarded
    and the policy is told so, as a tool_error; the workdir stays as the command before left
    it."""
    cls = harbor(tmp_path, workspace_mb=1)
    traj = play(cls, tokenizer, [
        shell("echo hello harbor > greeting.txt"),
        shell("rm greeting.txt; for i in 1 2 3; do head -c 600000 /dev/zero > big$i; done; "
              "echo grew"),
        shell("ls"),
        "Done."])
    wrote, grew, listed = (r for _, r in traj.tool_results)
    assert grew.outcome.value == "tool_error"
    assert grew.content.startswith("grew\n[exit 0]\n[the workdir could not be kept (it grew "
                                   "past env.harbor.workspace_mb=1: ")
    assert grew.content.endswith("): the command's changes are discarded]")
    assert listed.content == "greeting.txt\nnotes.txt\n[exit 0]"
    assert traj.env_errors == 0 and traj.reward.value == 1.0


def test_memory_mb_bounds_a_commands_address_space(tmp_path, tokenizer):
    cls = harbor(tmp_path, memory_mb=200)
    alloc = "python3 -c 'bytearray({} << 20); print(\"got {} MB\")'"
    traj = play(cls, tokenizer, [shell(alloc.format(32, 32)),
                                 shell(alloc.format(400, 400) + " 2>&1 | tail -1"), "Done."])
    small, big = (r.content for _, r in traj.tool_results)
    assert small == "got 32 MB\n[exit 0]"
    assert big == "MemoryError\n[exit 0]"  # (the pipe's exit status: tail's)
    assert traj.env_errors == 0


@pytest.mark.slow
def test_tests_the_policy_broke_give_reward_0_not_env_error(tmp_path, tokenizer, caplog):
    """The rule: when the tests write no (usable) reward after the policy changed the workdir,
    and they do on the task's untouched workdir, the policy broke them: reward 0, counted
    (`tests_broken`) and logged. Here an endless loop in calc.py makes test.sh time out."""
    folder = copy_task(tmp_path, "fix-bug")
    edit(folder / "task.toml", "[verifier]\ntimeout_sec = 3.0\n", append=False)
    cls = harbor(tmp_path, tasks=folder.parent)
    traj = play(cls, tokenizer, [shell("printf 'while True:\\n    pass\\n' > calc.py"),
                                 "Done."], name="fix-bug")
    assert traj.status.value == "completed" and traj.env_errors == 0
    assert traj.reward.value == 0.0 and traj.reward.checks == {"tests_broken": 1.0}
    assert "harbor task fix-bug: the tests gave no reward after the policy's commands" in \
        caplog.text
    fixed = play(cls, tokenizer, [shell(cls.source.task("fix-bug").solve), "Done."],
                 name="fix-bug")
    assert fixed.reward.value == 1.0 and fixed.reward.checks == {"reward": 1.0,
                                                                 "tests_broken": 0.0}


@pytest.mark.parametrize("report,rewards", [
    ({"json": '{"reward": 0.5, "style": 1}', "txt": "0"}, {"reward": 0.5, "style": 1.0}),
    ({"json": None, "txt": " 1\n"}, {"reward": 1.0}),
    ({"json": '{"reward": NaN}', "txt": None}, "holds a value that is not a finite number"),
    ({"json": "[1]", "txt": None}, "is not an object of named rewards"),
    ({"json": None, "txt": ""}, "reward.txt is empty"),
    ({"json": None, "txt": "passed"}, "reward.txt is not a number: 'passed'"),
    ({"json": None, "txt": "inf"}, "reward.txt holds inf"),
    ({"json": None, "txt": None}, "the tests wrote neither /logs/verifier/reward.json nor"),
])
def test_rewards_are_read_as_harbors_verifier_reads_them(report, rewards):
    if isinstance(rewards, dict):
        assert harbor_rewards(report) == rewards
    else:
        with pytest.raises(ValueError, match=rewards):
            harbor_rewards(report)


def copy_task(tmp_path: Path, name: str = "write-file") -> Path:
    folder = tmp_path / "tasks" / name
    shutil.copytree(TASKS / name, folder)
    return folder


def test_tests_that_write_no_reward_are_an_env_error(tmp_path, tokenizer):
    folder = copy_task(tmp_path)
    (folder / "tests" / "test.sh").write_text("#!/bin/bash\necho checking; exit 3\n")
    traj = play(harbor(tmp_path, tasks=folder.parent), tokenizer, ["Done."])
    assert traj.status.value == "env_error"
    assert traj.info["error"] == (
        "env.verify: harbor task write-file: the tests wrote neither /logs/verifier/reward.json "
        "nor reward.txt; test.sh exit 3, output ends: 'checking'")


def test_a_reward_json_without_the_trained_key_is_an_env_error(tmp_path, tokenizer):
    folder = copy_task(tmp_path)
    (folder / "tests" / "test.sh").write_text(
        '#!/bin/bash\necho \'{"a": 1, "b": 0}\' > /logs/verifier/reward.json\n')
    traj = play(harbor(tmp_path, tasks=folder.parent), tokenizer, ["Done."])
    assert traj.status.value == "env_error"
    assert traj.info["error"] == ("env.verify: harbor task write-file: reward.json has no "
                                  "'reward' (env.harbor.reward_key) among a, b")
    traj = play(harbor(tmp_path, tasks=folder.parent, reward_key="b"), tokenizer, ["Done."])
    assert traj.status.value == "completed" and traj.reward.value == 0.0


def edit(path: Path, text: str, append: bool = True) -> None:
    path.write_text((path.read_text() if append and path.exists() else "") + text)


def relink(path: Path, target: str) -> None:
    """`path` (a file or a folder) replaced by a symbolic link to `target`."""
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    path.symlink_to(target)


def sparse(path: Path, size: int) -> None:
    with path.open("wb") as f:
        f.truncate(size)


# a folder holding the interpreter's (bound into the sandbox from the host): not a workdir
INTERPRETER_PARENT = str(Path(sys.prefix).resolve().parent)


@pytest.mark.parametrize("change,message", [
    (lambda f: (f / "tests" / "test.sh").unlink(),
     "is missing its tests: tests/test.sh (Harbor grades a task by running it)"),
    (lambda f: (f / "instruction.md").unlink(), "is missing instruction.md"),
    (lambda f: edit(f / "environment" / "Dockerfile", "RUN apt-get install -y curl\n"),
     "needs Docker, which tiller does not run: its Dockerfile runs RUN (line 4), which "
     "copying files cannot reproduce"),
    (lambda f: edit(f / "task.toml", '\n[environment.x]\n', append=False) or edit(
        f / "task.toml", '[environment]\ndocker_image = "ghcr.io/x/y:1"\n', append=False),
     "needs Docker, which tiller does not run: it runs in the prebuilt image 'ghcr.io/x/y:1'"),
    (lambda f: edit(f / "environment" / "docker-compose.yaml", "services: {}\n"),
     "its environment is a compose file (docker-compose.yaml)"),
    (lambda f: edit(f / "environment" / "Dockerfile", "COPY notes.txt /etc/notes.txt\n"),
     "copies to '/etc/notes.txt' (Dockerfile line 4); tiller carries the workdir '/app' only"),
    (lambda f: edit(f / "environment" / "Dockerfile", "COPY --from=builder /x /app/x\n"),
     "needs Docker: its Dockerfile's COPY takes --from=builder (line 4)"),
    (lambda f: edit(f / "task.toml", '[environment]\nos = "windows"\n', append=False),
     "runs on 'windows'; tiller's sandbox is Linux"),
    (lambda f: (f / "steps").mkdir(), "has several steps (steps/)"),
    (lambda f: edit(f / "task.toml", "[verifier\n", append=False),
     "has a task.toml that is not valid TOML"),
    # links read the host's files, a FIFO would hang the reading: refused, named
    (lambda f: relink(f / "instruction.md", "/etc/hostname"),
     "holds a symbolic link, instruction.md: tiller reads only regular files and folders of "
     "a task folder"),
    (lambda f: relink(f / "environment" / "notes.txt", "/etc/hostname"),
     "holds a symbolic link, environment/notes.txt"),
    (lambda f: relink(f / "tests", "/etc"), "holds a symbolic link, tests"),
    (lambda f: os.mkfifo(f / "environment" / "pipe") or edit(
        f / "environment" / "Dockerfile", "COPY pipe /app/pipe\n"),
     "holds environment/pipe, which is not a regular file or a folder (a FIFO, socket or "
     "device)"),
    (lambda f: sparse(f / "environment" / "big", 70 << 20) or edit(
        f / "environment" / "Dockerfile", "COPY big /app/big\n"),
     "holds 70 MB of files; tiller reads at most 64 MB of a task folder"),
    (lambda f: edit(f / "instruction.md", "x" * (300 << 10)),
     "has an instruction.md of 300 KB; tiller takes at most 256 KB as a prompt"),
    # workdirs the sandbox cannot provide: one shared check, before any work
    (lambda f: edit(f / "task.toml", '[environment]\nworkdir = "/bin"\n', append=False),
     "has the workdir '/bin', which tiller's sandbox cannot provide: it is /bin or lies "
     "under it, a path the sandbox provides itself"),
    (lambda f: edit(f / "environment" / "Dockerfile", "WORKDIR /lib/x\n"),
     "has the workdir '/lib/x', which tiller's sandbox cannot provide: it is /lib or lies "
     "under it"),
    (lambda f: edit(f / "task.toml", '[environment]\nworkdir = "/tests"\n', append=False),
     "has the workdir '/tests', which tiller's sandbox cannot provide: it is /tests or lies "
     "under it"),
    (lambda f: edit(f / "task.toml", f'[environment]\nworkdir = "{INTERPRETER_PARENT}"\n',
                    append=False),
     f"has the workdir '{INTERPRETER_PARENT}', which tiller's sandbox cannot provide: it "
     "holds the Python interpreter's "),
])
def test_a_task_tiller_cannot_run_is_one_line_naming_it_before_any_work(tmp_path, change,
                                                                          message):
    folder = copy_task(tmp_path)
    change(folder)
    cfg = load_config(EXAMPLE, [f"env.harbor.tasks={folder.parent}"])
    with pytest.raises(ConfigError) as e:
        Run(cfg, tmp_path / "run")
    assert str(e.value).startswith(f"config field env.harbor.tasks: harbor task 'write-file' "
                                   f"({folder}) ")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # refused while the config was read


def test_a_workdir_docker_would_normalise_is_normalised(tmp_path):
    folder = copy_task(tmp_path)
    edit(folder / "environment" / "Dockerfile", "FROM ubuntu:24.04\nWORKDIR /app/../home\n"
         "COPY notes.txt notes.txt\n", append=False)
    [task] = read_tasks(str(folder), "config field env.harbor.tasks")
    assert (task.workdir, list(task.files)) == ("/home", ["notes.txt"])


def test_a_workdir_whose_sandbox_does_not_run_fails_at_start_in_one_line(tmp_path):
    folder = copy_task(tmp_path)
    workdir = "/" + "w" * 300  # past NAME_MAX: bubblewrap cannot make it
    edit(folder / "environment" / "Dockerfile", f"FROM ubuntu:24.04\nWORKDIR {workdir}\n"
         "COPY notes.txt notes.txt\n", append=False)
    with pytest.raises(ConfigError) as e:
        Run(load_config(EXAMPLE, [f"env.harbor.tasks={folder.parent}"]), tmp_path / "run")
    assert str(e.value).startswith(f"config field env.harbor: harbor task 'write-file': the "
                                   f"sandbox does not run with its workdir '{workdir}': ")
    assert "\n" not in str(e.value)


def test_task_toml_needs_tomllib_or_tomli_and_says_so(tmp_path, monkeypatch):
    import tomli

    monkeypatch.setitem(sys.modules, "tomllib", None)  # Python 3.10: no tomllib
    assert read_tasks(str(TASKS), "w")[0].name == "fix-bug"  # tomli, when it is installed
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ConfigError) as e:
        read_tasks(str(TASKS), "config field env.harbor.tasks")
    assert str(e.value) == ("config field env.harbor.tasks: reading task.toml needs tomllib "
                            "(Python 3.11+) or, on Python 3.10, the tomli package: pip install "
                            "tomli")
    assert tomli  # installed here


def test_a_python_without_tarfile_filters_is_one_line(monkeypatch):
    import tarfile

    monkeypatch.delattr(tarfile, "tar_filter")  # Python 3.10 before 3.10.12
    with pytest.raises(ConfigError, match=r"^env.name=harbor needs tarfile's extraction "
                                          r"filters \(Python 3.10.12\+, 3.11.4\+ or 3.12\+\); "
                                          r"this is Python 3\.\d+\.\d+$"):
        HarborEnv.configure(load_config(EXAMPLE))


@pytest.mark.parametrize("overrides,message", [
    (["env.harbor=null"], "config field env.harbor: env.name is harbor, so name the task"),
    (["env.harbor.tasks=/nonexistent"], "config field env.harbor.tasks: got '/nonexistent', "
                                        "which is not a folder of Harbor tasks"),
    (["env.tools.replay={path: t.sqlite}"], "config field env.tools.replay: env harbor's tests "
                                            "grade the workdir"),
    (["env.tools.executor.tools={shell: {cache: true}}"], "do not cache 'shell'"),
    (["env.name=calculator"], "config field env.harbor: only used with env.name: harbor"),
])
def test_harbor_config_errors_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        Run(load_config(EXAMPLE, overrides), tmp_path / "run")
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("executor,timeout", [
    ({}, None),  # unset: off, the sandbox's own deadline bounds each command
    ({"default": {"retries": 1}}, None),
    ({"tools": {"shell": {"retries": 2}}}, None),
    ({"tools": {"shell": {"timeout_s": 61}}}, 61.0),
    ({"default": {"timeout_s": 100}}, 100.0),
])
def test_the_shell_tools_executor_timeout_is_derived_or_above_the_sandboxs(executor, timeout):
    cfg = load_config(EXAMPLE, [f"env.tools.executor={json.dumps(executor)}",
                                "env.harbor.command_timeout_s=30"])
    HarborEnv.configure(cfg)
    policy = cfg.env.tools.executor.policy("shell")
    assert policy.timeout_s == timeout
    assert policy.retries == executor.get("default", executor.get("tools", {}).get(
        "shell", {})).get("retries", 0)  # the rest of the user's policy is kept


@pytest.mark.parametrize("executor", [{"default": {"timeout_s": 30}},
                                      {"tools": {"shell": {"timeout_s": 60}}}])
def test_a_shell_timeout_the_sandbox_would_outlive_is_one_line(tmp_path, executor):
    cfg = load_config(EXAMPLE, [f"env.tools.executor={json.dumps(executor)}",
                                "env.harbor.command_timeout_s=30"])
    with pytest.raises(ConfigError) as e:
        Run(cfg, tmp_path / "run")
    assert str(e.value).startswith(
        "config field env.tools.executor: the shell tool's timeout_s is ")
    assert ("env harbor needs more than env.harbor.command_timeout_s + 30 s = 60 s (the "
            "sandbox's own deadline for a command) or none") in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_mounts_need_bubblewrap_and_stay_out_of_the_sandbox_own_paths():
    with pytest.raises(ConfigError, match=r"^this sandbox needs bubblewrap: the paths /app "):
        Sandbox(backend="subprocess", mounts=["/app"])
    for path, why in [("/usr/local/app", "it is /usr or lies under it, a path the sandbox "
                                         "provides itself"),
                      ("/", "expected an absolute, normalised path other than /"),
                      ("app", "expected an absolute, normalised path other than /"),
                      ("/app/../usr", "expected an absolute, normalised path other than /"),
                      ("/inbox/x", "it is /inbox or lies under it"),
                      (INTERPRETER_PARENT, "it holds the Python interpreter's ")]:
        with pytest.raises(ValueError, match=re.escape(f"mounts: got {path!r}; {why}")):
            Sandbox(mounts=[path])


@pytest.mark.slow
def test_a_tiny_run_trains_on_the_harbor_examples(tmp_path):
    """examples/harbor/config.yaml, tiny: a model built on the expert's episodes, the tool
    gate (the expert's shell calls all succeed), SFT on the expert, 2 RL steps."""
    summary = train(load_config(EXAMPLE, ["logging.report=false", "sft.tasks=6",
                                          "model.build.corpus_tasks=10"]), tmp_path / "run")
    assert summary["tool_gate"] == {"gate_ok_rate/shell": 1.0}
    steps = rl_rows(tmp_path / "run")
    assert len(steps) == 2 and all(r["env_error_rate"] == 0.0 for r in steps)
    assert summary["heldout"] == "disabled"  # no env.harbor.eval: said, not a silent zero
