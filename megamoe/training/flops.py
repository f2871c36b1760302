"""The model FLOPs of a :class:`~megamoe.models.GPTMoEConfig`: every matmul, per token and per step.

A matmul of an ``[m, k]`` by a ``[k, n]`` matrix costs ``2 m k n`` FLOPs (a multiply and an add per
term), as :class:`torch.utils.flop_counter.FlopCounterMode` counts it. Per token and per layer, with
``H`` = hidden_size, ``S`` = the sequence length (keys per query), forward:

- GQA attention (``nh`` query heads, ``nkv`` KV heads, ``d`` = head_dim):
  projections ``2 H (nh d) + 2 * 2 H (nkv d) + 2 (nh d) H`` (q, k and v, o);
  scores and values ``2 S d nh + 2 S d nh`` (``q k^T`` and ``p v``).
- MLA attention (DeepSeek; ``dqk = qk_nope_head_dim + qk_rope_head_dim``, ``dv = v_head_dim``,
  ``rq = q_lora_rank``, ``rkv = kv_lora_rank``): q ``2 H nh dqk`` (no q LoRA) or ``2 H rq + 2 rq nh dqk``;
  ``kv_a_proj_with_mqa`` ``2 H (rkv + qk_rope_head_dim)``; ``kv_b_proj`` ``2 rkv nh (qk_nope_head_dim + dv)``;
  o ``2 nh dv H``; scores and values ``2 S dqk nh + 2 S dv nh``.
- Dense MLP (``F`` = intermediate_size): ``3 * 2 H F`` gated (gate, up, down), ``2 * 2 H F`` plain.
- MoE layer (``E`` experts, ``k`` = top_k, ``Fe`` = ffn_hidden_size per expert): router ``2 H E``;
  routed experts ``k * 3 * 2 H Fe`` (``swiglu``, gated) or ``k * 2 * 2 H Fe``; shared experts
  ``3 * 2 H Fs`` (``Fs`` = their total ffn_hidden_size; ``2 * 2 H Fs`` ungated) plus ``2 H`` for
  Qwen2-MoE's shared-expert gate.
- LM head (once per token, not per layer): ``2 H V`` (``V`` = vocab_size). The embedding is a lookup.

Attention scores are counted for the FULL ``S x S`` score matrix: the causal half that masking
throws away is NOT subtracted, as :class:`FlopCounterMode` counts SDPA (``sdpa_flop_count``), and as a
sliding window is not either. MoE experts are counted dropless: every token reaches its ``top_k``
experts (a ``capacity_factor`` that drops pairs makes the real count lower).

Training = forward + backward = ``3 x`` forward: each matmul's backward is two matmuls of its size
(the input gradient and the weight gradient), attention's ``q k^T`` and ``p v`` included. This is
what :class:`FlopCounterMode` measures for every matmul and for SDPA's math backend (the one CPU
autograd runs under ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``); its formula for the fused
flash / memory-efficient SDPA backward adds one recomputation of ``q k^T`` (``2.5 x`` the attention
forward instead of ``2 x``), which this module does not count: recomputation is not model FLOPs.
Norms, activations, softmax, RoPE and the loss are elementwise and not counted (as in Megatron-LM's
``num_floating_point_operations``).

Checking against :class:`FlopCounterMode` (tests/unit/test_flops.py: equal on GQA and MLA configs): run
the MoE experts on the ``loop`` backend (``MoEConfig.expert_backend="loop"``, one ``F.linear`` per slot)
or the ``torch`` one on CPU (one ``torch.mm`` per slot, on the calling thread), and SDPA on the math
backend. ``torch._grouped_mm`` (the ``torch`` backend on accelerators) has no FlopCounterMode formula
(torch 2.13); CPU's fused SDPA kernel has none either.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from megamoe.models.config import GPTMoEConfig
from megamoe.transformer.attention import AttentionConfig
from megamoe.transformer.mla import MLAConfig

__all__ = ["FlopsPerToken", "flops_per_token", "training_flops"]

# Forward + backward (input gradient + weight gradient) of a matmul: three times its forward.
TRAINING_MULTIPLIER = 3


@dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token of a whole model (all layers), by kind of matmul."""

    attention_projections: int      # q/k/v/o (GQA) or MLA's low-rank projections
    attention_scores: int           # q k^T and p v over the full S x S matrix
    dense_mlp: int
    router: int
    routed_experts: int             # top_k active experts per token
    shared_experts: int             # shared experts and their gate
    lm_head: int                    # the output layer, plus each MTP depth's pass and its eh_proj

    @property
    def forward(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def training(self) -> int:
        """Forward + backward (``3 x`` forward; see the module docstring)."""
        return TRAINING_MULTIPLIER * self.forward


def _attention_flops(config: AttentionConfig | MLAConfig, seq_len: int) -> tuple[int, int]:
    """(projection, score) forward FLOPs per token of one attention layer."""
    H, heads = config.hidden_size, config.num_attention_heads
    if isinstance(config, MLAConfig):
        qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank is None:
            q = 2 * H * heads * qk_dim
        else:
            q = 2 * H * config.q_lora_rank + 2 * config.q_lora_rank * heads * qk_dim
        kv_a = 2 * H * (config.kv_lora_rank + config.qk_rope_head_dim)
        kv_b = 2 * config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
        o = 2 * heads * config.v_head_dim * H
        return q + kv_a + kv_b + o, 2 * seq_len * heads * (qk_dim + config.v_head_dim)
    if isinstance(config, AttentionConfig):
        q_width, kv_width = heads * config.head_dim, config.num_key_value_heads * config.head_dim
        projections = 2 * H * q_width + 2 * (2 * H * kv_width) + 2 * q_width * H
        return projections, 2 * seq_len * heads * (2 * config.head_dim)
    raise TypeError(f"flops_per_token knows AttentionConfig and MLAConfig, got {type(config).__name__}")


def _ffn_flops(hidden_size: int, ffn_size: int, gated: bool) -> int:
    """Forward FLOPs per token of one (gated) MLP: two or three ``H x F`` matmuls."""
    return (3 if gated else 2) * 2 * hidden_size * ffn_size


def flops_per_token(config: GPTMoEConfig, seq_len: int) -> FlopsPerToken:
    """The forward FLOPs per token of ``config``'s whole model at sequence length ``seq_len`` (the
    attention scores grow with it), by component; ``.training`` is forward + backward. See the
    module docstring for the formula."""
    if seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len must be >= 1, got {seq_len}")
    H = config.hidden_size
    projections, scores = _attention_flops(config.attention, seq_len)
    # MTP layers (megamoe.models.mtp) are decoder layers too, each with its own pass through the output layer.
    layers, mtp = config.num_layers + config.mtp_num_layers, config.mtp_num_layers
    num_moe = len(config.moe_layer_ids)
    num_dense = layers - num_moe
    dense = 0
    if num_dense:
        mlp = config.dense_mlp
        dense = num_dense * _ffn_flops(H, mlp.intermediate_size, mlp.gated)
    router = routed = shared = 0
    if num_moe:
        moe = config.moe
        router = num_moe * 2 * H * moe.num_experts
        gated = moe.activation in ("swiglu", "swiglu_clamped")
        routed = num_moe * moe.router.top_k * _ffn_flops(H, moe.ffn_hidden_size, gated)
        if moe.shared_experts is not None:
            se = moe.shared_experts
            shared = num_moe * (_ffn_flops(H, se.ffn_hidden_size, se.activation == "swiglu")
                                + (2 * H if se.gate else 0))
    return FlopsPerToken(attention_projections=layers * projections,
                         attention_scores=layers * scores, dense_mlp=dense, router=router,
                         routed_experts=routed, shared_experts=shared,
                         lm_head=(1 + mtp) * 2 * H * config.vocab_size + mtp * 2 * (2 * H) * H)   # + eh_proj


def training_flops(config: GPTMoEConfig, seq_len: int, num_tokens: int) -> int:
    """Forward + backward FLOPs of a step over ``num_tokens`` tokens in sequences of ``seq_len``."""
    return flops_per_token(config, seq_len).training * num_tokens
