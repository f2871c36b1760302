"""Rotary position embeddings: frequencies for the scaling variants the supported families use, and
the two ways of pairing dimensions.

Frequencies (``RopeConfig.rope_type``, the ``rope_type`` of HuggingFace's ``config.rope_parameters``):

- ``default``: ``inv_freq[i] = theta^(-2i/dim)``.
- ``linear``: ``default / factor`` (position interpolation).
- ``dynamic`` (dynamic NTK): ``default`` up to ``max_position_embeddings``; beyond it the base grows
  with the longest position seen in the call. Stateless here: recomputed from each call's
  ``position_ids`` (HF caches the grown frequencies across calls; the first call agrees).
- ``yarn`` (DeepSeek-V2/V3, Qwen long-context): per-frequency blend of interpolation and
  extrapolation, and cos/sin multiplied by an "attention factor" (from ``attention_factor``, or
  ``mscale`` / ``mscale_all_dim`` / ``factor``). DeepSeek's MLA additionally multiplies the softmax
  scale by ``mscale(factor, mscale_all_dim)^2`` (:meth:`RopeConfig.softmax_scale_factor`).
- ``llama3``: wavelength-dependent smoothing between ``default`` and ``default / factor``.

Layouts (``RopeConfig.layout``), the rotation of pair ``(a, b)`` by angle ``t`` being
``(a cos t - b sin t, b cos t + a sin t)``:

- ``half``: pairs are ``(x[i], x[i + dim/2])`` — HF's ``rotate_half`` (Llama, Mixtral, Qwen, OLMoE,
  DeepSeek-V3 with ``rope_interleave=False``).
- ``interleaved``: pairs are ``(x[2i], x[2i+1])`` and stay in place — DeepSeek-V2's complex
  multiplication. HF's DeepSeek-V3 ``apply_rotary_pos_emb_interleave`` rotates the same pairs but
  writes them de-interleaved (all first elements, then all second elements). The two outputs differ
  by one fixed permutation of the rotary dims applied to both q and k, so q·k and the attention
  output are identical; only the layout of cached rotated keys differs.

cos / sin are returned at half width ``[..., dim/2]`` (one angle per pair); HF returns
``cat(freqs, freqs)``, whose first half is the same tensor.

Partial rotary (GLM-4.5's ``partial_rotary_factor``, MiniMax-M2's ``rotary_dim``): ``dim`` is then less
than the head dim; the frequencies are those of a ``dim``-wide embedding, the first ``dim`` features of
each head are rotated in the configured layout and the others pass through unchanged, as HF's
``apply_rotary_pos_emb`` does with its ``q[..., :rotary_dim]`` / ``q[..., rotary_dim:]`` split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megamoe.host_values import host_ints

__all__ = ["RopeConfig", "RotaryEmbedding", "apply_rotary"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
LAYOUTS = ("half", "interleaved")


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding over ``dim`` dims (the rotated part of a head; even).

    Fields other than ``dim``, ``theta``, ``rope_type`` and ``layout`` are the HF
    ``rope_parameters`` fields of the same name and matter only for the types that read them.
    """

    dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    layout: str = "half"
    factor: float = 1.0
    max_position_embeddings: int | None = None            # dynamic: where the base starts to grow
    original_max_position_embeddings: int | None = None   # yarn, llama3: the pretraining length
    attention_factor: float | None = None                 # yarn: cos/sin multiplier (None: derived)
    beta_fast: float = 32.0                               # yarn ramp bounds (rotations)
    beta_slow: float = 1.0
    mscale: float | None = None                           # yarn (DeepSeek)
    mscale_all_dim: float | None = None                   # yarn (DeepSeek): also scales the softmax
    truncate: bool = True                                 # yarn: floor/ceil the correction range
    low_freq_factor: float | None = None                  # llama3
    high_freq_factor: float | None = None                 # llama3

    def __post_init__(self):
        if self.dim < 2 or self.dim % 2:
            raise ValueError(f"RopeConfig.dim must be a positive even number, got {self.dim}")
        if not 0 < self.theta < math.inf:              # NaN fails both comparisons
            raise ValueError(f"RopeConfig.theta must be a finite number > 0, got {self.theta}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeConfig.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"RopeConfig.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not 0 < self.factor < math.inf:
            raise ValueError(f"RopeConfig.factor must be a finite number > 0, got {self.factor}")
        if self.rope_type == "dynamic" and not self.max_position_embeddings:
            raise ValueError("RopeConfig.max_position_embeddings is required for rope_type 'dynamic'")
        if self.rope_type in ("yarn", "llama3") and not self.original_max_position_embeddings:
            raise ValueError(f"RopeConfig.original_max_position_embeddings is required for rope_type "
                             f"{self.rope_type!r}")
        if self.rope_type == "llama3":
            if self.low_freq_factor is None or self.high_freq_factor is None:
                raise ValueError("RopeConfig.low_freq_factor and high_freq_factor are required for 'llama3'")
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError("RopeConfig.high_freq_factor must exceed low_freq_factor")

    @classmethod
    def from_hf(cls, rope_parameters: dict, *, dim: int, max_position_embeddings: int,
                layout: str = "half", partial_rotary: bool = False) -> "RopeConfig":
        """From a transformers ``config.rope_parameters`` dict (or a legacy ``rope_scaling`` dict with
        ``type``; ``rope_theta`` defaults to 10000 as in HF). ``dim`` is the rotated head dim
        (``head_dim``, or ``qk_rope_head_dim`` for MLA).

        ``partial_rotary`` (families whose HF rotary embedding reads ``partial_rotary_factor``: glm4_moe,
        minimax_m2): ``dim`` is the head dim and the rotated part is ``int(dim * partial_rotary_factor)``
        (default factor 1), computed as HF does. Otherwise a factor other than 1 is refused."""
        params = dict(rope_parameters or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters['rope_type'] = {rope_type!r} is not supported; "
                             f"supported: {ROPE_TYPES}")
        factor = params.get("partial_rotary_factor", 1.0)
        if partial_rotary:
            if not (isinstance(factor, (int, float)) and 0 < factor <= 1):
                raise ValueError(f"rope_parameters['partial_rotary_factor'] must be in (0, 1], got {factor!r}")
            rotated = int(dim * factor)
            if rotated < 2 or rotated % 2:
                raise ValueError(f"rope_parameters['partial_rotary_factor'] = {factor} rotates {rotated} of the "
                                 f"{dim} head dims; that must be a positive even number")
            dim = rotated
        elif factor != 1.0:
            raise ValueError("rope_parameters['partial_rotary_factor'] != 1 is not supported for this family "
                             "(only glm4_moe and minimax_m2 rotate part of each head)")
        original = params.get("original_max_position_embeddings")
        if rope_type in ("yarn", "llama3") and original is None:
            original = max_position_embeddings          # HF's standardize_rope_params default
        factor = params.get("factor")
        if factor is None:
            factor = max_position_embeddings / original if rope_type == "yarn" else 1.0
        return cls(
            dim=dim, theta=float(params.get("rope_theta", 10000.0)), rope_type=rope_type, layout=layout,
            factor=float(factor), max_position_embeddings=max_position_embeddings,
            original_max_position_embeddings=original, attention_factor=params.get("attention_factor"),
            beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
            mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
            truncate=params.get("truncate", True), low_freq_factor=params.get("low_freq_factor"),
            high_freq_factor=params.get("high_freq_factor"))

    # ------------------------------------------------------------------------------------------
    def _default_inv_freq(self, theta: float) -> torch.Tensor:
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        return 1.0 / (theta ** exponents)

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """Inverse frequencies [dim/2] (fp32, CPU). ``seq_len`` (the longest position + 1) matters
        only for ``dynamic``."""
        if self.rope_type == "default":
            return self._default_inv_freq(self.theta)
        if self.rope_type == "linear":
            return self._default_inv_freq(self.theta) / self.factor
        if self.rope_type == "dynamic":
            max_len = self.max_position_embeddings
            seq_len = max(seq_len or max_len, max_len)
            growth = (self.factor * seq_len / max_len - (self.factor - 1)) ** (self.dim / (self.dim - 2))
            return self._default_inv_freq(self.theta * growth)
        if self.rope_type == "yarn":
            return self._yarn_inv_freq()
        return self._llama3_inv_freq()

    def _yarn_inv_freq(self) -> torch.Tensor:
        dim, base, original = self.dim, self.theta, self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            # The dim whose wavelength completes `rotations` turns over the original context.
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001                                     # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1.0 / pos_freqs                       # high frequencies: unchanged
        interpolation = 1.0 / (self.factor * pos_freqs)       # low frequencies: stretched
        extrapolation_weight = 1 - ramp
        return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight

    def _llama3_inv_freq(self) -> torch.Tensor:
        inv_freq = self._default_inv_freq(self.theta)
        original, low, high = self.original_max_position_embeddings, self.low_freq_factor, self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / self.factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(is_medium, smoothed, scaled)

    def attention_scaling(self) -> float:
        """Multiplier applied to cos and sin (yarn's attention factor; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        """DeepSeek MLA's softmax-scale correction ``mscale(factor, mscale_all_dim)^2``: applied (as in
        HF's ``yarn_apply_mscale``) whenever the type is not ``default`` and ``mscale_all_dim`` is set."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate ``x`` [B, heads, S, D] by the angles of ``cos`` / ``sin`` [B, S, dim/2]: all of it when
    ``D == dim``; when ``D > dim`` (partial rotary) its first ``dim`` features, the rest unchanged."""
    rotated = 2 * cos.shape[-1]
    if x.shape[-1] != rotated:
        if x.shape[-1] < rotated:
            raise ValueError(f"apply_rotary: {rotated} rotary dims exceed the {x.shape[-1]} features of x")
        return torch.cat((apply_rotary(x[..., :rotated], cos, sin, layout), x[..., rotated:]), dim=-1)
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    if layout == "half":
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    """cos / sin for given positions, and their application in the configured layout.

    ``inv_freq`` is a non-persistent buffer (derived from the config, never checkpointed), computed on
    the CPU and created on ``device`` (the model's, so no forward mixes devices); it follows
    ``module.to(device)``.
    """

    def __init__(self, config: RopeConfig, *, device=None):
        super().__init__()
        self.config = config
        self.attention_scaling = config.attention_scaling()
        self.register_buffer("inv_freq", config.inv_freq().to(device), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids`` [B, S] -> ``(cos, sin)``, each [B, S, dim/2] in fp32."""
        inv_freq = self.inv_freq
        if self.config.rope_type == "dynamic":
            # A host sync, as in HF's dynamic update; a meta dry run has positions 0 .. S - 1.
            longest = host_ints(position_ids.max(), on_meta=[position_ids.shape[-1] - 1])[0] + 1
            if longest > self.config.max_position_embeddings:
                inv_freq = self.config.inv_freq(longest).to(inv_freq.device)
        angles = position_ids[..., None].float() * inv_freq.float()
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Apply the rotation to ``x`` [B, heads, S, D >= dim] in this config's layout (its first ``dim``
        features when ``D > dim``)."""
        return apply_rotary(x, cos, sin, self.config.layout)

    def extra_repr(self) -> str:
        return f"dim={self.config.dim}, type={self.config.rope_type}, layout={self.config.layout}"
