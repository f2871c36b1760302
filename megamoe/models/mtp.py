"""DeepSeek-V3's multi-token prediction (MTP): modules after the decoder layers that predict further tokens.

The module of depth k (``k = 1 .. config.mtp_num_layers``, layer id ``L + k - 1`` with L = num_layers, as
DeepSeek-V3's checkpoints number it: ``model.layers.{L}`` for depth 1) at position i combines the hidden
state of the previous depth with the embedding of token ``t[i + k]`` and predicts ``t[i + k + 1]``::

    h^0     = the main model's last hidden state after its final norm (what the output layer reads)
    x^k     = eh_proj(cat(enorm(embed(t[i + k])), hnorm(h^{k-1})))     # eh_proj: [H, 2H], no bias
    h^k     = shared_head.norm(decoder_layer_{L+k-1}(x^k))             # MLA + MoE, or dense by the family rule
    logits^k = output_layer(h^k)

(DeepSeek-V3 paper, section 2.2.) h^0 is the final norm's output, as Megatron-Core (the decoder block's
final layernorm runs before its MTP block), vLLM (the target model's output hidden states) and transformers
5.24's MTP drafting (the last of ``output_hidden_states``) take it; the next depth takes the normed ``h^k``,
as Megatron-Core's ``MultiTokenPredictionBlock`` and transformers' ``MtpModel`` do (for one depth, every
DeepSeek release, that choice does not arise). vLLM and SGLang also zero the embedding at position 0 for
DeepSeek's releases; Megatron-Core and transformers do not, nor does this module (it changes drafts, never
the verified output of :mod:`megamoe.inference.mtp_draft`). The decoder layer is an ordinary
:class:`~megamoe.models.decoder_layer.DecoderLayer` (same module names, so the checkpoint, expert-slot, EPLB and
placement machinery keyed by layer id applies), at RoPE position i: only relative positions enter
attention, so this equals the other conventions (transformers' drafting at i + 1) up to rounding.

Embedding and output head: SHARED with the main model, as the paper specifies (both are shared for
training, section 2.2), Megatron-Core trains them and DeepSeek's and vLLM's inference run them. A separate
copy would add vocab x hidden x 2 parameters per depth (1.85 B for DeepSeek-V3) and drift from the main
ones when trained. DeepSeek's HF releases store copies (``model.layers.{L}.embed_tokens.weight``,
``.shared_head.head.weight``) equal to the main tensors: the importer checks that they are bit-identical
(AdapterError naming both keys otherwise) and the exporter writes them back from the main tensors, so the
round trip stays bit-exact. The last pipeline stage therefore holds a copy of the input embedding (as with
tied embeddings), kept identical by summing its gradient over the embedding group.

Training loss (Megatron-Core's, ``--mtp-loss-coeff``): with ``labels`` [B, S] (``labels[i]`` the target of
position i, i.e. ``t[i + 1]``, -100 ignored) depth k's target at position i is ``labels[i + k]``. A position
counts for depth k iff ``i + k < S``, ``labels[i + k] != -100`` and, with packed documents, ``t[i + k]``
lies in position i's document (``document_ids[i + k] == document_ids[i]``); the embedded token of a position
without one is id 0 (its output is never used: causal attention keeps it from earlier positions). Then::

    mtp_loss_k = sum of depth k's token cross entropies over its counted positions / their number
    loss       = main loss + mtp_loss_coeff * mean over k of mtp_loss_k

per micro-batch (the main loss is the micro-batch's mean token loss too). Under context parallelism each
rank sums its own positions and divides by the whole micro-batch's count, times cp, like the main loss.
The MTP term joins the loss in training mode (``model.train()``) only: an evaluation forward returns the
language-model loss alone. Its MoE layers' aux losses join ``aux_loss`` like any layer's.
"""

from __future__ import annotations

import torch
from torch import nn

from megamoe.models.config import GPTMoEConfig
from megamoe.models.decoder_layer import DecoderLayer
from megamoe.models.sequence_parallel import sequence_parallel_group
from megamoe.tensor_parallel import ColumnParallelLinear
from megamoe.tensor_parallel.init import normal_init
from megamoe.transformer import RMSNorm

__all__ = ["MTPLayer", "SharedHead", "shift_left", "mtp_targets"]

IGNORE_INDEX = -100


class SharedHead(nn.Module):
    """The norm before the (shared) output layer: HF's ``shared_head.norm``; ``shared_head.head`` is the main
    output layer (see the module docstring)."""

    def __init__(self, hidden_size: int, eps: float, **factory):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, **factory)


class MTPLayer(DecoderLayer):
    """One MTP depth: a :class:`DecoderLayer` (its attention, norms and MLP under the usual names) plus
    ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H] (replicated over TP: every rank holds the whole hidden state
    after attention's all-reduce) and ``shared_head.norm``."""

    def __init__(self, config: GPTMoEConfig, layer_id: int, state, *, device=None, dtype=None, **kwargs):
        super().__init__(config, layer_id, state, device=device, dtype=dtype, **kwargs)
        factory = {"device": device, "dtype": dtype}
        H = config.hidden_size
        self.enorm = RMSNorm(H, config.norm_eps, **factory)
        self.hnorm = RMSNorm(H, config.norm_eps, **factory)
        self.eh_proj = ColumnParallelLinear(2 * H, H, tp_group=None, bias=False,
                                            init_method=normal_init(config.init_std), **factory)
        self.shared_head = SharedHead(H, config.norm_eps, **factory)
        # Under sequence parallelism these see this rank's sequence chunk only: gradients summed over TP.
        if sequence_parallel_group(config, state) is not None:
            for module in (self.enorm, self.hnorm, self.eh_proj, self.shared_head):
                for param in module.parameters():
                    param.sequence_parallel = True

    def forward_mtp(self, embeds: torch.Tensor, previous: torch.Tensor, position_ids: torch.Tensor, *args,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h^k [B, S, H] normed by shared_head.norm, aux_loss [])`` from ``embeds`` = embed(t[i + k]) and
        ``previous`` = h^{k-1}; the other arguments are :meth:`DecoderLayer.forward`'s."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        x, aux_loss = super().forward(x, position_ids, *args, **kwargs)
        return self.shared_head.norm(x), aux_loss


def shift_left(tensor: torch.Tensor, k: int, fill) -> torch.Tensor:
    """``out[:, i] = tensor[:, i + k]``, ``fill`` for the last k positions (on the tensor's device)."""
    if k == 0:
        return tensor
    tail = torch.full_like(tensor[:, :k], fill)
    return torch.cat([tensor[:, k:], tail], dim=1)


def mtp_targets(labels: torch.Tensor, k: int, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Depth k's targets [B, S]: ``labels[:, i + k]``, -100 where position i has none (see the module
    docstring: past the end, ignored labels, another document's token)."""
    targets = shift_left(labels, k, IGNORE_INDEX)
    if document_ids is not None:
        same_document = shift_left(document_ids, k, -1) == document_ids
        targets = targets.masked_fill(~same_document, IGNORE_INDEX)
    return targets
