"""Shared by tests/unit/test_atomic_file.py (and other tests): the builders and constants of the atomic file tests."""

import os


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
