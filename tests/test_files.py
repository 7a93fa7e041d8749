"""tiller.files: output files are replaced, never written through a planted link; files written
in place refuse a link; a linked folder inside the run folder is refused. The attacks through
the commands are in tests/test_run_folder.py."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from tiller import files
from tiller.errors import ConfigError
from tiller.files import (
    REMOVE_FAILURES,
    folder_below,
    open_append,
    refuse_sqlite_links,
    remove_tree,
    replacing,
    write_file,
)


def plant(tmp_path, name):
    """A victim file outside the folder and a link to it at `name` inside the folder."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    folder = tmp_path / "run"
    folder.mkdir(exist_ok=True)
    (folder / name).symlink_to(victim)
    return folder / name, victim


def test_write_file_replaces_a_link_and_leaves_its_target(tmp_path):
    link, victim = plant(tmp_path, "report.html")
    write_file(link, "new\ncontent", root=link.parent)
    assert victim.read_text() == "precious\n"
    assert not link.is_symlink() and link.read_text() == "new\ncontent"
    write_file(link, b"\x00bytes", root=link.parent)  # bytes as they are, replacing the old
    assert link.read_bytes() == b"\x00bytes"
    assert sorted(p.name for p in link.parent.iterdir()) == ["report.html"]  # no temp left


def test_write_file_keeps_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        path = write_file(tmp_path / "summary.json", "{}", root=tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # not the private folder's 0700


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = write_file(tmp_path / "config.yaml", "old", root=tmp_path)
    with pytest.raises(RuntimeError), replacing(path, root=tmp_path) as new:
        new.write_text("half")
        raise RuntimeError("the writer failed")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("before", ["link", "folder", "missing"])
def test_a_folder_replaces_a_link_or_an_old_folder(tmp_path, before):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    out = tmp_path / "checkpoints" / "final"
    out.parent.mkdir()
    if before == "link":
        out.symlink_to(victim, target_is_directory=True)
    elif before == "folder":
        out.mkdir()
        (out / "stale.bin").write_text("old weights")
    with replacing(out, root=tmp_path) as new:
        new.mkdir()
        (new / "model.safetensors").write_text("weights")
    assert not out.is_symlink() and sorted(p.name for p in out.iterdir()) == [
        "model.safetensors"]
    assert sorted(p.name for p in victim.iterdir()) == ["keep"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["final"]


def held_at_every_line(out, write) -> list[str]:
    """Run `write()` (a `replacing` of the folder `out`) with every line tiller.files executes
    traced, and return what `out` held at each: a kill lands between two lines, so this is
    what a kill could leave at its name ("old", "new", or "nothing")."""
    held: list[str] = []
    files_py = str(Path(files.__file__))

    def seen() -> str:
        names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
        return {("old.bin",): "old", ("new.bin",): "new"}.get(tuple(names), "nothing")

    def trace(frame, event, arg):
        if frame.f_code.co_filename != files_py:
            return None
        if event == "line":
            held.append(seen())
        return trace

    before = sys.gettrace()  # a coverage tool's, if any: put back after
    sys.settrace(trace)
    try:
        write()
    finally:
        sys.settrace(before)
    held.append(seen())
    return held


def write_new(out, root):
    with replacing(out, root=root) as new:
        new.mkdir()
        (new / "new.bin").write_text("new weights")


def test_a_folder_over_a_folder_leaves_one_of_the_two_at_its_name_at_every_moment(tmp_path,
                                                                                   caplog):
    """Review s8 F6: checkpoints/final and checkpoints/sft are written over the folder of
    the run before (a resumed run's). rename(2) cannot put a folder over a full one; two
    renames (the old aside, the new in) left nothing at the name between them, where a kill
    lost both. One renameat2(RENAME_EXCHANGE) swaps them: at each line executed the name holds
    the old folder or the new one, and then only the new one is left."""
    out = tmp_path / "checkpoints" / "final"
    out.mkdir(parents=True)
    (out / "old.bin").write_text("old weights")
    held = held_at_every_line(out, lambda: write_new(out, tmp_path))
    assert "nothing" not in held and held[0] == "old" and held[-1] == "new", held
    assert sorted(p.name for p in out.parent.iterdir()) == ["final"]
    assert not [r for r in caplog.records if "two renames" in r.getMessage()]


def test_without_an_exchange_a_folder_is_replaced_in_two_renames_with_a_warning(
        tmp_path, monkeypatch, caplog):
    """A system or file system without renameat2's exchange (`exchange` says why): the two
    renames, each time a warning naming the folder and why; the name holds nothing between
    them."""
    monkeypatch.setattr(files, "exchange", lambda a, b: "renameat2 RENAME_EXCHANGE: EINVAL")
    out = tmp_path / "checkpoints" / "sft"
    out.mkdir(parents=True)
    (out / "old.bin").write_text("old weights")
    held = held_at_every_line(out, lambda: write_new(out, tmp_path))
    assert held[0] == "old" and "nothing" in held and held[-1] == "new", held
    assert sorted(p.name for p in out.parent.iterdir()) == ["sft"]
    assert [r.getMessage() for r in caplog.records if "two renames" in r.getMessage()] == [
        f"{out} is replaced in two renames (renameat2 RENAME_EXCHANGE: EINVAL): a kill "
        f"between them leaves nothing at its name"]


def test_exchange_swaps_two_folders_and_says_why_not_for_a_missing_one(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    assert files.exchange(a, b) is None
    assert [p.name for p in a.iterdir()] == [] and [p.name for p in b.iterdir()] == ["x"]
    with pytest.raises(FileNotFoundError):  # an error other than "no exchange here" raises
        files.exchange(a, tmp_path / "missing")


def test_open_append_refuses_a_link_in_one_line(tmp_path):
    link, victim = plant(tmp_path, "metrics.jsonl")
    with pytest.raises(ConfigError) as e:
        open_append(link, root=link.parent)
    assert str(e.value) == (f"{link} is a symbolic link (to {str(victim)!r}); tiller does not "
                            "write through links: remove it, or write to another folder")
    assert victim.read_text() == "precious\n"
    with open_append(tmp_path / "plain.jsonl", root=tmp_path) as f:  # a plain file: appended to
        f.write("a\n")
    with open_append(tmp_path / "plain.jsonl", root=tmp_path) as f:
        f.write("b\n")
    assert (tmp_path / "plain.jsonl").read_text() == "a\nb\n"


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm", "-journal"])
def test_sqlite_files_refuse_a_link_beside_the_database(tmp_path, suffix):
    link, victim = plant(tmp_path, f"traces.sqlite{suffix}")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        refuse_sqlite_links(tmp_path / "run" / "traces.sqlite")
    assert victim.read_text() == "precious\n"


def tree(folder):
    """Every path below `folder` with its content (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_text()
            for p in sorted(folder.rglob("*"))}


def write_folder(new):
    new.mkdir()
    (new / "model.safetensors").write_text("weights")


WRITERS = {  # what each writer of tiller.files writes below the run folder
    "write_file": lambda path, root: write_file(path, "{}", root=root),
    "replacing a folder": lambda path, root: _replace(path, root, write_folder),
    "replacing a file": lambda path, root: _replace(path, root, lambda new: new.write_text("x")),
    "open_append": lambda path, root: open_append(path, root=root).close(),
}


def _replace(path, root, write):
    with replacing(path, root=root) as new:
        write(new)


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("linked, name", [
    ("checkpoints", "checkpoints/final"),  # the link is the folder that holds the name
    ("traces", "traces/deep/er/x.json"),  # ... or one further up
    ("eval/sub", "eval/sub/x"),  # ... below a plain folder
])
def test_a_linked_folder_in_the_run_folder_is_refused(tmp_path, writer, linked, name):
    """A sub-folder of the run folder linked to a folder of the user's: tiller wrote into it
    (and, replacing a folder, removed the user's folder of that name) before; now one line
    naming the link, and nothing outside changes or appears."""
    outside = tmp_path / "outside"
    (outside / "final").mkdir(parents=True)
    (outside / "final" / "thesis.tex").write_text("years of work")
    (outside / "x.json").write_text("the user's")
    run = tmp_path / "run"
    (run / linked).parent.mkdir(parents=True)
    (run / linked).symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    with pytest.raises(ConfigError) as e:
        WRITERS[writer](run / name, run)
    assert str(e.value) == (f"{run / linked} is a symbolic link (to {str(outside)!r}); tiller "
                            "does not write through links: remove it, or write to another "
                            "folder")
    assert tree(outside) == before


def test_the_root_itself_may_be_a_link_and_missing_folders_are_made(tmp_path):
    """The run folder is the user's choice, links and all; below it folders are made."""
    (tmp_path / "real").mkdir()
    (tmp_path / "runs").symlink_to(tmp_path / "real", target_is_directory=True)
    path = write_file(tmp_path / "runs" / "a" / "b" / "summary.json", "{}",
                      root=tmp_path / "runs")
    assert (tmp_path / "real" / "a" / "b" / "summary.json").read_text() == "{}"
    assert path == tmp_path / "runs" / "a" / "b" / "summary.json"
    with pytest.raises(ValueError, match="is not inside"):
        folder_below(tmp_path / "runs", tmp_path / "elsewhere")
    assert folder_below(tmp_path / "runs", tmp_path / "runs" / "a" / ".." / "c", make=False
                        ) == tmp_path / "runs" / "c"
    assert not (tmp_path / "runs" / "c").exists()  # make=False makes nothing


def test_remove_tree_logs_and_counts_what_it_cannot_remove(tmp_path, caplog):
    """files.replacing and the HTTP backend's weight folders used rmtree(ignore_errors=True):
    a folder left behind was silent. Now each failure is a warning with its path and error,
    counted (REMOVE_FAILURES, and the number returned). A missing folder is such a failure
    (an unremovable entry cannot be made as root; the non-root case is the next test)."""
    tree = tmp_path / "v1"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "model.safetensors").write_bytes(b"w")
    before = REMOVE_FAILURES["entries"]
    assert remove_tree(tree) == 0 and not tree.exists()
    with caplog.at_level("WARNING", logger="tiller.files"):
        assert remove_tree(tmp_path / "gone") == 1
    assert REMOVE_FAILURES["entries"] == before + 1
    [record] = caplog.records
    assert record.getMessage().startswith(f"could not remove {tmp_path / 'gone'}: "
                                          "FileNotFoundError: ")


@pytest.mark.skipif(os.geteuid() == 0, reason="root removes entries of read-only folders")
def test_remove_tree_goes_on_past_an_unremovable_entry(tmp_path, caplog):
    tree = tmp_path / "v1"
    (tree / "locked").mkdir(parents=True)
    (tree / "locked" / "model.safetensors").write_bytes(b"w")
    (tree / "other.json").write_text("{}")
    (tree / "locked").chmod(0o500)
    try:
        with caplog.at_level("WARNING", logger="tiller.files"):
            assert remove_tree(tree) >= 1
        assert not (tree / "other.json").exists()
        assert str(tree / "locked" / "model.safetensors") in caplog.text
    finally:
        (tree / "locked").chmod(0o700)
