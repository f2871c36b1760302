"""The megamoe checkpoint format: one directory holding a JSON manifest and safetensors files.

Training checkpoints and the HuggingFace converter both read and write this format; nothing is pickled.

Layout
------
::

    <path>/manifest.json
    <path>/rank00000-0000.safetensors      # what rank 0 wrote, split into files of at most max_file_bytes
    <path>/rank00001-0000.safetensors
    ...

``manifest.json``::

    format, format_version            "megamoe-checkpoint", 3 (versions 1, which recorded SHA-256s, and 2,
                                      without manifest_digest, read too)
    model_config, parallel_layout,    the caller's JSON dicts (merged over ranks: a key given by several
    expert_placement, extra           ranks must have the same value everywhere)
    world_size                        ranks that saved
    tensors      {logical name: {dtype, global_shape, chunks: [{file, key, offsets, shape}]}}
    rank_state   {"<rank>": {key: {file, key, dtype, shape}}}   per-rank state (RNG states as uint8 ...)
    files        {file name: {bytes, xxh3_128}}   (see megamoe.checkpoint.checksums)
    manifest_digest  {xxh3_128}   of everything else (see megamoe.checkpoint.manifest_digest)

The stored chunks of one logical tensor never overlap and cover it exactly (checked on save and on read),
so any region can be assembled from them whatever layout it was saved under.

Saving (collective over ``group``)
----------------------------------
Ranks exchange chunk metadata (never data). A logical chunk (name, offsets, shape) held by several ranks
(parameters replicated over DP, expert replicas) is written once, by the lowest rank holding it; with
``verify_replicas`` every holder hashes its copy first and a difference fails the save. Each rank writes
its own files; rank 0 writes the manifest last.

Atomicity and leftovers
-----------------------
Everything is written under ``<path>.tmp-<random>`` (the name chosen by rank 0 and shared with the
metadata exchange) and fsynced; once every rank has reported its files, rank 0 writes and fsyncs the
manifest, renames the current checkpoint to ``<path>.old``, renames the temporary directory to ``<path>``
and deletes ``<path>.old``. A crash therefore leaves, at worst:

- ``<path>.tmp-*`` directories: never read; the next save deletes them.
- ``<path>.old`` next to a complete ``<path>`` (crash before the deletion): the next save deletes it.
- ``<path>.old`` and no ``<path>`` (crash between the two renames): loading falls back to ``<path>.old``
  (the previous complete checkpoint, with a warning) and the next save renames it back first.

A directory at ``<path>`` without a manifest is never replaced nor deleted. Concurrent saves to one path
are not supported.

Loading
-------
Each requested chunk is assembled from the stored chunks it intersects, reading only those slices through
``safe_open(...).get_slice(key)[...]``; replicas requested twice are read once. Stored dtypes are converted
explicitly to the destination's dtype (a bf16 checkpoint loads into fp32 parameters).

Integrity (:mod:`megamoe.checkpoint.integrity`). A manifest is untrusted input: it must match its own
digest (an edit that does not update it is refused by name; ``megamoe-convert edit-config`` changes a
config on purpose), hold no key twice, and every file name it gives must be a plain relative name
resolving inside the checkpoint (:mod:`megamoe.checkpoint.safe_names`); its chunks lie inside their tensor
and tile it, each names its own stored key, and the dtypes and shapes fit in the recorded file sizes, or
reading the manifest fails before any file is opened. Reading a chunk checks its stored dtype and shape.
The model fields are checked by :mod:`megamoe.checkpoint.model_manifest`. Every load path checks each
file it reads against the manifest before using its bytes: its size always, its checksum unless the caller opts out
(``verify_checksums=False``; the CLI's ``--no-verify-checksums``). A file is hashed once per process
(remembered by path, size, mtime, inode and recorded digest; a changed file is hashed again). A
damaged file is a :class:`CheckpointError` naming the file and the expected and actual checksums.

Several ranks loading together: without a process group each rank hashes the files it reads (no
communication); with one (``load_checkpoint(..., group=)``, ``load_training_checkpoint(world_group=)``,
``build_model_from_checkpoint(world_group=)``) the ranks exchange the names of the files they will read
and each file is hashed by exactly one rank (the bytes spread evenly), then the verdicts are exchanged and
every rank raises the same error if any file failed. Like saving (rank 0 renames the directory holding
every rank's files), this assumes all ranks see one shared filesystem.
"""

# The format's parts live in their own modules, one concept each: checkpoint_manifest (constants, dtype table,
# reading a manifest), chunk_regions (regions and the tiling check), checkpoint_save and checkpoint_load. This
# module documents the format and re-exports their API.
from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.integrity import check_stored_file
from megamoe.checkpoint.load import (iter_logical_tensors, load_checkpoint, load_rank_state, planned_files,
                                     verify_checkpoint)
from megamoe.checkpoint.manifest import (FORMAT_NAME, FORMAT_VERSION, MANIFEST_FIELDS, MANIFEST_FILE,
                                         read_manifest, resolve_checkpoint)
from megamoe.checkpoint.save import DEFAULT_MAX_FILE_BYTES, fsync_dir, save_checkpoint

# Private names code outside this package may still import from here (they were defined here before the split).
from megamoe.checkpoint.chunk_regions import _check_tiling  # noqa: F401
from megamoe.checkpoint.manifest import _DTYPES  # noqa: F401

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_FILE", "MANIFEST_FIELDS", "DEFAULT_MAX_FILE_BYTES",
    "CheckpointError", "save_checkpoint", "load_checkpoint", "load_rank_state", "read_manifest",
    "verify_checkpoint", "iter_logical_tensors", "resolve_checkpoint", "check_stored_file", "planned_files",
    "fsync_dir",
]
