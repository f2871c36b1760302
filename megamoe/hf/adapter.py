"""Declarative key maps between HuggingFace checkpoints and megamoe logical tensors: the machinery
(:class:`HFAdapter`) and the key tables the families share. Each family's map is a module of
:mod:`megamoe.hf.families`; :mod:`megamoe.hf.adapters` finds it by ``model_type``.

A logical name is what :func:`megamoe.checkpoint_state.sharded_state_dict` lists for a
:class:`~megamoe.models.GPTMoEModel` (full, unsharded tensors; routed experts per expert id).

Two HF forms (transformers 5.24)
--------------------------------
- **checkpoint** (``fused=False``): what ``save_pretrained`` writes and ``from_pretrained`` reads. Every
  family stores routed experts per expert: ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``,
  and Mixtral keeps its original ``model.layers.{i}.block_sparse_moe.{gate.weight, experts.{e}.w1/w3/w2.weight}``
  (w1 = gate, w3 = up, w2 = down), as does MiniMax-M2 (plus ``block_sparse_moe.e_score_correction_bias``).
- **fused** (``fused=True``): what ``model.state_dict()`` returns in memory: per MoE layer
  ``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2F, H] (gate rows first, then up, per expert) and
  ``model.layers.{i}.mlp.experts.down_proj`` [E, H, F]; Mixtral's and MiniMax-M2's module is ``mlp``
  there, not ``block_sparse_moe``.

Every other key is the same in both forms and differs from the logical name only by the ``model.`` prefix,
except: the router ``mlp.gate.weight`` is ``mlp.router.weight``, DeepSeek-V3's and GLM-4.5's
``mlp.gate.e_score_correction_bias`` (MiniMax-M2's ``mlp.e_score_correction_bias``, on the block) is
``mlp.router.expert_bias``, shared experts (``mlp.shared_expert.*`` in Qwen2-MoE,
``mlp.shared_experts.*`` in DeepSeek and GLM-4.5) are raw parameters
``mlp.shared_experts.{gate,up,down}_proj`` (no ``.weight``), and Qwen2-MoE's
``mlp.shared_expert_gate.weight`` [1, H] is ``mlp.shared_experts.gate_weight``.

DeepSeek-V3's and GLM-4.5's multi-token-prediction layers (``config.mtp_num_layers``, :mod:`megamoe.models.mtp`): layer
``L + k`` (L = num_layers) has a decoder layer's keys under ``model.layers.{L+k}.`` like any layer, plus
``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight`` and ``shared_head.norm.weight`` (logical
``layers.{L+k}.<same>``), and copies of the main embedding and output layer, ``embed_tokens.weight`` and
``shared_head.head.weight``: the model shares those, so each joins the main tensor's step, which checks
on import that the copies are bit-identical to it and writes them back from it on export.

gpt-oss (transformers 5.24 has no conversion mapping for it: both forms are the same) stores its experts
fused with biases: ``mlp.experts.gate_up_proj`` [E, H, 2F] (gate and up INTERLEAVED along the last dim:
column 2j is gate feature j, 2j + 1 up feature j), ``gate_up_proj_bias`` [E, 2F] (interleaved alike),
``down_proj`` [E, F, H] (transposed to nn.Linear's layout) and ``down_proj_bias`` [E, H]; the logical
tensors are per expert ``experts.{e}.{gate,up,down}_proj.{weight,bias}`` in nn.Linear layout. Its router
is ``mlp.router.{weight,bias}`` and its attention sinks ``self_attn.sinks``. Import also reads the released
MXFP4 form (:mod:`megamoe.quantization.mxfp4`): ``gate_up_proj_blocks`` [E, 2F, H / 32, 16] +
``gate_up_proj_scales`` [E, 2F, H / 32] (rows interleaved gate / up) and ``down_proj_blocks`` /
``down_proj_scales`` (rows = H), dequantized to fp32 (exact) by an import-only step; export writes the
unquantized form.

Ignored on import: ``lm_head.weight`` of a model with tied embeddings (``state_dict()`` lists the tied
alias; checkpoints omit it) and the multi-token-prediction layers past the config's
(``model.layers.{num_layers + mtp_num_layers}.*``: the MTP weights of a config built without them), which
transformers ignores as well.

Streaming
---------
A conversion is a list of :class:`KeyTransform` steps (:meth:`HFAdapter.transforms`), each turning a few
named tensors of one side into a few of the other, with every shape known from the config. The
``iter_*`` methods consume ``(key, tensor)`` pairs in any order and yield results as soon as a step has
all its inputs, so only the inputs of unfinished steps are held; given a Mapping, the dict methods read
it in step order (one step's inputs at a time). Every input key must be consumed exactly once; unknown
keys, duplicates, missing keys and shape mismatches raise :class:`AdapterError` naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch

from megamoe.hf.block_fp8_steps import HFWeightForm, block_fp8_steps
from megamoe.hf.key_transforms import AdapterError, KeyTransform, Shape, Tensors, _identity, _in_step_order, _run
from megamoe.models.config import GPTMoEConfig

__all__ = ["AdapterError", "KeyTransform", "HFAdapter", "Rename", "ExpertKeys", "LOGICAL_EXPERT_KEYS"]

# ----------------------------------------------------------------------------------------------
# The declarative tables
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rename:
    """One tensor under two names. ``{i}`` is the layer index. ``fused``: None when the HF name is the
    same in both forms, else the form (True: in-memory state_dict, False: checkpoint) it belongs to."""

    hf: str
    logical: str
    shape: Callable[[GPTMoEConfig], Shape]
    when: Callable[[GPTMoEConfig], bool] = lambda c: True
    fused: bool | None = None


@dataclass(frozen=True)
class ExpertKeys:
    """How a family names its routed experts: checkpoint keys per expert (``{i}`` layer, ``{e}`` expert:
    gate, up, down) and the fused in-memory keys (gate_up, down)."""

    per_expert: tuple[str, str, str]
    fused: tuple[str, str]


def _q_out(c):
    a = c.attention
    return a.num_attention_heads * a.head_dim


def _kv_out(c):
    a = c.attention
    return a.num_key_value_heads * a.head_dim


def _mla_q_out(c):
    a = c.attention
    return a.num_attention_heads * a.qk_head_dim


_L = "model.layers.{i}."        # HF per-layer prefix
_P = "layers.{i}."              # logical per-layer prefix

GLOBAL_KEYS = (
    Rename("model.embed_tokens.weight", "embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size)),
    Rename("model.norm.weight", "norm.weight", lambda c: (c.hidden_size,)),
    Rename("lm_head.weight", "lm_head.weight", lambda c: (c.vocab_size, c.hidden_size),
           when=lambda c: not c.tie_word_embeddings),
)

LAYER_NORM_KEYS = tuple(
    Rename(f"{_L}{n}.weight", f"{_P}{n}.weight", lambda c: (c.hidden_size,))
    for n in ("input_layernorm", "post_attention_layernorm"))

GQA_ATTENTION_KEYS = (
    Rename(f"{_L}self_attn.q_proj.weight", f"{_P}self_attn.q_proj.weight", lambda c: (_q_out(c), c.hidden_size)),
    Rename(f"{_L}self_attn.q_proj.bias", f"{_P}self_attn.q_proj.bias", lambda c: (_q_out(c),),
           when=lambda c: c.attention.qkv_bias),
    *(r for n in ("k_proj", "v_proj") for r in (
        Rename(f"{_L}self_attn.{n}.weight", f"{_P}self_attn.{n}.weight", lambda c: (_kv_out(c), c.hidden_size)),
        Rename(f"{_L}self_attn.{n}.bias", f"{_P}self_attn.{n}.bias", lambda c: (_kv_out(c),),
               when=lambda c: c.attention.qkv_bias))),
    Rename(f"{_L}self_attn.o_proj.weight", f"{_P}self_attn.o_proj.weight", lambda c: (c.hidden_size, _q_out(c))),
    Rename(f"{_L}self_attn.o_proj.bias", f"{_P}self_attn.o_proj.bias", lambda c: (c.hidden_size,),
           when=lambda c: c.attention.o_proj_bias),
    Rename(f"{_L}self_attn.q_norm.weight", f"{_P}self_attn.q_norm.weight",
           lambda c: (c.attention.head_dim if c.attention.qk_norm == "per_head" else _q_out(c),),
           when=lambda c: c.attention.qk_norm is not None),
    Rename(f"{_L}self_attn.k_norm.weight", f"{_P}self_attn.k_norm.weight",
           lambda c: (c.attention.head_dim if c.attention.qk_norm == "per_head" else _kv_out(c),),
           when=lambda c: c.attention.qk_norm is not None),
)


def _mla_key(name: str, shape, when=lambda c: True) -> Rename:
    return Rename(f"{_L}self_attn.{name}", f"{_P}self_attn.{name}", shape, when)


_NO_Q_LORA = lambda c: c.attention.q_lora_rank is None            # noqa: E731
_Q_LORA = lambda c: c.attention.q_lora_rank is not None           # noqa: E731
_MLA_BIAS = lambda c: c.attention.attention_bias                  # noqa: E731

MLA_ATTENTION_KEYS = (
    _mla_key("q_proj.weight", lambda c: (_mla_q_out(c), c.hidden_size), _NO_Q_LORA),
    _mla_key("q_a_proj.weight", lambda c: (c.attention.q_lora_rank, c.hidden_size), _Q_LORA),
    _mla_key("q_a_proj.bias", lambda c: (c.attention.q_lora_rank,), lambda c: _Q_LORA(c) and _MLA_BIAS(c)),
    _mla_key("q_a_layernorm.weight", lambda c: (c.attention.q_lora_rank,), _Q_LORA),
    _mla_key("q_b_proj.weight", lambda c: (_mla_q_out(c), c.attention.q_lora_rank), _Q_LORA),
    _mla_key("kv_a_proj_with_mqa.weight",
             lambda c: (c.attention.kv_lora_rank + c.attention.qk_rope_head_dim, c.hidden_size)),
    _mla_key("kv_a_proj_with_mqa.bias", lambda c: (c.attention.kv_lora_rank + c.attention.qk_rope_head_dim,),
             _MLA_BIAS),
    _mla_key("kv_a_layernorm.weight", lambda c: (c.attention.kv_lora_rank,)),
    _mla_key("kv_b_proj.weight", lambda c: (
        c.attention.num_attention_heads * (c.attention.qk_nope_head_dim + c.attention.v_head_dim),
        c.attention.kv_lora_rank)),
    _mla_key("o_proj.weight", lambda c: (c.hidden_size, c.attention.num_attention_heads * c.attention.v_head_dim)),
    _mla_key("o_proj.bias", lambda c: (c.hidden_size,), _MLA_BIAS),
)

_DENSE_INTER = lambda c: c.dense_mlp.intermediate_size            # noqa: E731

DENSE_MLP_KEYS = (
    Rename(f"{_L}mlp.gate_proj.weight", f"{_P}mlp.gate_proj.weight", lambda c: (_DENSE_INTER(c), c.hidden_size),
           when=lambda c: c.dense_mlp.gated),
    Rename(f"{_L}mlp.gate_proj.bias", f"{_P}mlp.gate_proj.bias", lambda c: (_DENSE_INTER(c),),
           when=lambda c: c.dense_mlp.gated and c.dense_mlp.bias),
    Rename(f"{_L}mlp.up_proj.weight", f"{_P}mlp.up_proj.weight", lambda c: (_DENSE_INTER(c), c.hidden_size)),
    Rename(f"{_L}mlp.up_proj.bias", f"{_P}mlp.up_proj.bias", lambda c: (_DENSE_INTER(c),),
           when=lambda c: c.dense_mlp.bias),
    Rename(f"{_L}mlp.down_proj.weight", f"{_P}mlp.down_proj.weight", lambda c: (c.hidden_size, _DENSE_INTER(c))),
    Rename(f"{_L}mlp.down_proj.bias", f"{_P}mlp.down_proj.bias", lambda c: (c.hidden_size,),
           when=lambda c: c.dense_mlp.bias),
)


def router_keys(module: str, fused: bool | None = None) -> tuple[Rename, ...]:
    """The router of an HF MoE module named ``module`` (``mlp`` / Mixtral's ``block_sparse_moe``)."""
    return (
        Rename(f"{_L}{module}.gate.weight", f"{_P}mlp.router.weight",
               lambda c: (c.moe.num_experts, c.hidden_size), fused=fused),
        Rename(f"{_L}{module}.gate.e_score_correction_bias", f"{_P}mlp.router.expert_bias",
               lambda c: (c.moe.num_experts,), when=lambda c: c.moe.router.use_expert_bias, fused=fused),
    )


_SHARED_FFN = lambda c: c.moe.shared_experts.ffn_hidden_size     # noqa: E731
_HAS_SHARED = lambda c: c.moe.shared_experts is not None           # noqa: E731


def shared_expert_keys(module: str) -> tuple[Rename, ...]:
    """Shared experts held by the HF submodule ``mlp.<module>`` (a plain gated MLP)."""
    return (
        Rename(f"{_L}mlp.{module}.gate_proj.weight", f"{_P}mlp.shared_experts.gate_proj",
               lambda c: (_SHARED_FFN(c), c.hidden_size), when=_HAS_SHARED),
        Rename(f"{_L}mlp.{module}.up_proj.weight", f"{_P}mlp.shared_experts.up_proj",
               lambda c: (_SHARED_FFN(c), c.hidden_size), when=_HAS_SHARED),
        Rename(f"{_L}mlp.{module}.down_proj.weight", f"{_P}mlp.shared_experts.down_proj",
               lambda c: (c.hidden_size, _SHARED_FFN(c)), when=_HAS_SHARED),
    )


def block_router_keys(module: str, fused: bool) -> tuple[Rename, ...]:
    """MiniMax-M2's router: ``{module}.gate.weight``, and the selection bias held by the MoE block itself
    rather than by its gate, ``{module}.e_score_correction_bias``."""
    return (
        Rename(f"{_L}{module}.gate.weight", f"{_P}mlp.router.weight", lambda c: (c.moe.num_experts, c.hidden_size),
               fused=fused),
        Rename(f"{_L}{module}.e_score_correction_bias", f"{_P}mlp.router.expert_bias", lambda c: (c.moe.num_experts,),
               when=lambda c: c.moe.router.use_expert_bias, fused=fused),
    )


SHARED_EXPERT_GATE_KEY = Rename(f"{_L}mlp.shared_expert_gate.weight", f"{_P}mlp.shared_experts.gate_weight",
                                lambda c: (1, c.hidden_size),
                                when=lambda c: _HAS_SHARED(c) and c.moe.shared_experts.gate)

MIXTRAL_EXPERT_KEYS = tuple(f"{_L}block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2"))

STANDARD_EXPERTS = ExpertKeys(
    per_expert=(f"{_L}mlp.experts.{{e}}.gate_proj.weight", f"{_L}mlp.experts.{{e}}.up_proj.weight",
                f"{_L}mlp.experts.{{e}}.down_proj.weight"),
    fused=(f"{_L}mlp.experts.gate_up_proj", f"{_L}mlp.experts.down_proj"))

GQA_LAYER_KEYS = LAYER_NORM_KEYS + GQA_ATTENTION_KEYS
MLA_LAYER_KEYS = LAYER_NORM_KEYS + MLA_ATTENTION_KEYS

LOGICAL_EXPERT_KEYS = (f"{_P}mlp.experts.{{e}}.gate_proj.weight", f"{_P}mlp.experts.{{e}}.up_proj.weight",
                       f"{_P}mlp.experts.{{e}}.down_proj.weight")


MTP_OWN_KEYS = tuple(Rename(f"{_L}{n}.weight", f"{_P}{n}.weight", lambda c: (c.hidden_size,))
                      for n in ("enorm", "hnorm", "shared_head.norm")) + (
    Rename(f"{_L}eh_proj.weight", f"{_P}eh_proj.weight", lambda c: (c.hidden_size, 2 * c.hidden_size)),)


def past_last_layer(key: str, config: GPTMoEConfig) -> bool:
    """Layers after the decoder and MTP layers the config builds: DeepSeek-V3's and GLM-4.5's MTP layers when
    the config leaves them out (transformers skips them too)."""
    if not key.startswith("model.layers."):
        return False
    index = key.split(".")[2]
    return index.isdigit() and int(index) >= config.num_layers + config.mtp_num_layers


def tied_lm_head(key: str, config: GPTMoEConfig) -> bool:
    return key == "lm_head.weight" and config.tie_word_embeddings


# ----------------------------------------------------------------------------------------------
# Expansion of the tables into steps for one config
# ----------------------------------------------------------------------------------------------
def _rename_step(hf: str, logical: str, shape: Shape) -> KeyTransform:
    return KeyTransform((hf,), (shape,), (logical,), (shape,), _identity, _identity)


def _split_gate_up(num_experts: int, ffn: int):
    def to_logical(tensors: Tensors) -> Tensors:
        gate_up = tensors[0]                                     # [E, 2F, H]
        return [gate_up[e, :ffn] for e in range(num_experts)] + [gate_up[e, ffn:] for e in range(num_experts)]

    def to_hf(tensors: Tensors) -> Tensors:
        gates, ups = tensors[:num_experts], tensors[num_experts:]
        return [torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)])]    # [E, 2F, H]
    return to_logical, to_hf


def _split_down(num_experts: int):
    def to_logical(tensors: Tensors) -> Tensors:
        return list(tensors[0].unbind(0))                        # E x [H, F]

    def to_hf(tensors: Tensors) -> Tensors:
        return [torch.stack(list(tensors))]                      # [E, H, F]
    return to_logical, to_hf


def _shared_copies(main: str, copies: list[str]):
    """One logical tensor stored under ``main`` and as the bit-identical ``copies`` (see the module docstring)."""
    def to_logical(tensors: Tensors) -> Tensors:
        for key, copy in zip(copies, tensors[1:]):
            if copy.device.type != "meta" and not (copy.dtype == tensors[0].dtype and torch.equal(copy, tensors[0])):
                raise AdapterError(f"{key!r} differs from {main!r}: the MTP layers share the main embedding and "
                                   "output layer, so their copies must be bit-identical to them (DeepSeek's "
                                   "releases are)")
        return tensors[:1]

    def to_hf(tensors: Tensors) -> Tensors:
        # Copies, not aliases: safetensors writers refuse tensors sharing memory.
        return [tensors[0]] + [tensors[0].clone() for _ in copies]
    return to_logical, to_hf


def _mtp_shared_steps(config: GPTMoEConfig, global_steps: list[KeyTransform]) -> list[KeyTransform]:
    """``global_steps`` with the MTP layers' embedding / head copies joined to the main tensors' steps."""
    layers = list(config.mtp_layer_ids)
    embed_copies = [f"model.layers.{i}.embed_tokens.weight" for i in layers]
    head_copies = [f"model.layers.{i}.shared_head.head.weight" for i in layers]
    joins = {"embed_tokens.weight": embed_copies + (head_copies if config.tie_word_embeddings else []),
             "lm_head.weight": [] if config.tie_word_embeddings else head_copies}
    steps = []
    for step in global_steps:
        copies = joins.get(step.logical_keys[0]) if step.is_rename else None
        if not copies:
            steps.append(step)
            continue
        main, shape = step.hf_keys[0], step.hf_shapes[0]
        to_logical, to_hf = _shared_copies(main, copies)
        steps.append(KeyTransform((main, *copies), (shape,) * (1 + len(copies)), step.logical_keys,
                                  step.logical_shapes, to_logical, to_hf,
                                  what=f"{main} and its MTP copies"))
    return steps


def _expert_steps(keys: ExpertKeys, config: GPTMoEConfig, layer: int, fused: bool) -> list[KeyTransform]:
    moe = config.moe
    if moe.activation != "swiglu":
        raise AdapterError(f"HF MoE families have gated (swiglu) experts; the config's experts use "
                           f"{moe.activation!r}")
    E, F, H = moe.num_experts, moe.ffn_hidden_size, config.hidden_size
    logical = [[t.format(i=layer, e=e) for e in range(E)] for t in LOGICAL_EXPERT_KEYS]     # gate, up, down
    if not fused:
        shapes = ((F, H), (F, H), (H, F))
        return [_rename_step(hf.format(i=layer, e=e), logical[k][e], shapes[k])
                for e in range(E) for k, hf in enumerate(keys.per_expert)]
    gate_up_to_logical, gate_up_to_hf = _split_gate_up(E, F)
    down_to_logical, down_to_hf = _split_down(E)
    return [
        KeyTransform((keys.fused[0].format(i=layer),), ((E, 2 * F, H),), tuple(logical[0] + logical[1]),
                     ((F, H),) * (2 * E), gate_up_to_logical, gate_up_to_hf,
                     what="split fused gate_up into per-expert gate/up"),
        KeyTransform((keys.fused[1].format(i=layer),), ((E, H, F),), tuple(logical[2]), ((H, F),) * E,
                     down_to_logical, down_to_hf, what="split fused down into per-expert down"),
    ]


_TRANSFORMS_CACHE: dict[tuple, tuple] = {}
_TRANSFORMS_CACHE_SIZE = 16


@dataclass(frozen=True)
class HFAdapter:
    """The key map of one HF family: which :class:`Rename` tables apply where, how its routed experts are
    named, and which HF keys are deliberately dropped on import."""

    model_type: str
    layer_keys: tuple[Rename, ...]          # every layer (norms, attention)
    dense_keys: tuple[Rename, ...]          # layers with a dense MLP
    moe_keys: tuple[Rename, ...]            # MoE layers, besides the routed experts
    experts: ExpertKeys
    global_keys: tuple[Rename, ...] = GLOBAL_KEYS
    ignored: tuple[Callable[[str, GPTMoEConfig], bool], ...] = (tied_lm_head,)
    mtp_keys: tuple[Rename, ...] = ()      # an MTP layer's own keys, besides a decoder layer's (DeepSeek-V3)
    # How the HF side stores block-FP8-quantizable weights; None: as the config's weight_quantization
    # says the megamoe side does (see megamoe.hf.block_fp8_steps). Set with with_hf_weights().
    hf_weights: HFWeightForm | None = None

    def with_hf_weights(self, form: HFWeightForm | None) -> "HFAdapter":
        """This adapter for HF files whose quantizable weights are stored as ``form`` says."""
        return dataclasses.replace(self, hf_weights=form)

    def _hf_quantization(self, config: GPTMoEConfig):
        return config.weight_quantization if self.hf_weights is None else self.hf_weights.quantization
    # A family whose experts ExpertKeys cannot describe: (config, layer, fused) -> its expert steps.
    expert_steps: Callable[[GPTMoEConfig, int, bool], list[KeyTransform]] | None = None
    # Steps of a third HF form that only import reads (a quantized release): (config, layer) -> steps.
    import_only_steps: Callable[[GPTMoEConfig, int], list[KeyTransform]] | None = None

    # ---- planning -----------------------------------------------------------------------------
    def transforms(self, config: GPTMoEConfig, fused: bool) -> tuple[KeyTransform, ...]:
        """Every step converting a whole model of ``config`` in the given HF form, in model order.
        Built once per (adapter, config, form): a conversion asks for them several times, and a large
        model has tens of thousands of steps. With block-FP8 weights on either side there is only the
        checkpoint form (the scales are per expert), which both forms then give."""
        if config.weight_quantization is not None or self._hf_quantization(config) is not None:
            fused = False
        key = (self, repr(config), fused)
        steps = _TRANSFORMS_CACHE.get(key)
        if steps is None:
            if len(_TRANSFORMS_CACHE) >= _TRANSFORMS_CACHE_SIZE:
                _TRANSFORMS_CACHE.clear()
            steps = _TRANSFORMS_CACHE[key] = tuple(self._build_transforms(config, fused))
        return steps

    def _build_transforms(self, config: GPTMoEConfig, fused: bool) -> list[KeyTransform]:
        def renames(table, layer=None):
            return [_rename_step(r.hf.format(i=layer), r.logical.format(i=layer), r.shape(config))
                    for r in table if r.fused in (None, fused) and r.when(config)]

        if config.mtp_num_layers and not self.mtp_keys:
            raise AdapterError(f"{self.model_type} checkpoints have no multi-token-prediction layers, but the config "
                               f"has mtp_num_layers={config.mtp_num_layers}")
        steps = renames(self.global_keys)
        if config.mtp_num_layers:
            steps = _mtp_shared_steps(config, steps)
        for layer in range(config.total_layers):
            steps += renames(self.layer_keys, layer)
            if config.is_moe_layer(layer):
                steps += renames(self.moe_keys, layer)
                steps += (_expert_steps(self.experts, config, layer, fused) if self.expert_steps is None
                          else self.expert_steps(config, layer, fused))
            else:
                steps += renames(self.dense_keys, layer)
            if layer >= config.num_layers:
                steps += renames(self.mtp_keys, layer)
        dtype = torch.float32 if self.hf_weights is None else self.hf_weights.dtype
        try:
            return block_fp8_steps(steps, config.weight_quantization, self._hf_quantization(config), dtype,
                                   _rename_step, KeyTransform)
        except ValueError as e:
            raise AdapterError(str(e)) from None

    def renames(self, config: GPTMoEConfig) -> dict[str, str]:
        """logical name -> HF key of the tensors stored under both names unchanged (checkpoint form):
        their bytes can be copied between the two files without being read."""
        return {step.logical_keys[0]: step.hf_keys[0] for step in self.transforms(config, fused=False)
                if step.is_rename}

    def is_ignored(self, hf_key: str, config: GPTMoEConfig) -> bool:
        return any(rule(hf_key, config) for rule in self.ignored)

    # ---- HF -> megamoe ------------------------------------------------------------------------
    def iter_hf_to_megamoe(self, hf_items: Iterable[tuple[str, torch.Tensor]],
                           config: GPTMoEConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Logical ``(name, tensor)`` pairs from HF pairs in either form (even mixed per layer)."""
        steps = self._both_forms(config)
        yield from _run(hf_items, steps, to_logical=True,
                        skip=lambda key: self.is_ignored(key, config), side="HF")

    def hf_to_megamoe(self, hf_state: Mapping[str, torch.Tensor], config: GPTMoEConfig) -> dict[str, torch.Tensor]:
        """All logical tensors of ``config`` from an HF state dict (checkpoint or fused form)."""
        steps = self._both_forms(config)
        return dict(self.iter_hf_to_megamoe(_in_step_order(hf_state, steps, to_logical=True), config))

    def _both_forms(self, config: GPTMoEConfig) -> list[KeyTransform]:
        steps, seen = [], set()
        for fused in (False, True):
            for step in self.transforms(config, fused):
                if step.hf_keys not in seen:
                    seen.add(step.hf_keys)
                    steps.append(step)
        if self.import_only_steps is not None:
            steps += [step for layer in config.moe_layer_ids for step in self.import_only_steps(config, layer)]
        return steps

    # ---- megamoe -> HF ------------------------------------------------------------------------
    def iter_megamoe_to_hf(self, logical_items: Iterable[tuple[str, torch.Tensor]], config: GPTMoEConfig,
                           fused: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """HF ``(key, tensor)`` pairs in the checkpoint form (``fused=False``) or the in-memory form."""
        yield from _run(logical_items, self.transforms(config, fused), to_logical=False, skip=lambda key: False,
                        side="logical")

    def megamoe_to_hf(self, logical: Mapping[str, torch.Tensor], config: GPTMoEConfig,
                      fused: bool) -> dict[str, torch.Tensor]:
        """The HF state dict of a model given all its logical tensors."""
        steps = self.transforms(config, fused)
        return dict(self.iter_megamoe_to_hf(_in_step_order(logical, steps, to_logical=False), config, fused))
