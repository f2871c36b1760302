"""A no-grad forward pass of a pipelined, tensor-parallel model that returns the FULL logits on every
rank of the pipeline group: the simplest building block for evaluation and uncached generation."""

from __future__ import annotations

import torch

from megamoe import comms
from megamoe.models.gpt_moe import GPTMoEModel

__all__ = ["pipeline_logits", "greedy_generate_uncached"]


@torch.no_grad()
def pipeline_logits(model: GPTMoEModel, state, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [B, S] (identical on every rank of the pipeline and TP groups) -> logits [B, S, V] fp32.

    Stages run in turn: each receives the previous stage's hidden states, the last stage gathers the
    vocab shards over TP, and the logits are broadcast back over the pipeline group.
    """
    batch, seq = input_ids.shape
    hidden_size = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    pp = state.pp
    if model.is_first_stage:
        inputs = input_ids
    else:
        inputs = comms.recv(torch.empty(batch, seq, hidden_size, dtype=dtype), state.pp_prev_rank, pp.group)
    output, _ = model(inputs)
    if not model.is_last_stage:
        comms.send(output, state.pp_next_rank, pp.group)
        logits = torch.empty(batch, seq, model.config.vocab_size, dtype=torch.float32)
    else:
        logits = comms.gather_from_tensor_parallel_region(output, state.tp.group).float()
    return comms.broadcast_(logits, pp.ranks[-1], pp.group)


@torch.no_grad()
def greedy_generate_uncached(model: GPTMoEModel, state, prompt_ids: list[int], max_new_tokens: int,
                             stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation by re-running the whole sequence each step (no KV cache). Every rank of
    the model must call it with the same prompt; returns the new token ids on every rank."""
    ids = list(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = pipeline_logits(model, state, torch.tensor([ids]))
        token = int(logits[0, -1].argmax())
        ids.append(token)
        new.append(token)
        if token in stop_ids:
            break
    return new
