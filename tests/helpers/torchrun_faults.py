"""Launched by tests/multirank/test_demo.py under torchrun (and run in-process by tests/unit/test_demo.py): a run
that saves a checkpoint into SAVE_DIR after each of 3 steps and meets FAULT at step 2:

- ``kill``: the last rank is killed (SIGKILL, as the out-of-memory killer does) before the step;
- ``enospc``: the disk fills during the save: the last rank's checkpoint file write fails as safetensors
  reports it;
- ``erofs``: the save directory has become read-only: creating the save's directory fails.

Usage: torchrun_faults.py FAULT SAVE_DIR
"""

import contextlib
import errno
import os
import signal
import sys
from unittest import mock

import safetensors.torch
import torch
from safetensors import SafetensorError

# torchrun runs this file as a script: the repo root is put on the path for tests.helpers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.helpers.tiny_model import tiny_config  # noqa: E402

import torch.distributed as dist  # noqa: E402

from megamoe.after_torchrun import note_newest_checkpoint  # noqa: E402
from megamoe.cli.launch import init_distributed, run_script  # noqa: E402
from megamoe.models import GPTMoEModel  # noqa: E402
from megamoe.tensor_parallel import initialize_parameters  # noqa: E402
from megamoe.training.checkpoint import checkpoint_path, save_training_checkpoint  # noqa: E402
from megamoe.training.trainer import TrainConfig, Trainer  # noqa: E402
from parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel  # noqa: E402

FAULTS = ("kill", "enospc", "erofs")


def _full_disk(tensors, file_path):
    raise SafetensorError(f'Error while serializing: I/O error: No space left on device (os error 28) at path '
                          f'"{os.path.join(os.path.dirname(file_path), ".tmpXb3kQz")}"')


def _read_only(save_dir):
    real_makedirs = os.makedirs

    def makedirs(name, *args, **kwargs):
        if os.path.dirname(os.path.abspath(name)) == os.path.abspath(save_dir) and not os.path.exists(name):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), name)
        return real_makedirs(name, *args, **kwargs)
    return makedirs


def _save_fault(fault, rank, world, save_dir):
    """The fault this rank meets during the save (a context): a full disk on the last rank (it writes a file),
    a read-only save dir on rank 0 (it creates the save's directory); nothing otherwise."""
    if fault == "enospc" and rank == world - 1:
        return mock.patch.object(safetensors.torch, "save_file", _full_disk)
    if fault == "erofs" and rank == 0:
        return mock.patch.object(os, "makedirs", _read_only(save_dir))
    return contextlib.nullcontext()


def main(argv=None) -> int:
    fault, save_dir = argv if argv is not None else sys.argv[1:]
    assert fault in FAULTS, fault
    rank, world = init_distributed()
    torch.set_num_threads(1)
    state = initialize_model_parallel(ep=world) if dist.is_initialized() else ParallelState.single_process()
    try:
        model = GPTMoEModel(tiny_config("alltoall", num_layers=2), state)
        initialize_parameters(model, seed=0)
        world_group = dist.group.WORLD if dist.is_initialized() else None
        trainer = Trainer(model, state, TrainConfig(), world_group=world_group)
        tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
        for step in (1, 2, 3):
            if step == 2 and fault == "kill" and rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            trainer.train_step([(tokens[:, :-1], tokens[:, 1:])])
            path = checkpoint_path(save_dir, step)
            with _save_fault(fault if step == 2 else None, rank, world, save_dir):
                save_training_checkpoint(path, trainer, sampler_state={"step": step}, world_group=world_group)
            note_newest_checkpoint(path)
    finally:
        destroy_model_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, prog="torchrun_faults.py"))
