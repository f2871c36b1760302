"""Your own parallel layer inside the shipped model: a gated column-parallel MLP in GPTMoEModel,
trained at TP 2, checkpointed, and reloaded at TP 1 with the same loss.

    torchrun --nproc-per-node 2 examples/custom_layers.py [--dir DIR] [--steps N]
    python examples/custom_layers.py [--dir DIR] [--steps N]        # one process: TP 1 throughout

The part between the ``README`` markers is docs/design.md's "Subclassing a layer in your own model"
(tests/unit/test_readme.py checks that they are the same code). ``GatedColumnParallelLinear`` adds a
parameter of its own, a gate on each rank's output features: :func:`megamoe.sharding.shard_parameter`
declares it a TP shard, so checkpoints store the whole gate and reload it under any TP size (without
the declaration the gate is taken as replicated, and the TP 2 save refuses the ranks' differing
copies). ``LayerSpec(mlp=GatedMLP)`` makes GPTMoEModel build its dense layers with it.

Prints the evaluation loss after training (at the training TP) and after reloading at TP 1; exits
with ``error:`` and code 1 if they differ.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

# README: begin
import torch
import torch.nn.functional as F
from torch import nn

from megamoe.models import GPTMoEModel, LayerSpec
from megamoe.sharding import shard_parameter
from megamoe.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megamoe.transformer import MLPConfig


class GatedColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel layer with a learned per-feature gate on its local output shard."""
    def __init__(self, in_features, out_features, *, tp_group=None, device=None, dtype=None, **kwargs):
        super().__init__(in_features, out_features, tp_group=tp_group, device=device, dtype=dtype, **kwargs)
        # This rank's chunk of the [out_features] gate, declared so: checkpoints hold the whole gate.
        gate = torch.ones(self.out_features_per_rank, device=device, dtype=dtype)
        self.gate = shard_parameter(nn.Parameter(gate), dim=0, group=tp_group)

    def forward(self, x):
        return super().forward(x) * self.gate


class GatedMLP(nn.Module):
    """A dense MLP for GPTMoEModel: ``LayerSpec(mlp=GatedMLP)`` builds it as ``GatedMLP(config.dense_mlp,
    tp_group=..., device=..., dtype=...)``."""
    def __init__(self, config: MLPConfig, *, tp_group=None, device=None, dtype=None):
        super().__init__()
        hidden, ffn = config.hidden_size, config.intermediate_size
        self.up = GatedColumnParallelLinear(hidden, ffn, tp_group=tp_group, device=device, dtype=dtype)
        self.down = RowParallelLinear(ffn, hidden, tp_group=tp_group, device=device, dtype=dtype)  # one all-reduce

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))

# model = GPTMoEModel(config, state, layer_spec=LayerSpec(mlp=GatedMLP))
# README: end

import torch.distributed as dist  # noqa: E402  (after the README part, which must stand alone)

from megamoe.cli.launch import HelpFormatter, init_distributed, run_script  # noqa: E402
from megamoe.errors import UsageError  # noqa: E402
from megamoe.models import GPTMoEConfig  # noqa: E402
from megamoe.moe.moe_layer import MoEConfig  # noqa: E402
from megamoe.moe.router import RouterConfig  # noqa: E402
from megamoe.tensor_parallel import initialize_parameters  # noqa: E402
from megamoe.training.checkpoint import load_training_checkpoint, save_training_checkpoint  # noqa: E402
from megamoe.training.trainer import StepMetrics, TrainConfig, Trainer  # noqa: E402
from megamoe.transformer import AttentionConfig, RopeConfig  # noqa: E402
from parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel  # noqa: E402

logger = logging.getLogger("custom_layers")

HIDDEN, VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCH = 32, 64, 16, 8, 4
MAX_TP = 2               # the 2 key-value heads split over at most 2 ranks
REL_TOL = 1e-5           # TP 1 and TP 2 sum in different orders (fp32)


def model_config() -> GPTMoEConfig:
    """Two layers: layer 0 dense (the GatedMLP), layer 1 MoE (4 experts, top 2)."""
    return GPTMoEConfig(
        family="custom", vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2,
        attention=AttentionConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8)),
        moe=MoEConfig(router=RouterConfig(hidden_size=HIDDEN, num_experts=4, top_k=2, aux_loss_coeff=0.01),
                      ffn_hidden_size=32, dispatcher="allgather", expert_backend="torch"),
        moe_layer_ids=(1,), dense_mlp=MLPConfig(hidden_size=HIDDEN, intermediate_size=64))


def build_trainer(state, world_group) -> Trainer:
    model = GPTMoEModel(model_config(), state, layer_spec=LayerSpec(mlp=GatedMLP))
    initialize_parameters(model, seed=0)
    return Trainer(model, state, TrainConfig(lr=1e-2), world_group=world_group)


def token_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [GLOBAL_BATCH, SEQ], next-token labels): the same on every rank."""
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def train(trainer: Trainer, steps: int) -> list[StepMetrics]:
    """``steps`` steps on one fixed batch (the loss falls visibly), this DP rank's share of it."""
    state = trainer.state
    inputs, labels = token_batch(seed=1)
    per_rank = GLOBAL_BATCH // state.dp_cp.size
    mine = slice(state.dp_cp.rank * per_rank, (state.dp_cp.rank + 1) * per_rank)
    micro_batches = list(zip(inputs[mine].split(MICRO_BATCH), labels[mine].split(MICRO_BATCH)))
    return [trainer.train_step(micro_batches) for _ in range(steps)]


@torch.no_grad()
def evaluation_loss(model: GPTMoEModel) -> float:
    """The mean token loss of a held-out batch (the whole batch on every rank: no DP reduction)."""
    inputs, labels = token_batch(seed=2)
    model.eval()
    loss, _ = model(inputs, labels=labels)
    model.train()
    return float(loss)


def train_and_save(state, world_group, directory: str | Path, steps: int) -> tuple[list[StepMetrics], float]:
    """Train ``steps`` steps under ``state``, save a training checkpoint in ``directory``; returns each
    step's metrics and the evaluation loss of the trained model."""
    trainer = build_trainer(state, world_group)
    metrics = train(trainer, steps)
    save_training_checkpoint(directory, trainer, sampler_state=None, world_group=world_group)
    return metrics, evaluation_loss(trainer.model)


def reload_and_evaluate(state, world_group, directory: str | Path) -> float:
    """The evaluation loss of the checkpoint in ``directory`` loaded under ``state``."""
    trainer = build_trainer(state, world_group)
    load_training_checkpoint(directory, trainer, world_group=world_group)
    return evaluation_loss(trainer.model)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("runs/custom_layers/checkpoint"),
                        help="where the checkpoint is written (replaced if it exists)")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    rank, world = init_distributed()
    if world > MAX_TP:
        raise UsageError(f"this model splits over at most {MAX_TP} TP ranks; run with --nproc-per-node 1 or 2, "
                         f"not {world}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(name)s: %(message)s")
    torch.set_num_threads(1)
    group = dist.group.WORLD if world > 1 else None

    state = initialize_model_parallel(tp=world) if world > 1 else ParallelState.single_process()
    metrics, trained = train_and_save(state, group, args.dir, args.steps)
    if world > 1:
        destroy_model_parallel()
        state = initialize_model_parallel(tp=1)          # the same ranks as TP 1 x DP 2
    reloaded = reload_and_evaluate(state, group, args.dir)
    if world > 1:
        destroy_model_parallel()
    if rank == 0:
        print(f"training loss {metrics[0].loss:.4f} -> {metrics[-1].loss:.4f}; evaluation loss at TP {world}: "
              f"{trained:.6f}, reloaded at TP 1: {reloaded:.6f}", flush=True)
    if abs(reloaded - trained) > REL_TOL * abs(trained):
        raise ValueError(f"the checkpoint reloaded at TP 1 gives the evaluation loss {reloaded}, not {trained}")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, prog="custom_layers.py"))
