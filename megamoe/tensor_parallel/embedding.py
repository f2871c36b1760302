"""Vocab-parallel embedding: the vocabulary is split into contiguous ranges over the TP group.

Rank r holds rows ``r*Vp/tp : (r+1)*Vp/tp`` of the [V, H] table padded to ``Vp`` rows (a multiple of
tp; rows >= V are zero padding, outside the logical table: :mod:`megamoe.tensor_parallel.vocab_padding`).
Each rank looks up the ids in its range (zeros elsewhere) and the partial embeddings are summed:
all-reduce, or reduce-scatter along
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
from megamoe.tensor_parallel.vocab_padding import padded_vocab_size

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """Embedding table [num_embeddings, embedding_dim] split along the vocabulary over ``tp_group``.

    Any ``num_embeddings``: the table is padded to ``padded_num_embeddings`` rows (default: the next
    multiple of the TP size, :func:`~megamoe.tensor_parallel.vocab_padding.padded_vocab_size`); the
    padding rows are zero, never looked up by a valid id, and not part of the logical weight.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, sequence_dim: int = 0, init_method: InitMethod | None = None,
                 padded_num_embeddings: int | None = None, device=None, dtype=None):
        super().__init__()
        self.sequence_dim = sequence_dim
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = comms.group_size(tp_group), comms.group_rank(tp_group)
        if padded_num_embeddings is None:
            padded_num_embeddings = padded_vocab_size(num_embeddings, self.tp_size)
        if padded_num_embeddings < num_embeddings or padded_num_embeddings % self.tp_size:
            raise ValueError(f"VocabParallelEmbedding: padded_num_embeddings ({padded_num_embeddings}) must be >= "
                             f"num_embeddings ({num_embeddings}) and a multiple of the tensor-parallel size "
                             f"({self.tp_size})")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = padded_num_embeddings
        self.num_embeddings_per_rank = padded_num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.sequence_parallel = sequence_parallel
        self.init_method = init_method or normal_init()
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim, device=device, dtype=dtype))
        padded = padded_num_embeddings if padded_num_embeddings != num_embeddings else None
        set_shard_spec(self.weight, ShardSpec((num_embeddings, embedding_dim), 0, self.tp_rank, self.tp_size,
                                              padded_size=padded))
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
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}), {self.embedding_dim}, "
                f"tp={self.tp_size}, "
                f"rows [{self.vocab_start}, {self.vocab_end}), sequence_parallel={self.sequence_parallel}")
