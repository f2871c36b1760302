"""FP8 configuration and the scaling math every FP8 expert path shares.

A tensor ``x`` is stored in FP8 as ``q = saturate(x * scale)`` and read back as ``q / scale``.
The scale maps the tensor's absolute maximum (amax) onto the format's largest finite value, less a
safety ``margin`` of powers of two::

    scale = fp8_max / amax / 2 ** margin

Recipes (how amax is chosen, i.e. the scaling granularity and its timing):

- ``delayed`` (TransformerEngine ``DelayedScaling``): one scale per tensor role and expert slot,
  computed from a rolling history of past amaxes, so the scale for step n only uses steps < n (no
  extra pass over the tensor before quantising it). ``amax_compute_algo`` reduces the history:
  ``max`` (its maximum) or ``most_recent`` (the last recorded amax).
- ``tensorwise`` (TE ``Float8CurrentScaling``): one scale per tensor role and slot from the
  current tensor's own amax.
- ``rowwise`` (``torch._scaled_grouped_mm``): current scaling per token row of activations and
  gradients and per output row of weights.
- ``block`` (DeepSeek-V3's inference, TE ``Float8BlockScaling``): for kept block-FP8 weights
  (``GPTMoEConfig.weight_quantization``) only: the weights' stored 2-D block scales as they are, the
  activations quantized per 1 x block tile along the contraction dim at run time (current scaling). Inference
  only; ``margin`` must be 0. See :mod:`megamoe.moe.experts.block_fp8_experts`.

Formats: ``e4m3`` everywhere, or ``hybrid`` (as TE's ``Format.HYBRID``): e4m3 for forward operands
(activations, weights: more mantissa), e5m2 for gradients (more range).

Amax reduction (:class:`FP8AmaxReduction`, as TE's amax reduction group): a slot's operands are
quantised alike whatever the layout. Under expert tensor parallelism each rank holds a shard of a
slot's weights and activations, so amaxes of a shard are reduced (max) over the ETP group: the scales
are those of the whole tensor, and ETP = 2 quantises exactly as ETP = 1. With the delayed recipe the
slot amaxes are reduced over the ETP x expert-data-parallel group (``ParallelState.etp_edp``), so every
replica of a slot also keeps the same history and scales (the current-scaling recipes scale each
rank's own batch, as TE does). TransformerEngine's delayed recipe reduces over the same group (its
``fp8_group``), and not at all when that group is one rank (TE's default would be every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from megamoe import comms
from megamoe.moe.experts.kernel_probes import block_scaled_mm_problem, cuda_capability, transformer_engine_problem

__all__ = ["FP8Config", "FP8ScalingState", "FP8AmaxReduction", "FP8_ROLES", "amax_rows", "compute_scale",
           "dequantize", "fp8_max", "quantize", "resolve_fp8_backend", "te_fp8_recipe"]

_RECIPES = ("delayed", "tensorwise", "rowwise", "block")
_FORMATS = ("e4m3", "hybrid")
_AMAX_ALGOS = ("max", "most_recent")
# One entry per operand of the expert MLP's two grouped GEMMs (fc1 = gate/up, fc2 = down): the
# forward input and weight, and the backward's incoming gradient.
FP8_ROLES = ("fc1_input", "fc1_weight", "fc1_grad_output", "fc2_input", "fc2_weight", "fc2_grad_output")
# Under expert tensor parallelism, the operands of which a rank holds part of each slot's tensor (all
# but the token-major fc1 input and fc2 output gradient, which every ETP rank holds whole), and of
# those the ones whose rows are cut too (fc1's weight rows are whole: ETP splits them between ranks).
_ETP_SPLIT_SLOT_ROLES = frozenset({"fc1_weight", "fc1_grad_output", "fc2_input", "fc2_weight"})
_ETP_SPLIT_ROW_ROLES = frozenset({"fc1_grad_output", "fc2_input", "fc2_weight"})


@dataclass
class FP8Config:
    """How the expert GEMMs quantise their operands to FP8; see the module docstring.

    ``amax_history_len`` and ``amax_compute_algo`` are the delayed recipe's history; ``margin``
    applies to every recipe's scale.
    """

    recipe: str = "delayed"            # "delayed" | "tensorwise" | "rowwise" | "block" (kept FP8 weights)
    format: str = "hybrid"             # "e4m3" | "hybrid" (e4m3 forward, e5m2 gradients)
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"     # "max" | "most_recent"
    margin: int = 0

    def __post_init__(self) -> None:
        if self.recipe not in _RECIPES:
            raise ValueError(f"FP8Config.recipe must be one of {_RECIPES}, got {self.recipe!r}")
        if self.format not in _FORMATS:
            raise ValueError(f"FP8Config.format must be one of {_FORMATS}, got {self.format!r}")
        if self.amax_compute_algo not in _AMAX_ALGOS:
            raise ValueError(f"FP8Config.amax_compute_algo must be one of {_AMAX_ALGOS}, got "
                             f"{self.amax_compute_algo!r}")
        if self.amax_history_len < 1:
            raise ValueError(f"FP8Config.amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.margin < 0:
            raise ValueError(f"FP8Config.margin must be >= 0 (a power-of-two headroom), got {self.margin}")
        if self.recipe == "block" and self.margin != 0:
            raise ValueError(f"FP8Config.margin must be 0 with recipe='block' (tiles are scaled onto the whole FP8 "
                             f"range, as the checkpoint's weight blocks are), got {self.margin}")

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def gradient_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    def dtype_for(self, role: str) -> torch.dtype:
        return self.gradient_dtype if role.endswith("grad_output") else self.forward_dtype


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return torch.finfo(dtype).max


def compute_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int,
                  fallback: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``fp8_max / amax / 2^margin`` elementwise; where amax is 0 or not finite (nothing to scale,
    or an overflow upstream) the scale is ``fallback`` (TE keeps the previous scale)."""
    amax = amax.float()
    scale = fp8_max(dtype) / amax / (2.0 ** margin)
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, scale, torch.as_tensor(fallback, dtype=scale.dtype, device=scale.device))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` in ``dtype``; ``scale`` broadcasts against ``x``. The clamp makes
    out-of-range values saturate at +-fp8_max (a plain cast would give NaN for e4m3fn, inf for
    e5m2)."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp_(-limit, limit).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q / scale`` in ``dtype`` (computed in fp32)."""
    return (q.float() / scale).to(dtype)


def amax_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row absolute maximum of a 2-D ``x`` [N, K] -> [N] fp32 (0 for an empty row)."""
    if x.shape[1] == 0:
        return x.new_zeros(x.shape[0], dtype=torch.float32)
    return x.detach().abs().amax(dim=1).float()


class FP8ScalingState(nn.Module):
    """The delayed recipe's per-slot amax histories and scales, one row per role of
    :data:`FP8_ROLES`.

    Buffers (non-persistent: a checkpoint carries weights only; after a load the histories refill
    within ``amax_history_len`` steps, starting from scale 1 as TE does on its first step)::

        amax_history  [roles, S, L]   most recent amax at index 0
        scale         [roles, S]      the scale the next quantisation of that role uses

    Histories advance only in training mode (``self.training``): evaluation and generation reuse
    the training scales.
    """

    def __init__(self, config: FP8Config, num_slots: int, device=None) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("amax_history", torch.zeros(len(FP8_ROLES), num_slots, config.amax_history_len,
                                                          device=device), persistent=False)
        self.register_buffer("scale", torch.ones(len(FP8_ROLES), num_slots, device=device), persistent=False)

    def slot_state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one slot's state: (amax_history [roles, L], scale [roles]). Expert migration
        moves them with the slot's weights (see megamoe.moe.placement.expert_migration)."""
        return self.amax_history[:, slot], self.scale[:, slot]

    def current_scale(self, role: str) -> torch.Tensor:
        """[S] scales for quantising ``role`` now (from the history up to the previous step)."""
        return self.scale[FP8_ROLES.index(role)]

    @torch.no_grad()
    def record(self, role: str, amax_per_slot: torch.Tensor) -> None:
        """Push this step's amax [S] of ``role`` into its history and recompute its next scale."""
        if not self.training:
            return
        index = FP8_ROLES.index(role)
        history = self.amax_history[index]                                  # [S, L]
        history.copy_(torch.roll(history, shifts=1, dims=1))
        history[:, 0] = amax_per_slot.to(history.dtype)
        amax = history.amax(dim=1) if self.config.amax_compute_algo == "max" else history[:, 0]
        self.scale[index] = compute_scale(amax, self.config.dtype_for(role), self.config.margin,
                                          fallback=self.scale[index])

    def extra_repr(self) -> str:
        return f"slots={self.scale.shape[1]}, history={self.config.amax_history_len}"


@dataclass(frozen=True)
class FP8AmaxReduction:
    """The groups over which amaxes are reduced (max) so that a slot is quantised alike on every rank
    holding part or a replica of it; see the module docstring. No groups: nothing is reduced.

    ``etp_group``: the expert-tensor-parallel group (ranks holding shards of the same slots).
    ``slot_group``: the ETP x expert-DP group (``ParallelState.etp_edp``: ranks holding shards or
    replicas of the same slots), for the delayed recipe's histories; it contains ``etp_group``.
    """

    etp_group: ProcessGroup | None = None
    slot_group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        etp, slots = comms.group_size(self.etp_group), comms.group_size(self.slot_group)
        if slots % etp:
            raise ValueError(f"FP8AmaxReduction.slot_group (size {slots}) must contain etp_group (size {etp}): "
                             "pass ParallelState.etp_edp.group and ParallelState.etp.group (to MoELayer: "
                             "etp_edp_group= and etp_group=)")

    def slot_amax(self, role: str, amax: torch.Tensor, delayed: bool) -> torch.Tensor:
        """Per-slot amaxes [S] of ``role``, reduced in place where the layout needs it."""
        if delayed:
            comms.all_reduce_(amax, self.slot_group, op=ReduceOp.MAX)      # a no-op on a group of one
        elif role in _ETP_SPLIT_SLOT_ROLES:
            comms.all_reduce_(amax, self.etp_group, op=ReduceOp.MAX)
        return amax

    def row_amax(self, role: str, amax: torch.Tensor) -> torch.Tensor:
        """Per-row amaxes of ``role`` (tokens, or weight output rows), reduced in place over the ETP group
        where ETP cuts the rows."""
        if role in _ETP_SPLIT_ROW_ROLES:
            comms.all_reduce_(amax, self.etp_group, op=ReduceOp.MAX)
        return amax


def te_fp8_recipe(config: FP8Config, reduce_amax: bool = True):
    """The TransformerEngine recipe equivalent to ``config`` (``delayed`` -> ``DelayedScaling``,
    ``tensorwise`` -> ``Float8CurrentScaling``). ``rowwise`` has no TE equivalent: ValueError.
    ``reduce_amax``: whether the delayed recipe reduces amaxes over ``fp8_autocast``'s ``fp8_group``."""
    try:
        from transformer_engine.common import recipe as te_recipe
    except (ImportError, OSError, RuntimeError) as error:      # OSError / RuntimeError: built for another torch
        raise ValueError(f"FP8 with the 'te' expert backend needs a TransformerEngine that loads ({error}): install "
                         "it with `pip install .[te]` on a CUDA machine, or use backend='fp8_emulated'") from error
    fp8_format = te_recipe.Format.HYBRID if config.format == "hybrid" else te_recipe.Format.E4M3
    if config.recipe == "delayed":
        return te_recipe.DelayedScaling(fp8_format=fp8_format, margin=config.margin,
                                        amax_history_len=config.amax_history_len,
                                        amax_compute_algo=config.amax_compute_algo, reduce_amax=reduce_amax)
    if config.recipe == "tensorwise":
        if not hasattr(te_recipe, "Float8CurrentScaling"):
            raise ValueError("FP8Config.recipe='tensorwise' needs TransformerEngine >= 2.2 "
                             "(Float8CurrentScaling): upgrade it, or use recipe='delayed'")
        if config.margin != 0:
            raise ValueError("TransformerEngine's current scaling has no margin: set FP8Config.margin=0")
        return te_recipe.Float8CurrentScaling(fp8_format=fp8_format)
    if config.recipe == "block":
        if not hasattr(te_recipe, "Float8BlockScaling"):
            raise ValueError("FP8Config.recipe='block' needs TransformerEngine >= 2.3 (Float8BlockScaling): upgrade "
                             "it, or use backend='torch' / 'fp8_emulated'")
        return te_recipe.Float8BlockScaling(fp8_format=fp8_format)
    raise ValueError("FP8Config.recipe='rowwise' is the torch backend's (torch._scaled_grouped_mm); with "
                     "backend='te' use recipe='delayed' or 'tensorwise'")


# Compute capabilities with FP8 tensor cores (Ada, sm89) and with torch._scaled_grouped_mm's
# row-wise FP8 grouped kernels (Hopper, sm90).
_TE_FP8_MIN_CAPABILITY = (8, 9)
_SCALED_GROUPED_MM_MIN_CAPABILITY = (9, 0)


def _te_fp8_problem(device: torch.device) -> str | None:
    capability = cuda_capability(device)
    if capability is None or capability < _TE_FP8_MIN_CAPABILITY:
        return (f"FP8 with backend='te' needs a CUDA GPU of compute capability >= 8.9 (device {device}, "
                f"capability {capability})")
    problem = transformer_engine_problem()
    return None if problem is None else f"FP8 with backend='te' needs TransformerEngine: {problem}"


def _torch_kernel_problem(device: torch.device, kernel: str, what: str) -> str | None:
    """Why ``torch.<kernel>`` cannot run ``what`` on ``device`` (None: it can)."""
    capability = cuda_capability(device)
    if capability is None or capability < _SCALED_GROUPED_MM_MIN_CAPABILITY:
        return (f"{what} with backend='torch' needs torch.{kernel} on a CUDA GPU of compute capability >= 9.0 "
                f"(device {device}, capability {capability})")
    if not hasattr(torch, kernel):
        return f"{what} with backend='torch' needs torch.{kernel} (torch {torch.__version__} lacks it)"
    return None


_TE_BLOCK_PROBLEM = ("kept block-FP8 weights cannot run on backend='te': TransformerEngine's GroupedLinear keeps "
                     "weights of its own and would not hold the checkpoint's bytes")


def resolve_fp8_backend(requested: str, device: torch.device, recipe: str | None = None) -> str:
    """The expert backend that runs FP8 on ``device``: ``te`` (TE >= sm89), ``torch`` (sm90+),
    ``fp8_emulated`` (anywhere). ``auto`` picks ``te``, then ``torch``, and never falls back to the
    (slow) emulation silently. Raises ValueError naming the fix when ``requested`` cannot run.
    ``recipe='block'`` (kept block-FP8 weights): ``torch`` (``torch._scaled_mm`` blockwise: sm90 with cuBLASLt
    >= 12.9, :func:`~megamoe.moe.experts.kernel_probes.block_scaled_mm_problem`) or
    ``fp8_emulated``; ``te`` is refused."""
    if requested == "fp8_emulated":
        return requested
    if recipe == "block":
        block_problem = block_scaled_mm_problem(device)
        problems = {"te": _TE_BLOCK_PROBLEM,
                    "torch": block_problem and f"the block FP8 recipe with backend='torch': {block_problem}"}
    else:
        problems = {"te": _te_fp8_problem(device), "torch": _torch_kernel_problem(device, "_scaled_grouped_mm", "FP8")}
    if requested == "auto":
        for backend, problem in problems.items():
            if problem is None:
                return backend
        raise ValueError(f"no FP8 expert backend runs here ({problems['te']}; {problems['torch']}): use "
                         "ExpertsConfig.backend='fp8_emulated' (CPU reference) or ExpertsConfig.fp8=None")
    if requested not in problems:
        raise ValueError(f"ExpertsConfig.backend={requested!r} has no FP8 path: use 'te', 'torch' or 'fp8_emulated'")
    if problems[requested] is not None:
        raise ValueError(f"{problems[requested]}: run on such a machine, or use "
                         "ExpertsConfig.backend='fp8_emulated' (CPU reference) or ExpertsConfig.fp8=None")
    return requested
