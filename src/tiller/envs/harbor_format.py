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
without instruction.md or task.toml) is refused the same way.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tiller.errors import ConfigError

_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)
IGNORED = {"FROM", "LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "MAINTAINER", "STOPSIGNAL", "USER"}
COMPOSE = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
RESERVED = ("/tests", "/logs", "/solution")  # the verifier's paths: not a workdir
MAX_TASK_BYTES = 64 << 20  # a task's environment, tests and solution files together


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


def read_task(folder: Path, where: str) -> HarborTask:
    """The task in `folder`; `Refused` (one line starting with `where` and the task's name)
    for anything tiller cannot run as Harbor would."""
    name = folder.name

    def refuse(why: str) -> Refused:
        return Refused(f"{where}: harbor task {name!r} ({folder}) {why}")

    for required in ("task.toml", "instruction.md", "tests/test.sh"):
        if not (folder / required).is_file():
            what = "its tests" if required.startswith("tests") else required
            raise refuse(f"is missing {what}: {required} (Harbor "
                         f"{'grades a task by running it' if what == 'its tests' else 'needs it'})")
    import tomllib  # Python 3.11+ (env harbor needs it)

    try:
        config = tomllib.loads((folder / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise refuse(f"has a task.toml that is not valid TOML: {e}") from e
    environment = _table(config, "environment", refuse)
    verifier = _table(config, "verifier", refuse)
    _check_runnable(folder, config, environment, refuse)
    workdir, files, env = read_environment(folder / "environment", environment, refuse)
    tests = read_tree(folder / "tests")
    solve = folder / "solution" / "solve.sh"
    total = sum(map(len, (*files.values(), *tests.values()))) + (solve.stat().st_size
                                                                  if solve.is_file() else 0)
    if total > MAX_TASK_BYTES:
        raise refuse(f"holds {total >> 20} MB of files; tiller carries at most "
                     f"{MAX_TASK_BYTES >> 20} MB")
    timeout = verifier.get("timeout_sec", 600.0)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise refuse(f"has [verifier] timeout_sec = {timeout!r}; expected a positive number")
    instruction = strip_canary((folder / "instruction.md").read_text())
    if not instruction:
        raise refuse("has an empty instruction.md")
    return HarborTask(name=name, instruction=instruction, workdir=workdir, files=files,
                      env={**env, **_strings(environment.get("env", {}), "[environment] env",
                                             refuse)},
                      tests=tests,
                      verifier_env=_strings(verifier.get("env", {}), "[verifier] env", refuse),
                      verifier_timeout_s=float(timeout),
                      solve=solve.read_text() if solve.is_file() else None)


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


def _check_runnable(folder: Path, config: dict[str, Any], environment: dict[str, Any],
                    refuse: Any) -> None:
    """What makes a task need more than files copied into a sandbox."""
    needs_docker = "needs Docker, which tiller does not run:"
    if environment.get("docker_image"):
        raise refuse(f"{needs_docker} it runs in the prebuilt image "
                     f"{environment['docker_image']!r} ([environment] docker_image)")
    for name in COMPOSE:
        if (folder / "environment" / name).exists():
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
    if config.get("steps") or (folder / "steps").is_dir():
        raise refuse("has several steps (steps/); tiller runs single-step tasks")
    tests_image = folder / "tests" / "Dockerfile"
    if tests_image.is_file():
        for line_no, instruction, _ in dockerfile_instructions(tests_image.read_text()):
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


def read_environment(context: Path, environment: dict[str, Any], refuse: Any
                     ) -> tuple[str, dict[str, bytes], dict[str, str]]:
    """(workdir, its files, ENV variables) that environment/Dockerfile describes."""
    current, last = "/", None  # Docker's working directory before any WORKDIR is /
    files: dict[str, bytes] = {}
    env: dict[str, str] = {}
    dockerfile = context / "Dockerfile"
    steps = dockerfile_instructions(dockerfile.read_text()) if dockerfile.is_file() else []
    copies = []
    for n, instruction, args in steps:
        if instruction == "WORKDIR":
            current = last = str(PurePosixPath(current) / args)  # relative: to the current
        elif instruction == "ENV":
            env.update(_env_pairs(args, refuse, n))
        elif instruction == "COPY":
            copies.append((n, args, current))
        elif instruction not in IGNORED:
            raise refuse(f"needs Docker, which tiller does not run: its Dockerfile runs "
                         f"{instruction} (line {n}), which copying files cannot reproduce")
    workdir = str(environment.get("workdir") or last or "/app")  # task.toml wins
    if not workdir.startswith("/") or any(workdir == r or workdir.startswith(r + "/")
                                          for r in ("/usr", "/etc", "/proc", "/dev", "/tmp",
                                                    *RESERVED)) or workdir == "/":
        raise refuse(f"has the workdir {workdir!r}, which tiller cannot provide (an absolute "
                     f"path outside /usr, /etc, /tmp, {', '.join(RESERVED)})")
    for n, args, current in copies:
        files.update(_copy(context, args, current, workdir, refuse, n))
    return workdir, files, env


def _env_pairs(args: str, refuse: Any, line: int) -> dict[str, str]:
    parts = shlex.split(args)
    if parts and "=" not in parts[0]:  # the legacy form: ENV KEY value with spaces
        return {parts[0]: " ".join(parts[1:])}
    pairs = dict(p.split("=", 1) for p in parts if "=" in p)
    if len(pairs) != len(parts) or any("$" in v for v in pairs.values()):
        raise refuse(f"has an ENV tiller cannot read (line {line}): {args[:80]!r}")
    return pairs


def _copy(context: Path, args: str, current: str, workdir: str, refuse: Any, line: int
          ) -> dict[str, bytes]:
    """The files one COPY puts in the workdir (relative paths), read from the context."""
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
    root = context.resolve()
    for source in sources:
        path = (context / source).resolve()
        if any(c in source for c in "*?[") or not path.is_relative_to(root) or not path.exists():
            raise refuse(f"copies {source!r} (Dockerfile line {line}), which is not a file or "
                         "folder of environment/")
        if path.is_dir():
            for name, data in read_tree(path).items():
                out[str(PurePosixPath(relative) / name).removeprefix("./")] = data
        else:
            name = PurePosixPath(relative) / path.name if into_dir else PurePosixPath(relative)
            out[str(name).removeprefix("./")] = path.read_bytes()
    return out


def _inside(path: str, root: str) -> str | None:
    """`path` relative to `root` ("." for root itself), or None when it is outside."""
    p, r = PurePosixPath(path), PurePosixPath(root)
    try:
        return str(p.relative_to(r)) if ".." not in p.parts else None
    except ValueError:
        return None


def read_tree(folder: Path) -> dict[str, bytes]:
    """Every regular file under `folder` by relative path (symlinks are not followed)."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def read_tasks(folder: str, where: str) -> list[HarborTask]:
    """Every task folder in `folder` (the folders holding a task.toml, or any folder when
    none does: each then refused for what it misses), in name order."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"{where}: got {folder!r}, which is not a folder of Harbor tasks")
    if (root / "task.toml").is_file():  # a single task folder
        return [read_task(root, where)]
    tasks = [read_task(p, where) for p in sorted(root.iterdir())
             if p.is_dir() and not p.name.startswith(".")]
    if not tasks:
        raise ConfigError(f"{where}: got {folder!r}, which holds no task folders")
    return tasks
