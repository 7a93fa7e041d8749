"""A resumable checkpoint's folder read back (`tiller.checkpoints`, issue 24): what `verify`
accepts, what checkpoint.keep does with a folder it cannot read, `tiller checkpoints` on a
corrupt one, the task stream's check on resume, and the CLI's resume options. Checkpoints
here are written by `write_checkpoint` with small stand-in files (no model): the format's
checks do not read them as weights."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers import cli

from tiller import checkpoints
from tiller.checkpoints import (
    FORMAT_VERSION,
    KEEP_SKIPPED,
    MARKER,
    REFERENCE_ADAPTER,
    REFERENCE_CONFIG,
    STATE_KEYS,
    Checkpoint,
    check_steps_free,
    checkpoint_dir,
    complete_checkpoints,
    describe,
    newest_checkpoint,
    tiller_version,
    verify,
    write_checkpoint,
)
from tiller.errors import ConfigError
from tiller.observe.metrics import MetricsLogger
from tiller.resume import MAX_TAIL_BYTES, check_metrics_cut, check_no_links, prepare_run_dir
from tiller.rollout.resume import MANAGER_KEYS, check_drawn, check_state
from tiller.train.process_state import PAUSE_ENV, rng_state, set_rng_state

FILES = ("model/model.safetensors", "model/config.json", "trainer.pt", "rng.pt")


def write(run: Path, at: int, keep: int = 5, files: tuple[str, ...] = FILES, **state) -> Path:
    """Checkpoint `at` of `run`: `files` (by default those every checkpoint holds), with
    stand-in bytes, and a state.json with every key (`state` overrides)."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text("{}\n")

    def parts(new: Path) -> dict:
        for name in files:
            (new / name).parent.mkdir(parents=True, exist_ok=True)
            (new / name).write_bytes(f"{name} {at}".encode())
        return {**{k: None for k in STATE_KEYS}, "step": at, **state}

    return write_checkpoint(run, at, keep, parts)


def one_line_error(match: str, fn, *args) -> str:
    with pytest.raises(ConfigError, match=re.escape(match)) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return str(e.value)


def marker(path: Path) -> dict:
    return json.loads((path / MARKER).read_text())


def test_verify_accepts_a_whole_checkpoint_of_another_tiller_version(tmp_path):
    path = write(tmp_path, 1)
    assert marker(path)["tiller"] == tiller_version()
    # the tiller version is for a reader to see; the format is what is checked
    (path / MARKER).write_text(json.dumps({**marker(path), "tiller": "0.0.1"}))
    assert newest_checkpoint(tmp_path).state["step"] == 1
    (path / MARKER).write_text(json.dumps({**marker(path), "format": 99}))
    one_line_error(f"is of checkpoint format 99 (tiller 0.0.1); this tiller reads format "
                   f"{FORMAT_VERSION}", newest_checkpoint, tmp_path)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.pop("files"), "complete.json does not parse (KeyError: 'files')"),
    (lambda m: m.update(files=["trainer.pt"]), "does not parse (TypeError: files is a list)"),
    (lambda m: m["files"].pop("trainer.pt"), "complete.json does not list trainer.pt"),
    (lambda m: m["files"].update({"../../victim": m["files"]["rng.pt"]}),
     "complete.json lists '../../victim', not a name inside the checkpoint"),
    (lambda m: m["files"].update({"/etc/hostname": m["files"]["rng.pt"]}),
     "complete.json lists '/etc/hostname', not a name inside the checkpoint"),
    (lambda m: m.update(step=3), "its complete.json says step 3, its folder's name step 1"),
])
def test_verify_refuses_a_marker_it_cannot_trust_in_one_line(tmp_path, edit, match):
    path = write(tmp_path, 1)
    m = marker(path)
    edit(m)
    (path / MARKER).write_text(json.dumps(m))
    one_line_error(match, newest_checkpoint, tmp_path)


def test_verify_refuses_a_link_and_a_state_of_another_step(tmp_path):
    path = write(tmp_path, 1)
    # a link in place of a file, to a file of the same bytes: refused, not followed
    copy = tmp_path / "elsewhere.pt"
    copy.write_bytes((path / "rng.pt").read_bytes())
    (path / "rng.pt").unlink()
    (path / "rng.pt").symlink_to(copy)
    one_line_error(f"checkpoint {path} is corrupt: rng.pt is a symbolic link",
                   newest_checkpoint, tmp_path)
    (path / "rng.pt").unlink()
    os.replace(copy, path / "rng.pt")
    assert verify(complete_checkpoints(tmp_path)[0]).step == 1
    other = tmp_path / "other"
    write(other, 2, step=5)
    one_line_error("state.json says step 5, the folder's name 2", newest_checkpoint, other)


def test_a_lora_checkpoint_without_its_adapter_is_refused_in_one_line(tmp_path):
    """Under model.lora the adapter is what a resume loads: a checkpoint whose marker does not
    list it is partial, refused before any work (not a failed load once the run started)."""
    lora = {"model": {"lora": {"r": 4, "alpha": 8.0}}}
    path = write(tmp_path / "a", 1, config=lora)
    one_line_error(f"checkpoint {path} is corrupt: {MARKER} does not list "
                   f"adapter/adapter_config.json", newest_checkpoint, tmp_path / "a")
    path = write(tmp_path / "b", 1, files=(*FILES, "adapter/adapter_config.json"), config=lora)
    one_line_error(f"checkpoint {path} is corrupt: {MARKER} does not list "
                   f"adapter/adapter_model.safetensors", newest_checkpoint, tmp_path / "b")
    whole = (*FILES, "adapter/adapter_config.json", "adapter/adapter_model.safetensors")
    write(tmp_path / "c", 1, files=whole, config=lora)
    assert newest_checkpoint(tmp_path / "c").step == 1
    write(tmp_path / "d", 1, config={"model": {"lora": None}})  # no adapter without LoRA
    assert newest_checkpoint(tmp_path / "d").step == 1
    # review s9 F9: the reference adapter's config, which loading it reads, is required with it
    path = write(tmp_path / "e", 1, files=(*whole, REFERENCE_ADAPTER), config=lora)
    one_line_error(f"checkpoint {path} is corrupt: {MARKER} lists {REFERENCE_ADAPTER} but not "
                   f"{REFERENCE_CONFIG}", newest_checkpoint, tmp_path / "e")
    write(tmp_path / "f", 1, files=(*whole, REFERENCE_ADAPTER, REFERENCE_CONFIG), config=lora)
    assert newest_checkpoint(tmp_path / "f").step == 1


def test_verify_compares_a_files_size_before_it_reads_it(tmp_path, monkeypatch):
    """Review s9 F10: a listed file of another size than the marker's is refused without being
    read (hashed): a large or sparse file put there costs nothing. One of the listed size is
    hashed."""
    path = write(tmp_path, 1)
    with (path / "trainer.pt").open("ab") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB
    read: list[str] = []
    describe_ = checkpoints._describe
    monkeypatch.setattr(checkpoints, "_describe", lambda p: read.append(p.name) or describe_(p))
    one_line_error(f"checkpoint {path} is corrupt: trainer.pt does not match its size and "
                   f"SHA-256 in {MARKER}", newest_checkpoint, tmp_path)
    assert "trainer.pt" not in read and read  # the files before it were hashed


def test_a_checkpoint_is_never_written_over_an_existing_folder(tmp_path):
    """Putting a folder over a full one takes two renames (the old aside, the new in): a kill
    between them would leave neither. A step folder already there is refused in one line,
    left as it was, and nothing of the new checkpoint is left behind."""
    write(tmp_path, 1)
    taken = checkpoint_dir(tmp_path) / "step-000002"
    taken.mkdir()
    (taken / "theirs").write_text("kept")
    one_line_error(f"{taken} already exists: tiller does not write a checkpoint over an "
                   f"existing folder", write, tmp_path, 2)
    assert [p.name for p in taken.iterdir()] == ["theirs"]
    assert sorted(p.name for p in checkpoint_dir(tmp_path).iterdir()) == ["step-000001",
                                                                          "step-000002"]
    one_line_error(f"{checkpoint_dir(tmp_path)} already holds step-000002 (why)",
                   check_steps_free, tmp_path, 1, "why")
    check_steps_free(tmp_path, 2, "why")  # none past step 2
    # a resume from step 1 would write its step 2 there
    one_line_error(f"{checkpoint_dir(tmp_path)} already holds step-000002 (not a complete "
                   f"checkpoint, past step-000001 the run resumes from)", newest_checkpoint,
                   tmp_path)


def test_verify_names_a_state_key_that_is_missing(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")

    def parts(new: Path) -> dict:
        (new / "model").mkdir()
        for name in ("model/model.safetensors", "model/config.json", "trainer.pt", "rng.pt"):
            (new / name).write_bytes(b"x")
        return {"step": 1}

    write_checkpoint(tmp_path, 1, 2, parts)
    one_line_error("state.json has no trainer_version, rng", newest_checkpoint,
                   tmp_path)


def test_keep_leaves_a_checkpoint_it_cannot_read_and_the_run_goes_on(tmp_path, caplog):
    """An old checkpoint of another format in the folder: each later write keeps the newest
    `keep` of its own format and leaves the other one where it is (logged, counted)."""
    old = write(tmp_path, 1)
    (old / MARKER).write_text(json.dumps({**marker(old), "format": 99}))
    skipped = KEEP_SKIPPED["unreadable"]
    for step in (2, 3, 4):
        write(tmp_path, step, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000001", "step-000003", "step-000004"]
    assert KEEP_SKIPPED["unreadable"] == skipped + 3
    assert "checkpoint.keep: " in caplog.text and "left in place" in caplog.text
    assert newest_checkpoint(tmp_path).step == 4  # the old one does not block a resume


def test_checkpoints_lists_a_corrupt_state_json_in_its_status(tmp_path):
    write(tmp_path, 1, holds=["model", "optimizer"])
    path = write(tmp_path, 2, holds=["model"])
    (path / "state.json").write_text("{")
    code, out = cli("checkpoints", tmp_path)
    assert code == 0, out
    assert "step-000001" in out and "optimizer" in out and "corrupt" in out
    rows = describe(tmp_path)
    assert rows[0]["status"] == "complete" and rows[0]["holds"] == ["model", "optimizer"]
    assert rows[1]["status"].startswith("corrupt: state.json does not parse (JSONDecodeError")


@pytest.mark.parametrize("edit, status", [
    (lambda state, m: state.update(holds=[1, 2]), "state.json's holds is not a list of names"),
    (lambda state, m: state.update(holds="model"), "state.json's holds is not a list of names"),
    (lambda state, m: state.pop("holds"), "state.json does not parse (KeyError: 'holds')"),
    (lambda state, m: m["files"].update({"rng.pt": 5}),
     "does not parse (TypeError: files['rng.pt'] is not a size and a sha256)"),
    (lambda state, m: m["files"]["rng.pt"].update(size="12"),
     "does not parse (TypeError: files['rng.pt'] is not a size and a sha256)"),
])
def test_checkpoints_says_what_is_corrupt_in_a_manifest_in_one_line(tmp_path, edit, status):
    """`tiller checkpoints` validates the marker and state.json it reads: content of the
    wrong kind is that checkpoint's one-line status, never a traceback (the other checkpoints
    still listed)."""
    write(tmp_path, 1, holds=["model", "optimizer"])
    path = write(tmp_path, 2, holds=["model"])
    state, m = json.loads((path / "state.json").read_text()), marker(path)
    edit(state, m)
    (path / "state.json").write_text(json.dumps(state))
    (path / MARKER).write_text(json.dumps(m))
    code, out = cli("checkpoints", tmp_path)
    assert code == 0 and "optimizer" in out, out
    rows = describe(tmp_path)
    assert rows[0]["status"] == "complete" and status in rows[1]["status"], rows[1]
    assert "\n" not in rows[1]["status"] and rows[1]["holds"] == []


def test_the_pause_hook_refuses_a_phase_it_does_not_know(tmp_path, monkeypatch):
    monkeypatch.setenv(PAUSE_ENV, "nowhere:1")
    with pytest.raises(ValueError, match="PHASE one of"):
        write(tmp_path, 1)


def test_metrics_are_on_disk_before_a_checkpoint_records_their_length(tmp_path, monkeypatch):
    """save_rl records metrics.jsonl's length from `synced_size`: flushed and fsynced first,
    so after a power loss the file is at least as long as the fsynced checkpoint says."""
    synced = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log("rl", 1, {"x": 1.0})
    size = logger.synced_size()
    logger.close()
    assert synced == [str(tmp_path / "metrics.jsonl")]
    assert size == (tmp_path / "metrics.jsonl").stat().st_size > 0


def test_a_json_file_over_the_cap_is_refused_unread(tmp_path, monkeypatch):
    """complete.json and state.json are read whole: one larger than MAX_JSON_BYTES (a run
    folder is data) is refused as corrupt in one line, not read into memory."""
    path = write(tmp_path, 1)
    cap = max((path / MARKER).stat().st_size, (path / "state.json").stat().st_size) - 1
    monkeypatch.setattr(checkpoints, "MAX_JSON_BYTES", cap)
    read = []
    monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: read.append(p))
    one_line_error(f"complete.json does not parse (ValueError: complete.json is "
                   f"{(path / MARKER).stat().st_size} bytes, over the {cap}",
                   newest_checkpoint, tmp_path)
    assert [p.name for p in read] == []
    assert "over the" in describe(tmp_path)[0]["status"]


def test_links_in_the_checkpoints_folder_are_not_read_through(tmp_path, monkeypatch, caplog):
    """`checkpoints/` a link: refused before any file below it is read or hashed. A step
    folder that is a link: never a checkpoint (not resumed from, not counted or removed by
    checkpoint.keep), shown as a link by `tiller checkpoints`."""
    elsewhere = tmp_path / "elsewhere"
    write(elsewhere, 1)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    (run / "checkpoints").symlink_to(elsewhere / "checkpoints")
    hashed = []
    monkeypatch.setattr(checkpoints, "_describe", hashed.append)
    one_line_error(f"{run / 'checkpoints'} is a symbolic link", newest_checkpoint, run)
    assert hashed == []
    monkeypatch.undo()
    (run / "checkpoints").unlink()
    write(run, 1)
    (run / "checkpoints" / "step-000002").symlink_to(elsewhere / "checkpoints" / "step-000001")
    assert [c.step for c in complete_checkpoints(run)] == [1]
    assert "is a symbolic link" in caplog.text
    write(run, 3, keep=1)  # keep: step 1 removed, the link neither counted nor removed
    assert sorted(p.name for p in checkpoint_dir(run).iterdir()) == ["step-000002",
                                                                     "step-000003"]
    assert (elsewhere / "checkpoints" / "step-000001" / MARKER).is_file()
    assert describe(run)[0]["status"].startswith("a symbolic link (to ")


def test_a_resume_killed_while_cutting_the_run_folder_discards_each_row_once(tmp_path,
                                                                           monkeypatch):
    """prepare_run_dir moves metrics.jsonl's rows past the checkpoint to
    metrics.discarded.jsonl, then cuts metrics.jsonl: a resume killed between the two, or
    while it appended them (part of the rows written), and the next one, record those rows
    once. Neither file is read whole (review s9 F10: only the rows past the checkpoint, and as
    many bytes of the discarded file's end)."""
    read_whole = Path.read_bytes

    def never_whole(path: Path) -> bytes:
        assert path.name not in ("metrics.jsonl", "metrics.discarded.jsonl"), path
        return read_whole(path)

    monkeypatch.setattr(Path, "read_bytes", never_whole)
    rows = [json.dumps({"phase": "rl", "step": i, "time": 1000.0 + i}) + "\n"
            for i in range(4)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(rows))
    kept = len("".join(rows[:2]).encode())
    ckpt = Checkpoint(tmp_path, 2, {"metrics_bytes": kept,
                                     "manager": {"open_groups": []}}, {})
    (tmp_path / "checkpoints").mkdir()
    prepare_run_dir(tmp_path, ckpt)
    discarded = tmp_path / "metrics.discarded.jsonl"
    assert discarded.read_text() == "".join(rows[2:])
    metrics.write_text("".join(rows))  # as if killed before the cut
    assert prepare_run_dir(tmp_path, ckpt)["metrics_rows_discarded"] == 2
    assert discarded.read_text() == "".join(rows[2:])
    assert metrics.read_text() == "".join(rows[:2])
    # a later resume's rows (other times) are added
    later = json.dumps({"phase": "rl", "step": 2, "time": 2000.0}) + "\n"
    metrics.write_text("".join(rows[:2]) + later)
    prepare_run_dir(tmp_path, ckpt)
    assert discarded.read_text() == "".join(rows[2:]) + later
    # killed while it appended the tail: its first row and part of the next one written
    again = [json.dumps({"phase": "rl", "step": i, "time": 3000.0 + i}) + "\n"
             for i in range(2, 4)]
    metrics.write_text("".join(rows[:2]) + "".join(again))
    whole = discarded.read_text() + "".join(again)
    for cut in (len(again[0]) + 5, len(again[0]), 3):  # rows' bytes appended before the kill
        discarded.write_text(whole[:len(whole) - len("".join(again)) + cut])
        assert prepare_run_dir(tmp_path, ckpt)["metrics_rows_discarded"] == 2
        assert discarded.read_text() == whole, cut
        assert metrics.read_text() == "".join(rows[:2])
        metrics.write_text("".join(rows[:2]) + "".join(again))


def test_a_run_folder_a_resume_would_block_on_or_cut_twice_is_refused_first(tmp_path):
    """Review s10 N1, N3, N4, N5: a FIFO in the run folder (a resume's open of it would block
    for ever) and a metrics.jsonl with another name (a hard link: the cut in place would cut
    the other file too) are refused in one line; so are a checkpoint length inside a row and
    a tail past MAX_TAIL_BYTES. A torn last row of metrics.discarded.jsonl (not this tail's)
    is ended before the tail is appended, so each row stays a line."""
    rows = [json.dumps({"step": i, "time": 1000.0 + i}) + "\n" for i in range(3)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(rows))
    kept = len(rows[0])
    ckpt = Checkpoint(tmp_path, 1, {"metrics_bytes": kept, "manager": {"open_groups": []}}, {})
    (tmp_path / "checkpoints").mkdir()
    check_no_links(tmp_path)
    check_metrics_cut(metrics, ckpt)
    os.mkfifo(tmp_path / "metrics.discarded.jsonl")
    one_line_error("metrics.discarded.jsonl is neither a folder nor a regular file",
                   check_no_links, tmp_path)
    (tmp_path / "metrics.discarded.jsonl").unlink()
    os.link(metrics, tmp_path / "backup.jsonl")
    one_line_error("metrics.jsonl has 2 names (a hard link)", check_no_links, tmp_path)
    (tmp_path / "backup.jsonl").unlink()
    torn = Checkpoint(tmp_path, 1, {**ckpt.state, "metrics_bytes": kept - 3}, {})
    one_line_error("ends inside a row", check_metrics_cut, metrics, torn)
    with metrics.open("ab") as f:
        f.truncate(kept + MAX_TAIL_BYTES + 1)
    one_line_error(f"move the rows past byte {kept} away by hand", check_metrics_cut,
                   metrics, ckpt)
    metrics.write_text("".join(rows))
    discarded = tmp_path / "metrics.discarded.jsonl"
    discarded.write_text('{"step": 9, "ti')  # an earlier row torn by a full disk
    prepare_run_dir(tmp_path, ckpt)
    assert discarded.read_text() == '{"step": 9, "ti\n' + "".join(rows[1:])
    assert metrics.read_text() == rows[0]


MANAGER = {"pulled": 2, "next_unit": 1, "slots": 0, "steps_trained": 1, "max_ahead": 1,
           "draw_ids": ["a", "b"], "open_tasks": [], "open_groups": [], "ledger": {"x": 1},
           "draws": [[[0], "a", 1]], "refills": []}


@pytest.mark.parametrize("edit, match", [
    ({"draws": "abc"}, "ValueError: not enough values to unpack"),
    ({"pulled": "2"}, "TypeError: pulled is a str, not an int"),
    ({"ledger": {"x": "1"}}, "TypeError: ledger or draws holds a count that is not an int"),
    ({"open_tasks": [{"id": "a", "nonsense": 1}]}, "TypeError:"),
    ({"refills": None}, "TypeError:"),
    # review s9 F9: the open groups, which the cut of traces.sqlite reads
    ({"open_groups": 5}, "TypeError: 'int' object is not iterable"),
    ({"open_groups": [[[0], "a"]]}, "ValueError: not enough values to unpack"),
    ({"open_groups": [[0, "a", 1]]}, "TypeError: open_groups holds [0, 'a', 1], not a (tag, "
                                     "task id, draw in [0, 2**63)) triple"),
    ({"open_groups": [[[0], "a", "1"]]}, "TypeError: open_groups holds [[0], 'a', '1']"),
    # review s10 N3: SQLite's integers are 64-bit (the cut of traces.sqlite failed past the cut)
    ({"open_groups": [[[0], "a", 2**70]]}, f"TypeError: open_groups holds [[0], 'a', {2**70}]"),
    ({"extra": 1}, "ValueError: extra is not a field (its fields: pulled, "),
])
def test_a_manager_state_of_another_shape_is_one_line(edit, match):
    """A checkpoint's hashes say it is whole, not that a hand-edited state.json is tiller's:
    the rollout manager's state is checked for the shape the resume reads before any work."""
    check_state(MANAGER, "checkpoint c")
    one_line_error(f"checkpoint c is corrupt: its state.json's manager state does not fit "
                   f"({match}", check_state, {**MANAGER, **edit}, "checkpoint c")
    # a field missing
    one_line_error("does not fit (ValueError: open_groups is missing (its fields: ", check_state,
                   {k: v for k, v in MANAGER.items() if k != "open_groups"}, "checkpoint c")


def test_the_checkpoint_state_schema_is_pinned_to_the_format_version():
    """Review s9 F8: the marker's format is what a resume checks (its tiller version is the
    same at every commit), so a change of what state.json or the rollout manager's part of it
    holds must come with a new FORMAT_VERSION: a resume refuses a field it does not know and
    one that is missing (`verify`, `check_state_shape`, `check_state`), so save_rl and
    manager_state cannot drift from these lists without every resume test failing, and this
    test fails when the lists change."""
    assert (FORMAT_VERSION, STATE_KEYS, MANAGER_KEYS) == (5, (
        "step", "trainer_version", "rng", "holds", "tensors", "manager", "curriculum",
        "recorder", "idle_steps", "metrics_bytes", "summary", "config", "base"), (
        "pulled", "draw_ids", "open_tasks", "open_groups", "ledger", "next_unit",
        "steps_trained", "slots", "max_ahead", "draws", "refills")), (
        "state.json's fields changed: bump FORMAT_VERSION (tiller.checkpoints, with what the new "
        "format holds in its comment) and update this test's lists")


@pytest.mark.parametrize("saved, devices, warned", [
    (0, 0, False), (0, 1, True), (1, 0, True), (2, 1, True), (1, 1, False)])
def test_a_resume_warns_when_the_checkpoints_cuda_rng_states_do_not_fit_the_machine(
        monkeypatch, caplog, saved, devices, warned):
    """Review s9 F7: the checkpoint's CUDA generator states are put back device by device; a
    CPU checkpoint resumed on CUDA (or the other way, or another device count) is one warning
    line, as those generators then keep their own states. (No GPU here: the device count is
    patched; the states put back are patched out on CUDA.)"""
    import torch

    py, tensors = rng_state()
    tensors = {k: v for k, v in tensors.items() if not k.startswith("cuda")}
    tensors.update({f"cuda{i}": torch.zeros(16, dtype=torch.uint8) for i in range(saved)})
    put: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: devices > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: put.append(len(states)))
    caplog.set_level("WARNING")
    set_rng_state(py, tensors)
    lines = [r.getMessage() for r in caplog.records if "CUDA" in r.getMessage()]
    assert lines == ([f"--resume: the checkpoint holds the RNG states of {saved} CUDA devices, "
                      f"this process sees {devices}: the CUDA generators of the first "
                      f"{min(saved, devices)} are put back, the rest keep their own (what draws "
                      f"from them is not the checkpointed run's)"] if warned else [])
    assert put == ([min(saved, devices)] if min(saved, devices) else [])



def test_a_stream_that_changed_its_first_tasks_is_refused():
    state = {"pulled": 3, "draw_ids": ["a", "c"], "open_tasks": [{"id": "b"}]}
    check_drawn(["a", "b", "c"], state, "--resume")
    one_line_error("--resume: the task stream's first 3 tasks are not those the checkpoint "
                   "drew (e.g. ['d'] were not drawn)", check_drawn, ["a", "d", "c"], state,
                   "--resume")
    one_line_error("the task stream has 2 tasks; the checkpoint drew 3", check_drawn,
                   ["a", "b"], state, "--resume")


@pytest.mark.parametrize("args, match", [
    (["configs/calculator.yaml", "--trust-run-config"],
     "--trust-run-config goes with --resume RUN_DIR"),
    (["configs/calculator.yaml", "--resume", "RUN", "--trust-run-config"],
     "with a CONFIG given it is not read"),
])
def test_trust_run_config_where_it_does_nothing_is_refused(tmp_path, args, match):
    code, out = cli("train", *[str(tmp_path) if a == "RUN" else a for a in args])
    assert code == 2 and match in out and len(out.strip().splitlines()) == 1, out


def recorder_state() -> dict:
    return {"staleness": [[0, 4]], "env_errors": [[1, [0, 4]]], "env_error_rising": False,
            "trainer_s": 1.5, "judge_history": [[0.5, 0.25]], "judge_suspected": False,
            "judge_warnings": 0}


PY_RNG = rng_state()[0]  # Python's and numpy's generator states, as state.json holds them


def whole_state(cfg) -> dict:
    """A state.json of every field's shape (`resume.STATE_TYPES`), of a run with `cfg` at
    step 1 that drew nothing yet."""
    return {"step": 1, "trainer_version": 1, "rng": PY_RNG,
            "holds": ["model"], "tensors": ["optimizer"], "manager": dict(MANAGER, pulled=0,
                                                                          draw_ids=[], draws=[]),
            "curriculum": None, "recorder": recorder_state(), "idle_steps": 0,
            "metrics_bytes": 0, "summary": {}, "config": cfg.model_dump(mode="json"),
            "base": None}


@pytest.mark.parametrize("edit, match", [
    ({"trainer_version": "1"}, "TypeError: trainer_version is a str"),
    ({"idle_steps": True}, "TypeError: idle_steps is a bool"),
    ({"tensors": ["optimizer", 3]}, "TypeError: tensors is not a list of names"),
    ({"config": []}, "TypeError: config is a list"),
    ({"rng": {"python": [3, [1, 2], None]}}, "ValueError: state vector is the wrong size"),
    ({"rng": {"python": PY_RNG["python"]}}, "KeyError: 'numpy'"),
    ({"rng": {**PY_RNG, "numpy": ["MT19937", [1, 2], 0, 0, 0.0]}}, "IndexError:"),
    ({"rng": {**PY_RNG, "numpy": ["MT19937", [2**40] * 624, 0, 0, 0.0]}}, "OverflowError:"),
    ({"rng": {**PY_RNG, "ranks": [{"python": PY_RNG["python"]}]}}, "KeyError: 'numpy'"),
    ({"recorder": {**recorder_state(), "env_errors": [[1, [0]]]}},
     "TypeError: the recorder's env_errors holds counts that are not two ints"),
    ({"recorder": {**recorder_state(), "trainer_s": "1.5"}},
     "TypeError: the recorder's trainer_s is a str"),
    ({"recorder": {**recorder_state(), "staleness": {"0": 4}}},
     "TypeError: the recorder's staleness is not a list of pairs"),
    # review s9 F9: a negative length would cut metrics.jsonl's rows from its end
    ({"metrics_bytes": -1}, "ValueError: metrics_bytes is -1, below 0"),
    ({"engine_version": 1}, "ValueError: engine_version is not a field this tiller writes"),
])
def test_a_state_json_of_another_shape_is_one_line_before_any_work(tmp_path, edit, match):
    """Review s8 F7: a hand-edited state.json (its marker re-hashed: whole) of another shape
    is found by `check_state_shape` before any of it is used, in one line blaming the
    checkpoint; the fields' types are those of every field tiller writes."""
    from tiller.config import load_config
    from tiller.resume import STATE_TYPES, check_state_shape

    assert set(STATE_TYPES) == set(STATE_KEYS)
    cfg = load_config(None, ["model.build.vocab_size=600", "checkpoint.every=1"])
    state = whole_state(cfg)
    check_state_shape(Checkpoint(Path("c"), 1, state, {}))
    one_line_error(f"checkpoint c is corrupt: its state.json does not fit ({match}",
                   check_state_shape, Checkpoint(Path("c"), 1, {**state, **edit}, {}))


def test_a_bug_in_the_resumes_own_checks_is_raised_as_itself(tmp_path, monkeypatch):
    """Review s8 F7: `start_resume` called any KeyError, TypeError or AttributeError of its
    checks a corrupt checkpoint ("move it away"), so a bug of tiller's own (here an attribute
    renamed, in the model check) had users discard good checkpoints. Past the state's shape
    check, it is raised as itself."""
    from tiller import resume
    from tiller.config import load_config

    cfg = load_config(None, ["model.build.vocab_size=600", "checkpoint.every=1"])
    run = tmp_path / "run"
    write(run, 1, **whole_state(cfg))
    assert resume.start_resume(cfg, run)[0].step == 1  # the checkpoint fits

    def renamed(cfg, ckpt):
        return cfg.model.pth  # a typo of tiller's own

    monkeypatch.setattr(resume, "check_base", renamed)
    with pytest.raises(AttributeError, match="has no attribute 'pth'"):
        resume.start_resume(cfg, run)


HTTP = ["engine.backend=http", "engine.urls=[http://127.0.0.1:8001, http://127.0.0.1:8002]"]
RAY = ["cluster.backend=ray", "cluster.address=10.0.0.1:6379"]


@pytest.mark.parametrize("base, change, safe", [
    # a slower node: longer waits for its parts
    (["train.world_size=2"], ["train.rank_timeout_s=1200", "weight_sync.timeout_s=900"],
     ["train.rank_timeout_s: 600.0 -> 1200.0", "weight_sync.timeout_s: 600.0 -> 900.0"]),
    (HTTP, ["engine.request_timeout_s=600"], ["engine.request_timeout_s: 300.0 -> 600.0"]),
    (["engine.backend=http", "engine.servers=1"], ["engine.startup_timeout_s=600"],
     ["engine.startup_timeout_s: 120.0 -> 600.0"]),
    # a lost node's replacement at another address
    (HTTP, ["engine.urls=[http://127.0.0.1:8001, http://10.0.0.9:8002]"],
     ["engine.urls: ['http://127.0.0.1:8001', 'http://127.0.0.1:8002'] -> "
      "['http://127.0.0.1:8001', 'http://10.0.0.9:8002']"]),
    (RAY, ["cluster.address=10.0.0.2:6379"], ["cluster.address: '10.0.0.1:6379' -> "
                                              "'10.0.0.2:6379'"]),
])
def test_a_resume_allows_and_lists_longer_waits_and_moved_engines(base, change, safe):
    """Review s9 F6: a resume refused new timeouts and an external engine or Ray cluster at
    another address (after a lost node the run could go on only at the old one). They are safe
    changes now, each listed (`start_resume` logs them, summary.json records them); the
    resume's push and parity check prove the moved engines hold the checkpoint's weights."""
    from tiller.config import load_config
    from tiller.resume import check_config

    old = load_config("configs/calculator.yaml", base).model_dump(mode="json")
    new = load_config("configs/calculator.yaml", [*base, *change]).model_dump(mode="json")
    assert check_config(old, new) == safe


@pytest.mark.parametrize("base, change, field", [
    (HTTP, ["engine.urls=[http://127.0.0.1:8001]"], "engine.urls"),  # another count
    (["engine.backend=http", "engine.servers=1"], ["engine.urls=[http://127.0.0.1:8001]",
                                                  "engine.servers=0"],
     "engine.servers"),  # started servers -> attached ones
    (["cluster.backend=ray"], ["cluster.address=10.0.0.2:6379"], "cluster.address"),  # local
    # instance -> an existing cluster
])
def test_a_resume_refuses_an_engine_or_cluster_of_another_kind(base, change, field):
    from tiller.config import load_config
    from tiller.resume import check_config

    old = load_config("configs/calculator.yaml", base).model_dump(mode="json")
    new = load_config("configs/calculator.yaml", [*base, *change]).model_dump(mode="json")
    one_line_error(f"--resume: config field {field} changed", check_config, old, new)
