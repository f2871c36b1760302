"""Damaged checkpoints are refused by every load path (a flipped data byte, a truncated file), a file is
hashed once per process and once over ranks loading together, the opt-out lets damage through, names
taken from manifests and HF indexes stay inside their directory, and inspect reports NaN/Inf.

The cases that spawn ranks or run scripts end to end; the in-process ones are in
tests/unit/test_checkpoint_integrity.py."""

import re
import shutil

import pytest

from megamoe.checkpoint.errors import CheckpointError
from megamoe.checkpoint.format import read_manifest
from megamoe.checkpoint.model_loading import build_model_from_checkpoint
from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.hf_checkpoints import _single_file_copy
from tests.helpers.checkpoint_integrity import _copy, _counting_hashes


def _collective_worker(rank, world_size, checkpoint, trained, damaged, poisoned):
    """On 2 ranks (data parallel: both read every file): hashes per file on this rank while building the
    model and resuming the training checkpoint, and the error each rank gets from a damaged checkpoint;
    then (EP 2: each rank holds half the experts) the error each gets from a NaN in one rank's expert."""
    import torch.distributed as dist

    from tests.helpers.checkpointed_training import build_trainer
    from megamoe.training.checkpoint import load_training_checkpoint
    from parallel_state import destroy_model_parallel, initialize_model_parallel

    counts = _counting_hashes()
    state = initialize_model_parallel()
    try:
        build_model_from_checkpoint(checkpoint, state, world_group=dist.group.WORLD)
        built = dict(counts)
        counts.clear()
        load_training_checkpoint(trained, build_trainer(state, "alltoall", None, dist.group.WORLD),
                                 world_group=dist.group.WORLD)
        resumed = dict(counts)
        try:
            build_model_from_checkpoint(damaged, state, world_group=dist.group.WORLD)
            error = None
        except CheckpointError as e:
            error = str(e)
        destroy_model_parallel()
        state = initialize_model_parallel(ep=2)
        try:
            build_model_from_checkpoint(poisoned, state, world_group=dist.group.WORLD)
            non_finite = None
        except CheckpointError as e:
            non_finite = str(e)
    finally:
        destroy_model_parallel()
    return built, resumed, error, non_finite


@pytest.mark.slow
def test_ranks_loading_together_hash_each_file_once(sources, tmp_path):
    from megamoe.hf.import_hf import import_hf
    from megamoe.checkpoint.layout import ParallelLayout

    checkpoint = tmp_path / "many_files"
    import_hf(sources / "hf", checkpoint, ParallelLayout(tp=1, pp=1, ep=1, etp=1), max_file_bytes=40_000)
    files = read_manifest(checkpoint)["files"]
    assert len(files) >= 4
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    victim = damaged / sorted(files)[-1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    victim.write_bytes(bytes(data))
    trained = _copy(sources, "trained", tmp_path)

    def poison(state):                  # an expert EP rank 1 holds (experts 4-7 of 8)
        state["model.layers.1.mlp.experts.6.up_proj.weight"][0, 0] = float("nan")
    poisoned_hf = _single_file_copy(sources / "hf", str(tmp_path / "poisoned_hf"), poison)
    poisoned = tmp_path / "poisoned"
    import_hf(poisoned_hf, poisoned, ParallelLayout(tp=1, pp=1, ep=1, etp=1), allow_non_finite=True)

    (built0, resumed0, error0, nan0), (built1, resumed1, error1, nan1) = run_on_ranks(
        _collective_worker, 2, args=(str(checkpoint), str(trained), str(damaged), str(poisoned)), timeout_s=300)
    total = {name: built0.get(name, 0) + built1.get(name, 0) for name in files}
    assert total == {name: 1 for name in files}, (built0, built1)        # each file once, over both ranks
    assert built0 and built1                                            # the hashing was shared out
    assert sum(resumed0.values()) + sum(resumed1.values()) == 1          # the training checkpoint's one file
    assert error0 == error1 and re.search(f"checksum mismatch for .*{victim.name}", error0)
    assert nan0 == nan1 and "layers.1.mlp.experts.6.up_proj.weight holds 1 NaN" in nan0   # rank 0 refuses too
