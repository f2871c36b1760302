"""Weight formats of released checkpoints: block-scaled FP8 (DeepSeek's layout)."""

from megamoe.quantization.block_fp8 import (BlockFP8Config, block_scale_shape, dequantize_block_fp8,
                                            is_block_fp8_weight, quantize_block_fp8, scale_inv_name)

__all__ = ["BlockFP8Config", "block_scale_shape", "dequantize_block_fp8", "is_block_fp8_weight",
           "quantize_block_fp8", "scale_inv_name"]
