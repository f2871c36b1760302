"""Grouped-query self-attention with heads split over a tensor-parallel group.

Layout: hidden states [B, S, H] (batch first) and ``position_ids`` [B, S]. Per layer:
q/k/v projections (column-parallel by heads, optional bias) -> optional q/k norm -> optional clip
-> RoPE -> (KV cache) -> causal (optionally sliding-window) SDPA -> o_proj (row-parallel).

Tensor parallelism (``tp`` ranks): every rank holds ``num_attention_heads / tp`` query heads and the
KV heads they use (:mod:`megamoe.transformer.head_sharding`):

- ``num_key_value_heads % tp == 0``: k/v are ordinary column shards.
- ``tp % num_key_value_heads == 0``: each rank holds the ONE KV head its query heads share; a KV head
  is replicated on ``tp / num_key_value_heads`` ranks, and its k/v weights (and OLMoE k-norm weight)
  have their gradients summed over those replicas in backward (one all-reduce of the logical k/v
  weight size). Anything else raises ValueError.

Communication: forward, one all-reduce (o_proj). Backward, one all-reduce of the input gradient for
q, k and v together: the block enters the TP region once (``copy_to_tensor_parallel_region``) and
applies the three column shards locally, instead of calling each ``ColumnParallelLinear``'s forward
(which would all-reduce the same input gradient three times). Plus tiny all-reduces for the q/k
norms under TP (OLMoE: [B, S, 1] each way; Qwen3: the [head_dim] weight gradients) and the replica
sums above.

q/k norm (``AttentionConfig.qk_norm``):

- ``"per_head"`` (Qwen3): RMSNorm over ``head_dim`` of every head, one shared [head_dim] weight.
- ``"full_width"`` (OLMoE): RMSNorm over the whole q (``heads * head_dim``) or k projection output,
  i.e. across heads; under TP the variance spans ranks (see :mod:`megamoe.transformer.norm`).

KV cache seam: ``forward(hidden, position_ids, kv_cache=None, attention_mask=None)``. A cache is any
object with ``update(key, value) -> (all_keys, all_values)`` (:class:`KVCache`) holding ONE layer's
state; it receives this call's rotated keys and values [B, kv_heads_local, S, head_dim] and returns
every cached position [B, kv_heads_local, S_past + S, head_dim]. The queries are taken to be the last
S positions: the causal / sliding-window mask is aligned to the end of the key sequence. A paged cache
serving several requests packed in one row (:mod:`megamoe.serving`) also tells where each request's
queries and keys lie (``packed_segments``); attention then runs per request (:func:`packed_attention`).

Masking is by index along each batch row; ``position_ids`` only drive RoPE. Padding: the optional
``attention_mask`` [B, S_past + S] (HF's 2-D mask: True / 1 where the position holds a real token)
hides padding keys (see :func:`causal_attention`); with left padding, the index-based causal and
sliding-window masks stay exact.

Packed documents (training, :mod:`megamoe.data.packing`): ``document_ids`` [B, S] (a keyword of
``forward``) makes attention document-causal: a query sees the keys at or before it that carry the
same document id (and lie in its sliding window, when configured). Pair it with per-document
``position_ids`` (restarting at 0) for every document to be computed as if alone. It describes one
full-sequence call: with a KV cache it raises ValueError (the cache does not keep past document ids).
None: plain causal attention, the ``is_causal`` SDPA kernel.

Sequence parallelism (``sequence_parallel=True``, under TP, training): the input is this rank's
contiguous chunk [B, S / tp, H] of the sequence dim. The block all-gathers it once before q, k and v
(backward: one reduce-scatter of the input gradient, instead of the all-reduce; only the chunk is kept
for backward, gathered again there for the weight gradients) and ``o_proj``
reduce-scatters its output back to [B, S / tp, H] (instead of all-reducing; its bias, replicated and
added to this rank's chunk only, is tagged ``sequence_parallel`` so its gradient is summed over TP).
Attention itself sees the whole gathered sequence, so ``position_ids`` and ``document_ids`` stay the
full [B, S]. No KV cache: decoding single tokens cannot be split (build the model with
``sequence_parallel=False`` for generation; it computes the same function).

Context parallelism (``cp_group=``, :mod:`megamoe.transformer.context_parallel`): the input holds this
CP rank's S / cp tokens (load-balanced chunks) and ``position_ids`` their positions; after RoPE the
KV heads are all-gathered over CP (backward: reduce-scatter) and the queries attend with
``query_positions`` = their indices in the whole sequence; ``document_ids`` is the FULL [B, S]. No KV cache.

Attention sinks (``AttentionConfig.sinks``, gpt-oss): one learned logit per query head joins every
softmax as an extra column that no value row goes with, so a query may put weight on "nothing". The
parameter ``sinks`` [heads] is sharded with the query heads under TP. :func:`causal_attention` runs it
as one extra key through the same SDPA call (a zero value; the heads grow by a few features that give
that key the score ``sinks[h]``, so the mask stays boolean), so the KV cache, packed documents, sliding
windows and context parallelism (which all reach attention through that function) see it unchanged.

Fused kernels under masks (GQA): plain causal attention (and a decoding step with no padding) takes
``is_causal`` / no mask with ``enable_gqa``, CUDA's flash kernel. Every other case (padding, packed
documents, sliding windows shorter than the keys, sinks, CP's query positions, a cache's chunked
prefill) passes an explicit mask, which CUDA's flash kernel refuses; the memory-efficient kernel takes
a mask but not ``enable_gqa``, and cuDNN's (mask and GQA) comes after the math kernel in torch's default
order, so a mask with ``enable_gqa`` would leave the math kernel: [B, Hq, Sq, Sk] scores and
probabilities. Off CPU, :func:`causal_attention` therefore expands the KV heads to the query heads
(``repeat_interleave``, what the math kernel does with ``enable_gqa`` itself) before a masked call, and
the memory-efficient kernel runs it (``benchmarks/attention.py`` measures both). CPU's flash kernel
takes a mask with ``enable_gqa`` (torch 2.13), so there the KV heads stay as they are, except with
sinks (each query head has its own sink key). The masks are boolean, with no gradient: CPU's flash
kernel computes none for a mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.quantization.kept_weights import linear_weight
from megamoe.sharding import set_shard_spec, shard_parameter
from megamoe.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megamoe.tensor_parallel.init import InitMethod, init_sharded_, normal_init, zeros_init
from megamoe.tensor_parallel.main_grad_linear import linear
from megamoe.comms import gather_linears_from_sequence_parallel_region
from megamoe.tensor_parallel.sequence import SEQUENCE_DIM
from megamoe.transformer.context_parallel import gather_keys_for_context_parallel
from megamoe.transformer.head_sharding import HeadShard, head_shard, sum_grad_over_replicas
from megamoe.transformer.norm import RMSNorm
from megamoe.transformer.recompute import checkpointed
from megamoe.transformer.rope import RopeConfig, RotaryEmbedding

__all__ = ["AttentionConfig", "Attention", "KVCache", "PackedSegments", "cache_packed_segments", "cached_keys",
           "causal_attention", "packed_attention",
           "check_no_cache_with_documents", "check_no_cache_under_context_parallel",
           "masked_attention_expands_kv_heads"]

QK_NORMS = (None, "per_head", "full_width")


class KVCache(Protocol):
    """One layer's KV cache (filled in by the inference code)."""

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's entries (sequence dim -2) and return all cached entries."""
        ...

    # Optional: cache indices [S] of the entries just stored, when they are not the last S of the
    # returned ones (a cache written by index returns its whole buffer); absent or None otherwise.
    query_positions: torch.Tensor | None

    # Optional (a paged cache serving several requests in one packed row [1, S], megamoe.serving): where
    # each request's queries and keys lie (:class:`PackedSegments`); attention then keeps requests apart
    # (:func:`packed_attention`). Absent or None otherwise.
    packed_segments: "PackedSegments | None"


def cached_keys(kv_cache: KVCache, a: torch.Tensor, b: torch.Tensor, attention_mask: torch.Tensor | None):
    """Store this call's ``a`` / ``b`` (keys / values, or MLA's latent / rope key) in ``kv_cache`` and
    return ``(all a, all b, query_positions)``: the cached positions and where this call's queries sit
    among them (None: the last S). A cache written by index returns its whole buffer; the positions
    in use are the first ``attention_mask.shape[-1]`` (the mask spans the keys, as always)."""
    a, b = kv_cache.update(a, b)
    query_positions = getattr(kv_cache, "query_positions", None)
    if query_positions is not None:
        if attention_mask is None:
            raise ValueError("a KV cache written by index needs the attention_mask that spans its filled positions")
        length = attention_mask.shape[-1]
        a, b = a[..., :length, :], b[..., :length, :]
    return a, b, query_positions


@dataclass(frozen=True)
class PackedSegments:
    """Where several requests packed in one row lie (a paged cache's ``packed_segments``, see :class:`KVCache`):
    per request ``(first query, queries, first key, keys)`` among the row's queries and the returned keys, a
    request's queries being the last of its keys; and, built once for every layer, how the decoding requests
    (one query each) are batched: their query indices ``decode_rows`` [R], the key indices ``decode_keys``
    [R, L] (real keys right-aligned, L the longest) and ``decode_mask`` [R, L] (True: a real key)."""

    segments: tuple[tuple[int, int, int, int], ...]
    decode_rows: torch.Tensor
    decode_keys: torch.Tensor
    decode_mask: torch.Tensor

    @classmethod
    def build(cls, segments, device=None) -> "PackedSegments":
        segments = tuple(tuple(int(x) for x in s) for s in segments)
        decodes = [s for s in segments if s[1] == 1]
        longest = max((n for _, _, _, n in decodes), default=0)
        offsets = torch.arange(longest)
        lengths = torch.tensor([n for _, _, _, n in decodes], dtype=torch.int64)
        ends = torch.tensor([k + n for _, _, k, n in decodes], dtype=torch.int64)
        keys = (ends[:, None] - longest + offsets).clamp(min=0)
        mask = offsets[None, :] >= (longest - lengths)[:, None]
        rows = torch.tensor([q for q, _, _, _ in decodes], dtype=torch.int64)
        return cls(segments, rows.to(device), keys.to(device), mask.to(device))


def cache_packed_segments(kv_cache) -> PackedSegments | None:
    """A paged cache's ``packed_segments`` (see :class:`KVCache`), or None."""
    return None if kv_cache is None else getattr(kv_cache, "packed_segments", None)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     packed: PackedSegments, sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`causal_attention` of several requests packed in one row: query [1, Hq, Sq, D], key [1, Hk, Sk, D],
    value [1, Hk, Sk, Dv] -> [1, Hq, Sq, Dv], each request's queries (the last of its keys) seeing only its own
    keys. Requests with one query (decoding) run as one left-padded batch [R, H, 1, longest keys] (padding
    hidden by the key mask), the others (prefill chunks) one call each: the work is each request's queries
    times its own keys, not every query times every key of the row."""
    out = query.new_empty(*query.shape[:-1], value.shape[-1])
    rows = packed.decode_rows
    if rows.numel():
        batch, longest = packed.decode_keys.shape
        k, v = (t[0].index_select(1, packed.decode_keys.flatten()).unflatten(1, (batch, longest)).transpose(0, 1)
                for t in (key, value))                                            # [R, Hk, L, D]
        q = query[0].index_select(1, rows).transpose(0, 1).unsqueeze(2)           # [R, Hq, 1, D]
        o = causal_attention(q, k, v, scale, sliding_window, attention_mask=packed.decode_mask, sinks=sinks)
        out[0].index_copy_(1, rows, o.squeeze(2).transpose(0, 1).to(out.dtype))
    for q0, q_len, k0, k_len in packed.segments:
        if q_len > 1:
            out[:, :, q0:q0 + q_len] = causal_attention(query[:, :, q0:q0 + q_len], key[:, :, k0:k0 + k_len],
                                                        value[:, :, k0:k0 + k_len], scale, sliding_window, sinks=sinks)
    return out


def check_no_cache_with_documents(kv_cache, document_ids: torch.Tensor | None) -> None:
    """ValueError when packed documents' ``document_ids`` come with a KV cache (one layer's, or a
    model's dict of them)."""
    if kv_cache is not None and document_ids is not None:
        raise ValueError("document_ids (packed documents) describe one full-sequence forward and cannot be "
                         "combined with a KV cache; pass document_ids=None when decoding")


def check_no_cache_under_context_parallel(cp_group, kv_cache) -> None:
    """ValueError when a KV cache comes to attention split over a CP group."""
    if cp_group is not None and kv_cache is not None:
        raise ValueError("context-parallel attention takes no KV cache (decoding one token cannot split the "
                         "sequence over the CP group); generate with a layout of cp=1 (the same checkpoint)")


@dataclass(frozen=True)
class AttentionConfig:
    """One GQA attention layer. ``rope.dim`` is ``head_dim``, or less for a partial rotary embedding
    (GLM-4.5, MiniMax-M2: the first ``rope.dim`` features of each head rotate, the rest pass through)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: RopeConfig
    qkv_bias: bool = False                 # Qwen2-MoE; Qwen3/OLMoE `attention_bias` (with o_proj_bias)
    o_proj_bias: bool = False
    qk_norm: str | None = None             # None | "per_head" (Qwen3) | "full_width" (OLMoE)
    norm_eps: float = 1e-6                 # eps of the q/k norms
    sliding_window: int | None = None      # key j is visible to query i iff i - window < j <= i
    clip_qkv: float | None = None          # OLMoE: clamp q, k, v to [-clip, clip] after the norms
    init_std: float = 0.02
    sinks: bool = False                    # gpt-oss: a learned per-head logit in every softmax

    def __post_init__(self):
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"AttentionConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"AttentionConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.rope.dim > self.head_dim:
            raise ValueError(f"AttentionConfig.rope.dim ({self.rope.dim}) must be <= head_dim ({self.head_dim})")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"AttentionConfig.qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"AttentionConfig.sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.clip_qkv is not None and self.clip_qkv <= 0:
            raise ValueError(f"AttentionConfig.clip_qkv must be > 0 or None, got {self.clip_qkv}")


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     sliding_window: int | None = None, attention_mask: torch.Tensor | None = None,
                     query_positions: torch.Tensor | None = None,
                     document_ids: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA of query [B, Hq, Sq, D] over key [B, Hk, Sk, D] / value [B, Hk, Sk, Dv] (``Hq`` a
    multiple of ``Hk``), the queries being the LAST ``Sq`` of the ``Sk`` positions, or those at the
    key indices ``query_positions`` [Sq] (a static-shape KV cache). Returns [B, Hq, Sq, Dv].

    ``attention_mask`` [B, Sk] (True / 1: a real token) hides padding keys. A query always sees its
    own position, so a padding query's row is never empty: some SDPA kernels return NaN for an empty
    row, which would reach real queries through the cached values (0 * NaN = NaN); this way its
    output is finite (and unused) on every backend.

    ``document_ids`` [B, Sk] (packed documents): a query sees only keys of its own document (the
    document id at the query's own key index), on top of the causal / sliding-window / padding mask."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    gqa = query.shape[1] != key.shape[1]
    if (query_positions is None and attention_mask is None and document_ids is None and sinks is None
            and (sliding_window is None or k_len <= sliding_window)):
        if q_len == k_len:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
        if q_len == 1:                              # the last position sees every key (decoding)
            return F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=gqa)
    if query_positions is None:
        q_pos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
    else:
        q_pos = query_positions.to(query.device)[:, None]
    k_pos = torch.arange(k_len, device=query.device)[None, :]
    visible = k_pos <= q_pos                                                   # [Sq, Sk]
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    if attention_mask is not None:
        visible = (visible & attention_mask.bool()[:, None, None, :]) | (k_pos == q_pos)   # [B, 1, Sq, Sk]
    if document_ids is not None:
        if document_ids.shape != (query.shape[0], k_len):
            raise ValueError(f"document_ids must be [batch, keys] = {[query.shape[0], k_len]}, got "
                             f"{list(document_ids.shape)}")
        query_documents = document_ids.index_select(1, q_pos[:, 0])                       # [B, Sq]
        visible = visible & (query_documents[:, None, :, None] == document_ids[:, None, None, :])   # [B, 1, Sq, Sk]
    if sinks is not None:
        return _attention_with_sinks(query, key, value, scale, visible, sinks)
    return _masked_attention(query, key, value, visible, scale)


def masked_attention_expands_kv_heads(device: torch.device) -> bool:
    """Whether a masked SDPA call on ``device`` gets its KV heads expanded to the query heads (GQA):
    everywhere but CPU (see the module docstring: CUDA's fused kernels that take a mask refuse
    ``enable_gqa`` ahead of the math kernel; the meta device stands for CUDA in the CPU-only tests)."""
    return device.type != "cpu"


def _masked_attention(query, key, value, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with an explicit boolean ``mask`` (True: visible), on a fused kernel with GQA:
    off CPU the KV heads are repeated to the query heads (query head ``h`` uses KV head ``h // group``,
    as ``enable_gqa``), so the memory-efficient kernel takes the call. In backward ``repeat_interleave``
    sums each expanded copy's gradient over its group of query heads: the same KV gradients as
    ``enable_gqa``."""
    group = query.shape[1] // key.shape[1]
    if group > 1 and masked_attention_expands_kv_heads(query.device):
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        group = 1
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=group > 1)


# Features the sink key adds to every head (one carries the sink, the rest keep the head dim a
# multiple of 8, which CUDA's fused kernels need in half precision).
SINK_FEATURES = 8


def _attention_with_sinks(query, key, value, scale: float, visible: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """SDPA whose softmax has one more column per query head: the logit ``sinks[h]`` with a zero value
    (HF gpt-oss: ``softmax(cat(scores, sink))[..., :-1] @ V``); ``visible`` [Sq, Sk] or [B, 1, Sq, Sk].

    The column is one more key, after the sequence's, that every query sees: the heads grow by
    :data:`SINK_FEATURES` features, 1 then zeros on every query, zeros on the sequence's keys and
    values, ``sinks[h] / scale`` then zeros on head ``h``'s sink key (KV heads expanded: the sink key
    differs per query head), so its score is ``sinks[h]`` and the mask stays boolean. A float mask
    carrying the sink would need its own gradient, which CPU's flash kernel does not compute (and on
    CUDA it is a [B, Hq, Sq, Sk] bias plus its gradient). The sinks' gradient arrives through the
    sink keys' (summed over the batch and the queries by the kernel's backward)."""
    batch, heads, q_len = query.shape[0], query.shape[1], query.shape[-2]
    group = heads // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    extra = query.new_zeros((*query.shape[:-1], SINK_FEATURES))
    extra[..., 0] = 1
    query = torch.cat([query, extra], dim=-1)
    key, value = (F.pad(t, (0, SINK_FEATURES)) for t in (key, value))          # zero features
    sink_key = F.pad((sinks.float() / scale).to(query.dtype).view(1, heads, 1, 1),
                     (key.shape[-1] - SINK_FEATURES, SINK_FEATURES - 1))
    key = torch.cat([key, sink_key.expand(batch, heads, 1, key.shape[-1])], dim=-2)
    value = F.pad(value, (0, 0, 0, 1))                                          # the sink's zero value
    visible = visible.expand(batch, 1, q_len, visible.shape[-1])
    visible = torch.cat([visible, visible.new_ones((batch, 1, q_len, 1))], dim=-1)
    return _masked_attention(query, key, value, visible, scale)[..., :-SINK_FEATURES]


class _ReplicatedHeadLinear(nn.Module):
    """A k or v projection when TP exceeds the KV heads: this rank's single KV head (a chunk of the
    logical [kv_heads * head_dim, hidden] weight, shared with ``shard.replicas - 1`` other ranks).
    Its gradients are summed over those replicas in backward."""

    def __init__(self, in_features: int, out_features: int, shard: HeadShard, tp_group: ProcessGroup | None,
                 bias: bool, init_method: InitMethod, device=None, dtype=None):
        super().__init__()
        self.shard, self.tp_group, self.init_method = shard, tp_group, init_method
        self.in_features, self.out_features = in_features, out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // shard.count, in_features, **factory))
        set_shard_spec(self.weight, shard.spec((out_features, in_features)))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // shard.count, **factory))
            set_shard_spec(self.bias, shard.spec((out_features,)))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        init_sharded_(self.weight, self.init_method, generator)
        if self.bias is not None:
            init_sharded_(self.bias, zeros_init, generator)

    def local_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` is already inside the TP region (its gradient is all-reduced by the caller)."""
        return F.linear(x, *self.local_weight_and_bias(x.dtype))

    def local_weight_and_bias(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight (a kept FP8 one dequantized to ``dtype``) and bias, their gradients summed over the
        replicas in backward."""
        replicas = self.shard.replicas
        weight = sum_grad_over_replicas(linear_weight(self, "weight", dtype), self.weight.shard_spec, self.tp_group,
                                        replicas)
        bias = None if self.bias is None else sum_grad_over_replicas(
            self.bias, self.bias.shard_spec, self.tp_group, replicas)
        return weight, bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local head "
                f"{self.shard.index} of {self.shard.count}, on {self.shard.replicas} ranks)")


def _local_linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A column shard's matmul on an input that already entered the TP region."""
    if isinstance(layer, _ReplicatedHeadLinear):
        return layer.local_linear(x)
    return linear(x, linear_weight(layer, "weight", x.dtype), layer.bias)


def _local_weight_and_bias(layer: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What :func:`_local_linear` multiplies by (a replicated KV head's, with its replica gradient sum; a
    kept FP8 weight dequantized to ``dtype``)."""
    if isinstance(layer, _ReplicatedHeadLinear):
        return layer.local_weight_and_bias(dtype)
    return linear_weight(layer, "weight", dtype), layer.bias


class Attention(nn.Module):
    """GQA self-attention, heads split over ``tp_group`` (``None``: one rank). Parameter names follow
    HuggingFace (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``, ``k_norm``).

    ``recompute_core_attn`` (set by the decoder layer from ``RecomputeConfig``, selective ``core_attn``):
    the SDPA is recomputed in backward (:mod:`megamoe.transformer.recompute`)."""

    recompute_core_attn: bool = False

    def __init__(self, config: AttentionConfig, *, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, cp_group: ProcessGroup | None = None, device=None, dtype=None):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        # Context parallelism: this rank holds S / cp tokens; k and v are gathered over cp_group.
        self.cp_group = cp_group if comms.group_size(cp_group) > 1 else None
        tp = comms.group_size(tp_group)
        self.sequence_parallel = sequence_parallel and tp > 1
        heads, kv_heads, head_dim, hidden = (config.num_attention_heads, config.num_key_value_heads,
                                             config.head_dim, config.hidden_size)
        if heads % tp:
            raise ValueError(f"AttentionConfig.num_attention_heads ({heads}) must be divisible by the "
                             f"tensor-parallel size ({tp})")
        kv_shard = head_shard(tp_group, kv_heads, "AttentionConfig.num_key_value_heads")
        self.num_heads_local = heads // tp
        self.num_kv_heads_local = kv_heads // kv_shard.count
        init = normal_init(config.init_std)
        factory = {"device": device, "dtype": dtype}
        self.q_proj = ColumnParallelLinear(hidden, heads * head_dim, tp_group=tp_group, bias=config.qkv_bias,
                                           init_method=init, **factory)
        for name in ("k_proj", "v_proj"):
            if kv_shard.replicas == 1:
                layer = ColumnParallelLinear(hidden, kv_heads * head_dim, tp_group=tp_group, bias=config.qkv_bias,
                                             init_method=init, **factory)
            else:
                layer = _ReplicatedHeadLinear(hidden, kv_heads * head_dim, kv_shard, tp_group, config.qkv_bias,
                                              init, **factory)
            self.add_module(name, layer)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, tp_group=tp_group, bias=config.o_proj_bias,
                                        input_is_parallel=True, sequence_parallel=self.sequence_parallel,
                                        sequence_dim=SEQUENCE_DIM, init_method=init, **factory)
        if config.qk_norm == "per_head":
            # One [head_dim] weight shared by all heads; each rank normalises its own heads.
            self.q_norm = RMSNorm(head_dim, config.norm_eps, weight_grad_group=tp_group, **factory)
            self.k_norm = RMSNorm(head_dim, config.norm_eps, weight_grad_group=tp_group, **factory)
        elif config.qk_norm == "full_width":
            self.q_norm = RMSNorm(heads * head_dim, config.norm_eps, tp_group=tp_group, num_heads=heads, **factory)
            self.k_norm = RMSNorm(kv_heads * head_dim, config.norm_eps, tp_group=tp_group, num_heads=kv_heads,
                                  **factory)
        else:
            self.q_norm = self.k_norm = None
        if config.sinks:     # this rank's query heads' sink logits
            self.sinks = shard_parameter(nn.Parameter(torch.empty(self.num_heads_local, **factory)), 0, tp_group)
            init_sharded_(self.sinks, init, None)
        else:
            self.register_parameter("sinks", None)
        self.rotary = RotaryEmbedding(config.rope, device=device)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Redraw every parameter from full logical tensors (same values for every TP layout)."""
        for module in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.q_norm, self.k_norm):
            if module is not None:
                module.reset_parameters(generator)
        if self.sinks is not None:
            init_sharded_(self.sinks, normal_init(self.config.init_std), generator)

    def kv_cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) per position of the two entries a KV cache stores for this layer (``update(a, b)``):
        this rank's KV heads' rotated keys and its values."""
        shape = (self.num_kv_heads_local, self.config.head_dim)
        return shape, shape

    def _qk_norm(self, norm: RMSNorm | None, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[B, S, heads * D] -> normed [B, S, heads, D]."""
        if norm is not None and self.config.qk_norm == "full_width":
            x = norm(x)
        x = x.unflatten(-1, (heads, self.config.head_dim))
        if norm is not None and self.config.qk_norm == "per_head":
            x = norm(x)
        return x

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, kv_cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden`` [B, S, H], ``position_ids`` [B, S] -> [B, S, H] (complete on every rank);
        ``attention_mask`` [B, S_past + S]: see :func:`causal_attention`.
        ``position_embeddings``: ``self.rotary(position_ids)`` if the caller already has it (a model
        computes it once for all its layers); computed here when None.
        ``document_ids`` [B, S]: document-causal attention over packed documents (no KV cache)."""
        check_no_cache_with_documents(kv_cache, document_ids)
        if self.sequence_parallel and kv_cache is not None:
            raise ValueError("sequence-parallel attention takes no KV cache (decoding cannot split the sequence); "
                             "build the model with sequence_parallel=False for generation")
        check_no_cache_under_context_parallel(self.cp_group, kv_cache)
        if self.sequence_parallel:   # one all-gather (and one grad reduce-scatter) for q, k and v
            layers = (self.q_proj, self.k_proj, self.v_proj)
            q, k, v = gather_linears_from_sequence_parallel_region(
                hidden, self.tp_group, *zip(*(_local_weight_and_bias(layer, hidden.dtype) for layer in layers)),
                dim=SEQUENCE_DIM)
        else:                        # one grad all-reduce for q, k and v
            x = comms.copy_to_tensor_parallel_region(hidden, self.tp_group)
            q, k, v = (_local_linear(layer, x) for layer in (self.q_proj, self.k_proj, self.v_proj))
        q = self._qk_norm(self.q_norm, q, self.num_heads_local)
        k = self._qk_norm(self.k_norm, k, self.num_kv_heads_local)
        v = v.unflatten(-1, (self.num_kv_heads_local, self.config.head_dim))
        if self.config.clip_qkv is not None:
            clip = self.config.clip_qkv
            q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)     # [B, heads, S, D]
        cos, sin = self.rotary(position_ids) if position_embeddings is None else position_embeddings
        q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        query_positions = None
        if kv_cache is not None:
            k, v, query_positions = cached_keys(kv_cache, k, v, attention_mask)
            segments = cache_packed_segments(kv_cache)
            if segments is not None:     # requests packed in one row (megamoe.serving)
                out = packed_attention(q, k, v, self.config.head_dim ** -0.5, segments, self.config.sliding_window,
                                       self.sinks)
                return self.o_proj(out.transpose(1, 2).flatten(2))
        if self.cp_group is not None:  # the whole sequence's KV heads; the queries stay this rank's
            (k, v), query_positions = gather_keys_for_context_parallel((k, v), self.cp_group)
        out = checkpointed(causal_attention, q, k, v, self.config.head_dim ** -0.5, self.config.sliding_window,
                           attention_mask, query_positions, document_ids, self.sinks, enabled=self.recompute_core_attn)
        return self.o_proj(out.transpose(1, 2).flatten(2))                     # [B, S, heads_local * D] in
