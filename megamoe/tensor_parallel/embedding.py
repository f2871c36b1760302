"""Vocab-parallel embedding: the vocabulary is split into contiguous ranges over the TP group.

Rank r holds rows ``r*V/tp : (r+1)*V/tp`` of the [V, H] table. Each rank looks up the ids in its
range (zeros elsewhere) and the partial embeddings are summed: all-reduce, or reduce-scatter along
the sequence dim under sequence parallelism (``sequence_dim``: 0, or 1 for [B, S] ids), each rank
keeping its chunk of the sequence. Weight gradients are complete locally (the reduce-scatter's
backward all-gathers the output gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.sharding import ShardSpec, set_shard_spec
from megamoe.tensor_parallel.init import InitMethod, init_sharded_, normal_init

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """Embedding table [num_embeddings, embedding_dim] split along the vocabulary over ``tp_group``.

    ``num_embeddings`` must be divisible by the TP size: pad the vocabulary (as Megatron's
    ``make_vocab_size_divisible_by`` does) when it is not.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, sequence_dim: int = 0, init_method: InitMethod | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.sequence_dim = sequence_dim
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = comms.group_size(tp_group), comms.group_rank(tp_group)
        if num_embeddings % self.tp_size:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings ({num_embeddings}) must be divisible by the "
                f"tensor-parallel size ({self.tp_size}); pad the vocabulary to a multiple of it")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_rank = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.sequence_parallel = sequence_parallel
        self.init_method = init_method or normal_init()
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device, dtype=dtype))
        set_shard_spec(self.weight, ShardSpec((num_embeddings, embedding_dim), 0, self.tp_rank, self.tp_size))
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_sharded_(self.weight, self.init_method, generator)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            out = F.embedding(input_ids, self.weight)
        else:
            outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
            local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comms.reduce_scatter_to_sequence_parallel_region(out, self.tp_group, dim=self.sequence_dim)
        return comms.reduce_from_tensor_parallel_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
                f"rows [{self.vocab_start}, {self.vocab_end}), sequence_parallel={self.sequence_parallel}")
