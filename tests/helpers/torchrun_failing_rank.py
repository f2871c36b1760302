"""Launched by tests/multirank/test_demo.py under torchrun: rank 0 fails alone (its metrics log is on a full disk,
/dev/full) while rank 1 goes on into a training step's collectives. The job must end promptly with rank 0's
error naming the file as the last line, and rank 1 must print no gloo traceback."""

import os
import sys

import torch
import torch.distributed as dist

# torchrun runs this file as a script: the repo root is put on the path for tests.helpers.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.helpers.tiny_model import tiny_config  # noqa: E402

from megamoe.cli.launch import init_distributed, run_script  # noqa: E402
from megamoe.models import GPTMoEModel  # noqa: E402
from megamoe.tensor_parallel import initialize_parameters  # noqa: E402
from megamoe.training.metric_sinks import build_metric_sinks  # noqa: E402
from megamoe.training.trainer import TrainConfig, Trainer  # noqa: E402
from parallel_state import initialize_model_parallel  # noqa: E402


def main(argv=None) -> int:
    rank, _ = init_distributed()
    torch.set_num_threads(1)
    state = initialize_model_parallel(ep=2)
    model = GPTMoEModel(tiny_config("alltoall"), state)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(), world_group=dist.group.WORLD)
    tokens = torch.randint(0, 64, (2, 13))
    with build_metric_sinks(rank=rank, jsonl_path="/dev/full") as sinks:     # only rank 0 writes the log
        sinks.start_run({"run_id": "x"})
        trainer.train_step([(tokens[:, :-1], tokens[:, 1:])])
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, prog="torchrun_failing_rank.py"))
