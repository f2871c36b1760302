"""Block-scaled FP8 (DeepSeek's weight layout): quantize / dequantize with partial edge blocks, both
scale formats, and the config read from an HF quantization_config."""

import pytest
import torch

from megamoe.quantization import (BlockFP8Config, block_scale_shape, dequantize_block_fp8, is_block_fp8_weight,
                                  quantize_block_fp8)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_quantize_dequantize_partial_blocks(scale_fmt):
    w = torch.randn(2, 200, 130, generator=torch.Generator().manual_seed(0))
    q, scale_inv = quantize_block_fp8(w, (128, 128), scale_fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.shape == block_scale_shape(w.shape, (128, 128)) == (2, 2, 2)
    assert scale_inv.dtype == (torch.float32 if scale_fmt == "float" else torch.float8_e8m0fnu)
    back = dequantize_block_fp8(q, scale_inv, (128, 128))
    # e4m3 keeps 3 mantissa bits: each element within 2^-4 of itself, relative to its block's scale.
    scale = scale_inv.float().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :200, :130]
    assert ((back - w).abs() <= scale * 448 * 2 ** -4 + 1e-30).all()
    # The edge blocks have their own scales: the partial block's amax maps onto the range.
    assert torch.equal(dequantize_block_fp8(q[..., 128:, 128:], scale_inv[..., 1:, 1:], (128, 128)), back[..., 128:, 128:])
    with pytest.raises(ValueError, match=r"block scales have shape \(2, 1, 2\)"):
        dequantize_block_fp8(q, scale_inv[:, :1], (128, 128))


def test_config_from_hf():
    config = BlockFP8Config.from_hf({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"})
    assert config == BlockFP8Config() and config.weight_dtype == torch.float8_e4m3fn
    assert BlockFP8Config.from_hf({"quant_method": "fp8", "weight_block_size": [64, 32], "scale_fmt": "ue8m0"}
                                  ).block_size == (64, 32)
    for bad, message in (({"quant_method": "fp8"}, "weight_block_size is missing"),
                         ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
                         ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt 'e5m2'"),
                         ({"quant_method": "gptq"}, "quant_method 'gptq'")):
        with pytest.raises(ValueError, match=message):
            BlockFP8Config.from_hf(bad)
    assert is_block_fp8_weight("layers.3.mlp.experts.12.down_proj.weight")
    assert is_block_fp8_weight("layers.1.mlp.shared_experts.up_proj")
    assert not is_block_fp8_weight("layers.1.mlp.router.weight") and not is_block_fp8_weight("lm_head.weight")
    assert not BlockFP8Config(unquantized=("layers.0.self_attn.q_proj.weight",)).quantizes(
        "layers.0.self_attn.q_proj.weight")
