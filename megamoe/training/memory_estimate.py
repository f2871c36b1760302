"""The closed-form per-rank memory of training a :class:`~megamoe.models.GPTMoEConfig` under a layout.

In the spirit of Megatron-LM's ``theoretical_memory_usage.py``, but counting what THIS library's
modules hold, so that the figures can be checked against the measurement
(:mod:`megamoe.training.memory_measure`, ``benchmarks/memory.py``, ``tests/unit/test_memory.py``). No model is
built: a DeepSeek-V3-shaped config at EP 64, PP 16 takes milliseconds.

State (exact: the same shard rules as the modules):

- parameters: every parameter tensor of the stage's modules, at its local shape: vocabulary (padded to
  a multiple of ``make_vocab_size_divisible_by * tp``, padding rows counted), heads,
  dense FFN and the output layer split over TP (KV heads over ``min(tp, kv_heads)`` shards, replicated
  beyond), expert slots ``num_expert_slots / ep`` per rank with their FFN split over ETP, shared
  experts' FFN over the MoE layer's reduction group (EP x ETP for the all-gather dispatcher, ETP for
  all-to-all), norms, the router and MLA's low-rank projections replicated. The tied embedding's copy
  on the last stage when ``tie_word_embeddings`` and PP > 1. The MTP layers' parameters on the last stage
  (their activations are not modelled).
- gradients, as held at the optimizer step: one per parameter, of its dtype (``p.grad``) for fp32
  parameters, in fp32 for the others (their fp32 accumulation buffer ``p.main_grad``, 4 bytes per
  element: :mod:`megamoe.gradients`); with the distributed optimizer also its fp32 reduced-gradient
  shards (1/N of each parameter, padded; for non-fp32 parameters in a group of one rank, ``N = 1``, the
  shard is the accumulation buffer itself, not counted twice), and under ZeRO-2 only those (the full
  gradients are freed after the reduce-scatter; during backward they exist, which the peak shows).
- optimizer state: plain AdamW: both moments in the parameter dtype and one 4-byte ``step`` tensor per
  parameter tensor (torch's fused AdamW keeps it as a tensor). Distributed optimizer
  (:mod:`megamoe.training.distributed_optimizer`): each parameter viewed as ``[rows, n]`` (rows = local
  slots for stacked expert weights, else 1), each row cut into ``N`` padded shards (``N`` = DP x CP for
  dense, expert-DP for expert parameters; 1 for the unsharded bf16 case): fp32 ``exp_avg`` and
  ``exp_avg_sq`` (and ``master`` for non-fp32 parameters) of ``rows * ceil(n / N)`` elements and a
  4-byte ``step``.

Activations (estimated): the bytes autograd saves for backward during one micro-batch's forward,
per op of the modules as implemented (``T`` = this rank's tokens ``micro_batch * seq_len / cp``; under
context parallelism attention's keys and values span the whole sequence, ``T cp`` tokens, see below;
``e`` = the activation element size, which is the parameter dtype's; norms and routers compute in
fp32, 4 bytes):

- RMSNorm over width ``w`` (rows ``r``): its fp32 input ``4 T w`` (the input itself in fp32, an fp32
  copy in bf16), ``rsqrt`` ``4 r`` and the normalised output ``e T w`` (``weight * normed`` saves it;
  :class:`~megamoe.transformer.norm.RMSNormFunction` in bf16 keeps the same bytes).
- GQA attention: its input ``e T H`` (the norm's output, saved by the q projection), q/k norms as
  above on the q/k projection outputs (without them the projections' outputs are not saved: RoPE
  saves only cos/sin), SDPA's rotated q and k, v, its output and log-sum-exp ``4 B heads S``, and the
  o-projection's input (a contiguous copy of the output) ``e T heads d``. RoPE's cos/sin
  ``2 * 4 B S d/2`` once per forward (shared by the layers).
- dense MLP: input ``e T H`` and four ``e T F/tp`` (gate and up outputs, the activation, the product);
  three for SwiGLU in bf16 / fp16 (:mod:`megamoe.transformer.swiglu` recomputes the activation).
- MoE layer with ``N`` (token, slot) pairs on this rank (balanced routing: ``T k`` for all-to-all,
  ``T k / ep`` for the all-gather dispatcher): router input ``4 T H`` (fp32), scores ``4 T E``, top-k
  ids ``8 T k`` (the gate's weight is fp32 in every model dtype: no copy), the renormalisation
  ``4 T (k + 1)``, the aux loss ``4 E``; per pair the row -> token index
  ``8 N``, combine weights ``4 N``, the experts' input and output ``2 e N H``, their gate/up output and
  activation ``3 e N F/etp``; the pair permutation ``8 k n_recv`` (it spans all k pairs of each token
  received). With EP > 1 (all-to-all) ``n_recv = n_send``, the token-rank pairs, ``T ep (1 - C(E - E/ep,
  k) / C(E, k))`` for uniform routing over distinct experts (``n_recv = T`` otherwise), and the
  exchange adds the send index ``8 n_send``, the pair mask ``k n_send`` and the tokens the second
  exchange returns, ``e n_send H``.
- first stage: the token ids ``8 T``; last stage: the final norm, the output layer's input ``e T H``,
  the fp32 logits ``4 T Vp/tp`` (padded vocabulary) and the labels / masks ``10 T``.

Sequence parallelism (``sequence_parallel``): the decoder norms, the q / k / v and dense gate / up
projections' saved input (the chunk: their weight gradients gather it again) and a fully recomputed
layer's saved input hold ``T / tp`` tokens; so do MLA's down projections and their norms (the latents
are gathered). Everything after the gathers (attention, experts, output layer) holds ``T`` tokens.

Context parallelism (``cp``): every per-token term holds this rank's ``T`` tokens, except attention's
gathered keys: GQA's k and v (and, flash, the explicit ``[S, S cp]`` mask; math, probabilities
``[B, heads, S, S cp]``), MLA's gathered latents, its up-projected k and v, and the int64 index
``[S cp]`` restoring sequence order (``S`` = seq_len / cp). Checked against the measured step at cp 2
for GQA (flash) and MLA (math).

Recomputation (``RecomputeConfig``, :mod:`megamoe.transformer.recompute`): ``full`` keeps each layer's
input ``e T H`` (``T / tp`` under SP; the checkpoint's saved inputs), the position ids, and the cos /
sin (held by the checkpoints by reference: ``breakdown["held_by_reference"]``, which the measurement's
hooks do not see). ``selective``: ``core_attn`` keeps the kernel's inputs (q, k, v) instead of its
output and log-sum-exp (or probabilities); ``moe_act`` drops the experts' activation ``e N F/etp``;
``mla_up_proj`` keeps MLA's latents only (no q, k, v, kernel state); ``layernorm``, ``moe`` and ``mlp``
keep their input only (category ``"other"``: saved at layer level). Pipeline: with 1F1B, stage ``s`` of
``pp`` holds ``min(pp - s, num_micro_batches)`` micro-batches' activations at its peak; without
pipelining one.

Not modelled: temporaries (gradients of activations, a recomputed layer's tensors during its backward,
the distributed optimizer's bucket buffers, kernels' workspaces), so ``total`` (state + saved
activations) is not the peak a device reports; ``benchmarks/memory.py`` shows both. Routing is taken as
balanced (EP ranks' token counts vary around it), attention as the kernel ``sdpa_backend`` names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megamoe.models.config import GPTMoEConfig
from megamoe.models.stage_parameters import ParamTensor, model_parameter_counts, stage_parameters, vocab_rows_per_rank
from megamoe.moe.token_dispatcher import dispatcher_class
from megamoe.parallel_plan import default_etp
from megamoe.pipeline.partition import partition_layers
from megamoe.transformer.mla import MLAConfig

if TYPE_CHECKING:
    from megamoe.transformer.recompute import RecomputeConfig

# ParamTensor, stage_parameters and model_parameter_counts live in megamoe.models.stage_parameters (re-exported).
__all__ = ["MemoryEstimate", "StageEstimate", "estimate_memory", "ParamTensor", "model_parameter_counts",
           "stage_parameters"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}
_SDPA_BACKENDS = ("flash", "math")
_ADAM_STEP_BYTES = 4      # torch's (fused) AdamW keeps ``step`` as a 0-d fp32 tensor per parameter


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage's per-rank bytes (expert slots split evenly: every rank of the stage alike)."""

    stage: int
    layer_ids: tuple[int, ...]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int                 # saved for backward, all micro-batches in flight at the peak
    activation_bytes_per_micro_batch: int
    micro_batches_in_flight: int
    dense_param_count: int = 0
    expert_param_count: int = 0
    dense_param_bytes: int = 0            # the routers' fp32 gates included (fp32 in every model dtype)
    dense_optimizer_bytes: int = 0
    expert_optimizer_bytes: int = 0
    norm_activation_bytes: int = 0        # of one micro-batch: the decoder norms' (what SP splits over TP)
    # One micro-batch's activations by category (those of memory_measure, plus "held_by_reference": what
    # checkpoints hold inside non-tensor arguments, which the measurement's hooks cannot see).
    breakdown: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank estimate: ``stages`` (one per pipeline stage); the scalar fields are the most loaded
    stage's (the largest total)."""

    stages: tuple[StageEstimate, ...]

    @property
    def worst(self) -> StageEstimate:
        return max(self.stages, key=lambda s: s.total)

    @property
    def param_bytes(self) -> int:
        return self.worst.param_bytes

    @property
    def grad_bytes(self) -> int:
        return self.worst.grad_bytes

    @property
    def optimizer_bytes(self) -> int:
        return self.worst.optimizer_bytes

    @property
    def activation_bytes(self) -> int:
        return self.worst.activation_bytes

    @property
    def total(self) -> int:
        return self.worst.total


# ---- activations ----------------------------------------------------------------------------------
def _norm_bytes(tokens: int, width: int, rows: int, e: int) -> int:
    """RMSNorm: fp32 input (or copy), rsqrt per row, normalised output."""
    return 4 * tokens * width + 4 * rows + e * tokens * width


def _swiglu_factor(e: int) -> int:
    """[T, F] tensors a SwiGLU MLP keeps (gate and up outputs, the down input): autograd's form also keeps
    silu(gate); the bf16 / fp16 node (:mod:`megamoe.transformer.swiglu`) does not."""
    return 4 if e == 4 else 3


def _sdpa_bytes(*, T: int, B: int, S: int, heads: int, dqk: int, dv: int, e: int, backend: str,
                v_storage: int, recompute_core: bool, cp: int = 1) -> int:
    """What the attention kernel saves: ``flash`` (fused kernels: CUDA's flash / memory-efficient / cuDNN,
    CPU's flash for equal q/k and v head dims) q, k, v, the output and the fp32 log-sum-exp; ``math``
    (CPU when the head dims differ, e.g. MLA) q, k, the probabilities ``[B, heads, S, S]`` and v (an
    fp32 copy in reduced precision). ``v_storage``: the bytes of the storage v is a view of (flash). Under ``core_attn``
    recomputation only the kernel's inputs stay (the checkpoint saves them). Context parallelism: the
    keys and values span the whole sequence (``T cp`` tokens, ``S cp`` per row), and the flash kernel
    also keeps the explicit [S, S cp] mask (converted to the queries' dtype)."""
    qk = e * T * heads * dqk * (1 + cp)
    if recompute_core:
        return qk + e * T * cp * heads * dv
    if backend == "math":
        # CPU's math kernel computes reduced precision in fp32: its saved q, k, probabilities, v are fp32
        # (in fp32 v is kept as the view it is, of ``v_storage``)
        v = v_storage if e == 4 else 4 * T * cp * heads * dv
        return 4 * (T * heads * dqk * (1 + cp) + B * heads * S * S * cp) + v
    mask = e * S * S * cp if cp > 1 else 0
    return qk + v_storage + e * T * heads * dv + 4 * B * heads * S + mask


def _attention_activations(cfg, *, T: int, B: int, S: int, tp: int, e: int, recompute_core: bool,
                           sdpa_backend: str, sp: bool = False, recompute_up_proj: bool = False,
                           cp: int = 1) -> dict[str, int]:
    H = cfg.hidden_size
    # Context parallelism: the keys are gathered over CP, T cp tokens; putting them back in sequence
    # order keeps its int64 index [S cp] (megamoe.transformer.context_parallel.gather_sequence).
    order_index = 8 * S * cp if cp > 1 else 0
    heads_l = cfg.num_attention_heads // tp
    if isinstance(cfg, MLAConfig):
        # Under SP the down projections and their norms run on this rank's T / tp tokens; the latents
        # are gathered to all T on entering the TP region.
        T_down = T // tp if sp else T
        dqk, dv, kv_rank, rope = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        b = e * T_down * H                                                   # the down projections' input
        # kv_a_layernorm: its fp32 input is a view of the whole kv_a output in fp32, a copy of the
        # latent part otherwise; rsqrt; output
        b += 4 * T_down * (kv_rank + (rope if e == 4 else 0)) + 4 * T_down + e * T_down * kv_rank
        q_rank = cfg.q_lora_rank or 0
        if q_rank:
            b += _norm_bytes(T_down, q_rank, T_down, e)                      # q_a output, q_a_layernorm
        b += e * T * (q_rank + kv_rank + rope)                              # the latents inside the TP region
        if not recompute_up_proj:                                           # mla_up_proj keeps the latents only
            if cp > 1:      # the gathered latents (kv_b's input is a view of them) and their order index
                b += e * T * cp * (kv_rank + rope) + order_index
            kv_b = e * T * cp * heads_l * (cfg.qk_nope_head_dim + dv)       # v is a view of kv_b's output
            b += _sdpa_bytes(T=T, B=B, S=S, heads=heads_l, dqk=dqk, dv=dv, e=e, backend=sdpa_backend,
                             v_storage=kv_b, recompute_core=recompute_core, cp=cp)
        b += e * T * heads_l * dv                                           # o_proj input
        return {"attention": b}
    # The q / k / v projections' input: under SP only this rank's chunk (the weight gradients gather it
    # again in backward: comms.gather_linears_from_sequence_parallel_region)
    b = e * (T // tp if sp else T) * H
    d, kv = cfg.head_dim, cfg.num_key_value_heads
    kv_l = kv // min(tp, kv)
    if cfg.qk_norm == "per_head":
        b += _norm_bytes(T, heads_l * d, T * heads_l, e) + _norm_bytes(T, kv_l * d, T * kv_l, e)
    elif cfg.qk_norm == "full_width":
        b += _norm_bytes(T, heads_l * d, T, e) + _norm_bytes(T, kv_l * d, T, e)
    # GQA: SDPA's k and v hold the KV heads only (enable_gqa), each its own storage (under CP: views of
    # the gathered [k, v], for the whole sequence)
    qk_v = e * T * heads_l * d + e * T * cp * 2 * kv_l * d + order_index
    if recompute_core:
        b += qk_v
    elif sdpa_backend == "math":
        b += qk_v + e * B * heads_l * S * S * cp
    else:
        b += qk_v + e * T * heads_l * d + 4 * B * heads_l * S               # + output, log-sum-exp
        b += e * S * S * cp if cp > 1 else 0                               # CP: the explicit [S, S cp] mask
    b += e * T * heads_l * d                                                # o_proj input
    return {"attention": b}


def _none_on_rank(num_experts: int, ep: int, k: int) -> float:
    """The probability that none of a token's k distinct experts (uniform) is on a given one of ep ranks."""
    per_rank = num_experts // ep
    return math.comb(num_experts - per_rank, k) / math.comb(num_experts, k)


def _moe_activations(config: GPTMoEConfig, *, T: int, tp: int, ep: int, etp: int, e: int,
                     recompute_act: bool) -> dict[str, int]:
    moe = config.moe
    H, E, k = moe.hidden_size, moe.num_experts, moe.router.top_k
    F_l = moe.ffn_hidden_size // etp
    gated = 2 if moe.activation in ("swiglu", "swiglu_clamped") else 1
    dispatcher = dispatcher_class(moe.dispatcher)
    if not dispatcher.exchanges_tokens:      # every rank of the reduce group sees the gathered tokens
        N = T * k * (etp if moe.input_sharded else 1) / (1 if moe.input_sharded else ep)
        n_send = n_recv = float(T)
    else:
        N = T * k
        # token-rank pairs: a token is sent once to each rank holding one of its k (distinct) experts
        n_send = n_recv = T * ep * (1 - _none_on_rank(E, ep, k)) if ep > 1 else float(T)
    router = 4 * T * H + 4 * T * E + 8 * T * k + 4 * T * (k + 1) + 4 * E     # its gate is fp32: no weight copy
    # per pair: the row -> token index, the combine weights (fp32), the experts' input, gate/up output,
    # activation and output; the permutation (the pair index) spans the received tokens' k pairs each
    pairs = 8 * N + 4 * N + 2 * e * N * H + e * N * gated * F_l + (0 if recompute_act else e * N * F_l)
    pairs += 8 * k * n_recv
    if dispatcher.exchanges_tokens and ep > 1:
        # the send index (held by the gather of the sent tokens and the combine's index_add), the pair
        # mask, and the tokens returned by the second exchange (the index_add saves them)
        pairs += 8 * n_send + k * n_send + e * n_send * H
    shared = 0
    if moe.shared_experts is not None:
        se = moe.shared_experts
        n = dispatcher.reduce_group_size(ep, etp)
        fs = se.ffn_hidden_size // n
        shared = (_swiglu_factor(e) if se.activation == "swiglu" else 2) * e * T * fs + (4 * T if se.gate else 0)
        if e != 4:
            shared += e * T * H        # their input, which the router saved as an fp32 copy instead
    return {"mlp": int(router + pairs + shared)}


def _layer_activations(config: GPTMoEConfig, layer_id: int, *, T: int, B: int, S: int, tp: int, ep: int, etp: int,
                       e: int, sp: bool, recompute, sdpa_backend: str, cp: int = 1) -> dict[str, int]:
    granularity = getattr(recompute, "granularity", "none") if recompute is not None else "none"
    modules = set(getattr(recompute, "modules", ()) or ()) if granularity == "selective" else set()
    T_norm = T // tp if sp else T
    if granularity == "full":
        return {"other": e * T_norm * config.hidden_size}          # the checkpoint's saved layer input
    H = config.hidden_size
    # Regions checkpointed by the decoder layer itself (layernorm, moe, mlp) keep their input as the
    # checkpoint's saved input, at layer level: category "other".
    out = {"norm": 2 * _norm_bytes(T_norm, H, T_norm, e), "other": 0}
    if "layernorm" in modules:
        out["norm"] = 0
        out["other"] += 2 * e * T_norm * H                         # only the norms' inputs stay
    out.update(_attention_activations(config.attention, T=T, B=B, S=S, tp=tp, e=e,
                                      recompute_core="core_attn" in modules, sdpa_backend=sdpa_backend, sp=sp,
                                      recompute_up_proj="mla_up_proj" in modules, cp=cp))
    if config.is_moe_layer(layer_id):
        if "moe" in modules:
            out["mlp"] = 0
            out["other"] += e * T_norm * H
        else:
            out.update(_moe_activations(config, T=T, tp=tp, ep=ep, etp=etp, e=e, recompute_act="moe_act" in modules))
    else:
        mlp = config.dense_mlp
        f_l = mlp.intermediate_size // tp
        kept = (_swiglu_factor(e) if mlp.activation == "silu" else 4) if mlp.gated else 2
        out["mlp"] = e * T_norm * H + kept * e * T * f_l     # input: the chunk under SP
        if "mlp" in modules:
            out["mlp"] = 0
            out["other"] += e * T_norm * H
    return out


def _resolve_dtype(param_dtype) -> torch.dtype:
    if isinstance(param_dtype, str):
        if param_dtype not in _DTYPES:
            raise ValueError(f"param_dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {param_dtype!r}")
        return _DTYPES[param_dtype]
    return param_dtype


def estimate_memory(config: GPTMoEConfig, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                    dp: int = 1, cp: int = 1, micro_batch: int = 1, seq_len: int = 2048,
                    num_micro_batches: int = 1, num_micro_batches_in_flight: int | None = None,
                    distributed_optimizer: bool = False, zero_stage: int = 1,
                    recompute: "RecomputeConfig | None" = None, sequence_parallel: bool = False,
                    param_dtype: torch.dtype | str = torch.float32, num_expert_slots: int | None = None,
                    pp_split=None, sdpa_backend: str | None = None) -> MemoryEstimate:
    """The per-rank memory of a training step of ``config`` under the layout (see the module docstring).

    ``dp`` is the data-parallel size of the dense grid (``world = tp * cp * dp * pp``); the expert-DP
    size is ``dp * cp * tp / (ep * etp)``. ``etp``: default ``tp`` for the all-to-all dispatcher, 1
    for all-gather. ``num_micro_batches_in_flight`` overrides the schedule's count (1F1B: stage ``s``
    holds ``min(pp - s, num_micro_batches)``). ``num_expert_slots`` overrides the config's.
    ``distributed_optimizer`` shards optimizer state (and with ``zero_stage=2`` the gradients) over DP
    x CP for dense and expert-DP for expert parameters. ``param_dtype`` "fp32" or "bf16" (bf16 params
    keep fp32 master weights in the optimizer). Returns a :class:`MemoryEstimate`."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("dp", dp), ("cp", cp), ("micro_batch", micro_batch),
                        ("seq_len", seq_len), ("num_micro_batches", num_micro_batches)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"estimate_memory: {name} must be an int >= 1, got {value!r}")
    if zero_stage not in (1, 2):
        raise ValueError(f"estimate_memory: zero_stage must be 1 or 2, got {zero_stage!r}")
    if zero_stage == 2 and not distributed_optimizer:
        raise ValueError("estimate_memory: zero_stage=2 requires distributed_optimizer=True")
    etp = default_etp(tp, config.moe.dispatcher if config.moe is not None else None, etp)
    if (tp * cp * dp) % (ep * etp):
        raise ValueError(f"estimate_memory: ep * etp ({ep} * {etp}) must divide tp * cp * dp ({tp * cp * dp})")
    edp = tp * cp * dp // (ep * etp)
    chunks = 2 * cp if cp > 1 else 1          # context parallelism: 2 cp load-balanced chunks
    if seq_len % chunks or (sequence_parallel and seq_len % (cp * tp)):
        raise ValueError(f"estimate_memory: seq_len ({seq_len}) must be divisible by "
                         f"{'2 * ' if cp > 1 else ''}cp ({cp})"
                         + (f" and by cp * tp ({cp} * {tp}) under sequence parallelism" if sequence_parallel else ""))
    if sdpa_backend is None:
        sdpa_backend = "flash"
    if sdpa_backend not in _SDPA_BACKENDS:
        raise ValueError(f"estimate_memory: sdpa_backend must be one of {_SDPA_BACKENDS}, got {sdpa_backend!r}")
    dtype = _resolve_dtype(param_dtype)
    e = torch.empty((), dtype=dtype).element_size()
    S = seq_len // cp
    B, T = micro_batch, micro_batch * seq_len // cp
    stages = []
    for stage, layer_ids in enumerate(partition_layers(config.num_layers, pp, pp_split)):
        params = stage_parameters(config, tp=tp, pp=pp, pp_rank=stage, ep=ep, etp=etp,
                                  num_expert_slots=num_expert_slots, pp_split=pp_split)
        dense = sum(p.numel for p in params if not p.expert)
        expert = sum(p.numel for p in params if p.expert)
        # The routers' and shared experts' gates are held in fp32 in every model dtype
        # (precision.hold_in_compute_dtype_): fp32 parameters beside the others, without a master copy.
        fp32 = [p for p in params if _held_in_fp32(p)] if e != 4 else []
        others = [p for p in params if not _held_in_fp32(p)] if fp32 else params
        param_bytes = sum(p.numel for p in others) * e + sum(p.numel for p in fp32) * 4
        grad_bytes, opt_dense, opt_expert = _grad_and_optimizer_bytes(
            others, e=e, distributed=distributed_optimizer, zero_stage=zero_stage, dp=dp * cp, edp=edp,
            master=dtype != torch.float32)
        if fp32:
            fp32_grads, fp32_dense, fp32_expert = _grad_and_optimizer_bytes(
                fp32, e=4, distributed=True, zero_stage=zero_stage, dp=dp * cp if distributed_optimizer else 1,
                edp=edp if distributed_optimizer else 1, master=False)
            grad_bytes, opt_dense, opt_expert = (grad_bytes + fp32_grads, opt_dense + fp32_dense,
                                                 opt_expert + fp32_expert)
        acts = _stage_activations(config, layer_ids, first=stage == 0, last=stage == pp - 1, T=T, B=B, S=S,
                                  tp=tp, ep=ep, etp=etp, e=e, sp=sequence_parallel, recompute=recompute,
                                  sdpa_backend=sdpa_backend, cp=cp)
        per_mb = sum(acts.values())
        in_flight = (num_micro_batches_in_flight if num_micro_batches_in_flight is not None
                     else (min(pp - stage, num_micro_batches) if pp > 1 else 1))
        stages.append(StageEstimate(
            stage=stage, layer_ids=tuple(layer_ids), param_bytes=param_bytes, grad_bytes=grad_bytes,
            optimizer_bytes=opt_dense + opt_expert, activation_bytes=per_mb * in_flight,
            activation_bytes_per_micro_batch=per_mb, micro_batches_in_flight=in_flight,
            dense_param_count=dense, expert_param_count=expert, dense_param_bytes=param_bytes - expert * e,
            dense_optimizer_bytes=opt_dense,
            expert_optimizer_bytes=opt_expert, norm_activation_bytes=acts.get("norm", 0), breakdown=acts))
    return MemoryEstimate(tuple(stages))


def _stage_activations(config, layer_ids, *, first, last, T, B, S, tp, ep, etp, e, sp, recompute,
                       sdpa_backend, cp: int = 1) -> dict[str, int]:
    out = dict.fromkeys(("embedding", "norm", "attention", "mlp", "lm_head", "other"), 0)
    out["held_by_reference"] = 0
    if first:
        out["embedding"] += 8 * T
    if layer_ids:
        rope_dim = config.attention.rope.dim          # qk_rope_head_dim (MLA); <= head_dim (partial rotary)
        rope = 2 * 4 * B * S * (rope_dim // 2)                   # fp32 cos / sin, shared by the layers
        full = getattr(recompute, "granularity", "none") == "full"
        if e != 4 and not full:
            # In reduced precision each rotation (q and k) saves its own cos / sin cast to the input's
            # dtype, per layer; the fp32 ones are not saved.
            rope = len(layer_ids) * 2 * 2 * e * B * S * (rope_dim // 2)
        if full:
            # The layers' checkpoints hold the cos / sin (by reference: a tuple argument, which the
            # measurement's hooks do not see) and save the position ids (an expanded [S] arange).
            out["held_by_reference"] = rope
            out["other"] += 8 * S
        else:
            out["attention"] += rope
    moe_ids, per_kind = frozenset(config.moe_layer_ids), {}     # the same bytes for every MoE / dense layer
    for i in layer_ids:
        if (i in moe_ids) not in per_kind:
            per_kind[i in moe_ids] = _layer_activations(config, i, T=T, B=B, S=S, tp=tp, ep=ep, etp=etp, e=e, sp=sp,
                                                        recompute=recompute, sdpa_backend=sdpa_backend, cp=cp)
        for category, nbytes in per_kind[i in moe_ids].items():
            out[category] += nbytes
    if last:
        H, V_local = config.hidden_size, vocab_rows_per_rank(config, tp)
        T_norm = T // tp if sp else T
        out["norm"] += _norm_bytes(T_norm, H, T_norm, e)
        out["lm_head"] += e * T * H + 4 * T * V_local + 10 * T
    return out


def _held_in_fp32(p: ParamTensor) -> bool:
    """A router's or the shared experts' gate (weight, bias): fp32 in every model dtype."""
    return ".router." in p.name or p.name.endswith("shared_experts.gate_weight")


def _grad_and_optimizer_bytes(params: list[ParamTensor], *, e: int, distributed: bool, zero_stage: int, dp: int,
                              edp: int, master: bool) -> tuple[int, int, int]:
    """(gradient bytes, dense optimizer bytes, expert optimizer bytes) of one rank."""
    numel = sum(p.numel for p in params)
    if not distributed and not master:
        def adam(ps):
            return sum(2 * p.numel * e + _ADAM_STEP_BYTES for p in ps)
        return numel * e, adam([p for p in params if not p.expert]), adam([p for p in params if p.expert])
    # DistributedOptimizer (also unsharded, groups of one rank, for non-fp32 parameters): each parameter
    # viewed as [rows, n], every row padded to a multiple of its group's size N and cut in N; this rank
    # keeps fp32 [rows, ceil(n / N)] moments (and master weights for non-fp32 parameters) plus a 4-byte
    # step, and an fp32 reduced-gradient shard of the same size until the step.
    def shard_numel(p: ParamTensor) -> int:
        n = (edp if p.expert else dp) if distributed else 1
        return p.rows * math.ceil(p.numel // p.rows / n)

    per_element = 4 * (3 if master else 2)
    opt = {flag: sum(per_element * shard_numel(p) + _ADAM_STEP_BYTES for p in params if p.expert == flag)
           for flag in (False, True)}
    grad_shards = sum(4 * shard_numel(p) for p in params)
    if zero_stage == 2:             # ZeRO-2 frees p.grad (and the fp32 accumulation) after the reduce-scatter
        return grad_shards, opt[False], opt[True]
    if not master:                  # fp32: p.grad besides the shards
        return grad_shards + numel * e, opt[False], opt[True]
    # Non-fp32 parameters accumulate in an fp32 buffer (p.main_grad) instead of p.grad: 4 bytes per element,
    # besides the shards, except in a group of one rank, where the buffer is the shard.
    def is_solo(p: ParamTensor) -> bool:
        return not distributed or (edp if p.expert else dp) == 1
    grads = sum(4 * p.numel + (0 if is_solo(p) else 4 * shard_numel(p)) for p in params)
    return grads, opt[False], opt[True]
