"""Decoder-only MoE language models assembled from configs (HF families in :mod:`families`)."""

from megamoe.models.config import GPTMoEConfig
from megamoe.models.gpt_moe import DecoderLayer, GPTMoEModel
from megamoe.models.layer_spec import LayerSpec

__all__ = ["GPTMoEConfig", "DecoderLayer", "GPTMoEModel", "LayerSpec"]
