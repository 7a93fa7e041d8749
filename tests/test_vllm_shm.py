"""`engine.weight_transfer: shm` (engine/vllm_shm.py, engine/vllm_shm_server.py): the segment
layout and the manifest checks the server runs before loading, and pushes into a live vLLM CPU
server (.venv-vllm) through tiller's `tiller_shm` weight-transfer engine: parity of vLLM's
prompt logprobs with the trainer's after a push, the weight version read back, and a missing
or truncated segment refused in one line with the server still serving the old weights."""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import dead_pid
from test_vllm_engine import cfg, tiny, trainer_logprobs
from transformers import AutoModelForCausalLM

from tiller.engine import vllm as vllm_mod
from tiller.engine import vllm_launch, vllm_shm
from tiller.engine.updates import WeightUpdate
from tiller.engine.vllm import VllmEngine, connect_vllm, default_python, server_specs
from tiller.engine.vllm_shm import (
    ALIGN,
    MAX_TENSORS,
    SHM_DIR,
    checked_segment,
    layout,
    plugin_installed,
    read_manifest,
    remove_segment,
    remove_stale_segments,
    write_segment,
)
from tiller.errors import ConfigError, RunError


def segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("tiller-weights-*")}


def test_a_segment_holds_each_tensor_at_an_aligned_offset_and_reads_back() -> None:
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16),
               "c": torch.randn(2, 2, 2).half()}
    entries, size = layout(tensors)
    assert [e.offset for e in entries] == [0, 64, 128] and size == 128 + 16
    info = write_segment(tensors)
    try:
        assert os.stat(info["path"]).st_mode & 0o777 == 0o600
        got = read_manifest(info, os.path.getsize(info["path"]))
        raw = torch.from_file(info["path"], shared=False, size=size, dtype=torch.uint8)
        for e, (name, t) in zip(got, tensors.items(), strict=True):
            view = raw[e.offset:e.offset + e.nbytes].view(t.dtype).view(e.shape)
            assert e.name == name and e.offset % ALIGN == 0 and torch.equal(view, t)
    finally:
        remove_segment(info["path"])
    assert not Path(info["path"]).exists()


def test_the_manifest_is_checked_against_the_segment_before_anything_is_read() -> None:
    info = {"path": "/dev/shm/tiller-weights-x", "size": 128, "names": ["a", "b"],
            "dtypes": ["float32", "float32"], "shapes": [[4], [16]], "offsets": [0, 64]}
    assert [e.nbytes for e in read_manifest(info, 128)] == [16, 64]
    bad = [({"size": 128}, 100, "100 bytes, the manifest says 128"),  # truncated
           ({"offsets": [0, 128]}, 128, "b ends at byte 192, past the segment's 128"),
           ({"offsets": [0, 60]}, 128, "bad entry 'b'"),
           ({"dtypes": ["float32", "int64"]}, 128, "bad entry 'b'"),
           ({"shapes": [[4], [-1]]}, 128, "bad entry 'b'"),
           ({"names": ["a"]}, 128, "differ in length"),
           ({"names": ["n"] * (MAX_TENSORS + 1)}, 128, "at most 100000"),
           ({"extra": 1}, 128, "expected keys")]
    for change, size, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            read_manifest({**info, **change}, size)


@pytest.mark.integration  # runs the vLLM env's Python
def test_the_vllm_envs_platform_is_asked_and_a_python_without_vllm_is_one_line() -> None:
    """scripts/setup.sh's env is vLLM's CPU build, which decides the CPU-only server flags; a
    Python without vllm (tiller's own env) is one RunError naming it and vLLM's import error."""
    assert vllm_launch.device_type(str(default_python()), vllm_launch.server_env(1)) == "cpu"
    with pytest.raises(RunError, match=r"^engine.python \S+python\S* cannot tell vLLM's platform "
                       r"\(exit 1\): ModuleNotFoundError: No module named 'vllm'; build the vLLM "
                       r"environment with `bash scripts/setup.sh`$"):
        vllm_launch.device_type(sys.executable, {})


@pytest.mark.integration  # runs the vLLM env's Python
def test_a_vllm_env_without_the_plugin_is_one_config_line(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The check runs in the vLLM env with the servers' environment; an entry point of another
    value stands for one not installed. Nothing is started."""
    env = server_specs("python", tmp_path, 1, max_context=64, dtype="float32",
                       kv_cache_bytes=1 << 20, threads=1, extra_args=[], cpu=True,
                       transfer="shm")[0].env
    assert plugin_installed(str(default_python()), env)  # installed by scripts/setup.sh
    monkeypatch.setattr(vllm_shm, "ENTRY_POINT", "tiller.engine.vllm_shm_server:missing")
    _, model, tok = tiny(tmp_path / "m", heads=4)
    with pytest.raises(ConfigError, match=r"^config field engine.weight_transfer: shm needs "
                       r"tiller's vLLM plugin \(entry point tiller_shm\) in .*python's "
                       r"environment; install it with `bash scripts/setup.sh` or use disk$"):
        connect_vllm(cfg(weight_transfer="shm"), model, tok, run_dir=tmp_path / "run",
                     initial=WeightUpdate.full(model, 0), dtype="float32")
    assert not (tmp_path / "run").exists()  # nothing saved, nothing started


class FullDisk(torch.Tensor):
    """A tensor whose copy into the segment fails as a full tmpfs would (ENOSPC), i.e. after
    `write_segment` has created or opened the file."""

    def detach(self) -> torch.Tensor:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_leaves_no_segment(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="No space left on device"):
        write_segment({"a": torch.ones(2), "b": torch.ones(2).as_subclass(FullDisk)},
                      folder=tmp_path)
    assert list(tmp_path.iterdir()) == []
    # reuse=: the kept segment of the last push is removed (the next push writes a fresh one)
    kept = write_segment({"a": torch.ones(2)}, folder=tmp_path)["path"]
    assert [p.name for p in tmp_path.iterdir()] == [Path(kept).name]
    with pytest.raises(OSError, match="No space left on device"):
        write_segment({"a": torch.ones(2).as_subclass(FullDisk)}, folder=tmp_path, reuse=kept)
    assert list(tmp_path.iterdir()) == []


def test_segment_names_carry_the_pid_and_stale_ones_of_dead_trainers_are_removed(
        tmp_path: Path) -> None:
    info = write_segment({"a": torch.ones(2)}, folder=tmp_path)
    mine = Path(info["path"]).name
    assert mine.startswith(f"tiller-weights-{os.getpid()}-")
    dead = f"tiller-weights-{dead_pid()}-abc"
    running = "tiller-weights-1-abc"  # init runs
    no_pid = "tiller-weights-abc"  # left: whose it is cannot be told
    for name in (dead, running, no_pid):
        (tmp_path / name).write_bytes(b"x" * 64)
    other = f"tiller-weights-{dead_pid()}-other-user"
    (tmp_path / other).write_bytes(b"x")
    os.chown(tmp_path / other, 12345, 12345)  # another user's (the tests run as root here)
    assert remove_stale_segments(tmp_path) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine, running, no_pid, other])


def test_connect_removes_stale_segments_and_a_gone_segment_is_written_anew(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """At start (VllmEngine with transfer shm, as connect_vllm makes it) the segments of dead
    trainers in /dev/shm are removed, counted and logged; a push whose kept segment was
    removed under the run writes a new one (counted, logged) instead of failing."""
    _, model, _ = tiny(tmp_path / "m", heads=4)
    stale = SHM_DIR / f"tiller-weights-{dead_pid()}-s7test"
    stale.write_bytes(b"x" * 64)
    with caplog.at_level(logging.WARNING, logger="tiller.engine.vllm"):
        engine = VllmEngine(["http://127.0.0.1:9"], weights_dir=tmp_path / "w",
                            transfer="shm", shapes={n: tuple(t.shape)
                                                    for n, t in model.state_dict().items()})
    try:
        assert not stale.exists()
        assert engine.counters["stale_segments_removed"] >= 1  # others' dead runs count too
        assert any(stale.name in r.getMessage() for r in caplog.records)
        gone = str(SHM_DIR / f"tiller-weights-{os.getpid()}-gone")
        engine._segment = {"path": gone}
        engine._save(WeightUpdate.full(model, 1), tmp_path / "w" / "v1")
        assert engine.counters["segments_rewritten"] == 1
        fresh = Path(engine._segment["path"])
        assert fresh.name.startswith(f"tiller-weights-{os.getpid()}-") and fresh.exists()
        assert not Path(gone).exists()
        assert any(f"segment {gone} is gone; writing v1 into a new one" in r.getMessage()
                   for r in caplog.records)
    finally:
        engine.close()
    assert not fresh.exists()


def test_the_server_opens_only_its_users_regular_segment_files_not_links() -> None:
    info = write_segment({"a": torch.ones(2)})
    path = Path(info["path"])
    link = SHM_DIR / f"tiller-weights-{os.getpid()}-link"
    try:
        fd, entries, size = checked_segment(info)
        os.close(fd)
        assert ([e.name for e in entries], size) == (["a"], 8)
        link.symlink_to(path)
        with pytest.raises(ValueError, match=rf"^tiller shm segment {link}: a symbolic link, "
                           r"refused$"):
            checked_segment({**info, "path": str(link)})
        os.chown(path, 12345, 12345)  # another local user's file (the tests run as root)
        with pytest.raises(ValueError, match=rf"^tiller shm segment {path}: owned by uid 12345,"
                           rf" not this server's user \({os.getuid()}\), refused$"):
            checked_segment(info)
    finally:
        link.unlink(missing_ok=True)
        remove_segment(str(path))


@pytest.fixture(scope="module")
def shm_served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm-shm")
    _, model, tok = tiny(root / "m32", heads=4)
    engine = connect_vllm(cfg(weight_transfer="shm"), model, tok, run_dir=root / "run",
                          initial=WeightUpdate.full(model, 0), dtype="float32")
    try:
        yield engine, model
    finally:
        last = engine._segment
        engine.close()
    assert last is not None and not Path(last["path"]).exists()  # removed at close


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(seed)
    for v in changed.values():
        v += 0.05 * torch.randn_like(v)
    new = AutoModelForCausalLM.from_config(model.config)
    new.load_state_dict(changed)
    return new.eval()


PROBE = list(range(1, 40))


def parity(engine: vllm_mod.VllmEngine, model: torch.nn.Module) -> float:
    ours = trainer_logprobs(model, PROBE[:1], PROBE[1:], 1.0)
    return float((torch.tensor(engine.score(PROBE)) - ours).abs().max())


@pytest.mark.integration
@pytest.mark.slow
def test_a_push_through_shared_memory_keeps_parity_and_sets_the_version(shm_served) -> None:
    engine, model = shm_served
    assert "--weight-transfer-config" in engine.managed.specs[0].argv
    assert parity(engine, model) < 1e-4
    new = perturbed(model, 1)
    before = segments()
    assert engine.update_weights(WeightUpdate(1, new.state_dict())) == 1
    assert parity(engine, new) < 1e-4 and parity(engine, model) > 1e-2
    info = engine._call(engine._post(engine.servers[0], "/weight_info"), "weight_info")
    assert info == {"weight_version": "1"}
    kept = Path(engine._segment["path"])  # kept: the next push writes into it
    assert segments() == before | {kept.name}
    assert engine.update_weights(WeightUpdate(2, model.state_dict())) == 2
    assert Path(engine._segment["path"]) == kept and segments() == before | {kept.name}
    assert parity(engine, model) < 1e-4


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_bad_segment_is_one_line_and_the_server_keeps_the_old_weights(
        shm_served, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    engine, model = shm_served
    engine.update_weights(WeightUpdate(engine.version + 1, model.state_dict()))
    held = engine.version
    real = vllm_mod.write_segment

    def damaged(tensors: dict[str, torch.Tensor], **kw: object) -> dict:
        info = real(tensors, **kw)
        if damage == "missing":
            os.unlink(info["path"])
        else:
            os.truncate(info["path"], info["size"] // 2)
        return info

    monkeypatch.setattr(vllm_mod, "write_segment", damaged)
    before = segments() - {Path(engine._segment["path"]).name}  # the failed write's
    with pytest.raises(RunError) as raised:
        engine.update_weights(WeightUpdate(held + 1, perturbed(model, 2).state_dict()))
    message = str(raised.value)
    assert "\n" not in message and engine.servers[0].url in message
    assert ("FileNotFoundError" if damage == "missing" else "the manifest says") in message
    assert segments() == before and engine._segment is None and engine.version == held
    assert parity(engine, model) < 1e-4  # still the old weights, and serving
    monkeypatch.setattr(vllm_mod, "write_segment", real)
    new = perturbed(model, 3)
    assert engine.update_weights(WeightUpdate(held + 1, new.state_dict())) == held + 1
    assert parity(engine, new) < 1e-4


def test_a_slow_vllm_environment_check_is_one_line_within_its_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = tmp_path / "python"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setattr(vllm_shm, "PLUGIN_CHECK_S", 1.0)
    start = time.monotonic()
    with pytest.raises(RunError, match=rf"^engine.weight_transfer: shm: checking {slow}'s "
                       r"environment for tiller's vLLM plugin took more than 1 s$"):
        plugin_installed(str(slow), {})
    assert time.monotonic() - start < 10


def test_a_model_with_tensors_a_segment_cannot_carry_is_refused_before_start(
        tmp_path: Path) -> None:
    _, model, tok = tiny(tmp_path / "m", heads=4)
    tensors = {**model.state_dict(), "step": torch.zeros(1, dtype=torch.int64)}
    with pytest.raises(ConfigError, match=r"^config field engine.weight_transfer: shm carries "
                       r"float32, bfloat16, float16 tensors only, and the model has step "
                       r"\(int64\); use disk$"):
        connect_vllm(cfg(weight_transfer="shm"), model, tok, run_dir=tmp_path / "run",
                     initial=WeightUpdate(0, tensors), dtype="float32")
    assert not (tmp_path / "run").exists()  # nothing saved, nothing started
