"""A run folder is data: attacks planted in one, through the real commands.

A run folder may be shared or downloaded, so a link can sit at any of its names and its
config.yaml (and the module files beside it) may be anyone's. Each test here plants the attack
and checks the command neither writes through the link nor imports the folder's code (issue
19, items 2 and 9; tiller.files and tiller.trust hold the rules).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TINY_RUN, cli
from safetensors.torch import load_file
from typer.testing import CliRunner

import tiller
from tiller.cli import app
from tiller.config import dump_config, load_config
from tiller.engine.delta import DeltaUpdate, TensorDelta
from tiller.engine.http import HttpEngine
from tiller.engine.updates import WeightUpdate
from tiller.errors import ConfigError
from tiller.run import Run
from tiller.tools.replay import ReplayStore
from tiller.tools.stack import ToolsConfig, ToolStack
from tiller.trust import run_config_requests

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs/calculator.yaml")
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyFakeKeyFakeKeyFakeKeyFakeKeyFake evil@x"
EVAL = ["eval.tasks=2", "logging.progress=false", "logging.tensorboard=false",
        "observe.traces.enabled=false"]
# a module that leaves a marker beside itself when imported: proof that it ran
HOSTILE = """import pathlib
pathlib.Path(__file__).with_name("MARKER").write_text("imported")
from tiller.rollout.agent_loop import run_episode  # noqa: E402,F401
"""


def victim(tmp_path: Path, name: str = "authorized_keys") -> Path:
    path = tmp_path / "home" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("ssh-ed25519 AAAA-the-users-own-key user@host\n")
    return path


def one_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    return lines[0]


# ---------------------------------------------------------------- item 2: links, newlines


def hostile_report_folder(tmp_path: Path) -> Path:
    """A finished run's records, as a downloaded run folder may hold them: a name that carries
    a whole line (an SSH key), a ledger key with a newline, a dotted path in the config."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"phase": "eval_sft", "step": 0, "success": 0.5, "ci_low": 0.1, "ci_high": 0.9,
             "tasks": 4, "samples": 4},
            {"phase": "rl", "step": 1, "phase_step": 1, "reward_mean": 0.2, "success_rate": 0.2,
             "ledger/trained": 4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps(
        {"rl": {"ledger": {"trained": 4, f"x\n{KEY}": 1}}}))
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"name": f"run\n{KEY}\n", "agent": {"loop": "hostile_loop:run_episode"}}))
    (run / "hostile_loop.py").write_text(HOSTILE)
    return run


def test_report_replaces_a_planted_link_and_keeps_attacker_lines_out(tmp_path, monkeypatch):
    run = hostile_report_folder(tmp_path)
    keys = victim(tmp_path)
    (run / "report.html").symlink_to(keys)
    monkeypatch.chdir(run)  # the folder's module would be importable from here
    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert keys.read_text() == "ssh-ed25519 AAAA-the-users-own-key user@host\n"
    report = run / "report.html"
    assert not report.is_symlink()
    html = report.read_text()
    assert KEY not in html.splitlines()  # no line of the attacker's own
    assert f"run\\n{KEY}\\n" in html and f"x\\n{KEY}" in html  # shown, escaped
    assert not (run / "MARKER").exists()  # the report reads config.yaml as data


def test_eval_outputs_replace_planted_links(calc_sft_dir, tmp_path):
    out = tmp_path / "ev"
    (out / "eval").mkdir(parents=True)
    planted = {name: victim(tmp_path, name.replace("/", "_"))
               for name in ("config.yaml", "summary.json", "eval/checkpoint.jsonl")}
    for name, target in planted.items():
        (out / name).symlink_to(target)
    r = CliRunner().invoke(app, ["eval", CONFIG, "--model", str(calc_sft_dir), "-o", str(out),
                                 *EVAL])
    assert r.exit_code == 0, r.output
    for name, target in planted.items():
        assert target.read_text() == "ssh-ed25519 AAAA-the-users-own-key user@host\n", name
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert json.loads((out / "summary.json").read_text())["model"] == str(calc_sft_dir)
    assert len((out / "eval/checkpoint.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("name, overrides", [
    ("metrics.jsonl", []),
    ("traces.sqlite-wal", ["observe.traces.enabled=true"]),
    ("tensorboard", ["logging.tensorboard=true"]),
])
def test_files_written_in_place_refuse_a_planted_link(calc_sft_dir, tmp_path, name, overrides):
    out = tmp_path / "ev"
    out.mkdir()
    target = victim(tmp_path)
    (out / name).symlink_to(target)
    code, printed = cli("eval", CONFIG, "--model", calc_sft_dir, "-o", out, *EVAL, *overrides)
    assert code == 2, printed
    assert one_line(printed) == (f"error: {out / name} is a symbolic link (to {str(target)!r}); "
                                  "tiller does not write through links: remove it, or write "
                                  "to another folder")
    assert target.read_text() == "ssh-ed25519 AAAA-the-users-own-key user@host\n"


def test_a_replay_store_refuses_a_planted_link(tmp_path):
    """A link to a file that does not exist yet: SQLite would create it there (a login
    script, say) and record the tool results into it."""
    profile = tmp_path / "home" / ".bash_profile"
    profile.parent.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tools.sqlite").symlink_to(profile)
    with pytest.raises(ConfigError, match=r"tools.sqlite is a symbolic link"):
        ReplayStore(tmp_path / "run" / "tools.sqlite", "record")
    assert not profile.exists()


def test_a_replay_store_in_a_linked_folder_of_the_run_folder_is_refused(tmp_path):
    """A relative env.tools.replay.path lives in the run folder; its folder linked elsewhere
    would have SQLite create the store there."""
    outside = tmp_path / "home"
    outside.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "cache").symlink_to(outside, target_is_directory=True)
    tools = ToolsConfig(replay={"path": "cache/tools.sqlite", "mode": "record"})
    with pytest.raises(ConfigError, match=r"run/cache is a symbolic link"):
        ToolStack(tools, tmp_path / "run")
    assert list(outside.iterdir()) == []


def test_weight_updates_replace_planted_links(tmp_path):
    names = ("model.safetensors", "delta.safetensors", "tiller_version.json")
    planted = {n: victim(tmp_path, n) for n in names}
    folder = tmp_path / "weights" / "v1"
    folder.mkdir(parents=True)
    for n, target in planted.items():
        (folder / n).symlink_to(target)
    WeightUpdate(1, {"w": torch.ones(3)}).save(folder)
    DeltaUpdate(2, 1, {"w": TensorDelta(3, torch.tensor([0, 2], dtype=torch.uint8),
                                        torch.tensor([5.0, 6.0]))}).save(folder)
    for n, target in planted.items():
        assert target.read_text() == "ssh-ed25519 AAAA-the-users-own-key user@host\n", n
        assert not (folder / n).is_symlink(), n
    assert json.loads((folder / "tiller_version.json").read_text())["kind"] == "delta"
    assert torch.equal(load_file(folder / "model.safetensors")["w"], torch.ones(3))
    assert torch.equal(load_file(folder / "delta.safetensors")["w/val"], torch.tensor([5., 6.]))


def test_http_engine_refuses_a_planted_version_folder(tmp_path):
    """weights/v1 linked to a folder of the user's: the push would write into it and, with no
    server taking the weights, remove it."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "v1").symlink_to(precious, target_is_directory=True)
    http = HttpEngine(["http://127.0.0.1:9"], weights_dir=tmp_path / "weights",
                      request_timeout_s=2.0, max_retries=0)
    try:
        with pytest.raises(ConfigError, match=r"weights/v1 is a symbolic link"):
            http.update_weights(WeightUpdate(1, {"w": torch.ones(3)}))
    finally:
        http.close()
    assert sorted(p.name for p in precious.iterdir()) == ["thesis.tex"]


def test_eval_refuses_a_linked_folder_in_its_output_folder(calc_sft_dir, tmp_path):
    """eval/ linked to a folder of the user's: the outcomes were written into it."""
    outside = tmp_path / "home" / "notes"
    outside.mkdir(parents=True)
    (outside / "todo.txt").write_text("mine")
    out = tmp_path / "ev"
    out.mkdir()
    (out / "eval").symlink_to(outside, target_is_directory=True)
    r = CliRunner().invoke(app, ["eval", CONFIG, "--model", str(calc_sft_dir), "-o", str(out),
                                 *EVAL])
    assert r.exit_code == 2, r.output
    assert one_line(r.output) == (f"error: {out / 'eval'} is a symbolic link (to "
                                  f"{str(outside)!r}); tiller does not write through links: "
                                  "remove it, or write to another folder")
    assert [p.name for p in outside.iterdir()] == ["todo.txt"]


def test_a_run_refuses_linked_checkpoints_and_weights_folders(calc_model_dir, tmp_path):
    """checkpoints/ linked to a folder of the user's: saving `final` wrote the weights there
    and removed the user's own `final` folder. weights/ (the HTTP engine's default, in the run
    folder): each version's folder was written there and the old ones removed."""
    outside = tmp_path / "home"
    (outside / "final").mkdir(parents=True)
    (outside / "final" / "thesis.tex").write_text("years of work")
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").symlink_to(outside, target_is_directory=True)
    (out / "weights").symlink_to(outside, target_is_directory=True)
    cfg = load_config(CONFIG, [f"model.path={calc_model_dir}", "model.build=null", *EVAL])
    run = Run(cfg, out)
    try:
        with pytest.raises(ConfigError, match=rf"^{out / 'checkpoints'} is a symbolic link "):
            run.save()
    finally:
        run.close()
    http = HttpEngine(["http://127.0.0.1:9"], weights_dir=out / "weights", root=out,
                      request_timeout_s=2.0, max_retries=0)
    try:
        with pytest.raises(ConfigError, match=rf"^{out / 'weights'} is a symbolic link "):
            http.update_weights(WeightUpdate(1, {"w": torch.ones(3)}))
    finally:
        http.close()
    assert sorted(str(p.relative_to(outside)) for p in outside.rglob("*")) == [
        "final", "final/thesis.tex"]


# ---------------------------------------------------------------- item 9: config as data


def run_folder(tmp_path: Path, model: Path | None = None, **settings) -> Path:
    """A run folder whose config.yaml is configs/calculator.yaml with `settings` (dotted keys)
    and the hostile module beside it; checkpoints/final a copy of `model` (or empty)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if model is None:
        (run / "checkpoints" / "final").mkdir()
    else:
        shutil.copytree(model, run / "checkpoints" / "final")
    cfg = load_config(CONFIG, [*TINY_RUN, *EVAL]).model_dump()
    for key, value in settings.items():
        *parents, leaf = key.split("__")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "hostile_loop.py").write_text(HOSTILE)
    return run


@pytest.fixture()
def trusted_module(tmp_path, monkeypatch):
    """hostile_loop importable from a folder the user put on the path (not the run folder)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "hostile_loop.py").write_text(HOSTILE)
    monkeypatch.syspath_prepend(str(lib))
    yield lib / "MARKER"
    sys.modules.pop("hostile_loop", None)


def test_eval_of_a_run_folder_refuses_its_code_unless_trusted(calc_sft_dir, tmp_path,
                                                             trusted_module, monkeypatch):
    run = run_folder(tmp_path, calc_sft_dir, agent__loop="hostile_loop:run_episode")
    monkeypatch.chdir(run)
    code, out = cli("eval", run)
    assert code == 2, out
    assert one_line(out) == (
        f"error: config field agent.loop: got 'hostile_loop:run_episode', which names code to "
        f"import; {run / 'config.yaml'} is a run folder's config, read as data: it may not "
        "ask for that; pass --trust-run-config if you trust whoever wrote it")
    assert not trusted_module.exists() and not (run / "MARKER").exists()
    # the user's own override is theirs: tiller's loop, nothing imported
    r = CliRunner().invoke(app, ["eval", str(run), "-o", str(tmp_path / "ours"),
                                 "agent.loop=tiller.rollout.agent_loop:run_episode"])
    assert r.exit_code == 0, r.output
    assert not trusted_module.exists()
    r = CliRunner().invoke(app, ["eval", str(run), "-o", str(tmp_path / "trusted"),
                                 "--trust-run-config"])
    assert r.exit_code == 0, r.output
    assert trusted_module.exists()  # imported from the user's path...
    assert not (run / "MARKER").exists()  # ...never from the run folder
    assert [len((tmp_path / d / "eval/checkpoint.jsonl").read_text().splitlines())
            for d in ("ours", "trusted")] == [2, 2]


@pytest.mark.parametrize("settings, field", [
    ({"env__name": "hostile_loop:Env"}, "env.name"),
    ({"env__tools__functions": ["hostile_loop:run_episode"]}, "env.tools.functions"),
    ({"agent__program": "hostile_loop:run_episode"}, "agent.program"),
    ({"rl__algorithm__credit__key_steps": "hostile_loop:run_episode"},
     "rl.algorithm.credit.key_steps"),
    ({"rl__judge__fn": "hostile_loop:run_episode"}, "rl.judge.fn"),
    ({"env__name": "dataset", "data__train": "rows.jsonl", "data__tools": ["hostile_loop:f"],
      "rewards": [{"verifier": "exact_match"}]}, "data.tools"),
    ({"env__name": "dataset", "data__train": "rows.jsonl",
      "rewards": [{"function": "hostile_loop:run_episode"}]}, "rewards"),
    ({"env__tools__sandbox__allow_unsafe_fallback": True},
     "env.tools.sandbox.allow_unsafe_fallback"),
    ({"env__tools__replay": {"path": "/tmp/x.sqlite", "mode": "record"}},
     "env.tools.replay.path"),
    ({"env__tools__replay": {"path": "../x.sqlite", "mode": "record"}},
     "env.tools.replay.path"),
    ({"env__tools__mcp": [{"name": "x", "command": ["sh", "-c", "exit 0"]}]},
     "env.tools.mcp"),
    ({"env__name": "openenv", "env__openenv": {"command": ["sh", "-c", "exit 0",
                                                           "{port}"]}}, "env.openenv"),
    ({"engine__backend": "http", "engine__urls": ["http://evil.example"]}, "engine.urls"),
    ({"engine__backend": "http", "engine__urls": ["http://127.0.0.1:1"],
      "engine__weights_dir": "/tmp/w"}, "engine.weights_dir"),
])
def test_each_setting_a_run_folder_may_not_hold_is_one_line(tmp_path, trusted_module,
                                                            settings, field):
    run = run_folder(tmp_path, **settings)
    code, out = cli("eval", run)
    assert code == 2, out
    line = one_line(out)
    assert line.startswith(f"error: config field {field}: got ") and line.endswith(
        "pass --trust-run-config if you trust whoever wrote it"), line
    assert not trusted_module.exists()


def test_managed_tiller_serve_servers_are_not_a_setting_to_trust():
    """engine.servers starts `tiller serve` on loopback (no program or URL of the run
    folder's): a resume of such a run needs no --trust-run-config (it was refused as
    `engine.urls: got []`)."""
    cfg = load_config("configs/calculator.yaml", ["engine.backend=http", "engine.servers=1"])
    assert run_config_requests(cfg) == []
    cfg = load_config("configs/calculator.yaml", ["engine.backend=http",
                                                  "engine.urls=[http://127.0.0.1:1]"])
    assert [field for field, *_ in run_config_requests(cfg)] == ["engine.urls"]


def test_a_data_rows_tools_column_is_refused_as_it_is_read(tmp_path, trusted_module):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1?", "answer": "2",
                                "tools": ["hostile_loop:run_episode"]}) + "\n")
    run = run_folder(tmp_path, env__name="dataset", data__train=str(rows),
                     data__eval=str(rows), rewards=[{"verifier": "exact_match"}])
    code, out = cli("eval", run)
    assert code == 2, out
    assert one_line(out) == (
        f"error: {rows} row 1, column 'tools': got 'hostile_loop:run_episode'; it names code "
        f"to import; {run / 'config.yaml'} is a run folder's config, read as data: it may not "
        "ask for that; pass --trust-run-config if you trust whoever wrote it")
    assert not trusted_module.exists()
    CliRunner().invoke(app, ["eval", str(run), "--trust-run-config"])
    assert trusted_module.exists()  # trusted: the row's tool was imported


@pytest.mark.slow
@pytest.mark.integration
def test_python_m_tiller_in_a_run_folder_imports_nothing_from_it(tmp_path):
    """`python -m tiller eval .` with the run folder as the current folder: a module file
    there named like anything tiller imports (yaml.py, typing.py, torch.py, ...) is not
    imported in its place, nor the module its config names."""
    run = run_folder(tmp_path, agent__loop="hostile_loop:run_episode")
    # the tiller under test (its src folder), in the subprocesses too
    env = {**os.environ, "PYTHONPATH": str(Path(tiller.__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    # what Python's `-m` start-up loads before tiller's code runs (tiller cannot help those)
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "modules_probe.py").write_text("import sys\nprint(' '.join(sys.modules))")
    before = subprocess.run([sys.executable, "-m", "modules_probe"], cwd=probe, env=env,
                            capture_output=True, text=True, timeout=60, check=True).stdout.split()
    # everything the refused eval imports, run elsewhere
    loaded = tmp_path / "loaded.json"
    code = ("import json, runpy, sys\nrun, out = sys.argv[1:]\n"
            "sys.argv = ['tiller', 'eval', run]\n"
            "try:\n    runpy.run_module('tiller', run_name='__main__')\nexcept SystemExit:\n"
            "    pass\nopen(out, 'w').write(json.dumps(list(sys.modules)))\n")
    subprocess.run([sys.executable, "-c", code, str(run), str(loaded)], cwd=probe, env=env,
                   capture_output=True, text=True, timeout=300, check=True)
    top = {m.partition(".")[0] for m in json.loads(loaded.read_text())}
    shadows = top - {m.partition(".")[0] for m in before} - set(sys.builtin_module_names) - {
        "__main__", "tiller"}  # a tiller/ folder there would be Python's -m choice, not ours
    assert {"typing", "yaml", "typer", "torch", "pydantic"} <= shadows, sorted(shadows)
    for name in shadows:  # builtins only: every other module there is a shadow too
        (run / f"{name}.py").write_text("open(__file__ + '.imported', 'w').close()\n")
    proc = subprocess.run([sys.executable, "-m", "tiller", "eval", "."], cwd=run, env=env,
                          capture_output=True, text=True, timeout=300)
    assert sorted(p.name for p in run.glob("*.imported")) == []
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert one_line(proc.stdout + proc.stderr).startswith(
        "error: config field agent.loop: got 'hostile_loop:run_episode', which names code")
    assert not (run / "MARKER").exists()


# ---------------------------------------------------------------- one run per run folder


def killed_before_its_first_checkpoint(tmp_path: Path, every: int) -> Path:
    """A run folder as a run killed in SFT leaves it: its config.yaml, metrics and traces, no
    checkpoint."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(CONFIG, [*TINY_RUN, f"checkpoint.every={every}"])
    (run / "config.yaml").write_text(dump_config(cfg))
    (run / "metrics.jsonl").write_text('{"phase": "sft", "phase_step": 1, "loss": 3.4}\n')
    (run / "traces.sqlite").write_bytes(b"")
    return run


def files_of(run: Path) -> dict[str, bytes]:
    """Each file of `run` and its bytes, but traces.sqlite's (a live run's trace writer
    thread may write them meanwhile)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and not p.name.startswith("traces.sqlite")}


@pytest.mark.parametrize("every, why", [
    (2, "its run stopped before its first (written after RL step 2 or the last step; none "
        "during the tool gate, SFT or the evaluation after it)"),
    (0, "its run wrote none (checkpoint.every 0)"),
])
def test_a_run_killed_before_its_first_checkpoint_is_refused_saying_what_to_do(tmp_path,
                                                                                every, why):
    """Review s9 F4: `--resume` of a run killed before its first checkpoint said "a run writes
    them with checkpoint.every > 0", which it had; and the same `tiller train -o` again
    appended a second run's rows and episodes to the dead one's. Now the resume says why
    there is none and what to do, and a fresh run refuses a folder holding a run's record,
    each in one line, the folder's files left as they were (a refused fresh run leaves at most
    the folder's empty lock file)."""
    run = killed_before_its_first_checkpoint(tmp_path, every)
    before = files_of(run)
    code, out = cli("train", "--resume", run)
    assert code == 2 and one_line(out) == (
        f"error: --resume {str(run)!r}: no complete checkpoint in {run / 'checkpoints'}: {why}; "
        "nothing to resume: start the run again in a new folder (-o), or in this one once its "
        "files are moved away"), out
    code, out = cli("train", CONFIG, *TINY_RUN, "-o", run)
    assert code == 2 and one_line(out) == (
        f"error: run folder {run} already holds a run's metrics.jsonl, traces.sqlite: resume "
        f"that run with `tiller train --resume {run}`, or start a new one in another folder "
        "(-o)"), out
    after = files_of(run)
    assert after.pop(".tiller.lock") == b"" and after == before
    assert (run / "traces.sqlite").read_bytes() == b""


def said_line(proc: subprocess.Popen, seen: list[str], text: str, timeout_s: float,
              what: str) -> None:
    """Wait until a line of `proc`'s output (read into `seen` by a thread) holds `text`; an
    error naming `what` it waited for when the process ended first or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in seen):
        out = "".join(seen)[-3000:]
        assert proc.poll() is None, f"the run ended before {what}: {out}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s: {out}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_second_process_in_a_run_folder_is_refused_naming_the_holder(tmp_path):
    """Review s9 F5: two processes training or resuming one run folder (a requeued job while
    the old one still dies) mixed their records. A run holds its folder's lock for its life:
    while one runs (held here in its first checkpoint's write by the test hook), a resume
    in another process and a fresh run into the folder are refused in one line naming its pid,
    the folder left as it was; the kernel drops the lock when the run dies (SIGKILL), and the
    folder can be locked again."""
    from tiller.files import hold_run_dir
    from tiller.train.process_state import PAUSE_ENV

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(tiller.__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "tiller", "train", CONFIG, *TINY_RUN, "checkpoint.every=1",
         "-o", str(run)], cwd=ROOT, env={**env, PAUSE_ENV: "files:300"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []  # its output, read as it comes (never blocked on a full pipe)
    reader = threading.Thread(target=lambda: seen.extend(first.stdout), daemon=True)
    reader.start()
    try:
        said_line(first, seen, f"{PAUSE_ENV}: 300 s at files", 600,
                  "the test hook's line at files (its first checkpoint paused)")
        before = files_of(run)
        busy = (f"error: run folder {run} is in use by another process (pid {first.pid}, "
                f"holding {run / '.tiller.lock'}): wait for it to end or stop it; two runs in "
                "one folder would mix their records")
        second = subprocess.run([sys.executable, "-m", "tiller", "train", "--resume", str(run)],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and one_line(second.stdout + second.stderr) == busy, (
            second.stdout + second.stderr)
        code, out = cli("train", CONFIG, *TINY_RUN, "-o", run)
        assert code == 2 and one_line(out) == busy, out
        assert files_of(run) == before
    finally:
        first.kill()
        first.wait(60)
        reader.join(30)
    with hold_run_dir(run):  # the dead run's lock is gone with it
        pass


@pytest.mark.slow
def test_a_fresh_run_holds_its_folder_until_its_summary_is_written(tmp_path, monkeypatch):
    """Review s9 F2: a fresh run gave its folder's lock up when it closed, before it wrote
    summary.json, so a resume could start in the folder while it still wrote. The lock is
    tried (non-blocking, from another open file) at that write: taken by the run."""
    import fcntl

    from tiller import controller

    run, tried = tmp_path / "run", []
    real = controller.write_file

    def write_file(path, data, *, root):
        if Path(path).name == "summary.json":
            fd = os.open(run / ".tiller.lock", os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                tried.append("free")
            except BlockingIOError:
                tried.append("held")
            finally:
                os.close(fd)
        return real(path, data, root=root)

    monkeypatch.setattr(controller, "write_file", write_file)
    controller.train(load_config(CONFIG, [*TINY_RUN, "rl.steps=1"]), run)
    assert tried == ["held"]
    with open(run / ".tiller.lock") as f:  # given up once the run returned
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
