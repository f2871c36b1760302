"""Train the tiny model of test_training with a checkpoint after every step; the helpers the checkpoint
tests share, and a script they run in subprocesses (to kill it).

    python tests/helpers/checkpointed_training.py --dir D --until-step N [--die-during-save-at K]

resumes from the latest checkpoint in D (if any), prints ``{"resumed_from": step}``, then one JSON line
``{"step": s, "loss": l}`` per step after that step's checkpoint is complete. With
``--die-during-save-at K`` the process exits with code DIED_IN_SAVE while writing the manifest of
step K's checkpoint (after its tensor files were written), leaving a half-written temporary directory.
"""

import argparse
import json
import os
import sys

import torch

from megamoe.data.resumable_sampler import ResumableSampler
from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.checkpoint import (checkpoint_path, latest_checkpoint, load_training_checkpoint,
                                         save_training_checkpoint)
from megamoe.training.trainer import TrainConfig, Trainer
if __name__ == "__main__":      # run as a script: the repo root holds the tests package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.helpers.tiny_model import GLOBAL_BATCH, MICRO_BATCH, S, V, tiny_config  # noqa: E402

NUM_SAMPLES = 32        # four global batches per epoch: longer runs cross epochs
DIED_IN_SAVE = 17


def dataset() -> torch.Tensor:
    """[NUM_SAMPLES, S + 1] token ids, the same in every process."""
    return torch.randint(0, V, (NUM_SAMPLES, S + 1), generator=torch.Generator().manual_seed(1234))


def build_trainer(state, dispatcher="alltoall", num_slots=None, world_group=None, placements=None,
                  config: TrainConfig | None = None) -> Trainer:
    model = GPTMoEModel(tiny_config(dispatcher, num_slots), state, placements=placements)
    initialize_parameters(model, seed=0)
    return Trainer(model, state, config or TrainConfig(lr=1e-2), world_group=world_group)


def build_sampler(state) -> ResumableSampler:
    return ResumableSampler(NUM_SAMPLES, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                            dp_rank=state.dp_cp.rank, dp_size=state.dp_cp.size, seed=0)


def train_steps(trainer, sampler, data, num_steps) -> list[float]:
    """The global loss of each of the next ``num_steps`` steps."""
    losses = []
    for _ in range(num_steps):
        micro_batches = [(data[i][:, :-1], data[i][:, 1:]) for i in sampler.next_micro_batches()]
        losses.append(trainer.train_step(micro_batches).loss)
    return losses


def _die_while_writing_the_manifest():
    import megamoe.checkpoint.save as checkpoint_save

    def write_half_and_die(tmp_dir, manifest):
        text = json.dumps(manifest)
        with open(os.path.join(tmp_dir, checkpoint_save.MANIFEST_FILE), "w") as f:
            f.write(text[:len(text) // 2])
        os._exit(DIED_IN_SAVE)

    checkpoint_save._write_manifest = write_half_and_die


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--until-step", type=int, required=True)
    parser.add_argument("--die-during-save-at", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the tests compare against an in-process run with one thread, bitwise

    from parallel_state import ParallelState
    state = ParallelState.single_process()
    trainer, sampler, data = build_trainer(state), build_sampler(state), dataset()
    latest = latest_checkpoint(args.dir)
    if latest is not None:
        sampler.load_state_dict(load_training_checkpoint(latest, trainer, world_group=None)["sampler_state"])
    print(json.dumps({"resumed_from": trainer.step}), flush=True)
    while trainer.step < args.until_step:
        (loss,) = train_steps(trainer, sampler, data, 1)
        if trainer.step == args.die_during_save_at:
            _die_while_writing_the_manifest()
        save_training_checkpoint(checkpoint_path(args.dir, trainer.step), trainer,
                                 sampler_state=sampler.state_dict(), world_group=None)
        print(json.dumps({"step": trainer.step, "loss": loss}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
