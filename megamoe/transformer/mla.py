"""DeepSeek Multi-head Latent Attention (DeepSeek-V2 / V3), heads split over a tensor-parallel group.

Per layer (HF names)::

    q  = q_proj(x)                                  if q_lora_rank is None (V2-Lite)
       = q_b_proj(q_a_layernorm(q_a_proj(x)))       otherwise
    kv_latent, k_pe = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])
    k_nope, v = split(kv_b_proj(kv_a_layernorm(kv_latent)), per head [qk_nope_head_dim, v_head_dim])
    q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe) shared by all heads]
    out = o_proj(softmax(q k^T * scale) v),  scale = qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2

RoPE touches only the ``qk_rope_head_dim`` part; DeepSeek pairs dims interleaved
(``RopeConfig.layout="interleaved"``; V3 with ``rope_interleave=False`` uses ``"half"``).

Tensor parallelism: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are column-parallel by heads,
``o_proj`` row-parallel. The low-rank down projections and their norms (``q_a_proj``,
``q_a_layernorm``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``) are replicated: every rank computes
them on the full input. Gradients: their outputs enter the TP region AFTER the norms, through one
``copy_to_tensor_parallel_region`` on ``[q_latent, kv_latent, k_pe]``. Each rank's backward only
reaches the latents through its own heads (partial gradients); that copy's backward all-reduce
sums them, so the latents' gradients, and from them the replicated weights' and the input's, are
complete and identical on every rank. No gradient sync over TP is needed afterwards. Cost: one
all-reduce of (q_lora_rank + kv_lora_rank + qk_rope_head_dim) per token instead of the hidden size.
Without ``q_lora_rank``, ``q_proj`` (a ColumnParallelLinear) all-reduces its own input gradient
and the kv latents get theirs: two all-reduces.

Sequence parallelism (``sequence_parallel=True``, under TP, training): the input is this rank's
chunk [B, S / tp, H] of the sequence dim. The replicated down projections and their norms run on
that chunk; ONE all-gather (dim 1) of ``[q_latent, kv_latent, k_pe]`` replaces the copy above (its
backward reduce-scatter sums the heads' partial latent gradients and keeps this rank's positions),
so the gathered bytes per token are the latent width, not the hidden size. The replicated weights
then see only this rank's tokens: they are tagged ``sequence_parallel`` (gradients summed over TP by
the gradient sync). Without ``q_lora_rank``, ``q_proj`` gathers the hidden chunk itself. ``o_proj``
reduce-scatters its output back to the chunk. No KV cache (see the attention module).

Context parallelism (``cp_group=``, :mod:`megamoe.transformer.context_parallel`): the input holds this
CP rank's S / cp tokens; the down projections, latent norms and RoPE run on them, then the latents
``[kv_latent, rotated k_pe]`` are all-gathered over CP (backward: reduce-scatter) and up-projected for
the whole sequence locally: (kv_lora_rank + qk_rope_head_dim) values per token cross the CP group
instead of heads x (qk_head_dim + v_head_dim). Queries attend with their whole-sequence positions;
``document_ids`` is the full [B, S]. No KV cache.

KV cache seam (as HF, on the compressed latents): ``kv_cache.update(kv_latent, k_pe)`` receives
[B, 1, S, kv_lora_rank] (after ``kv_a_layernorm``) and [B, 1, S, qk_rope_head_dim] (rotated) and
returns every cached position; queries are the last S positions. ``attention_mask`` [B, S_past + S]
hides padding keys, and ``document_ids`` [B, S] (packed documents, no KV cache) makes attention
document-causal, as in :func:`megamoe.transformer.attention.causal_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.quantization.kept_weights import linear_weight
from megamoe.sharding import ShardSpec, set_shard_spec
from megamoe.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megamoe.tensor_parallel.init import InitMethod, init_sharded_, normal_init, zeros_init
from megamoe.tensor_parallel.sequence import SEQUENCE_DIM, enter_tensor_parallel_region
from megamoe.transformer.attention import (KVCache, cache_packed_segments, cached_keys, causal_attention,
                                           check_no_cache_under_context_parallel, check_no_cache_with_documents,
                                           packed_attention)
from megamoe.transformer.context_parallel import gather_keys_for_context_parallel
from megamoe.transformer.norm import RMSNorm
from megamoe.transformer.recompute import checkpointed
from megamoe.transformer.rope import RopeConfig, RotaryEmbedding

__all__ = ["MLAConfig", "MultiHeadLatentAttention"]


@dataclass(frozen=True)
class MLAConfig:
    """One MLA layer. ``rope.dim`` must equal ``qk_rope_head_dim``."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int | None              # None: a direct q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    attention_bias: bool = False         # biases of q_a_proj, kv_a_proj_with_mqa and o_proj (HF)
    latent_norm_eps: float = 1e-6        # HF builds q_a_layernorm / kv_a_layernorm with eps 1e-6, not rms_norm_eps
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"MLAConfig.q_lora_rank must be >= 1 or None, got {self.q_lora_rank}")
        if self.rope.dim != self.qk_rope_head_dim:
            raise ValueError(f"MLAConfig.rope.dim ({self.rope.dim}) must equal qk_rope_head_dim "
                             f"({self.qk_rope_head_dim})")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_scale_factor()


class _ReplicatedLinear(nn.Module):
    """A linear layer every TP rank holds whole (ShardSpec: replicated)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, init_method: InitMethod,
                 device=None, dtype=None):
        super().__init__()
        self.init_method = init_method
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        set_shard_spec(self.weight, ShardSpec((out_features, in_features)))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            set_shard_spec(self.bias, ShardSpec((out_features,)))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_sharded_(self.weight, self.init_method, generator)
        if self.bias is not None:
            init_sharded_(self.bias, zeros_init, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, linear_weight(self, "weight", x.dtype), self.bias)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek MLA, heads split over ``tp_group`` (``None``: one rank); HF parameter names.

    Selective recomputation flags (set by the decoder layer from ``RecomputeConfig``, see
    :mod:`megamoe.transformer.recompute`): ``recompute_up_proj`` (``mla_up_proj``: the up projections
    ``q_b_proj`` / ``kv_b_proj``, the head split, RoPE and concatenations, and the core attention they
    feed (see :meth:`_attend`): only the latents are kept; the direct ``q_proj`` of a model without
    ``q_lora_rank`` is a down projection and stays outside); ``recompute_core_attn`` (``core_attn``:
    the SDPA alone).
    """

    recompute_up_proj: bool = False
    recompute_core_attn: bool = False

    def __init__(self, config: MLAConfig, *, tp_group: ProcessGroup | None = None, sequence_parallel: bool = False,
                 cp_group: ProcessGroup | None = None, device=None, dtype=None):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        # Context parallelism: this rank holds S / cp tokens; the latents are gathered over cp_group.
        self.cp_group = cp_group if comms.group_size(cp_group) > 1 else None
        tp = comms.group_size(tp_group)
        self.sequence_parallel = sp = sequence_parallel and tp > 1
        seq = {"sequence_parallel": sp, "sequence_dim": SEQUENCE_DIM}
        heads, hidden = config.num_attention_heads, config.hidden_size
        if heads % tp:
            raise ValueError(f"MLAConfig.num_attention_heads ({heads}) must be divisible by the "
                             f"tensor-parallel size ({tp})")
        self.num_heads_local = heads // tp
        init = normal_init(config.init_std)
        factory = {"device": device, "dtype": dtype}
        q_out = heads * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_out, tp_group=tp_group, bias=False, init_method=init,
                                               **seq, **factory)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = _ReplicatedLinear(hidden, config.q_lora_rank, config.attention_bias, init, **factory)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.latent_norm_eps, **factory)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, q_out, tp_group=tp_group, bias=False,
                                                 init_method=init, **factory)
        self.kv_a_proj_with_mqa = _ReplicatedLinear(hidden, config.kv_lora_rank + config.qk_rope_head_dim,
                                                    config.attention_bias, init, **factory)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.latent_norm_eps, **factory)
        kv_b_out = heads * (config.qk_nope_head_dim + config.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(config.kv_lora_rank, kv_b_out, tp_group=tp_group, bias=False,
                                              init_method=init, **factory)
        self.o_proj = RowParallelLinear(heads * config.v_head_dim, hidden, tp_group=tp_group,
                                        bias=config.attention_bias, input_is_parallel=True, init_method=init,
                                        **seq, **factory)
        self.rotary = RotaryEmbedding(config.rope, device=device)
        if sp:      # replicated, fed this rank's tokens only: gradients summed over TP (grad sync)
            for module in (self.q_a_proj, self.q_a_layernorm, self.kv_a_proj_with_mqa, self.kv_a_layernorm):
                for param in module.parameters() if module is not None else ():
                    param.sequence_parallel = True

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Redraw every parameter from full logical tensors (same values for every TP layout)."""
        for module in (self.q_proj, self.q_a_proj, self.q_a_layernorm, self.q_b_proj, self.kv_a_proj_with_mqa,
                       self.kv_a_layernorm, self.kv_b_proj, self.o_proj):
            if module is not None:
                module.reset_parameters(generator)

    def kv_cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) per position of the two entries a KV cache stores for this layer (``update(a, b)``):
        the normed compressed latent and the rotated shared rope key, one "head" each (every rank holds both)."""
        return (1, self.config.kv_lora_rank), (1, self.config.qk_rope_head_dim)

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, kv_cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden`` [B, S, H], ``position_ids`` [B, S] -> [B, S, H] (complete on every rank);
        ``attention_mask`` [B, S_past + S] (True: a real token) or None.
        ``position_embeddings``: ``self.rotary(position_ids)`` if the caller already has it (a model
        computes it once for all its layers); computed here when None.
        ``document_ids`` [B, S]: document-causal attention over packed documents (no KV cache)."""
        check_no_cache_with_documents(kv_cache, document_ids)
        if self.sequence_parallel and kv_cache is not None:
            raise ValueError("sequence-parallel attention takes no KV cache (decoding cannot split the sequence); "
                             "build the model with sequence_parallel=False for generation")
        check_no_cache_under_context_parallel(self.cp_group, kv_cache)
        cfg = self.config
        kv_latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        kv_latent = self.kv_a_layernorm(kv_latent)
        if self.q_proj is not None:
            q = self.q_proj(hidden)                                   # all-reduces its own input grad
            latents = enter_tensor_parallel_region(torch.cat([kv_latent, k_pe], -1), self.tp_group,
                                                   self.sequence_parallel)
            kv_latent, k_pe = latents.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(hidden))
            latents = enter_tensor_parallel_region(torch.cat([q_latent, kv_latent, k_pe], -1), self.tp_group,
                                                   self.sequence_parallel)
            q_latent, kv_latent, k_pe = latents.split([cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim], -1)
            q = q_latent                                              # projected up below
        cos, sin = self.rotary(position_ids) if position_embeddings is None else position_embeddings
        if self.recompute_up_proj and kv_cache is None:      # a KV cache update must happen once
            out = checkpointed(self._attend, q, kv_latent, k_pe, cos, sin, None, attention_mask, document_ids)
        else:
            out = self._attend(q, kv_latent, k_pe, cos, sin, kv_cache, attention_mask, document_ids,
                               recompute_core_attn=self.recompute_core_attn)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def _attend(self, q: torch.Tensor, kv_latent: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: KVCache | None, attention_mask: torch.Tensor | None,
                document_ids: torch.Tensor | None, recompute_core_attn: bool = False) -> torch.Tensor:
        """The up projections, RoPE and core attention: [B, heads, S, v_head_dim].

        Why ``mla_up_proj`` recomputes core attention too: the up projections' outputs (q, k, v) are
        exactly what core attention keeps for its backward, so they can be dropped only if core
        attention is recomputed with them; a region ending before it would free nothing."""
        q, k, v, query_positions = self._up_projections(q, kv_latent, k_pe, cos, sin, kv_cache, attention_mask)
        segments = cache_packed_segments(kv_cache)
        if segments is not None:         # requests packed in one row (megamoe.serving)
            return packed_attention(q, k, v, self.config.softmax_scale, segments)
        return checkpointed(causal_attention, q, k, v, self.config.softmax_scale, attention_mask=attention_mask,
                            query_positions=query_positions, document_ids=document_ids, enabled=recompute_core_attn)

    def _up_projections(self, q: torch.Tensor, kv_latent: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, kv_cache: KVCache | None, attention_mask: torch.Tensor | None):
        """``q`` [B, S, heads_local * qk] (or the q latent [B, S, q_lora_rank], projected here by
        ``q_b_proj``), ``kv_latent`` [B, S, kv_lora_rank], ``k_pe`` [B, S, rope], all inside the TP
        region -> (q [B, heads, S, qk], k [B, heads, Sk, qk], v [B, heads, Sk, v], query_positions)."""
        cfg = self.config
        batch, seq = kv_latent.shape[:2]                                # the whole (gathered) sequence
        if self.q_proj is None:
            q = F.linear(q, linear_weight(self.q_b_proj, "weight", q.dtype))   # already inside the TP region
        q = q.unflatten(-1, (self.num_heads_local, cfg.qk_head_dim)).transpose(1, 2)   # [B, heads, S, qk]
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        kv_latent = kv_latent.view(batch, 1, seq, cfg.kv_lora_rank)
        k_pe = k_pe.view(batch, 1, seq, cfg.qk_rope_head_dim)
        q_pe, k_pe = self.rotary.rotate(q_pe, cos, sin), self.rotary.rotate(k_pe, cos, sin)
        query_positions = None
        if kv_cache is not None:
            kv_latent, k_pe, query_positions = cached_keys(kv_cache, kv_latent, k_pe, attention_mask)
        if self.cp_group is not None:   # the whole sequence's latents (few bytes), up-projected here
            (kv_latent, k_pe), query_positions = gather_keys_for_context_parallel((kv_latent, k_pe), self.cp_group)
        kv_b = linear_weight(self.kv_b_proj, "weight", kv_latent.dtype)
        kv = F.linear(kv_latent.squeeze(1), kv_b)                  # [B, Sk, heads * (nope + v)]
        kv = kv.unflatten(-1, (self.num_heads_local, cfg.qk_nope_head_dim + cfg.v_head_dim)).transpose(1, 2)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], -1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.num_heads_local, -1, -1)], -1)
        q = torch.cat([q_nope, q_pe], -1)
        return q, k, v, query_positions
