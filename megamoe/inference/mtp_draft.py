"""Greedy generation with the model's own MTP layers as the draft (self-speculative decoding).

Each round the MTP layers (:mod:`megamoe.models.mtp`) propose one token per depth, the main model verifies
all of them in ONE forward (its KV cache grows by the proposal), and the longest prefix of the proposal
that equals the main model's own greedy choices is kept, plus the main model's token after it. So a round
adds 1 to ``1 + mtp_num_layers`` tokens, and the output is token for token plain greedy decoding's: every
kept token is the main model's argmax given the tokens before it (the drafts only decide how many of those
one forward checks).

State between rounds, with ``n`` committed tokens ``x[0..n-1]`` and the main model's next token ``x[n]``:

- the main model's KV cache and its final norm's outputs ``h^0`` of positions ``0 .. n-1``;
- for MTP depth k, its KV cache and outputs ``h^k`` of the positions whose inputs are all committed:
  position i of depth k embeds ``x[i + k]`` and reads ``h^{k-1}_i``, so positions ``0 .. n-k`` (``0 .. n-1``
  for depth 1). Drafting runs each depth over its positions not yet cached up to ``n - 1`` (the last ones
  embed drafted tokens), keeps the committed ones and rolls the cache back over the others.

A rejected proposal rolls the main cache back to the kept tokens (:class:`StaticKVCache` appends at its
``length``; what lies beyond is overwritten). One sequence, pipeline size 1 (the MTP layers sit with the
main model's last layers); every rank of the TP / EP groups must generate the same prompt (they run each
forward together). Not compiled; the plain loop is :func:`megamoe.inference.generation.generate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megamoe.inference.generation import GenerationConfig, check_generation_request
from megamoe.inference.kv_cache import StaticKVCache
from megamoe.models.gpt_moe import GPTMoEModel
from megamoe.tensor_parallel.vocab_padding import gather_vocab_parallel_logits

__all__ = ["MTPDraftOutput", "generate_with_mtp_draft"]


@dataclass
class MTPDraftOutput:
    token_ids: list[int]          # the new tokens (a stop token included), as plain greedy decoding gives them
    finish_reason: str            # "stop" or "length"
    main_forwards: int            # forwards of the main model, the prefill included
    drafted: int                  # tokens the MTP layers proposed
    accepted: int                 # of those, kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def _argmax(model: GPTMoEModel, hidden: torch.Tensor, norm: bool = True) -> torch.Tensor:
    """The greedy tokens [S] of hidden states [1, S, H] (the vocab shards gathered over TP, padding stripped)."""
    local = model.logits(hidden[0], norm=norm)
    return gather_vocab_parallel_logits(local, model.state.tp.group, model.config.vocab_size).argmax(dim=-1)


@torch.no_grad()
def generate_with_mtp_draft(model: GPTMoEModel, prompt: Sequence[int], max_new_tokens: int,
                            stop_token_ids: Sequence[int] = ()) -> MTPDraftOutput:
    """Greedy continuation of ``prompt`` (token ids) by ``model``, drafted by its MTP layers; see the
    module docstring. ValueError for a model without MTP layers, a pipeline, or a request
    :func:`~megamoe.inference.generation.generate` refuses (a bad prompt or stop token, a prompt with its
    new tokens past the model's positions)."""
    config = model.config
    if not model.mtp_layer_ids:
        raise ValueError("generate_with_mtp_draft needs a model with MTP layers (config.mtp_num_layers > 0)")
    if model.state.pp.size != 1 or getattr(model, "virtual_pipeline_stages", 1) != 1:
        raise ValueError("generate_with_mtp_draft runs one pipeline stage (pp = 1): the MTP draft needs the main "
                         "model's hidden states and the verification its logits on one rank")
    # generate()'s checks: tokens and stop tokens in the vocabulary, prompt + new tokens within the positions.
    request = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids))
    prompt = check_generation_request(config, [prompt], request)[0]
    model = model.without_sequence_parallel()
    depths = len(model.mtp_layer_ids)
    device = next(model.parameters()).device
    stops = {int(t) for t in stop_token_ids}
    capacity = len(prompt) + max_new_tokens + depths + 1
    main_caches = {i: StaticKVCache(capacity) for i in model.layer_ids}
    mtp_caches = {i: StaticKVCache(capacity) for i in model.mtp_layer_ids}

    def main_forward(tokens: list[int], start: int) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.int64, device=device)
        positions = torch.arange(start, start + len(tokens), device=device)[None]
        hidden, _ = model.run_layers(ids, positions, main_caches)
        return hidden

    hidden = main_forward(prompt, 0)
    outputs = [model.norm(hidden)]           # h^0 .. h^D of the committed positions, [1, count, H] each
    outputs += [hidden[:, :0]] * depths
    tokens = prompt + [int(_argmax(model, hidden[:, -1:])[0])]
    main_forwards, drafted, accepted = 1, 0, 0
    new = lambda: len(tokens) - len(prompt)                  # noqa: E731
    while new() < max_new_tokens and tokens[-1] not in stops:
        n = len(tokens) - 1                  # committed positions; tokens[n] is the main model's next token
        drafts: list[int] = []
        previous_speculative = outputs[0][:, :0]
        for k, layer_id in enumerate(model.mtp_layer_ids, start=1):
            start = outputs[k].shape[1]
            token_at = lambda j: tokens[j] if j <= n else drafts[j - n - 1]      # noqa: E731
            ids = torch.tensor([[token_at(i + k) for i in range(start, n)]], dtype=torch.int64, device=device)
            previous = torch.cat([outputs[k - 1][:, start:], previous_speculative], dim=1)
            positions = torch.arange(start, n, device=device)[None]
            cache = mtp_caches[layer_id]
            out, _ = model.layers[str(layer_id)].forward_mtp(model.embed_tokens(ids), previous, positions, cache,
                                                             None, None, model.rotary(positions))
            committed = max(n - k + 1, 0)               # positions whose inputs (x[i + k]) are all committed
            outputs[k] = torch.cat([outputs[k], out[:, :committed - start]], dim=1)
            previous_speculative = out[:, committed - start:]
            cache.length = committed
            drafts.append(int(_argmax(model, out[:, -1:], norm=False)[0]))
        drafted += depths
        # Verify: the main model on x[n] and the drafts, at positions n .. n + depths.
        hidden = main_forward([tokens[n]] + drafts, n)
        main_forwards += 1
        greedy = _argmax(model, hidden).tolist()
        keep = 0
        while keep < depths and drafts[keep] == greedy[keep] and drafts[keep] not in stops:
            keep += 1
        accepted += keep
        tokens += drafts[:keep] + [greedy[keep]]
        outputs[0] = torch.cat([outputs[0], model.norm(hidden[:, :keep + 1])], dim=1)
        for cache in main_caches.values():
            cache.length = n + keep + 1
    new_tokens = tokens[len(prompt):]
    for index, token in enumerate(new_tokens):
        if token in stops:
            return MTPDraftOutput(new_tokens[:index + 1], "stop", main_forwards, drafted, accepted)
    return MTPDraftOutput(new_tokens[:max_new_tokens], "length", main_forwards, drafted, accepted)
