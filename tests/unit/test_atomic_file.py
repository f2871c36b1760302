"""megamoe.atomic_file: a target that is not a regular file or a new path (a FIFO, a character device
such as /dev/null or /dev/full, a directory) is refused before anything is written, naming the path,
by atomic_write and by every writer built on it before its work; a write whose flush, fsync or rename
fails names the path and leaves the old file and no temporary file. The devices are reached through
links in the test's folder, so that a regression replaces a link there, never a device in /dev.
(The scripts' one-line errors: tests/unit/test_generate_script.py, tests/unit/test_preprocess.py.)"""

import errno
import os

import pytest
import torch

from megamoe.atomic_file import AtomicWriteError, atomic_write, check_output_target
from megamoe.data.token_dataset import sidecar_path, write_token_file
from megamoe.data.tokenizer import Tokenizer, train_sentencepiece
from megamoe.moe.placement.expert_load_file import save_expert_load
from tests.helpers.atomic_file import NOT_REGULAR


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


def _word_tokenizer(tmp_path) -> Tokenizer:
    from tokenizers import Tokenizer as TokenizerFile
    from tokenizers.models import WordLevel
    path = tmp_path / "words.json"
    TokenizerFile(WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(path))
    return Tokenizer.from_path(path)


def _train_tokenizer(tmp_path, target):
    (tmp_path / "text.txt").write_text("some text to train on\n")
    train_sentencepiece([tmp_path / "text.txt"], str(target)[:-len(".model")], 300)


def _write_tokens(tmp_path, target):
    write_token_file([[0, 1]], _word_tokenizer(tmp_path), target, append_eos=False)


def _write_token_sidecar(tmp_path, target):
    tokens = tmp_path / "tokens.bin"
    os.rename(target, sidecar_path(tokens))
    _write_tokens(tmp_path, tokens)


def _save_expert_load(tmp_path, target):
    save_expert_load(target, {1: torch.tensor([3.0, 1.0])}, num_experts=2)


# writer -> how it writes to a target (a FIFO here) in tmp_path
WRITERS = {"sentencepiece model": (_train_tokenizer, "pipe.model"), "token file": (_write_tokens, "pipe"),
           "token file's sidecar": (_write_token_sidecar, "pipe"), "expert load": (_save_expert_load, "pipe")}


@pytest.mark.parametrize("writer", WRITERS)
def test_every_writer_refuses_a_fifo_before_its_work(writer, tmp_path):
    """The library's writers on atomic_write: a FIFO target is refused (before training a tokenizer, before
    unlinking a token file's old sidecar) and stays a FIFO."""
    write, name = WRITERS[writer]
    os.mkfifo(tmp_path / name)
    with pytest.raises(AtomicWriteError, match="is a FIFO"):
        write(tmp_path, tmp_path / name)
    fifos = [p.name for p in tmp_path.iterdir() if p.is_fifo()]
    assert len(fifos) == 1, "the FIFO was replaced or removed"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".model", ".bin", ".tmp")) and not p.is_fifo()]
