"""megamoe.atomic_file: a target that is not a regular file or a new path (a FIFO, a character device
such as /dev/null or /dev/full, a directory) is refused before anything is written, naming the path;
a write whose flush, fsync or rename fails names the path and leaves the old file and no temporary
file. The devices are reached through links in the test's folder, so that a regression replaces a
link there, never a device in /dev."""

import errno
import os

import pytest

from megamoe.atomic_file import AtomicWriteError, atomic_write, check_output_target


def _fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def _link_to(device):
    def make(tmp_path):
        path = tmp_path / f"link-to-{os.path.basename(device)}"
        path.symlink_to(device)
        return path
    return make


def _directory(tmp_path):
    path = tmp_path / "folder"
    path.mkdir()
    return path


# target -> (how to make it in tmp_path, what the error calls it)
NOT_REGULAR = {"fifo": (_fifo, "a FIFO (named pipe)"),
               "/dev/null": (_link_to("/dev/null"), "a character device"),
               "/dev/full": (_link_to("/dev/full"), "a character device"),
               "directory": (_directory, "a directory")}


@pytest.mark.parametrize("target", NOT_REGULAR)
@pytest.mark.parametrize("mode", ["wb", "w"])
def test_a_target_that_is_not_a_regular_file_is_refused_untouched(target, mode, tmp_path):
    make, kind = NOT_REGULAR[target]
    path = make(tmp_path)
    before = sorted(os.listdir(tmp_path)), os.lstat(path)
    with pytest.raises(AtomicWriteError) as refused:
        with atomic_write(path, mode) as file:
            file.write(b"x" if mode == "wb" else "x")
    assert isinstance(refused.value, OSError) and refused.value.path == path
    assert f"{path} is {kind}" in str(refused.value) and "regular file or a new path" in str(refused.value)
    after = sorted(os.listdir(tmp_path)), os.lstat(path)
    assert after[0] == before[0], "a temporary file was left"
    assert (after[1].st_ino, after[1].st_mode) == (before[1].st_ino, before[1].st_mode), "the target was replaced"
    with pytest.raises(AtomicWriteError):
        check_output_target(path)


def test_regular_files_new_paths_and_links_to_them_are_accepted(tmp_path):
    (tmp_path / "old").write_bytes(b"old")
    (tmp_path / "link").symlink_to(tmp_path / "old")
    for name in ("old", "new", "link", "dangling"):
        check_output_target(tmp_path / name)
    with atomic_write(tmp_path / "new", "w") as file:
        file.write("new")
    assert (tmp_path / "new").read_text() == "new"


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_write_names_the_path_and_keeps_the_old_file(failing, tmp_path, monkeypatch):
    """A full disk (ENOSPC) at the fsync or the rename: AtomicWriteError naming the path, the old content
    kept, no temporary file left."""
    target = tmp_path / "out.json"
    target.write_text("old")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, failing, full_disk)
    with pytest.raises(AtomicWriteError) as failed:
        with atomic_write(target, "w") as file:
            file.write("new")
    monkeypatch.undo()
    assert f"writing {target} failed: No space left on device" in str(failed.value)
    assert failed.value.__cause__.errno == errno.ENOSPC
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
