"""Reading a Harbor task folder (harbor 0.25's format) into what tiller runs without Docker.

    task.toml          [verifier] timeout_sec, env; [environment] docker_image, os, gpus,
                       mcp_servers, env, workdir ...; [agent] timeout_sec
    instruction.md     the prompt (leading "canary" comment lines stripped, as Harbor does)
    environment/       Dockerfile (FROM, WORKDIR, COPY, ENV) and the files it copies
    solution/solve.sh  the oracle: tiller's scripted expert runs it through the shell tool
    tests/test.sh      run after the agent from the workdir; writes /logs/verifier/reward.txt
                       (one number) or /logs/verifier/reward.json (named numbers)

Harbor builds the environment as a container image. tiller has no Docker: it runs the task in
its bubblewrap sandbox, with the host's /usr standing in for the image's base and the files the
Dockerfile copies put in the workdir. That reproduces an environment made of files only, so a
task whose environment needs more is refused, in one line naming the task and the reason: a
`RUN` (or `ADD`, `ARG`, ...) in its Dockerfile, a `COPY` outside the workdir or `--from` another
image, a prebuilt `docker_image`, a compose file, another OS, GPUs, its own MCP servers,
several steps, a verifier image that needs building. A folder without tests/test.sh (or
without instruction.md or task.toml) is refused the same way, and so is one that holds a
symbolic link (it would read the host's files), a FIFO, socket or device (reading one could
hang), more than MAX_TASK_BYTES of files or an instruction.md over MAX_INSTRUCTION_BYTES: the
folder is walked with lstat and sized before any file is read, and only its regular files are
read. A workdir the sandbox cannot provide (`tiller.tools.launch.mount_problem`: /usr, /bin,
/tmp, ..., a verifier path, the interpreter's folders) is refused too; Docker's normalisation
of `WORKDIR` (/app/../home is /home) is kept.
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tiller.errors import ConfigError
from tiller.tools.launch import mount_problem

_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
IGNORED = {"FROM", "LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "MAINTAINER", "STOPSIGNAL", "USER"}
COMPOSE = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
VERIFIER_PATHS = ("/tests", "/logs", "/solution")  # the verifier's paths: not a workdir
MAX_TASK_BYTES = 64 << 20  # a task folder's files together
MAX_INSTRUCTION_BYTES = 256 << 10  # instruction.md: a prompt


@dataclass(frozen=True)
class HarborTask:
    """What tiller needs of one task folder, read and checked."""

    name: str
    instruction: str
    workdir: str
    files: dict[str, bytes]  # the workdir's files at the start, relative to it
    env: dict[str, str]  # ENV lines and [environment].env: the agent's commands see them
    tests: dict[str, bytes]  # tests/, relative to it (test.sh among them)
    verifier_env: dict[str, str] = field(default_factory=dict)
    verifier_timeout_s: float = 600.0
    solve: str | None = None  # solution/solve.sh, the scripted expert's commands


class Refused(ConfigError):
    """A task tiller cannot run without Docker (or that is not a Harbor task)."""


def strip_canary(text: str) -> str:
    """Harbor's rule: leading canary comment lines, then blank lines, are not the prompt."""
    lines = text.split("\n")
    i = 0
    while i < len(lines) and _CANARY.match(lines[i].strip()):
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:]).strip()


@dataclass(frozen=True)
class TaskFolder:
    """A task folder as `scan` found it: its regular files (relative POSIX path -> size) and
    folders. Every read goes through it, so only those files are read."""

    root: Path
    files: dict[str, int]
    dirs: set[str]

    def read(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def text(self, rel: str) -> str:
        return self.read(rel).decode()

    def tree(self, rel: str) -> dict[str, bytes]:
        """Every file under the folder `rel`, by its path relative to that folder."""
        prefix = "" if rel == "." else rel + "/"
        return {f.removeprefix(prefix): self.read(f) for f in sorted(self.files)
                if f.startswith(prefix)}


def scan(folder: Path, refuse: Any) -> TaskFolder:
    """The files and folders of `folder`, found with lstat (no link followed, nothing read);
    `refuse` for a link, anything else that is not a regular file or a folder, or more than
    MAX_TASK_BYTES of files in all."""
    files: dict[str, int] = {}
    dirs: set[str] = set()
    pending = [folder]
    while pending:
        for entry in sorted(os.scandir(pending.pop()), key=lambda e: e.name):
            rel = Path(entry.path).relative_to(folder).as_posix()
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                raise refuse(f"holds a symbolic link, {rel}: tiller reads only regular files "
                             "and folders of a task folder")
            if stat.S_ISDIR(mode):
                dirs.add(rel)
                pending.append(Path(entry.path))
            elif stat.S_ISREG(mode):
                files[rel] = entry.stat(follow_symlinks=False).st_size
            else:
                raise refuse(f"holds {rel}, which is not a regular file or a folder (a FIFO, "
                             "socket or device)")
    total = sum(files.values())
    if total > MAX_TASK_BYTES:
        raise refuse(f"holds {total >> 20} MB of files; tiller reads at most "
                     f"{MAX_TASK_BYTES >> 20} MB of a task folder")
    return TaskFolder(folder, files, dirs)


def toml_module(where: str) -> Any:
    """tomllib (Python 3.11+), else tomli when it is installed; one line otherwise."""
    try:
        import tomllib
    except ModuleNotFoundError:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(f"{where}: reading task.toml needs tomllib (Python 3.11+) or, on "
                              "Python 3.10, the tomli package: pip install tomli") from None
    return tomllib


def read_task(folder: Path, where: str) -> HarborTask:
    """The task in `folder`; `Refused` (one line starting with `where` and the task's name)
    for anything tiller cannot run as Harbor would."""
    name = folder.name

    def refuse(why: str) -> Refused:
        return Refused(f"{where}: harbor task {name!r} ({folder}) {why}")

    task = scan(folder, refuse)
    for required in ("task.toml", "instruction.md", "tests/test.sh"):
        if required not in task.files:
            what = "its tests" if required.startswith("tests") else required
            raise refuse(f"is missing {what}: {required} (Harbor "
                         f"{'grades a task by running it' if what == 'its tests' else 'needs it'})")
    if task.files["instruction.md"] > MAX_INSTRUCTION_BYTES:
        raise refuse(f"has an instruction.md of {task.files['instruction.md'] >> 10} KB; tiller "
                     f"takes at most {MAX_INSTRUCTION_BYTES >> 10} KB as a prompt")
    toml = toml_module(where)
    try:
        config = toml.loads(task.text("task.toml"))
    except (toml.TOMLDecodeError, UnicodeDecodeError) as e:
        raise refuse(f"has a task.toml that is not valid TOML: {e}") from e
    environment = _table(config, "environment", refuse)
    verifier = _table(config, "verifier", refuse)
    _check_runnable(task, config, environment, refuse)
    workdir, files, env = read_environment(task, environment, refuse)
    timeout = verifier.get("timeout_sec", 600.0)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise refuse(f"has [verifier] timeout_sec = {timeout!r}; expected a positive number")
    instruction = strip_canary(task.text("instruction.md"))
    if not instruction:
        raise refuse("has an empty instruction.md")
    solve = "solution/solve.sh"
    return HarborTask(name=name, instruction=instruction, workdir=workdir, files=files,
                      env={**env, **_strings(environment.get("env", {}), "[environment] env",
                                             refuse)},
                      tests=task.tree("tests"),
                      verifier_env=_strings(verifier.get("env", {}), "[verifier] env", refuse),
                      verifier_timeout_s=float(timeout),
                      solve=task.text(solve) if solve in task.files else None)


def _table(config: dict[str, Any], name: str, refuse: Any) -> dict[str, Any]:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise refuse(f"has a task.toml whose [{name}] is not a table")
    return table


def _strings(table: Any, what: str, refuse: Any) -> dict[str, str]:
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise refuse(f"has {what} that is not a table of strings")
    templated = [k for k, v in table.items() if "${" in v]
    if templated:
        raise refuse(f"has {what} values read from the host's environment ({templated[0]}); "
                     "tiller passes literal values only")
    return dict(table)


def _check_runnable(task: TaskFolder, config: dict[str, Any], environment: dict[str, Any],
                    refuse: Any) -> None:
    """What makes a task need more than files copied into a sandbox."""
    needs_docker = "needs Docker, which tiller does not run:"
    if environment.get("docker_image"):
        raise refuse(f"{needs_docker} it runs in the prebuilt image "
                     f"{environment['docker_image']!r} ([environment] docker_image)")
    for name in COMPOSE:
        if f"environment/{name}" in task.files:
            raise refuse(f"{needs_docker} its environment is a compose file ({name})")
    if str(environment.get("os", "linux")).lower() != "linux":
        raise refuse(f"runs on {environment['os']!r}; tiller's sandbox is Linux")
    if environment.get("gpus"):
        raise refuse(f"asks for {environment['gpus']} GPU(s); tiller's sandbox has none")
    if environment.get("mcp_servers"):
        raise refuse("declares its own MCP servers ([environment] mcp_servers); give them to "
                     "the run as env.tools.mcp instead")
    if environment.get("healthcheck"):
        raise refuse(f"{needs_docker} it has a service to wait for ([environment] healthcheck)")
    if config.get("steps") or "steps" in task.dirs:
        raise refuse("has several steps (steps/); tiller runs single-step tasks")
    if "tests/Dockerfile" in task.files:
        for line_no, instruction, _ in dockerfile_instructions(task.text("tests/Dockerfile")):
            if instruction not in IGNORED | {"WORKDIR", "COPY", "ENV"}:
                raise refuse(f"{needs_docker} its verifier image runs {instruction} "
                             f"(tests/Dockerfile line {line_no})")


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) of a Dockerfile, continuations joined."""
    out, pending, start = [], "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((start, word.upper(), rest.strip()))
    return out


def read_environment(task: TaskFolder, environment: dict[str, Any], refuse: Any
                     ) -> tuple[str, dict[str, bytes], dict[str, str]]:
    """(workdir, its files, ENV variables) that environment/Dockerfile describes."""
    current, last = "/", None  # Docker's working directory before any WORKDIR is /
    files: dict[str, bytes] = {}
    env: dict[str, str] = {}
    dockerfile = "environment/Dockerfile"
    steps = dockerfile_instructions(task.text(dockerfile)) if dockerfile in task.files else []
    copies = []
    for n, instruction, args in steps:
        if instruction == "WORKDIR":  # relative: to the current one; normalised as Docker does
            current = last = posixpath.normpath(posixpath.join(current, args))
        elif instruction == "ENV":
            env.update(_env_pairs(args, refuse, n))
        elif instruction == "COPY":
            copies.append((n, args, current))
        elif instruction not in IGNORED:
            raise refuse(f"needs Docker, which tiller does not run: its Dockerfile runs "
                         f"{instruction} (line {n}), which copying files cannot reproduce")
    workdir = str(environment.get("workdir") or last or "/app")  # task.toml wins
    workdir = posixpath.normpath(workdir) if workdir.startswith("/") else workdir
    problem = mount_problem(workdir, VERIFIER_PATHS)
    if problem is not None:
        raise refuse(f"has the workdir {workdir!r}, which tiller's sandbox cannot provide: "
                     f"{problem}")
    for n, args, current in copies:
        files.update(_copy(task, args, current, workdir, refuse, n))
    return workdir, files, env


def _env_pairs(args: str, refuse: Any, line: int) -> dict[str, str]:
    parts = shlex.split(args)
    if parts and "=" not in parts[0]:  # the legacy form: ENV KEY value with spaces
        return {parts[0]: " ".join(parts[1:])}
    pairs = dict(p.split("=", 1) for p in parts if "=" in p)
    if len(pairs) != len(parts) or any("$" in v for v in pairs.values()):
        raise refuse(f"has an ENV tiller cannot read (line {line}): {args[:80]!r}")
    return pairs


def _copy(task: TaskFolder, args: str, current: str, workdir: str, refuse: Any, line: int
          ) -> dict[str, bytes]:
    """The files one COPY puts in the workdir (relative paths), read from environment/."""
    parts = shlex.split(args)
    if any(p.startswith("--") and not p.startswith("--chown") for p in parts):
        raise refuse(f"needs Docker: its Dockerfile's COPY takes {parts[0]} (line {line})")
    parts = [p for p in parts if not p.startswith("--")]
    if len(parts) < 2:
        raise refuse(f"has a COPY without a source and a destination (line {line})")
    *sources, dest = parts
    target = PurePosixPath(current) / dest
    relative = _inside(str(target), workdir)
    if relative is None:
        raise refuse(f"copies to {str(target)!r} (Dockerfile line {line}); tiller carries the "
                     f"workdir {workdir!r} only")
    into_dir = dest.endswith("/") or len(sources) > 1 or dest in (".", "./")
    out: dict[str, bytes] = {}
    for source in sources:
        path = posixpath.normpath(posixpath.join("environment", source))
        if any(c in source for c in "*?[") or not (path in task.files or path in task.dirs) \
                or not (path == "environment" or path.startswith("environment/")):
            raise refuse(f"copies {source!r} (Dockerfile line {line}), which is not a file or "
                         "folder of environment/")
        if path in task.dirs:
            for name, data in task.tree(path).items():
                out[str(PurePosixPath(relative) / name).removeprefix("./")] = data
        else:
            base = PurePosixPath(path).name
            name = PurePosixPath(relative) / base if into_dir else PurePosixPath(relative)
            out[str(name).removeprefix("./")] = task.read(path)
    return out


def _inside(path: str, root: str) -> str | None:
    """`path` relative to `root` ("." for root itself), or None when it is outside."""
    p, r = PurePosixPath(path), PurePosixPath(root)
    try:
        return str(p.relative_to(r)) if ".." not in p.parts else None
    except ValueError:
        return None


def read_tasks(folder: str, where: str) -> list[HarborTask]:
    """Every task folder in `folder` (the folders holding a task.toml, or any folder when
    none does: each then refused for what it misses), in name order."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"{where}: got {folder!r}, which is not a folder of Harbor tasks")
    if (root / "task.toml").is_file():  # a single task folder
        return [read_task(root, where)]
    for p in sorted(root.iterdir()):
        if p.is_symlink():  # a task folder is read without following links, itself too
            raise ConfigError(f"{where}: {str(p)!r} is a symbolic link; tiller reads only "
                              "regular files and folders of a folder of tasks")
    tasks = [read_task(p, where) for p in sorted(root.iterdir())
             if p.is_dir() and not p.name.startswith(".")]
    if not tasks:
        raise ConfigError(f"{where}: got {folder!r}, which holds no task folders")
    return tasks
