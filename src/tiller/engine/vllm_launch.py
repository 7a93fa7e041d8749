"""What a managed vLLM server is started with: its command line and environment
(`server_specs`), and vLLM's platform as the server's own Python and environment see it
(`device_type`), which decides the flags tiller adds for vLLM's CPU build (`CPU_SETS`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tiller.config.engine import CPU_SETS, refused_flag
from tiller.engine.servers import ServerSpec, run_in_group
from tiller.engine.vllm_shm import BACKEND as SHM_BACKEND
from tiller.errors import ConfigError, RunError
from tiller.files import write_file

SERVED_NAME = "tiller"  # --served-model-name: the `model` of every request
# the environment of a managed server: the RL endpoints, the model's worker in the engine
# core's process (without VLLM_ENABLE_V1_MULTIPROCESSING=0 a server is 4 processes, with it 3:
# the API server, its `VLLM::EngineCore` process, which vLLM 0.32's API server starts whatever
# this says, and multiprocessing's resource tracker; all in the server's process group, which
# its stop and its watch end, `servers.py`), no CPU pinning (it shares the machine)
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
PLATFORM_CHECK_S = 120.0  # seconds `device_type` may take at most (imports vllm: 8.5 s at load 3)
_PLATFORMS: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}  # `device_type`'s answers


def server_env(threads: int, transfer: str = "disk", api_key: str | None = None
               ) -> dict[str, str]:
    """The environment (on top of this process's) of a managed server: `SERVER_ENV`, its OMP
    threads, the API key (the environment, not argv: argv is readable by every local user) and,
    with `transfer` shm, this tiller's source first on PYTHONPATH (the `tiller_shm` engine)."""
    env = {**SERVER_ENV, "OMP_NUM_THREADS": str(threads)}
    if api_key:
        env["VLLM_API_KEY"] = api_key
    if transfer == "shm":
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return env


def server_specs(python: str, model_dir: Path, count: int, *, max_context: int, dtype: str,
                 kv_cache_bytes: int, threads: int, extra_args: list[str], cpu: bool,
                 transfer: str = "disk", api_key: str | None = None) -> list[ServerSpec]:
    """The commands of `count` managed vLLM servers of the model saved in `model_dir`, with
    `server_env`; with `transfer` shm each loads pushes through tiller's `tiller_shm`
    weight-transfer engine. `CPU_SETS` only with `cpu` (vLLM's platform, `device_type`): on a
    GPU they would turn off CUDA graphs and chunked prefill, which `extra_args` may then name;
    on CPU an extra argument that would rebind them is a ConfigError."""
    for arg in extra_args if cpu else ():
        if (flag := refused_flag(arg, CPU_SETS)) is not None:
            raise ConfigError(f"config field engine.extra_args: got {arg!r}, which would rebind "
                              f"{flag}; tiller sets {' and '.join(CPU_SETS)} itself on vLLM's "
                              f"CPU build, which {python} runs (a CUDA build leaves both to "
                              f"engine.extra_args): leave it out")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", "{port}",
            "--dtype", dtype, "--max-model-len", str(max_context),
            "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--logprobs-mode", "processed_logprobs", *(CPU_SETS if cpu else ()), *extra_args]
    if transfer == "shm":
        argv += ["--weight-transfer-config", json.dumps({"backend": SHM_BACKEND})]
    env = server_env(threads, transfer, api_key)
    return [ServerSpec(f"vllm-{i}", argv, env) for i in range(count)]


def managed_flags() -> tuple[str, ...]:
    """Every flag of the argv `server_specs` emits (on CPU, under shm: the most), in order."""
    return tuple(a for a in server_specs("python", Path("model"), 1, max_context=1,
                 dtype="float32", kv_cache_bytes=1, threads=1, extra_args=[], cpu=True,
                 transfer="shm")[0].argv if a.startswith("--"))


def default_python() -> Path:
    """.venv-vllm/bin/python in the tiller checkout this module is imported from."""
    return Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"


def device_type(python: str, env: dict[str, str], *, timeout_s: float = PLATFORM_CHECK_S,
                log: Path | None = None) -> str:
    """vLLM's platform in `python`'s environment run with `env` on top of this process's (pass
    the server's own, `server_env`): 'cpu' for the CPU build (scripts/setup.sh's), 'cuda' for
    a CUDA build on a GPU machine; what the servers started from it will run on. Asked once
    per process for each `python` and `env` (it imports vllm: seconds), within
    min(`PLATFORM_CHECK_S`, `timeout_s`) seconds, in a process group of its own killed whole
    when it ends (`servers.run_in_group`). A failure or timeout is one RunError naming
    `python` and what to fix, and, with `log`, the file the child's output was written to."""
    key = (python, tuple(sorted(env.items())))
    if key in _PLATFORMS:
        return _PLATFORMS[key]
    bound = min(PLATFORM_CHECK_S, timeout_s)
    code = "from vllm.platforms import current_platform as p; print(p.device_type)"
    exit_code, out, err = run_in_group([python, "-c", code], env, bound)
    words, lines = out.split(), err.strip().splitlines() or ["no output"]
    timed_out = exit_code is None
    failed = timed_out or exit_code != 0 or not words
    where = ""
    if log is not None and failed:
        written = write_file(log, f"--- stdout\n{out}--- stderr\n{err}", root=log.parent)
        where = f"; log {written}"
    if timed_out:
        raise RunError(f"engine.python {python}: importing vllm to ask its platform took more "
                       f"than {bound:.3g} s (the least of {PLATFORM_CHECK_S:g} s and what "
                       f"was left of engine.startup_timeout_s){where}; check that "
                       f"`{python} -c 'import vllm'` runs, or raise engine.startup_timeout_s")
    if failed:
        raise RunError(f"engine.python {python} cannot tell vLLM's platform (exit "
                       f"{exit_code}): {lines[-1]}{where}; build the vLLM environment "
                       f"with `bash scripts/setup.sh`")
    _PLATFORMS[key] = words[-1]
    return words[-1]
