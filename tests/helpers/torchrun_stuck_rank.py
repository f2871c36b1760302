"""Launched by tests/multirank/test_demo.py under torchrun: rank 1 stops itself (SIGSTOP) inside a training step
while rank 0 goes on into the step's collectives. With ``--comm-timeout`` the job must end with one
``error:`` line naming the collective and rank 1, instead of hanging."""

import argparse
import os
import signal
import sys

import torch

# torchrun runs this file as a script: the repo root is put on the path for tests.helpers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.helpers.tiny_model import tiny_config  # noqa: E402

import torch.distributed as dist  # noqa: E402

from megamoe.cli.launch import add_launch_arguments, init_distributed, run_script  # noqa: E402
from megamoe.models import GPTMoEModel  # noqa: E402
from megamoe.tensor_parallel import initialize_parameters  # noqa: E402
from megamoe.training.trainer import TrainConfig, Trainer  # noqa: E402
from parallel_state import initialize_model_parallel  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    rank, _ = init_distributed(comm_timeout_s=args.comm_timeout)
    with open(f"rank{rank}.pid", "w") as f:      # in the job's working directory: the test ends the stopped rank
        f.write(str(os.getpid()))
    torch.set_num_threads(1)
    state = initialize_model_parallel(ep=2)
    model = GPTMoEModel(tiny_config("alltoall"), state)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(), world_group=dist.group.WORLD)
    if rank == 1:
        experts = model.layers["2"].mlp.experts
        original_forward = experts.forward

        def stopping_forward(*a, **kw):
            os.kill(os.getpid(), signal.SIGSTOP)      # nothing in this process runs past here
            return original_forward(*a, **kw)
        experts.forward = stopping_forward
    tokens = torch.randint(0, 64, (2, 13))
    trainer.train_step([(tokens[:, :-1], tokens[:, 1:])])
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, prog="torchrun_stuck_rank.py"))
