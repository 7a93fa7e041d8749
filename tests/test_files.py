"""tiller.files: output files are replaced, never written through a planted link; files written
in place refuse a link. The attacks through the commands are in tests/test_run_folder.py."""

from __future__ import annotations

import os
import stat

import pytest

from tiller.errors import ConfigError
from tiller.files import open_append, refuse_sqlite_links, replacing, write_file


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
    write_file(link, "new\ncontent")
    assert victim.read_text() == "precious\n"
    assert not link.is_symlink() and link.read_text() == "new\ncontent"
    write_file(link, b"\x00bytes")  # bytes as they are; the old file replaced whole
    assert link.read_bytes() == b"\x00bytes"
    assert sorted(p.name for p in link.parent.iterdir()) == ["report.html"]  # no temp left


def test_write_file_keeps_the_umask_mode(tmp_path):
    old = os.umask(0o027)
    try:
        path = write_file(tmp_path / "summary.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # not the private folder's 0700


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = write_file(tmp_path / "config.yaml", "old")
    with pytest.raises(RuntimeError), replacing(path) as new:
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
    with replacing(out) as new:
        new.mkdir()
        (new / "model.safetensors").write_text("weights")
    assert not out.is_symlink() and sorted(p.name for p in out.iterdir()) == [
        "model.safetensors"]
    assert sorted(p.name for p in victim.iterdir()) == ["keep"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["final"]


def test_open_append_refuses_a_link_in_one_line(tmp_path):
    link, victim = plant(tmp_path, "metrics.jsonl")
    with pytest.raises(ConfigError) as e:
        open_append(link)
    assert str(e.value) == (f"{link} is a symbolic link (to {str(victim)!r}); tiller does not "
                            "write through links: remove it, or write to another folder")
    assert victim.read_text() == "precious\n"
    with open_append(tmp_path / "plain.jsonl") as f:  # a plain file: appended to
        f.write("a\n")
    with open_append(tmp_path / "plain.jsonl") as f:
        f.write("b\n")
    assert (tmp_path / "plain.jsonl").read_text() == "a\nb\n"


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm", "-journal"])
def test_sqlite_files_refuse_a_link_beside_the_database(tmp_path, suffix):
    link, victim = plant(tmp_path, f"traces.sqlite{suffix}")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        refuse_sqlite_links(tmp_path / "run" / "traces.sqlite")
    assert victim.read_text() == "precious\n"
