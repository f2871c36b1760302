"""The configuration of a decoder-only MoE language model, composed of the blocks' own configs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from megamoe.moe.experts.fp8 import FP8Config
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.quantization.block_fp8 import BlockFP8Config
from megamoe.transformer.attention import AttentionConfig
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.mlp import MLPConfig
from megamoe.transformer.recompute import RecomputeConfig, recompute_from_dict
from megamoe.transformer.rope import RopeConfig

__all__ = ["GPTMoEConfig"]


@dataclass
class GPTMoEConfig:
    """``num_layers`` decoder layers; those in ``moe_layer_ids`` use ``moe``, the others ``dense_mlp``.

    Build one by hand, or from a HuggingFace config with :func:`megamoe.models.families.config_from_hf`.
    :meth:`to_dict` / :meth:`from_dict` convert to and from plain JSON values (the checkpoint manifest
    stores the config that way); the attention dict carries ``kind``: ``"gqa"`` or ``"mla"``.
    ``recompute`` (:class:`~megamoe.transformer.recompute.RecomputeConfig`) chooses what backward
    recomputes instead of storing; an engine field, like the MoE dispatcher: a checkpoint resumes
    under any choice.
    """

    family: str                          # HF model_type this config reproduces ("custom" otherwise)
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: AttentionConfig | MLAConfig
    moe: MoEConfig | None
    moe_layer_ids: tuple[int, ...]
    dense_mlp: MLPConfig | None = None
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    init_std: float = 0.02
    # How the engine trades compute for activation memory (megamoe.transformer.recompute); not part of
    # what the model is: a checkpoint resumes under another choice.
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    # Under tensor parallelism: norms, residuals and dropout run on sequence shards [B, S / tp, H]
    # (see megamoe.models.sequence_parallel). An engine field: a checkpoint resumes with either choice.
    sequence_parallel: bool = False
    # The embedding and output layer are padded internally to a multiple of this times the TP size (as
    # Megatron's --make-vocab-size-divisible-by; its default is 128): any vocab_size runs under any TP
    # size (megamoe.tensor_parallel.vocab_padding). 1: padded only where TP does not divide vocab_size.
    # An engine field: the padding is never saved, a checkpoint resumes under any value and any TP.
    make_vocab_size_divisible_by: int = 1
    # The checkpoint's linear weights are kept block-quantized (float8_e4m3fn + block scales, as DeepSeek's
    # FP8 releases store them; see megamoe.quantization.block_fp8): the model holds them so and runs them.
    # None: ordinary floating-point weights.
    weight_quantization: BlockFP8Config | None = None
    # DeepSeek-V3's multi-token-prediction modules (megamoe.models.mtp): ``mtp_num_layers`` of them follow the
    # decoder layers as layers ``num_layers .. num_layers + mtp_num_layers - 1`` (MoE when in ``moe_layer_ids``)
    # on the last pipeline stage; 0: none. ``mtp_loss_coeff``: the weight of their training loss (Megatron's
    # mtp_loss_scaling_factor, default 0.1 as there), a training field: no weight depends on it.
    mtp_num_layers: int = 0
    mtp_loss_coeff: float = 0.1
    # Which layers use ``attention.sliding_window`` (HF "layer_types": gpt-oss alternates sliding and full
    # layers, qwen2_moe may mix them); the others attend to every earlier key. None: the window, if any,
    # applies to every layer.
    sliding_window_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.recompute, RecomputeConfig):
            raise ValueError(f"GPTMoEConfig.recompute must be a RecomputeConfig, got {type(self.recompute).__name__}")
        if self.weight_quantization is not None and not isinstance(self.weight_quantization, BlockFP8Config):
            raise ValueError("GPTMoEConfig.weight_quantization must be a BlockFP8Config or None, got "
                             f"{type(self.weight_quantization).__name__}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"GPTMoEConfig.sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        divisible_by = self.make_vocab_size_divisible_by
        if isinstance(divisible_by, bool) or not isinstance(divisible_by, int) or divisible_by < 1:
            raise ValueError(f"GPTMoEConfig.make_vocab_size_divisible_by must be an int >= 1, got {divisible_by!r}")
        for name in ("vocab_size", "hidden_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTMoEConfig.{name} must be >= 1, got {getattr(self, name)}")
        if isinstance(self.mtp_num_layers, bool) or not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0:
            raise ValueError(f"GPTMoEConfig.mtp_num_layers must be an int >= 0, got {self.mtp_num_layers!r}")
        if (isinstance(self.mtp_loss_coeff, bool) or not isinstance(self.mtp_loss_coeff, (int, float))
                or not 0 <= self.mtp_loss_coeff < float("inf")):
            raise ValueError(f"GPTMoEConfig.mtp_loss_coeff must be a finite number >= 0, got {self.mtp_loss_coeff!r}")
        self.moe_layer_ids = tuple(sorted(set(self.moe_layer_ids)))
        total = self.num_layers + self.mtp_num_layers
        bad = [i for i in self.moe_layer_ids if not 0 <= i < total]
        if bad:
            raise ValueError(f"GPTMoEConfig.moe_layer_ids {bad} are outside [0, {total}) (num_layers "
                             f"{self.num_layers} + mtp_num_layers {self.mtp_num_layers})")
        if self.sliding_window_layer_ids is not None:
            self.sliding_window_layer_ids = tuple(sorted(set(self.sliding_window_layer_ids)))
            if getattr(self.attention, "sliding_window", None) is None:
                raise ValueError("GPTMoEConfig.sliding_window_layer_ids needs attention.sliding_window (the window "
                                 "those layers use)")
            bad = [i for i in self.sliding_window_layer_ids if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"GPTMoEConfig.sliding_window_layer_ids {bad} are outside [0, {self.num_layers})")
        if self.moe_layer_ids and self.moe is None:
            raise ValueError("GPTMoEConfig.moe is required when moe_layer_ids is not empty")
        if len(self.moe_layer_ids) < total and self.dense_mlp is None:
            raise ValueError("GPTMoEConfig.dense_mlp is required: some layers are not in moe_layer_ids")
        if self.attention.hidden_size != self.hidden_size:
            raise ValueError("GPTMoEConfig.attention.hidden_size must equal hidden_size")
        if self.moe is not None and self.moe.hidden_size != self.hidden_size:
            raise ValueError("GPTMoEConfig.moe.router.hidden_size must equal hidden_size")
        self._check_weight_quantization()

    def _check_weight_quantization(self) -> None:
        """The ``block`` FP8 recipe runs kept block-FP8 weights, and kept weights run it (or, with
        ``moe.expert_fp8=None``, are dequantized at run time): other recipes would re-quantize them."""
        fp8 = self.moe.expert_fp8 if self.moe is not None else None
        if fp8 is not None and fp8.recipe == "block" and self.weight_quantization is None:
            raise ValueError("GPTMoEConfig.moe.expert_fp8.recipe='block' uses the stored block scales of kept FP8 "
                             "weights, but GPTMoEConfig.weight_quantization is None: import the checkpoint with "
                             "`--dtype keep`, or use recipe 'delayed' / 'tensorwise' / 'rowwise'")
        if fp8 is not None and fp8.recipe != "block" and self.weight_quantization is not None:
            raise ValueError(f"GPTMoEConfig.moe.expert_fp8.recipe={fp8.recipe!r} would re-quantize the kept block-FP8 "
                             "weights (GPTMoEConfig.weight_quantization): use recipe='block', or expert_fp8=None to "
                             "dequantize them at run time")
        if self.weight_quantization is not None and self.moe is not None and self.moe.expert_backend == "te":
            raise ValueError(f"GPTMoEConfig.moe.expert_backend={self.moe.expert_backend!r} cannot hold kept block-FP8 "
                             "weights (GPTMoEConfig.weight_quantization): use 'fp8_emulated' (the CPU reference), "
                             "'torch' or 'auto'")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.moe_layer_ids

    @property
    def mtp_layer_ids(self) -> range:
        """The layer ids of the multi-token-prediction modules (depth k = id - num_layers + 1)."""
        return range(self.num_layers, self.num_layers + self.mtp_num_layers)

    @property
    def total_layers(self) -> int:
        """Decoder layers plus MTP layers: the size of anything indexed by layer id."""
        return self.num_layers + self.mtp_num_layers

    def attention_of(self, layer_id: int) -> AttentionConfig | MLAConfig:
        """The attention config of layer ``layer_id``: ``attention``, without its sliding window when
        ``sliding_window_layer_ids`` leaves the layer out."""
        if self.sliding_window_layer_ids is None or layer_id in self.sliding_window_layer_ids:
            return self.attention
        return dataclasses.replace(self.attention, sliding_window=None)

    def to_dict(self) -> dict[str, Any]:
        """Nested dicts of JSON values (tuples become lists); :meth:`from_dict` inverts it."""
        data = _json_values(dataclasses.asdict(self))
        data["attention"] = {"kind": _ATTENTION_KINDS_BY_TYPE[type(self.attention)], **data["attention"]}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GPTMoEConfig:
        """The config :meth:`to_dict` described; ValueError naming any unknown, missing or bad field."""
        fields = dict(data)
        attention = dict(_required(fields, "attention", "GPTMoEConfig"))
        kind = attention.pop("kind", None)
        if kind not in _ATTENTION_TYPES_BY_KIND:
            raise ValueError(f"GPTMoEConfig.from_dict: attention.kind must be one of "
                             f"{sorted(_ATTENTION_TYPES_BY_KIND)}, got {kind!r}")
        attention["rope"] = _build(RopeConfig, _required(attention, "rope", "attention"), "attention.rope")
        fields["attention"] = _build(_ATTENTION_TYPES_BY_KIND[kind], attention, "attention")
        if fields.get("moe") is not None:
            moe = dict(fields["moe"])
            moe["router"] = _build(RouterConfig, _required(moe, "router", "moe"), "moe.router")
            if moe.get("shared_experts") is not None:
                moe["shared_experts"] = _build(SharedExpertsConfig, moe["shared_experts"], "moe.shared_experts")
            if moe.get("expert_fp8") is not None:
                moe["expert_fp8"] = _build(FP8Config, moe["expert_fp8"], "moe.expert_fp8")
            fields["moe"] = _build(MoEConfig, moe, "moe")
        if fields.get("dense_mlp") is not None:
            fields["dense_mlp"] = _build(MLPConfig, fields["dense_mlp"], "dense_mlp")
        if fields.get("weight_quantization") is not None:
            fields["weight_quantization"] = _build(BlockFP8Config, fields["weight_quantization"],
                                                   "weight_quantization")
        if "recompute" in fields:
            fields["recompute"] = recompute_from_dict(fields["recompute"])
        fields["moe_layer_ids"] = tuple(_required(fields, "moe_layer_ids", "GPTMoEConfig"))
        return _build(cls, fields, "GPTMoEConfig")


_ATTENTION_KINDS_BY_TYPE = {AttentionConfig: "gqa", MLAConfig: "mla"}
_ATTENTION_TYPES_BY_KIND = {kind: cls for cls, kind in _ATTENTION_KINDS_BY_TYPE.items()}


def _json_values(value):
    if isinstance(value, dict):
        return {k: _json_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_values(v) for v in value]
    return value


def _required(fields: Mapping[str, Any], name: str, where: str):
    if name not in fields:
        raise ValueError(f"GPTMoEConfig.from_dict: {where} has no field {name!r}")
    return fields[name]


def _build(cls, fields: Mapping[str, Any], where: str):
    """``cls(**fields)``, naming unknown or missing fields instead of a bare TypeError."""
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"GPTMoEConfig.from_dict: unknown fields {unknown} in {where} ({cls.__name__})")
    try:
        return cls(**fields)
    except TypeError as e:   # a required field is missing
        raise ValueError(f"GPTMoEConfig.from_dict: {where} ({cls.__name__}): {e}") from e
