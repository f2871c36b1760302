"""The checkpoint format: bitwise round trips (parameters, buffers, AdamW state, rank state), resharding
TP=4 / TP=2 x DP=2 -> TP=2 / TP=1 / TP=4 on 4 ranks, expert replicas written once and loaded into every
slot, lazy slice reads, crash-safe saves and clear errors for corrupt or mismatched checkpoints."""

import contextlib
import hashlib
import json
import os
import shutil

import pytest
import safetensors.torch
import torch

import megamoe.checkpoint.chunk_regions as chunk_regions
import megamoe.checkpoint.format as fmt
from megamoe.checkpoint.format import (CheckpointError, iter_logical_tensors, load_checkpoint, load_rank_state,
                                       read_manifest, save_checkpoint, verify_checkpoint)
import megamoe.checkpoint.load as checkpoint_load
from megamoe.checkpoint.manifest_digest import DIGEST_FIELD, seal
from megamoe.checkpoint_state import (LogicalChunk, chunks_by_parameter, materialize_optimizer_state,
                                      optimizer_chunks, sharded_state_dict)
from tests.helpers.checkpoint_format import (EXPERT_SHAPE, H, OPTIM_STEP, TinyModel, WithExperts, _all_chunks,
                                             _assert_reference, _failing_save_file, _leftovers, _logical,
                                             _model_and_optimizer, _set_reference)


def _region(full, chunk):
    return full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.shape))]


def _simple_save(path, value, **kwargs):
    chunk = LogicalChunk("w", torch.full((4, 4), float(value)), (4, 4), (0, 0))
    save_checkpoint(path, [chunk], manifest_fields={"extra": {"version": value}}, **kwargs)


def _simple_load(path):
    target = torch.zeros(4, 4)
    manifest = load_checkpoint(path, [LogicalChunk("w", target, (4, 4), (0, 0))])
    assert torch.equal(target, torch.full((4, 4), float(manifest["extra"]["version"])))
    return manifest["extra"]["version"]


# ----------------------------------------------------------------------------------------------
# Single process
# ----------------------------------------------------------------------------------------------
def test_round_trip_is_bitwise(tmp_path):
    model, optimizer = _model_and_optimizer(seed=0)
    _set_reference(model, optimizer)
    model.scratch.fill_(7.0)
    rng = torch.get_rng_state()
    path = tmp_path / "ckpt"
    fields = {"model_config": {"hidden": H, "dims": (1, 2)}, "parallel_layout": {"tp": 1},
              "expert_placement": {}, "extra": {"step": 12}}
    save_checkpoint(path, _all_chunks(model, optimizer), manifest_fields=fields, rank_state={"rng": rng},
                    max_file_bytes=300)

    fresh, fresh_optimizer = _model_and_optimizer(seed=1)
    manifest = load_checkpoint(path, _all_chunks(fresh, fresh_optimizer), verify_checksums=True)
    _assert_reference(fresh, fresh_optimizer)
    assert torch.equal(fresh.scale, model.scale) and not torch.equal(fresh.scratch, model.scratch)
    assert "scratch" not in manifest["tensors"]
    assert manifest["model_config"] == {"hidden": H, "dims": [1, 2]} and manifest["extra"] == {"step": 12}
    assert manifest["missing_tensors"] == [] and manifest["world_size"] == 1
    assert torch.equal(load_rank_state(path, 0)["rng"], rng)
    with pytest.raises(CheckpointError, match="no rank state for rank 1"):
        load_rank_state(path, 1)

    # Files respect the size limit (a single larger chunk gets its own file).
    per_file = {}
    for entry in manifest["tensors"].values():
        for c in entry["chunks"]:
            per_file.setdefault(c["file"], []).append(4 * torch.Size(c["shape"]).numel())
    assert len(manifest["files"]) > 3
    assert all(sum(sizes) <= 300 or len(sizes) == 1 for sizes in per_file.values())

    # Streaming export sees every logical tensor whole; the checksums hold.
    streamed = dict(iter_logical_tensors(path))
    assert streamed.keys() == manifest["tensors"].keys()
    for name, p in model.named_parameters():
        assert torch.equal(streamed[name], p) and torch.equal(streamed[f"optim.exp_avg.{name}"],
                                                             optimizer.state[p]["exp_avg"])
    assert streamed["optim.step.up.weight"].item() == OPTIM_STEP
    verify_checkpoint(path)
    assert read_manifest(path)["format_version"] == fmt.FORMAT_VERSION and _leftovers(path) == []


def test_materialize_optimizer_state_keeps_parameters():
    model = TinyModel(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    materialize_optimizer_state(optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and optimizer.param_groups[0]["lr"] == 0.1
    assert len(optimizer.state) == len(list(model.parameters()))
    partial = torch.optim.AdamW(model.parameters())
    partial.state[model.up.weight]["step"] = torch.tensor(1.0)
    with pytest.raises(ValueError, match="needs a fresh optimizer"):
        materialize_optimizer_state(partial)
    with pytest.raises(ValueError, match="no state for parameter"):
        optimizer_chunks(torch.optim.AdamW(model.parameters()), chunks_by_parameter(model.parameters(),
                                                                                   sharded_state_dict(model)))


def test_custom_module_replicas_stored_once_and_loaded_into_every_slot(tmp_path):
    model = WithExperts([0, 1, 0, 2, 1])          # experts 0 and 1 have two slots each
    with torch.no_grad():
        for s, e in enumerate(model.moe.slot_to_expert):
            model.moe.weight[s] = _logical(f"expert{e}", EXPERT_SHAPE)
    optimizer = torch.optim.AdamW(model.parameters())
    materialize_optimizer_state(optimizer)
    with torch.no_grad():   # replicas carry equal optimizer state too (their gradients are summed)
        for s, e in enumerate(model.moe.slot_to_expert):
            optimizer.state[model.moe.weight]["exp_avg"][s] = _logical(f"exp_avg{e}", EXPERT_SHAPE)
    chunks = _all_chunks(model, optimizer)
    assert [c.name for c in chunks].count("moe.experts.0.weight") == 2
    path = tmp_path / "ckpt"
    save_checkpoint(path, chunks, manifest_fields={"expert_placement": {"moe": model.moe.slot_to_expert}},
                    verify_replicas=True)
    manifest = read_manifest(path)
    for e in range(3):
        assert len(manifest["tensors"][f"moe.experts.{e}.weight"]["chunks"]) == 1
        assert len(manifest["tensors"][f"optim.exp_avg.moe.experts.{e}.weight"]["chunks"]) == 1
    assert manifest["tensors"]["optim.step.moe.experts.2.weight"]["global_shape"] == []
    assert manifest["expert_placement"] == {"moe": [0, 1, 0, 2, 1]}

    fresh = WithExperts([2, 2, 1, 0])             # another placement: expert 2 now replicated
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    materialize_optimizer_state(fresh_optimizer)
    load_checkpoint(path, _all_chunks(fresh, fresh_optimizer))
    assert torch.equal(fresh.router.weight, model.router.weight)
    for s, e in enumerate(fresh.moe.slot_to_expert):
        assert torch.equal(fresh.moe.weight[s], _logical(f"expert{e}", EXPERT_SHAPE))
        assert torch.equal(fresh_optimizer.state[fresh.moe.weight]["exp_avg"][s], _logical(f"exp_avg{e}", EXPERT_SHAPE))

    with torch.no_grad():
        model.moe.weight[2, 0, 0] += 1.0          # slot 2 (expert 0) diverges from slot 0
    with pytest.raises(CheckpointError, match=r"replicas of logical tensor 'moe.experts.0.weight'.*differ"):
        save_checkpoint(path, sharded_state_dict(model), manifest_fields={}, verify_replicas=True)
    assert _leftovers(path) == [] and read_manifest(path)["expert_placement"] == {"moe": [0, 1, 0, 2, 1]}


class _CountingHandle:
    """Wraps a safe_open handle; records (key, bytes) of every slice read. Has no get_tensor: reading a
    whole tensor would fail the test."""

    def __init__(self, handle, log):
        self.handle, self.log = handle, log

    def get_slice(self, key):
        handle_slice, log = self.handle.get_slice(key), self.log

        class _Slice:
            def get_shape(self):
                return handle_slice.get_shape()

            def get_dtype(self):
                return handle_slice.get_dtype()

            def __getitem__(self, index):
                piece = handle_slice[index]
                log.append((key, piece.numel() * piece.element_size()))
                return piece
        return _Slice()


def test_loads_read_only_the_needed_slices(tmp_path, monkeypatch):
    full = _logical("w", (16, 12))
    tp4 = [LogicalChunk("w", full[4 * r:4 * r + 4], (16, 12), (4 * r, 0)) for r in range(4)]   # rows over 4 ranks
    path = tmp_path / "ckpt"
    save_checkpoint(path, tp4 + [LogicalChunk("h", full.to(torch.bfloat16), (16, 12), (0, 0))], manifest_fields={})
    log = []
    real_safe_open = checkpoint_load.safe_open

    @contextlib.contextmanager
    def counting_safe_open(file_path, framework):
        with real_safe_open(file_path, framework=framework) as handle:
            yield _CountingHandle(handle, log)
    monkeypatch.setattr(checkpoint_load, "safe_open", counting_safe_open)

    columns = torch.empty(16, 6)                   # column-split rank 1 of 2: spans the 4 stored chunks
    load_checkpoint(path, [LogicalChunk("w", columns, (16, 12), (0, 6))])
    assert torch.equal(columns, full[:, 6:])
    assert sorted(k for k, _ in log) == sorted(f"w@{4 * r},0" for r in range(4))
    assert sum(b for _, b in log) == 16 * 6 * 4

    log.clear()
    rows_a, rows_b = torch.empty(2, 12), torch.empty(2, 12)   # part of one stored chunk, requested twice
    load_checkpoint(path, [LogicalChunk("w", rows_a, (16, 12), (5, 0)), LogicalChunk("w", rows_b, (16, 12), (5, 0))])
    assert torch.equal(rows_a, full[5:7]) and torch.equal(rows_b, full[5:7])
    assert log == [("w@4,0", 2 * 12 * 4)]

    log.clear()
    as_fp32 = torch.empty(3, 12)                  # stored bf16, loaded into fp32
    load_checkpoint(path, [LogicalChunk("h", as_fp32, (16, 12), (1, 0))])
    assert torch.equal(as_fp32, full[1:4].to(torch.bfloat16).float()) and log == [("h@0,0", 3 * 12 * 2)]


class _Crash(BaseException):
    """Stands for the process dying: no `except Exception` cleanup runs."""


def _crash_on_call(number, real):
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == number:
            raise _Crash()
        return real(*args, **kwargs)
    return wrapper


def test_interrupted_saves_leave_a_complete_checkpoint(tmp_path, monkeypatch, caplog):
    path = tmp_path / "ckpt"
    _simple_save(path, 1)

    # Crash while writing files (several files: max_file_bytes < one chunk).
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", _crash_on_call(2, safetensors.torch.save_file))
        with pytest.raises(_Crash):
            chunks = [LogicalChunk("w", torch.full((4, 4), 2.0), (4, 4), (0, 0)),
                      LogicalChunk("x", torch.ones(8), (8,), (0,))]
            save_checkpoint(path, chunks, manifest_fields={"extra": {"version": 2}}, max_file_bytes=8)
    [tmp_dir] = _leftovers(path)
    assert _simple_load(path) == 1
    with pytest.raises(CheckpointError, match="not a megamoe checkpoint"):
        read_manifest(tmp_dir)

    # Crash between moving the old checkpoint aside and renaming the new one into place.
    with monkeypatch.context() as m:
        m.setattr(os, "rename", _crash_on_call(2, os.rename))
        with pytest.raises(_Crash):
            _simple_save(path, 3)
    assert not path.exists() and len(_leftovers(path)) == 2      # the new temp dir and <path>.old
    assert _simple_load(path) == 1 and "interrupted" in caplog.text
    _simple_save(path, 4)                                           # restores .old first, cleans the temp dir
    assert _simple_load(path) == 4 and _leftovers(path) == []

    # Crash after the new checkpoint is in place, before the old one is deleted.
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", _crash_on_call(1, shutil.rmtree))
        with pytest.raises(_Crash):
            _simple_save(path, 5)
    assert _leftovers(path) == [str(path) + ".old"] and _simple_load(path) == 5
    _simple_save(path, 6)
    assert _simple_load(path) == 6 and _leftovers(path) == []

    # An ordinary failure cleans up after itself; a foreign directory is never replaced.
    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", _failing_save_file)
        with pytest.raises(CheckpointError, match="rank 0: OSError: disk full"):
            _simple_save(path, 7)
    assert _simple_load(path) == 6 and _leftovers(path) == []
    foreign = tmp_path / "not_a_checkpoint"
    foreign.mkdir()
    with pytest.raises(CheckpointError, match="not a megamoe checkpoint"):
        _simple_save(foreign, 1)
    assert foreign.exists() and not (foreign / fmt.MANIFEST_FILE).exists()


@pytest.fixture
def pristine(tmp_path):
    """A two-file checkpoint of logical tensors 'a' [4, 4] and 'b' [8]."""
    path = tmp_path / "pristine"
    save_checkpoint(path, [LogicalChunk("a", _logical("a", (4, 4)), (4, 4), (0, 0)),
                           LogicalChunk("b", _logical("b", (8,)), (8,), (0,))],
                    manifest_fields={}, max_file_bytes=64)
    return path


def _copy(pristine, tmp_path, name):
    path = tmp_path / name
    shutil.copytree(pristine, path)
    manifest = read_manifest(path)
    return path, manifest, path / manifest["tensors"]["a"]["chunks"][0]["file"]


def _request_a():
    return [LogicalChunk("a", torch.empty(4, 4), (4, 4), (0, 0))]


def test_corrupt_or_mismatched_checkpoints_give_clear_errors(pristine, tmp_path):
    path, _, file_a = _copy(pristine, tmp_path, "truncated")
    file_a.write_bytes(file_a.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"{file_a.name} has \d+ bytes, the manifest says \d+ \(truncated"):
        load_checkpoint(path, _request_a())
    load_checkpoint(path, [LogicalChunk("b", torch.empty(8), (8,), (0,))])     # other files are still fine
    with pytest.raises(CheckpointError, match=rf"failed verification:\n.*{file_a.name} has \d+ bytes.*truncated"):
        verify_checkpoint(path)

    path, _, file_a = _copy(pristine, tmp_path, "flipped")
    data = bytearray(file_a.read_bytes())
    data[-1] ^= 0xFF
    file_a.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checksum mismatch for .*{file_a.name}"):
        load_checkpoint(path, _request_a(), verify_checksums=True)
    with pytest.raises(CheckpointError, match=f"failed verification:\n.*checksum mismatch for .*{file_a.name}"):
        verify_checkpoint(path)

    path, _, file_a = _copy(pristine, tmp_path, "bad_header")
    data = bytearray(file_a.read_bytes())
    data[:8] = (1 << 40).to_bytes(8, "little")                  # header length beyond the file
    file_a.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checksum mismatch for .*{file_a.name}"):    # checked by default
        load_checkpoint(path, _request_a())
    with pytest.raises(CheckpointError, match=f"{file_a.name} is corrupt"):     # without: safetensors refuses it
        load_checkpoint(path, _request_a(), verify_checksums=False)

    path, _, file_a = _copy(pristine, tmp_path, "missing_file")
    file_a.unlink()
    with pytest.raises(CheckpointError, match=f"{file_a.name} is missing"):
        load_checkpoint(path, _request_a())
    with pytest.raises(CheckpointError, match=f"{file_a.name} is missing"):
        verify_checkpoint(path)

    def edit_manifest(name, edit):
        path, manifest, _ = _copy(pristine, tmp_path, name)
        edit(manifest)
        (path / fmt.MANIFEST_FILE).write_text(json.dumps(seal(manifest)))     # edited on purpose: digest updated
        return path

    path = edit_manifest("future", lambda m: m.update(format_version=99))
    with pytest.raises(CheckpointError, match="unsupported checkpoint format version 99"):
        load_checkpoint(path, _request_a())
    path = edit_manifest("hole", lambda m: m["tensors"]["a"]["chunks"][0].update(shape=[2, 4]))
    with pytest.raises(CheckpointError, match="stored chunks of logical tensor 'a' cover 8 of its 16 elements"):
        read_manifest(path)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere", _request_a())

    # Requests that do not match the checkpoint.
    with pytest.raises(CheckpointError, match="'a' has global shape \\(4, 4\\) .* the model expects \\(4, 8\\)"):
        load_checkpoint(pristine, [LogicalChunk("a", torch.empty(4, 4), (4, 8), (0, 0))])
    with pytest.raises(CheckpointError, match="2 logical tensors are missing .*'c', 'd'"):
        load_checkpoint(pristine, _request_a() + [LogicalChunk(n, torch.empty(1), (1,), (0,)) for n in "cd"])
    loaded = _request_a()
    manifest = load_checkpoint(pristine, loaded + [LogicalChunk("c", torch.empty(1), (1,), (0,))], strict=False)
    assert manifest["missing_tensors"] == ["c"] and torch.equal(loaded[0].tensor, _logical("a", (4, 4)))


def test_format_version_1_checkpoints_with_sha256_still_load_and_verify(pristine, tmp_path):
    """Version 1 recorded SHA-256 per file; such checkpoints keep loading, and a damaged file is still found."""
    path, manifest, file_a = _copy(pristine, tmp_path, "v1")
    manifest["format_version"] = 1
    del manifest[DIGEST_FIELD]          # version 1 manifests carry no digest
    for name, info in manifest["files"].items():
        assert set(info) == {"bytes", "xxh3_128"}
        sha256 = hashlib.sha256((path / name).read_bytes()).hexdigest()
        manifest["files"][name] = {"bytes": info["bytes"], "sha256": sha256}
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    verify_checkpoint(path)
    loaded = _request_a()
    load_checkpoint(path, loaded, verify_checksums=True)
    assert torch.equal(loaded[0].tensor, _logical("a", (4, 4)))

    data = bytearray(file_a.read_bytes())
    data[-1] ^= 0xFF
    file_a.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checksum mismatch for .*{file_a.name}: sha256 "):
        load_checkpoint(path, _request_a(), verify_checksums=True)

    manifest["files"][file_a.name] = {"bytes": len(data), "md5": "0" * 32}
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"records no checksum this megamoe knows \(keys \['bytes', 'md5'\]"):
        verify_checkpoint(path)


def test_format_version_2_checkpoints_without_a_digest_still_load(pristine, tmp_path):
    """Manifests written before they carried a digest (versions 1 and 2) load, their fields checked as
    ever; from version 3 on a manifest without its digest is refused."""
    path, manifest, _ = _copy(pristine, tmp_path, "v2")
    assert manifest["format_version"] == fmt.FORMAT_VERSION == 3
    del manifest[DIGEST_FIELD]
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"was edited or damaged: its digest \(None\) does not match"):
        read_manifest(path)
    manifest["format_version"] = 2
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    loaded = _request_a()
    load_checkpoint(path, loaded)
    assert torch.equal(loaded[0].tensor, _logical("a", (4, 4)))
    manifest["tensors"]["a"]["chunks"][0]["shape"] = [2, 4]          # still checked field by field
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="stored chunks of logical tensor 'a' cover 8 of its 16 elements"):
        read_manifest(path)


def test_20k_irregular_chunks_are_checked_without_comparing_every_pair(tmp_path, monkeypatch):
    """The tiling check (on save and on every read of a manifest) compares each chunk with its neighbours
    only: rows cut at different columns (no grid) used to be compared pairwise (20k chunks: 2e8
    comparisons, minutes of `inspect`)."""
    rows = 10_000
    path = tmp_path / "ckpt"
    save_checkpoint(path, [LogicalChunk("w", torch.zeros(rows, 8), (rows, 8), (0, 0))], manifest_fields={})
    manifest = read_manifest(path)
    (stored,) = manifest["tensors"]["w"]["chunks"]
    chunks = []
    for row in range(rows):                     # as if saved in 20k pieces (the file is not read here)
        cut = 1 + row % 7
        chunks += [{**stored, "key": f"w@{row},0", "offsets": [row, 0], "shape": [1, cut]},
                   {**stored, "key": f"w@{row},{cut}", "offsets": [row, cut], "shape": [1, 8 - cut]}]
    manifest["tensors"]["w"]["chunks"] = chunks
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(seal(manifest)))
    comparisons = []
    real = chunk_regions._intersection
    monkeypatch.setattr(chunk_regions, "_intersection", lambda a, b: comparisons.append(1) or real(a, b))
    assert len(read_manifest(path)["tensors"]["w"]["chunks"]) == 2 * rows
    assert 0 < len(comparisons) <= 3 * len(chunks)

    chunks[-1]["offsets"] = [rows - 2, 4]       # now overlapping a chunk of the row before
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(seal(manifest)))
    with pytest.raises(CheckpointError, match=r"overlap without being equal: offsets \(9998, 3\) shape \(1, 5\) and "
                                              r"offsets \(9998, 4\) shape \(1, 4\)"):
        read_manifest(path)


def test_inconsistent_chunks_are_refused_at_save(tmp_path):
    path = tmp_path / "ckpt"
    full = torch.zeros(8, 2)
    cases = [
        ([LogicalChunk("w", full[0:4], (8, 2), (0, 0)), LogicalChunk("w", full[2:6], (8, 2), (2, 0))],
         "chunks held of logical tensor 'w' overlap"),
        ([LogicalChunk("w", full[0:4], (8, 2), (0, 0))], "cover 8 of its 16 elements .* held by no rank"),
        ([LogicalChunk("w", full[0:4], (8, 2), (0, 0)), LogicalChunk("w", full[4:].double(), (8, 2), (4, 0))],
         "'w': rank 0 holds it as float32 .* rank 0 as float64"),
    ]
    for chunks, message in cases:
        with pytest.raises(CheckpointError, match=message):
            save_checkpoint(path, chunks, manifest_fields={})
    with pytest.raises(CheckpointError, match="unknown manifest_fields \\['step'\\]"):
        save_checkpoint(path, [], manifest_fields={"step": {}})
    with pytest.raises(CheckpointError, match="manifest_fields\\['extra'\\] must be JSON-serialisable"):
        save_checkpoint(path, [], manifest_fields={"extra": {"t": torch.zeros(1)}})
    with pytest.raises(ValueError, match="dim 0 covers \\[6, 10\\), outside the logical size 8"):
        LogicalChunk("w", full[:4], (8, 2), (6, 0))
    assert not path.exists() and _leftovers(path) == []
