"""Damaged checkpoints are refused by every load path (a flipped data byte, a truncated file), a file is
hashed once per process and once over ranks loading together, the opt-out lets damage through, names
taken from manifests and HF indexes stay inside their directory, and inspect reports NaN/Inf."""

import argparse
import json
import os
import re
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from megamoe.cli.convert import build_parser
from megamoe.checkpoint import checksums, integrity
from megamoe.checkpoint.errors import CheckpointError, ConversionError
from megamoe.checkpoint.format import (MANIFEST_FILE, iter_logical_tensors, load_checkpoint, load_rank_state,
                                       read_manifest)
from megamoe.checkpoint.logical_reader import LogicalTensorReader
from megamoe.checkpoint.manifest_digest import seal
from megamoe.checkpoint.model_loading import build_model_from_checkpoint
from megamoe.checkpoint_state import sharded_state_dict
from parallel_state import ParallelState
from tests.helpers.hf_checkpoints import _single_file_copy, convert, hf_tensors
from tests.helpers.checkpoint_integrity import _copy, _counting_hashes

DAMAGES = ("flipped byte", "truncated")


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test starts with nothing verified (the cache is per process)."""
    integrity.forget_verified()
    yield
    integrity.forget_verified()


def _data_file(checkpoint):
    files = sorted(read_manifest(checkpoint)["files"])
    assert len(files) == 1, files
    return checkpoint / files[0]


def damage(checkpoint, how):
    """Flip one byte in the middle of the data (after the header) of the checkpoint's data file, or cut the
    file short; returns its path."""
    path = _data_file(checkpoint)
    data = bytearray(path.read_bytes())
    if how == "flipped byte":
        header = struct.unpack("<Q", data[:8])[0]
        data[8 + header + (len(data) - 8 - header) // 2] ^= 0x55
    else:
        del data[-64:]
    path.write_bytes(bytes(data))
    return path


def expected_error(how, path):
    if how == "flipped byte":
        return rf"checksum mismatch for .*{re.escape(path.name)}: xxh3_128 [0-9a-f]{{32}}, the manifest says [0-9a-f]{{32}}"
    return rf"{re.escape(path.name)} has \d+ bytes, the manifest says \d+ \(truncated"


def assert_cli_fails(capsys, argv, message, out_dir=None):
    """Exit code 1, exactly one ``error:`` line (the last of stderr, matching ``message``), no traceback,
    nothing at ``out_dir`` nor a temporary directory next to it."""
    assert convert(*argv) == 1, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    assert err.strip().splitlines()[-1].startswith(f"megamoe-convert {argv[0]}: error:"), err
    assert re.search(message, err), (message, err)
    if out_dir is not None:
        assert not os.path.exists(out_dir)
        assert not [n for n in os.listdir(os.path.dirname(out_dir)) if n.startswith(os.path.basename(out_dir) + ".")]


def _model_chunks(checkpoint):
    from megamoe.checkpoint.manifest_fields import model_config_from_manifest
    from megamoe.models import GPTMoEModel
    model = GPTMoEModel(model_config_from_manifest(read_manifest(checkpoint)), ParallelState.single_process())
    return sharded_state_dict(model)


def _trainer_for(checkpoint):
    from tests.helpers.checkpointed_training import build_trainer
    return build_trainer(ParallelState.single_process())


def _resume(checkpoint, **kwargs):
    from megamoe.training.checkpoint import load_training_checkpoint
    return load_training_checkpoint(checkpoint, _trainer_for(checkpoint), world_group=None, **kwargs)


def _read_one(checkpoint, how, **kwargs):
    with LogicalTensorReader(checkpoint, **kwargs) as reader:
        return getattr(reader, how)("embed_tokens.weight")


# ----------------------------------------------------------------------------------------------
# Every library load path refuses a damaged file
# ----------------------------------------------------------------------------------------------
LIBRARY_PATHS = {
    "load_checkpoint": lambda ckpt: load_checkpoint(ckpt, _model_chunks(ckpt)),
    "load_rank_state": lambda ckpt: load_rank_state(ckpt, 0),
    "iter_logical_tensors": lambda ckpt: list(iter_logical_tensors(ckpt)),
    "LogicalTensorReader.read": lambda ckpt: _read_one(ckpt, "read"),
    "LogicalTensorReader.extents": lambda ckpt: _read_one(ckpt, "extents"),
    "build_model_from_checkpoint": lambda ckpt: build_model_from_checkpoint(ckpt, ParallelState.single_process()),
    "load_training_checkpoint": _resume,
}


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("load", LIBRARY_PATHS)
def test_every_load_path_refuses_a_damaged_file(load, how, sources, tmp_path):
    checkpoint = _copy(sources, "trained", tmp_path)
    path = damage(checkpoint, how)
    with pytest.raises(CheckpointError, match=expected_error(how, path)):
        LIBRARY_PATHS[load](checkpoint)


def test_the_opt_out_lets_a_flipped_byte_through(sources, tmp_path):
    checkpoint = _copy(sources, "trained", tmp_path)
    damage(checkpoint, "flipped byte")
    load_checkpoint(checkpoint, _model_chunks(checkpoint), verify_checksums=False)
    load_rank_state(checkpoint, 0, verify_checksums=False)
    assert len(list(iter_logical_tensors(checkpoint, verify_checksums=False))) == len(read_manifest(checkpoint)["tensors"])
    _read_one(checkpoint, "read", verify_checksums=False)
    build_model_from_checkpoint(checkpoint, ParallelState.single_process(), verify_checksums=False)
    assert _resume(checkpoint, verify_checksums=False)["step"] == 1
    with pytest.raises(CheckpointError, match="truncated"):       # sizes are still checked
        damage(checkpoint, "truncated")
        load_rank_state(checkpoint, 0, verify_checksums=False)


# ----------------------------------------------------------------------------------------------
# The CLI commands
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", DAMAGES)
def test_export_and_reshard_refuse_a_damaged_checkpoint(how, sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    path = damage(checkpoint, how)
    out = str(tmp_path / "out")
    assert_cli_fails(capsys, ["export-hf", checkpoint, out], expected_error(how, path), out)
    # No laundering: a damaged checkpoint is not rewritten with fresh checksums.
    assert_cli_fails(capsys, ["reshard", checkpoint, out, "--tp", 1, "--pp", 1, "--ep", 1],
                     expected_error(how, path), out)
    assert convert("inspect", checkpoint) == 1
    captured = capsys.readouterr().out
    assert "checksums    FAILED" in captured and "values       not scanned" in captured


def test_no_verify_checksums_lets_a_flipped_byte_through(sources, tmp_path):
    checkpoint = _copy(sources, "imported", tmp_path)
    path = damage(checkpoint, "flipped byte")
    assert convert("export-hf", checkpoint, tmp_path / "hf", "--no-verify-checksums") == 0
    assert convert("reshard", checkpoint, tmp_path / "resharded", "--tp", 1, "--pp", 1, "--ep", 1,
                   "--no-verify-checksums") == 0
    assert convert("export-hf", tmp_path / "resharded", tmp_path / "hf2") == 0     # the damage was carried along
    original = hf_tensors(sources / "hf")
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert [k for k in original if not torch.equal(original[k], exported[k])], f"{path}: the flip changed nothing?"


def test_a_damaged_side_file_is_refused_before_anything_is_written(sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    side = checkpoint / "hf_files" / "tokenizer.json"
    side.write_text(side.read_text().replace("BPE", "XYZ"))
    out = str(tmp_path / "out")
    assert_cli_fails(capsys, ["export-hf", checkpoint, out], "side file checksum mismatch for .*tokenizer.json", out)
    assert_cli_fails(capsys, ["reshard", checkpoint, out, "--tp", 1, "--pp", 1, "--ep", 1],
                     "side file checksum mismatch for .*tokenizer.json", out)


@pytest.mark.slow
@pytest.mark.parametrize("how", DAMAGES)
def test_verify_refuses_a_damaged_checkpoint(how, sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    path = damage(checkpoint, how)
    assert_cli_fails(capsys, ["verify", checkpoint, "--hf", sources / "hf"],
                     "running the checkpoint on 1 ranks failed: .*" + expected_error(how, path))


def test_a_file_is_hashed_once_per_process_until_it_changes(sources, tmp_path, monkeypatch):
    checkpoint = _copy(sources, "trained", tmp_path)
    counts = _counting_hashes(monkeypatch)
    # model chunks, optimizer chunks and rank state are read by separate calls, all from one file
    _resume(checkpoint)
    build_model_from_checkpoint(checkpoint, ParallelState.single_process())
    list(iter_logical_tensors(checkpoint))
    assert counts == {_data_file(checkpoint).name: 1}
    path = _data_file(checkpoint)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))   # rewritten, say
    load_rank_state(checkpoint, 0)
    assert counts == {path.name: 2}


# ----------------------------------------------------------------------------------------------
# Names in a manifest or an HF index stay inside their directory
# ----------------------------------------------------------------------------------------------
def _edit_manifest(checkpoint, edit, *, reseal=True):
    """Apply ``edit`` to the manifest; ``reseal``: recompute its digest, as whoever edits on purpose can
    (the field checks must refuse the edit all the same)."""
    path = checkpoint / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(seal(manifest) if reseal else manifest))


def _rename_data_file(manifest, new_name):
    (old,) = manifest["files"]
    manifest["files"] = {new_name: manifest["files"][old]}
    for entry in manifest["tensors"].values():
        for chunk in entry["chunks"]:
            chunk["file"] = new_name


@pytest.mark.parametrize("bad", ["../x.safetensors", "/etc/passwd", "sub/../../x.safetensors", "a\\b.safetensors"])
def test_manifest_file_names_must_stay_inside_the_checkpoint(bad, sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    shutil.copy(_data_file(checkpoint), tmp_path / "x.safetensors")           # a valid file outside
    _edit_manifest(checkpoint, lambda m: _rename_data_file(m, bad))
    with pytest.raises(CheckpointError, match=f"refusing the file name {re.escape(repr(bad))}"):
        read_manifest(checkpoint)
    assert_cli_fails(capsys, ["inspect", checkpoint], "refusing the file name")
    assert_cli_fails(capsys, ["export-hf", checkpoint, tmp_path / "out"], "refusing the file name",
                     str(tmp_path / "out"))


@pytest.mark.parametrize("damage", ["no tensors", "tensors a list", "chunk without shape", "files a list",
                                    "file entry a number", "negative shape", "rank state dtype", "hf_files a list",
                                    "side file named config.json"])
def test_a_malformed_manifest_is_an_error_naming_it(damage, sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)

    def edit(manifest):
        first = next(iter(manifest["tensors"].values()))
        if damage == "no tensors":
            del manifest["tensors"]
        elif damage == "tensors a list":
            manifest["tensors"] = list(manifest["tensors"])
        elif damage == "chunk without shape":
            del first["chunks"][0]["shape"]
        elif damage == "files a list":
            manifest["files"] = list(manifest["files"])
        elif damage == "file entry a number":
            manifest["files"][next(iter(manifest["files"]))] = 5
        elif damage == "negative shape":
            first["global_shape"][0] = -first["global_shape"][0]
            first["chunks"][0]["shape"][0] = -first["chunks"][0]["shape"][0]
        elif damage == "rank state dtype":
            manifest["rank_state"] = {"0": {"torch_cpu": {"file": next(iter(manifest["files"])), "key": "k",
                                                          "dtype": "complex32", "shape": [4]}}}
        elif damage == "hf_files a list":
            manifest["extra"]["hf_files"] = ["config.json"]
        else:
            manifest["extra"]["hf_files"]["config.json"] = next(iter(manifest["extra"]["hf_files"].values()))

    _edit_manifest(checkpoint, edit)
    expected = "not a side file" if damage == "side file named config.json" else "is malformed"
    with pytest.raises(CheckpointError, match=expected):
        read_manifest(checkpoint)
    assert_cli_fails(capsys, ["export-hf", checkpoint, tmp_path / "out"], expected, str(tmp_path / "out"))


def test_a_manifest_file_linking_outside_is_refused(sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    path = _data_file(checkpoint)
    shutil.move(path, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", path)
    with pytest.raises(CheckpointError, match="symbolic link leading outside"):
        read_manifest(checkpoint)
    os.unlink(path)
    os.symlink("../imported/" + path.name, path)                            # a loop
    with pytest.raises(CheckpointError, match="symbolic link loop"):
        read_manifest(checkpoint)


def test_a_side_file_name_cannot_escape_the_output(sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    (checkpoint / "escaped.sh").write_text("echo pwned\n")
    entry = checksums.file_entry(str(checkpoint / "escaped.sh"))
    _edit_manifest(checkpoint, lambda m: m["extra"]["hf_files"].update({"../escaped.sh": entry}))
    out = tmp_path / "outputs" / "out"
    os.makedirs(out.parent)
    assert_cli_fails(capsys, ["export-hf", checkpoint, out], "refusing the file name '../escaped.sh'", str(out))
    assert_cli_fails(capsys, ["reshard", checkpoint, out, "--tp", 1, "--pp", 1, "--ep", 1],
                     "refusing the file name '../escaped.sh'", str(out))
    assert os.listdir(out.parent) == []                                      # no escaped.sh next to OUT_DIR


def _sharded_hf(sources, tmp_path):
    """A two-shard copy of the tiny HF model with its index; returns (directory, index dict)."""
    directory = tmp_path / "hf_sharded"
    os.makedirs(directory)
    state = hf_tensors(sources / "hf")
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, shard_keys in shards.items():
        save_file({k: state[k] for k in shard_keys}, str(directory / name), metadata={"format": "pt"})
    shutil.copy(sources / "hf" / "config.json", directory / "config.json")
    index = {"metadata": {}, "weight_map": {k: name for name, shard_keys in shards.items() for k in shard_keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory, index


@pytest.mark.parametrize("bad", ["../outside/x.safetensors", "ABSOLUTE"])
def test_hf_index_names_must_stay_inside_the_directory(bad, sources, tmp_path, capsys):
    directory, index = _sharded_hf(sources, tmp_path)
    assert convert("import-hf", directory, tmp_path / "ok", "--tp", 1, "--pp", 1, "--ep", 1) == 0
    os.makedirs(tmp_path / "outside")
    second = "model-00002-of-00002.safetensors"
    shutil.move(directory / second, tmp_path / "outside" / "x.safetensors")
    bad = str(tmp_path / "outside" / "x.safetensors") if bad == "ABSOLUTE" else bad
    index["weight_map"] = {k: bad if v == second else v for k, v in index["weight_map"].items()}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    out = str(tmp_path / "out")
    assert_cli_fails(capsys, ["import-hf", directory, out, "--tp", 1, "--pp", 1, "--ep", 1],
                     f"weight_map: refusing the file name {re.escape(repr(bad))}", out)


def test_hf_links_leading_outside_and_loops_are_refused(sources, tmp_path, capsys):
    directory = _single_file_copy(sources / "hf", str(tmp_path / "hf"), lambda s: None)
    (tmp_path / "secret").write_text("not a tokenizer")
    os.symlink(tmp_path / "secret", os.path.join(directory, "tokenizer.json"))
    out = str(tmp_path / "out")
    assert_cli_fails(capsys, ["import-hf", directory, out, "--tp", 1, "--pp", 1, "--ep", 1],
                     "tokenizer.json: it is a symbolic link leading outside", out)
    os.unlink(os.path.join(directory, "tokenizer.json"))
    os.symlink("b.safetensors", os.path.join(directory, "a.safetensors"))
    os.symlink("a.safetensors", os.path.join(directory, "b.safetensors"))
    assert_cli_fails(capsys, ["import-hf", directory, out, "--tp", 1, "--pp", 1, "--ep", 1],
                     "a.safetensors is a symbolic link loop", out)


def test_a_hub_cache_snapshot_with_links_into_its_blobs_imports(sources, tmp_path):
    repo = tmp_path / "models--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    os.makedirs(repo / "blobs")
    os.makedirs(snapshot)
    for name in os.listdir(sources / "hf"):
        blob = repo / "blobs" / f"blob-{name}"
        shutil.copy(sources / "hf" / name, blob)
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snapshot / name)
    assert convert("import-hf", snapshot, tmp_path / "out", "--tp", 1, "--pp", 1, "--ep", 1) == 0
    assert "tokenizer.json" in read_manifest(tmp_path / "out")["extra"]["hf_files"]


def test_a_hub_cache_blobs_directory_linking_out_of_the_cache_is_refused(sources, tmp_path, capsys):
    repo, outside = tmp_path / "models--tiny", tmp_path / "outside"
    snapshot = repo / "snapshots" / "0123abc"
    os.makedirs(snapshot)
    os.makedirs(outside)
    os.symlink(outside, repo / "blobs")                 # the blobs themselves lie outside the cache
    for name in os.listdir(sources / "hf"):
        shutil.copy(sources / "hf" / name, outside / f"blob-{name}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob-{name}"), snapshot / name)
    out = str(tmp_path / "out")
    assert_cli_fails(capsys, ["import-hf", snapshot, out, "--tp", 1, "--pp", 1, "--ep", 1],
                     "symbolic link leading outside", out)


def test_a_side_file_that_is_not_a_regular_file_is_refused_unopened(sources, tmp_path, capsys):
    directory = _single_file_copy(sources / "hf", str(tmp_path / "hf"), lambda s: None)
    os.mkfifo(os.path.join(directory, "tokenizer.json"))           # opening it would block: never opened
    out = str(tmp_path / "out")
    assert_cli_fails(capsys, ["import-hf", directory, out, "--tp", 1, "--pp", 1, "--ep", 1],
                     r"side file .*tokenizer.json is a FIFO, not a regular file", out)
    assert_cli_fails(capsys, ["export-hf", sources / "imported", out, "--hf-config", directory],
                     r"tokenizer.json is a FIFO", out)
    from megamoe.training.hf_start import hf_start_config
    with pytest.raises(ConversionError, match="tokenizer.json is a FIFO"):
        hf_start_config(directory)
    checkpoint = _copy(sources, "imported", tmp_path)             # a checkpoint's recorded side file
    os.unlink(checkpoint / "hf_files" / "tokenizer.json")
    os.mkfifo(checkpoint / "hf_files" / "tokenizer.json")
    for verify in ([], ["--no-verify-checksums"]):
        assert_cli_fails(capsys, ["export-hf", checkpoint, out, *verify], "tokenizer.json is a FIFO", out)
        assert_cli_fails(capsys, ["reshard", checkpoint, out, "--tp", 1, "--pp", 1, "--ep", 1, *verify],
                         "tokenizer.json is a FIFO", out)
    assert convert("inspect", checkpoint) == 1
    assert "tokenizer.json is a FIFO" in capsys.readouterr().out


def test_a_linked_hf_files_directory_must_stay_inside_the_checkpoint(sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    shutil.move(checkpoint / "hf_files", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", checkpoint / "hf_files")
    out = str(tmp_path / "out")
    message = r"hf_files: it is a symbolic link leading outside"
    assert_cli_fails(capsys, ["inspect", checkpoint], message)
    assert_cli_fails(capsys, ["export-hf", checkpoint, out], message, out)
    assert_cli_fails(capsys, ["reshard", checkpoint, out, "--tp", 1, "--pp", 1, "--ep", 1], message, out)
    os.unlink(checkpoint / "hf_files")                  # a link inside the checkpoint is fine
    shutil.move(tmp_path / "elsewhere", checkpoint / "side")
    os.symlink("side", checkpoint / "hf_files")
    assert convert("export-hf", checkpoint, out) == 0


def test_export_overwrite_refuses_a_linked_output_directory(sources, tmp_path, capsys):
    real, link = tmp_path / "real", tmp_path / "link"
    assert convert("export-hf", sources / "imported", real) == 0
    before = sorted(os.listdir(real))
    os.symlink(real, link)
    for _ in range(2):                  # the same one-line refusal every time: nothing was renamed
        assert_cli_fails(capsys, ["export-hf", sources / "imported", link, "--overwrite"],
                         rf"{re.escape(str(link))} is a symbolic link .*refusing to replace it")
        assert os.path.islink(link) and sorted(os.listdir(real)) == before
        assert sorted(os.listdir(tmp_path)) == ["link", "real"]


@pytest.mark.parametrize("field", ["num_attention_heads", "num_key_value_heads", "hidden_size"])
def test_zero_sizes_in_config_json_name_the_field(field, sources, tmp_path, capsys):
    directory = _single_file_copy(sources / "hf", str(tmp_path / "hf"), lambda s: None)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config[field] = 0
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    out = str(tmp_path / "out")
    assert_cli_fails(capsys, ["import-hf", directory, out, "--tp", 1, "--pp", 1, "--ep", 1],
                     f"{field} must be a positive integer, got 0", out)
    from megamoe.hf.import_hf import model_config_from_hf
    with pytest.raises(ConversionError, match=field):
        model_config_from_hf(config, "config.json")


# ----------------------------------------------------------------------------------------------
# inspect: NaN / Inf; --help: defaults
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["model.norm.weight",                  # copied file to file: scanned only
                                 "model.layers.0.self_attn.o_proj.weight"])   # TP 2 cuts its columns: read
def test_non_finite_hf_weights_are_refused_at_import_unless_allowed(key, sources, tmp_path, capsys, caplog):
    def poison(state):
        state[key].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    directory = _single_file_copy(sources / "hf", str(tmp_path / "hf"), poison)
    out = str(tmp_path / "ckpt")
    numel = hf_tensors(directory)[key].numel()
    assert_cli_fails(capsys, ["import-hf", directory, out, "--tp", 2, "--pp", 1, "--ep", 1],
                     rf"{re.escape(key)} holds 1 NaN and 2 infinite values \(of {numel}\); refusing to import "
                     r"non-finite weights \(pass --allow-non-finite to import them anyway\)", out)
    assert convert("import-hf", directory, out, "--tp", 2, "--pp", 1, "--ep", 1, "--allow-non-finite") == 0
    assert f"{key} holds 1 NaN and 2 infinite values" in caplog.text

    # A checkpoint holding them (allowed here; or saved with verification off): loading it for generation
    # and exporting it scan the values they read, and refuse alike.
    name = key.removeprefix("model.")
    assert_cli_fails(capsys, ["export-hf", out, tmp_path / "hf_out"],
                     rf"{re.escape(name)} holds 1 NaN and 2 infinite values .*refusing to export non-finite "
                     r"weights \(pass --allow-non-finite", str(tmp_path / "hf_out"))
    assert convert("export-hf", out, tmp_path / "hf_out", "--allow-non-finite") == 0
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} holds 1 NaN and 2 infinite values .*refusing to "
                                              "load non-finite weights"):
        build_model_from_checkpoint(out, ParallelState.single_process())
    model = build_model_from_checkpoint(out, ParallelState.single_process(), allow_non_finite=True)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_inspect_reports_non_finite_tensors(sources, tmp_path, capsys):
    assert convert("inspect", sources / "imported") == 0
    assert "values       all finite" in capsys.readouterr().out

    def poison(state):
        state["model.layers.1.mlp.experts.3.up_proj.weight"][0, 0] = float("nan")
        state["model.norm.weight"][2] = float("inf")
    directory = _single_file_copy(sources / "hf", str(tmp_path / "hf"), poison)
    assert convert("import-hf", directory, tmp_path / "ckpt", "--tp", 1, "--pp", 1, "--ep", 1,
                   "--allow-non-finite") == 0
    assert convert("inspect", tmp_path / "ckpt") == 1
    text = capsys.readouterr().out
    assert re.search(r"NON-FINITE: 2 tensors hold NaN or Inf: .*layers\.1\.mlp\.experts\.3\.up_proj\.weight", text)
    assert "norm.weight" in text and "checksums    OK" in text
    assert convert("inspect", tmp_path / "ckpt", "--json") == 1
    info = json.loads(capsys.readouterr().out)
    assert info["non_finite"] == {"scanned": True, "count": 2,          # in name order
                                  "tensors": ["layers.1.mlp.experts.3.up_proj.weight", "norm.weight"]}
    assert "NaN" in _help("inspect")


def _help(command):
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    return subparsers.choices[command].format_help()


def test_every_help_shows_the_defaults():
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    for command, parser in subparsers.choices.items():
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if action.default not in (None, argparse.SUPPRESS) and not isinstance(action.default, bool):
                assert f"default: {action.default}" in text, (command, action.dest, text)
    assert "--no-verify-checksums" in _help("export-hf") and "--no-verify-checksums" in _help("reshard")
    assert "--no-verify-checksums" in _help("verify")


# ----------------------------------------------------------------------------------------------
# The manifest: its digest, and every field checked by every load path
# ----------------------------------------------------------------------------------------------
def _first_expert_pair(manifest):
    """Two routed-expert tensors of one shape (experts 0 and 1 of the first MoE layer's up projection)."""
    names = sorted(n for n in manifest["tensors"] if re.fullmatch(r"layers\.\d+\.mlp\.experts\.[01]\.up_proj\.weight", n))
    return names[0], names[1]


def _swap_expert_chunks(manifest):
    a, b = _first_expert_pair(manifest)
    tensors = manifest["tensors"]
    tensors[a]["chunks"], tensors[b]["chunks"] = tensors[b]["chunks"], tensors[a]["chunks"]


def _set_path(*path):
    """An edit setting ``manifest[path[0]][path[1]]... = path[-1]``."""
    def edit(manifest):
        node = manifest
        for key in path[:-2]:
            node = node[key]
        node[path[-2]] = path[-1]
    return edit


def _first_layer_placement(manifest):
    return manifest["expert_placement"][min(manifest["expert_placement"], key=int)]


def _placement(change):
    return lambda m: change(_first_layer_placement(m))


def _drop_expert(placement):
    placement["slot_to_expert"][0] = placement["slot_to_expert"][1]       # expert 0's slot given to expert 1


def _empty_tensors(manifest):
    """30k empty tensors: refused as 300k are (by hand, `inspect` of 300k exits 1 after 29 s, imports
    included, on 2 cores under a load average of 7: too long for the suite)."""
    manifest["tensors"].update({f"empty.{i}": {"dtype": "float32", "global_shape": [0], "chunks": []}
                                for i in range(30_000)})


def _drop_optimizer_tensor(manifest):
    del manifest["tensors"]["optim.exp_avg_sq.norm.weight"]


def _lying_dtype(manifest):
    manifest["tensors"]["norm.weight"]["dtype"] = "bfloat16"        # stored as float32: half the bytes


def _huge_vocab(manifest):
    manifest["model_config"]["vocab_size"] = 10**12


# Edits that only the digest can tell from the saved values (each field still holds a valid value).
DIGEST_ONLY = {
    "same-shape expert chunks swapped": ("imported", _swap_expert_chunks),
    "top-k 2 -> 3": ("imported", _set_path("model_config", "moe", "router", "top_k", 3)),
    "rope theta": ("imported", _set_path("model_config", "attention", "rope", "theta", 1e6)),
    "norm eps": ("imported", _set_path("model_config", "norm_eps", 1e-3)),
    "step with a flipped bit": ("trained", _set_path("extra", "step", 1 ^ (1 << 20))),
    "sampler position changed": ("trained", _set_path("extra", "sampler_state", "consumed_samples", 16)),
}


@pytest.mark.parametrize("case", DIGEST_ONLY)
def test_an_edit_that_keeps_the_digest_is_refused_by_name(case, sources, tmp_path, capsys):
    name, edit = DIGEST_ONLY[case]
    checkpoint = _copy(sources, name, tmp_path)
    _edit_manifest(checkpoint, edit, reseal=False)
    message = (r"manifest\.json was edited or damaged: its digest \(xxh3_128 [0-9a-f]{32}\) does not match its content "
               r"\(xxh3_128 [0-9a-f]{32}\); use `megamoe-convert edit-config` to change a checkpoint's config")
    for entry in _ENTRY_POINTS[name]:
        _ENTRY_POINTS[name][entry](checkpoint, tmp_path, capsys, message)


def _cli_refuses(*command):
    def run(checkpoint, tmp_path, capsys, message):
        out = tmp_path / "out"
        argv = [command[0], checkpoint] + ([out] if command[0] != "inspect" else []) + list(command[1:])
        assert_cli_fails(capsys, argv, message, None if command[0] == "inspect" else str(out))
    return run


def _raises(load):
    def run(checkpoint, tmp_path, capsys, message):
        with pytest.raises(CheckpointError, match=message):
            load(checkpoint)
    return run


_COMMON_ENTRY_POINTS = {
    "inspect": _cli_refuses("inspect"),
    "reshard": _cli_refuses("reshard", "--tp", 1, "--pp", 1, "--ep", 1),
    "generate's model load": _raises(lambda ckpt: build_model_from_checkpoint(ckpt, ParallelState.single_process())),
}
# A converted checkpoint exports to HF; a training checkpoint (of a "custom" model) resumes.
_ENTRY_POINTS = {"imported": {**_COMMON_ENTRY_POINTS, "export-hf": _cli_refuses("export-hf")},
                 "trained": {**_COMMON_ENTRY_POINTS, "resume": _raises(_resume)}}

# Edits that keep the digest valid (recomputed, as whoever edits on purpose can): the field checks refuse them.
FIELD_EDITS = {
    "placement: an expert dropped": ("imported", _placement(_drop_expert), r"experts \[0\] have no slot"),
    "placement: expert id 99": ("imported", _placement(lambda p: p["slot_to_expert"].__setitem__(2, 99)),
                                r"slot_to_expert\[2\] = 99 is not an expert id"),
    "placement: expert id -1": ("imported", _placement(lambda p: p["slot_to_expert"].__setitem__(2, -1)),
                                r"slot_to_expert\[2\] = -1 is not an expert id"),
    "placement: a short list": ("imported", _placement(lambda p: p["slot_to_expert"].pop()),
                                r"num_slots \(7\) < num_experts \(8\)"),
    "placement: a string": ("imported", _placement(lambda p: p.update(slot_to_expert="0,1,2,3,4,5,6,7")),
                            r"'slot_to_expert' must be a list of ints, got str"),
    "placement: a dense layer's": ("imported", lambda m: m["expert_placement"].update({"0": m["expert_placement"].pop("1")}),
                                   r"expert_placement has layers '0', the model config's MoE layers are '1'"),
    "model_config: unknown family": ("imported", _set_path("model_config", "family", "llama9"),
                                     r"model_config\.family 'llama9' is not a family this megamoe knows"),
    "model_config: a list": ("imported", lambda m: m.update(model_config=[m["model_config"]]),
                             r"model_config must be a JSON object, got \[\{"),
    "model_config.moe a list": ("imported", _set_path("model_config", "moe", [1, 2]),
                                r"model_config is malformed \(a section that is not a JSON object\?\): TypeError"),
    "model_config: top-k past the experts": ("imported", _set_path("model_config", "moe", "router", "top_k", 9),
                                             r"top_k"),
    "model_config: vocab 1e12": ("imported", _huge_vocab,
                                 r"model_config describes a model of at least [\d,]+ parameters, but the checkpoint "
                                 r"stores \d+,\d+: vocab_size 1000000000000"),
    "model_config: unknown activation": ("imported", _set_path("model_config", "dense_mlp", "activation", "swish9"),
                                         r"activation must be one of .* got 'swish9'"),
    "parallel_layout: tp 0": ("imported", _set_path("parallel_layout", "tp", 0),
                              r"parallel_layout\.tp must be a positive integer, got 0"),
    "parallel_layout: negative world size": ("imported", _set_path("parallel_layout", "world_size", -1),
                                             r"parallel_layout\.world_size must be a positive integer, got -1"),
    "parallel_layout: a string": ("imported", lambda m: m.update(parallel_layout="tp=1"),
                                  r"parallel_layout must be a JSON object, got 'tp=1'"),
    "parallel_layout: not the saving world": ("trained", _set_path("parallel_layout", "dp", 2),
                                              r"tp\*pp\*dp\*cp must be the world_size"),
    "a lying dtype": ("trained", _lying_dtype, r"norm\.weight@0 is (stored as F32|torch\.float32 \(32,\)), the manifest says (torch\.)?bfloat16"),
    "no tensors": ("imported", lambda m: m["tensors"].clear(),
                   r"model_config has 3 layers, but the manifest lists only 0 model tensors"),
    "the tensors of another model": ("imported", lambda m: m["tensors"].pop("norm.weight"),
                                     r"tensors does not hold the tensors of its model_config: 1 missing \('norm\.weight'\)"),
    # Parsing that many entries takes a while: one entry point (the others read the manifest the same way).
    "30k empty tensors": ("imported", _empty_tensors, r"30000 unexpected \('empty\.0', ", ("inspect",)),
    "a chunk outside its tensor": ("imported", lambda m: m["tensors"]["norm.weight"]["chunks"][0].update(
        offsets=[4], shape=[32]), r"lies outside its global shape \[32\]"),
    "step a float": ("trained", _set_path("extra", "step", 1.0), r"extra\.step must be an integer in \[0, 2\*\*63\), got 1\.0"),
    "step 10**27": ("trained", _set_path("extra", "step", 10**27),
                    r"extra\.step must be an integer in \[0, 2\*\*63\), got 1000000000000000000000000000"),
    "sampler position negative": ("trained", _set_path("extra", "sampler_state", "consumed_samples", -8),
                                  r"extra\.sampler_state\.consumed_samples must be an integer in \[0, 2\*\*63\)"),
    "has_optimizer_state false with state": ("trained", _set_path("extra", "has_optimizer_state", False),
                                             r"extra\.has_optimizer_state is false, but the manifest lists \d+ "
                                             r"optimizer state tensors"),
    "an optimizer tensor missing": ("trained", _drop_optimizer_tensor,
                                    r"optimizer state 'exp_avg_sq' is missing for 1 parameters that have 'exp_avg': "
                                    r"'optim\.exp_avg_sq\.norm\.weight'"),
    "extra a list": ("trained", lambda m: m.update(extra=[m["extra"]]), r"'extra' must be a JSON object"),
}


@pytest.mark.parametrize("case", FIELD_EDITS)
def test_every_manifest_field_is_checked_by_every_load_path(case, sources, tmp_path, capsys):
    name, edit, message, *only = FIELD_EDITS[case]
    checkpoint = _copy(sources, name, tmp_path)
    _edit_manifest(checkpoint, edit)
    for entry in only[0] if only else _ENTRY_POINTS[name]:
        _ENTRY_POINTS[name][entry](checkpoint, tmp_path, capsys, message)


@pytest.mark.parametrize("text_edit", ["duplicate tensor name", "deep nesting", "nesting too deep for its readers"])
def test_malformed_manifest_json_is_one_clean_error(text_edit, sources, tmp_path, capsys):
    checkpoint = _copy(sources, "trained", tmp_path)
    path = checkpoint / MANIFEST_FILE
    text = path.read_text()
    if text_edit == "duplicate tensor name":        # a second "norm.weight" entry, as JSON allows
        entry = json.dumps(json.loads(text)["tensors"]["norm.weight"])
        text = text.replace('"tensors": {', f'"tensors": {{\n  "norm.weight": {entry},', 1)
        message = r"cannot read .*manifest\.json: the key 'norm\.weight' appears twice in one object"
    elif text_edit == "deep nesting":           # past what json parses
        text = text.replace('"extra": {', '"deep": ' + "[" * 100_000 + "]" * 100_000 + ', "extra": {', 1)
        message = r"cannot read .*manifest\.json: its JSON is nested too deeply"
    else:                                       # json parses it, copying the config recursively did not
        manifest = json.loads(text)
        manifest["model_config"]["deep"] = json.loads("[" * 900 + "]" * 900)
        text = json.dumps(seal(manifest))
        message = r"cannot read .*manifest\.json: its JSON is nested too deeply \(more than 32 levels in its fields\)"
    path.write_text(text)
    for entry in _ENTRY_POINTS["trained"]:
        _ENTRY_POINTS["trained"][entry](checkpoint, tmp_path, capsys, message)


def test_edit_config_changes_the_config_and_rewrites_the_digest(sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    before = read_manifest(checkpoint)
    assert convert("edit-config", checkpoint, "--set", "moe.router.top_k=3", "--set", "attention.rope.theta=1e6") == 0
    assert capsys.readouterr().out.strip() == (f"edited {checkpoint}: moe.router.top_k 2 -> 3, attention.rope.theta "
                                               "10000.0 -> 1000000.0")
    after = read_manifest(checkpoint)                                 # the new digest matches
    assert after["manifest_digest"] != before["manifest_digest"]
    assert (after["model_config"]["moe"]["router"]["top_k"], after["model_config"]["attention"]["rope"]["theta"]) == (3, 1e6)
    assert {k: v for k, v in after.items() if k not in ("model_config", "manifest_digest")} == \
        {k: v for k, v in before.items() if k not in ("model_config", "manifest_digest")}
    model = build_model_from_checkpoint(checkpoint, ParallelState.single_process())
    assert model.config.moe.router.top_k == 3
    assert not [n for n in os.listdir(checkpoint) if n.startswith(".")]           # no temporary file left


@pytest.mark.parametrize("assignment, message", [
    ("moe.router.topk=3", r"model_config has no field 'moe\.router\.topk'; its fields at that level: .*top_k"),
    ("moe.router.top_k=9", r"top_k"),
    ("vocab_size=128", r"tensors\['embed_tokens\.weight'\] has global_shape \[64, 32\], the model_config gives \[128, 32\]"),
    ("family=llama9", r"model_config\.family 'llama9' is not a family this megamoe knows"),
    ("router.top_k=3", r"model_config has no section 'router'"),
])
def test_edit_config_refuses_a_config_that_does_not_fit(assignment, message, sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    before = (checkpoint / MANIFEST_FILE).read_bytes()
    assert_cli_fails(capsys, ["edit-config", checkpoint, "--set", assignment], message)
    assert (checkpoint / MANIFEST_FILE).read_bytes() == before


def test_edit_config_does_not_launder_a_hand_edit(sources, tmp_path, capsys):
    checkpoint = _copy(sources, "imported", tmp_path)
    _edit_manifest(checkpoint, _set_path("model_config", "norm_eps", 1e-3), reseal=False)
    before = (checkpoint / MANIFEST_FILE).read_bytes()
    assert_cli_fails(capsys, ["edit-config", checkpoint, "--set", "moe.router.top_k=3"], "was edited or damaged")
    assert (checkpoint / MANIFEST_FILE).read_bytes() == before
    assert convert("edit-config", checkpoint, "--set", "top_k") == 2         # not KEY=VALUE: a usage error
    assert "expected KEY=VALUE" in capsys.readouterr().err
