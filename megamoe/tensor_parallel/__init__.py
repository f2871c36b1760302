"""Tensor-parallel building blocks: plain nn.Modules holding local shards, groups passed explicitly."""

from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.gradients import gradients
from megamoe.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megamoe.tensor_parallel.embedding import VocabParallelEmbedding
from megamoe.tensor_parallel.init import initialize_parameters, normal_init, seeded_generator
from megamoe.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "initialize_parameters", "normal_init", "seeded_generator", "allreduce_sequence_parallel_grads",
]


def allreduce_sequence_parallel_grads(module: nn.Module, tp_group: ProcessGroup | None) -> None:
    """Sum, over TP, the gradients of parameters tagged ``sequence_parallel`` (replicated over TP but
    fed only this rank's tokens). One all-reduce for all of them. Reads each parameter's accumulated gradient
    (:func:`megamoe.gradients.main_grad`: the fp32 ``main_grad`` of a bf16 parameter, else ``p.grad``)."""
    grads = gradients(p for p in module.parameters() if getattr(p, "sequence_parallel", False))
    comms.all_reduce_coalesced_(grads, tp_group)
