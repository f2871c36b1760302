"""Launched by tests/test_demo.py under torchrun: rank 1 fails inside a training step while rank 0
is inside the same step's collectives. The job must end promptly with rank 1's error."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from test_training import tiny_config  # noqa: E402

from megamoe.models import GPTMoEModel  # noqa: E402
from megamoe.tensor_parallel import initialize_parameters  # noqa: E402
from megamoe.training.trainer import TrainConfig, Trainer  # noqa: E402
from parallel_state import initialize_model_parallel  # noqa: E402


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    state = initialize_model_parallel(ep=2)
    model = GPTMoEModel(tiny_config("alltoall"), state)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(), world_group=dist.group.WORLD)
    if dist.get_rank() == 1:
        def broken_forward(*args, **kwargs):
            raise RuntimeError("injected failure on rank 1")
        model.layers["2"].mlp.experts.forward = broken_forward
    tokens = torch.randint(0, 64, (2, 13))
    trainer.train_step([(tokens[:, :-1], tokens[:, 1:])])


if __name__ == "__main__":
    main()
