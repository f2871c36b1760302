"""Model FLOPs utilisation: the model TFLOP/s a rank achieves against the peak of its device.

``model TFLOP/s per rank = training FLOPs of the step's global batch / step time / world size``
(:func:`model_tflops_per_rank`): the whole model's forward + backward FLOPs
(:func:`megamoe.training.flops.training_flops`) for every token of the global batch, shared evenly by
all ranks, as Megatron-LM reports "TFLOP/s/GPU". Equivalently each data-parallel replica's tokens
divided over its model-parallel (TP x PP x CP, EP inside DP) group. ``mfu = that / peak``
(:func:`model_flops_utilization`).

The peak (:func:`resolve_peak_tflops`), in this order: an explicit value (``--peak-tflops``); the
dense bf16 / fp16 tensor-core peak of a known GPU by ``torch.cuda.get_device_name()`` (training in
bf16 or fp16 only); else the matmul throughput measured once per process in the training dtype
(:func:`megamoe.matmul_peak.matmul_peak_tflops`, shared with ``--autocast auto``; CPUs, unknown GPUs,
fp32), logged as "MFU against measured matmul peak X TFLOP/s".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from megamoe.matmul_peak import matmul_peak_tflops, measure_matmul_tflops

__all__ = ["PeakTFlops", "known_gpu_peak_tflops", "measure_matmul_tflops", "model_flops_utilization",
           "model_tflops_per_rank", "resolve_peak_tflops"]

logger = logging.getLogger(__name__)

# Dense (no 2:4 sparsity) bf16 = fp16 tensor-core peaks in TFLOP/s, first match in the device name
# wins (so "H100 PCIe" precedes "H100", "L40S" precedes "L40" and "L4"). Sources: NVIDIA's datasheets,
# whose headline figures are "with sparsity", i.e. twice these: H100 / H200 datasheet (SXM 1,979,
# PCIe 1,513, NVL 1,671 sparse), H800 as H100 SXM; A100 datasheet (312 dense, A800 the same);
# L40S datasheet (733 sparse), L40 datasheet (362 sparse), L4 datasheet (242 sparse); B200: DGX B200 /
# HGX B200 datasheet (4.5 PFLOPS sparse per GPU).
_GPU_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H200 NVL", 835.5),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.05),
    ("L40", 181.05),
    ("L4", 121.0),
)
_TABLE_DTYPES = (torch.bfloat16, torch.float16)


def model_tflops_per_rank(step_flops: float, *, step_time_s: float, world_size: int) -> float:
    """TFLOP/s per rank: ``step_flops`` (the whole model's training FLOPs of the global batch) over
    ``step_time_s`` seconds, shared by ``world_size`` ranks."""
    if not step_time_s > 0:
        raise ValueError(f"model_tflops_per_rank: step_time_s must be > 0, got {step_time_s}")
    if world_size < 1:
        raise ValueError(f"model_tflops_per_rank: world_size must be >= 1, got {world_size}")
    return step_flops / step_time_s / world_size / 1e12


def model_flops_utilization(tflops_per_rank: float, peak_tflops: float | None) -> float | None:
    """``tflops_per_rank / peak_tflops`` (a fraction, 1.0 = the peak); None without a peak."""
    if peak_tflops is None:
        return None
    if not peak_tflops > 0:
        raise ValueError(f"peak_tflops must be > 0, got {peak_tflops}")
    return tflops_per_rank / peak_tflops


def known_gpu_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """The dense bf16 / fp16 peak of a GPU named ``device_name`` (``torch.cuda.get_device_name()``)
    from the table above; None for another dtype (fp32 / TF32 peaks are not tabled) or an unknown GPU."""
    if dtype not in _TABLE_DTYPES:
        return None
    name = device_name.upper()
    for pattern, tflops in _GPU_PEAK_TFLOPS:
        if pattern.upper() in name:
            return tflops
    return None


@dataclass(frozen=True)
class PeakTFlops:
    tflops: float
    source: str          # "given" | "table" (known GPU) | "measured"


def resolve_peak_tflops(device: torch.device, dtype: torch.dtype, *, explicit_tflops: float | None = None,
                        measure: Callable[[torch.device, torch.dtype], float] = matmul_peak_tflops
                        ) -> PeakTFlops:
    """The per-device peak MFU is measured against, in the order of the module docstring; logs which."""
    device = torch.device(device)
    if explicit_tflops is not None:
        if not explicit_tflops > 0:
            raise ValueError(f"peak_tflops (--peak-tflops) must be > 0, got {explicit_tflops}")
        logger.info("MFU against the given peak %.4g TFLOP/s", explicit_tflops)
        return PeakTFlops(float(explicit_tflops), "given")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tabled = known_gpu_peak_tflops(name, dtype)
        if tabled is not None:
            logger.info("MFU against the %s dense %s peak %.4g TFLOP/s", name, str(dtype).removeprefix("torch."),
                        tabled)
            return PeakTFlops(tabled, "table")
    measured = measure(device, dtype)
    logger.info("MFU against measured matmul peak %.4g TFLOP/s (%s, %s; pass --peak-tflops to set it)", measured,
                device.type, str(dtype).removeprefix("torch."))
    return PeakTFlops(measured, "measured")
