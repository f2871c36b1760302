"""A no-grad forward pass of a pipelined, tensor-parallel model that returns the FULL logits on every
rank of the pipeline group: the simplest building block for evaluation (generation with a KV cache is
:func:`megamoe.inference.generate`)."""

from __future__ import annotations

import torch

from megamoe import comms
from megamoe.models.gpt_moe import GPTMoEModel
from megamoe.pipeline.stage_dtype import stage_hidden_dtype
from megamoe.tensor_parallel.vocab_padding import gather_vocab_parallel_logits

__all__ = ["pipeline_logits"]


@torch.no_grad()
def pipeline_logits(model: GPTMoEModel, state, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                    document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids [B, S] (identical on every rank of the pipeline and TP groups) -> logits [B, S, V] fp32.

    Stages run in turn: each receives the previous stage's hidden states, the last stage gathers the
    vocab shards over TP (the padding of a padded vocabulary stripped: V columns), and the logits are
    broadcast back over the pipeline group. ``position_ids``
    / ``document_ids`` [B, S] (packed documents, :mod:`megamoe.data.packing`) go to every stage.
    """
    batch, seq = input_ids.shape
    hidden_size = model.config.hidden_size
    dtype, device = stage_hidden_dtype(model), next(model.parameters()).device
    pp = state.pp
    # With virtual pipeline stages the hidden states go around the ring once per model chunk (the last
    # rank's chunk c feeds the first rank's chunk c + 1), one send and its receive per hop, each posted as a
    # batch (comms.batch_send_recv): on NCCL it runs on the pipeline group's communicator, where a single
    # send / recv would create a two-rank communicator per neighbour pair.
    prev_rank, next_rank = pp.ranks[(pp.rank - 1) % pp.size], pp.ranks[(pp.rank + 1) % pp.size]
    logits = None
    for chunk in range(getattr(model, "virtual_pipeline_stages", 1)):
        if model.chunk_is_first(chunk):
            inputs = input_ids
        else:
            buffer = torch.empty(batch, seq, hidden_size, dtype=dtype, device=device)
            inputs, = comms.batch_send_recv([], [(buffer, prev_rank)], pp.group)
        output, _ = model(inputs, position_ids, document_ids=document_ids, chunk=chunk)
        if model.chunk_is_last(chunk):
            logits = gather_vocab_parallel_logits(output, state.tp.group, model.config.vocab_size).float()
        else:
            comms.batch_send_recv([(output, next_rank)], [], pp.group)
    if logits is None:
        logits = torch.empty(batch, seq, model.config.vocab_size, dtype=torch.float32, device=device)
    return comms.broadcast_(logits, pp.ranks[-1], pp.group)
