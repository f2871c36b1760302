"""The checkpoint format: bitwise round trips (parameters, buffers, AdamW state, rank state), resharding
TP=4 / TP=2 x DP=2 -> TP=2 / TP=1 / TP=4 on 4 ranks, expert replicas written once and loaded into every
slot, lazy slice reads, crash-safe saves and clear errors for corrupt or mismatched checkpoints.

The cases that spawn ranks or run scripts end to end; the in-process ones are in
tests/unit/test_checkpoint_format.py."""

import os

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

from megamoe.checkpoint.format import (CheckpointError, iter_logical_tensors, load_checkpoint, load_rank_state,
                                     read_manifest, save_checkpoint)
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.spawned_ranks import run_on_ranks
from tests.helpers.checkpoint_format import (EXPERT_SHAPE, WithExperts, _all_chunks, _assert_reference,
                                             _failing_save_file, _leftovers, _logical, _model_and_optimizer,
                                             _set_reference)


# ----------------------------------------------------------------------------------------------
# Four ranks: one spawn, several layouts
# ----------------------------------------------------------------------------------------------
def _load_fresh_and_check(path, tp_group, seed):
    model, optimizer = _model_and_optimizer(tp_group, seed)
    manifest = load_checkpoint(path, _all_chunks(model, optimizer))
    _assert_reference(model, optimizer)
    return manifest


def _check_tp4_reshards(rank, root, world, pair):
    path = os.path.join(root, "tp4")
    model, optimizer = _model_and_optimizer(world, seed=10)
    _set_reference(model, optimizer)
    rng = torch.get_rng_state()
    save_checkpoint(path, _all_chunks(model, optimizer), group=world, rank_state={"rng": rng},
                    manifest_fields={"parallel_layout": {"tp": 4}, "expert_placement": {f"layer{rank}": [rank]}})
    manifest = _load_fresh_and_check(path, pair, seed=11)                 # TP=2
    _load_fresh_and_check(path, None, seed=12)                              # TP=1
    assert torch.equal(load_rank_state(path, rank)["rng"], rng)
    assert manifest["world_size"] == 4 and manifest["expert_placement"] == {f"layer{r}": [r] for r in range(4)}
    assert len(manifest["tensors"]["embed.weight"]["chunks"]) == 4
    if rank == 0:
        for name, full in iter_logical_tensors(path):
            if name.startswith(("embed", "up", "down")):
                assert torch.equal(full, _logical(name, full.shape)), name


def _check_dp_replicas_written_once(rank, root, world, pair):
    path = os.path.join(root, "tp2dp2")
    model, optimizer = _model_and_optimizer(pair, seed=20)               # ranks (0,1) and (2,3): DP replicas
    _set_reference(model, optimizer)
    save_checkpoint(path, _all_chunks(model, optimizer), group=world, manifest_fields={}, verify_replicas=True)
    manifest = _load_fresh_and_check(path, world, seed=21)               # TP=4
    files = {c["file"] for t in manifest["tensors"].values() for c in t["chunks"]}
    assert files and all(f.startswith(("rank00000-", "rank00001-")) for f in files)
    assert set(manifest["files"]) == files                                # ranks 2 and 3 wrote nothing
    assert len(manifest["tensors"]["up.weight"]["chunks"]) == 2
    assert len(manifest["tensors"]["down.bias"]["chunks"]) == 1           # replicated over TP and DP: once
    assert manifest["tensors"]["down.bias"]["chunks"][0]["file"].startswith("rank00000-")


def _check_expert_replicas_across_ranks(rank, root, world):
    path = os.path.join(root, "experts")
    placement = [0, 1, 2, 0, 1, 2, 0, 1]                                   # 8 slots, 2 per rank
    model = WithExperts(placement[2 * rank:2 * rank + 2])
    with torch.no_grad():
        model.router.weight.copy_(_logical("router", (3, 4)))
        for s, e in enumerate(model.moe.slot_to_expert):
            model.moe.weight[s] = _logical(f"expert{e}", EXPERT_SHAPE)
    save_checkpoint(path, sharded_state_dict(model), group=world, manifest_fields={}, verify_replicas=True)
    manifest = read_manifest(path)
    writers = {e: manifest["tensors"][f"moe.experts.{e}.weight"]["chunks"] for e in range(3)}
    assert [len(c) for c in writers.values()] == [1, 1, 1]
    assert [writers[e][0]["file"][:9] for e in range(3)] == ["rank00000", "rank00000", "rank00001"]

    fresh = WithExperts([[2, 2], [1, 1], [0, 0], [1, 2]][rank])
    load_checkpoint(path, sharded_state_dict(fresh))
    assert torch.equal(fresh.router.weight, _logical("router", (3, 4)))
    for s, e in enumerate(fresh.moe.slot_to_expert):
        assert torch.equal(fresh.moe.weight[s], _logical(f"expert{e}", EXPERT_SHAPE))

    # A diverged replica on rank 3 fails the save on every rank; the previous checkpoint stays.
    if rank == 3:
        with torch.no_grad():
            model.moe.weight[0] += 1.0
    with pytest.raises(CheckpointError, match="replicas of logical tensor 'moe.experts.0.weight'.*rank 0 and rank 3"):
        save_checkpoint(path, sharded_state_dict(model), group=world, manifest_fields={}, verify_replicas=True)
    # A rank that fails to write fails the save everywhere, without a hang.
    real_save_file = safetensors.torch.save_file
    if rank == 1:                                                           # the writer of expert 2
        safetensors.torch.save_file = _failing_save_file
    try:
        with pytest.raises(CheckpointError, match="while writing files: rank 1: OSError: disk full"):
            save_checkpoint(path, sharded_state_dict(model), group=world, manifest_fields={})
    finally:
        safetensors.torch.save_file = real_save_file
    dist.barrier()
    assert read_manifest(path) == manifest and _leftovers(path) == []


def _checkpoint_worker(rank, world_size, root):
    world = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _check_tp4_reshards(rank, root, world, pairs[rank // 2])
    _check_dp_replicas_written_once(rank, root, world, pairs[rank // 2])
    _check_expert_replicas_across_ranks(rank, root, world)
    return rank


@pytest.mark.slow
def test_reshard_and_deduplicate_on_four_ranks(tmp_path):
    assert run_on_ranks(_checkpoint_worker, 4, args=(str(tmp_path),)) == [0, 1, 2, 3]
