"""The configuration of a decoder-only MoE language model, composed of the blocks' own configs."""

from __future__ import annotations

from dataclasses import dataclass

from megamoe.moe.moe_layer import MoEConfig
from megamoe.transformer.attention import AttentionConfig
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.mlp import MLPConfig

__all__ = ["GPTMoEConfig"]


@dataclass
class GPTMoEConfig:
    """``num_layers`` decoder layers; those in ``moe_layer_ids`` use ``moe``, the others ``dense_mlp``.

    Build one by hand, or from a HuggingFace config with :func:`megamoe.models.families.config_from_hf`.
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

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTMoEConfig.{name} must be >= 1, got {getattr(self, name)}")
        self.moe_layer_ids = tuple(sorted(set(self.moe_layer_ids)))
        bad = [i for i in self.moe_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"GPTMoEConfig.moe_layer_ids {bad} are outside [0, {self.num_layers})")
        if self.moe_layer_ids and self.moe is None:
            raise ValueError("GPTMoEConfig.moe is required when moe_layer_ids is not empty")
        if len(self.moe_layer_ids) < self.num_layers and self.dense_mlp is None:
            raise ValueError("GPTMoEConfig.dense_mlp is required: some layers are not in moe_layer_ids")
        if self.attention.hidden_size != self.hidden_size:
            raise ValueError("GPTMoEConfig.attention.hidden_size must equal hidden_size")
        if self.moe is not None and self.moe.hidden_size != self.hidden_size:
            raise ValueError("GPTMoEConfig.moe.router.hidden_size must equal hidden_size")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id in self.moe_layer_ids
