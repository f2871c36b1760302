"""The streaming safetensors writer behind the converters: files safetensors reads back exactly, whatever
way each tensor's bytes arrive (from memory with any strides, queued stable tensors, file-to-file copies,
copies through memory where the kernel refuses), the checksum of the file as written, every failure
reported and nothing left running; a checkpoint streamed with copied chunks reads back and verifies."""

import errno
import os
import threading

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megamoe.checkpoint.format import read_manifest, verify_checkpoint
from megamoe.checkpoint.logical_reader import LogicalTensorReader
import megamoe.checkpoint.safetensors_stream as stream
from megamoe.checkpoint.safetensors_stream import (FileExtent, PlannedTensor, SafetensorsStreamWriter,
                                                   read_data_extents)
from megamoe.checkpoint.stream import CheckpointStreamWriter, StreamedTensor


def _source(tmp_path):
    """A safetensors file to copy from: key -> tensor, and where each tensor's bytes lie."""
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(8, 6, generator=g), "b": torch.randn(5, 3, generator=g).to(torch.bfloat16)}
    path = str(tmp_path / "source.safetensors")
    save_file(tensors, path)
    return tensors, {key: extent for key, (_, _, extent) in read_data_extents(path).items()}


def _write_all(tmp_path, name="out.safetensors"):
    """Every way of giving a tensor, in one file; returns (path, expected tensors, result)."""
    source, extents = _source(tmp_path)
    g = torch.Generator().manual_seed(1)
    strided = torch.randn(4, 6, generator=g).to(torch.bfloat16).t()           # not contiguous
    reused = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    stable_view = source["a"][:, 1:4]                                          # stable, not contiguous
    expected = {
        "strided": strided.clone(), "reused": reused.clone(), "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.int32), "mask": torch.arange(9) % 2 == 0,
        "copied": source["a"], "copied_halves": source["b"], "stable": stable_view.clone(),
    }
    plan = [PlannedTensor(k, t.dtype, tuple(t.shape)) for k, t in expected.items()]
    writer = SafetensorsStreamWriter(tmp_path / name, plan, metadata={"format": "pt"})
    writer.write("strided", strided)
    writer.write("reused", reused)
    reused.fill_(-1)                                # the caller may reuse its memory once write returns
    writer.write("scalar", expected["scalar"])
    writer.write("empty", expected["empty"])
    writer.write("mask", expected["mask"])
    writer.write("copied", torch.empty(8, 6, device="meta"), [extents["a"]])
    b = extents["b"]
    halves = [FileExtent(b.path, b.offset, 12), FileExtent(b.path, b.offset + 12, b.nbytes - 12)]
    writer.write("copied_halves", torch.empty(5, 3, dtype=torch.bfloat16, device="meta"), halves)
    writer.write("stable", stable_view, stable=True)
    return str(tmp_path / name), expected, writer.close().result(timeout=60)


def _check_file(path, expected, result):
    data = open(path, "rb").read()
    assert result == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    loaded = load_file(path)
    assert set(loaded) == set(expected)
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_every_way_of_giving_bytes_reads_back_with_its_checksum(tmp_path):
    threads = threading.active_count()
    _check_file(*_write_all(tmp_path))
    assert threading.active_count() == threads          # the file's threads are done


def test_small_steps_and_copies_through_memory(tmp_path, monkeypatch):
    """Tiny pieces (many writes, gathers, out-of-order completions, periodic writeback, hash blocks) and a
    file system that refuses kernel copies give the same file."""
    for name, value in (("_IO_STEP", 16), ("_GATHER_BYTES", 8), ("WRITEBACK_STEP", 64), ("_HASH_BLOCK", 24),
                        ("_QUEUED_TENSOR_BYTES", 100)):
        monkeypatch.setattr(stream, name, value)
    refused = []

    def no_kernel_copy(*args):
        refused.append(args)
        raise OSError(errno.EXDEV, "cross-device")
    monkeypatch.setattr(os, "copy_file_range", no_kernel_copy)
    _check_file(*_write_all(tmp_path))
    assert len(refused) == 1                            # tried once, then through memory


def test_mistakes_and_failures_are_reported_and_stop_everything(tmp_path):
    threads = threading.active_count()
    source, extents = _source(tmp_path)
    plan = [PlannedTensor("a", torch.float32, (8, 6)), PlannedTensor("b", torch.bfloat16, (5, 3))]

    writer = SafetensorsStreamWriter(tmp_path / "x.safetensors", plan)
    with pytest.raises(ValueError, match="expected 'a' next, got 'b'"):
        writer.write("b", source["b"])
    with pytest.raises(ValueError, match=r"is torch.float32 \(6, 8\), planned"):
        writer.write("a", source["a"].t())
    with pytest.raises(ValueError, match="hold 96 bytes, not its 192"):
        writer.write("a", source["a"], [FileExtent(extents["a"].path, extents["a"].offset, 96)])
    writer.write("a", source["a"])
    with pytest.raises(ValueError, match=r"closed with 1 planned tensors unwritten: \['b'\]"):
        writer.close()
    with pytest.raises(RuntimeError, match="aborted"):
        writer.result.result(timeout=60)

    # A source that ends before the bytes asked for: the copy fails; the result says so.
    writer = SafetensorsStreamWriter(tmp_path / "y.safetensors", plan)
    size = os.path.getsize(extents["a"].path)
    writer.write("a", torch.empty(8, 6, device="meta"), [FileExtent(extents["a"].path, size - 100, 192)])
    # The copy fails in a background thread: the next write reports it if the failure came first, else the
    # result does (which one depends on the threads' timing, so the test accepts both).
    with pytest.raises(OSError, match="ends before byte"):
        try:
            writer.write("b", source["b"])
        except OSError:
            writer.abort()
            raise
        writer.close().result(timeout=60)

    # Aborting in the middle (as a failing conversion does) closes the file and stops the threads.
    with pytest.raises(KeyError):
        with SafetensorsStreamWriter(tmp_path / "z.safetensors", plan) as writer:
            writer.write("a", source["a"])
            raise KeyError("the conversion failed")
    assert writer.result.done() and threading.active_count() == threads


def test_read_data_extents_matches_safetensors_and_refuses_garbage(tmp_path):
    source, extents = _source(tmp_path)
    data = open(extents["a"].path, "rb").read()
    for key, extent in extents.items():
        stored = data[extent.offset:extent.offset + extent.nbytes]
        assert stored == source[key].contiguous().view(torch.uint8).numpy().tobytes()
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="not JSON"):
        read_data_extents(str(tmp_path / "bad.safetensors"))
    (tmp_path / "short.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="outside the file"):
        read_data_extents(str(tmp_path / "short.safetensors"))


def test_checkpoint_stream_copies_row_chunks_and_reads_back(tmp_path):
    """Chunks cut along rows are copied from the source file (placeholder tensor), chunks cut along columns
    gathered from the stable mapped tensor; the checkpoint verifies and its reader hands back the bytes of
    row-cut tensors as file ranges."""
    g = torch.Generator().manual_seed(2)
    rows, cols = torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g).to(torch.bfloat16)
    save_file({"rows": rows, "cols": cols}, tmp_path / "hf.safetensors")
    extents = {k: e for k, (_, _, e) in read_data_extents(str(tmp_path / "hf.safetensors")).items()}
    planned = [StreamedTensor("rows", torch.float32, (6, 4), (((0, 0), (2, 4)), ((2, 0), (4, 4)))),
               StreamedTensor("cols", torch.bfloat16, (4, 6), (((0, 0), (4, 3)), ((0, 3), (4, 3))))]
    assert planned[0].chunks_are_runs and not planned[1].chunks_are_runs
    (tmp_path / "ckpt").mkdir()
    writer = CheckpointStreamWriter(str(tmp_path / "ckpt"), planned, max_file_bytes=40)     # several files
    writer.write("rows", torch.empty(6, 4, device="meta"), extents["rows"])
    with safe_open(tmp_path / "hf.safetensors", "pt") as f:
        writer.write("cols", f.get_tensor("cols"), extents["cols"], stable=True)
    manifest = writer.finish({"extra": {"note": "test"}}, world_size=1)
    assert len(manifest["files"]) == 4 and read_manifest(tmp_path / "ckpt")["extra"] == {"note": "test"}
    verify_checkpoint(tmp_path / "ckpt")                  # sizes, checksums and keys
    with LogicalTensorReader(tmp_path / "ckpt") as reader:
        assert torch.equal(reader.read("rows"), rows) and torch.equal(reader.read("cols"), cols)
        assert reader.extents("cols") is None
        copied = b"".join(open(e.path, "rb").read()[e.offset:e.offset + e.nbytes] for e in reader.extents("rows"))
        assert copied == rows.numpy().tobytes()
