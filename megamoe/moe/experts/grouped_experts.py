"""Expert MLPs over this rank's local expert slots, with optional expert tensor parallelism (ETP).

Each slot holds one expert: ``down(act(gate(x)) * up(x))`` for ``swiglu`` (SiLU-gated), or
``down(act(gate(x)))`` for a plain activation (``gelu`` exact, ``relu``, ``silu``); for a non-gated
expert the single input projection is called ``gate`` (the one the activation is applied to).

The module does NO communication. With ETP each rank holds a slice of every expert's FFN dimension
(``ffn_hidden_size / etp_size`` columns of gate and up, the matching rows of down's input), so its
output is a partial sum: the caller reduces it once for all experts, together with the EP reduction.

Backends (one interface, see :class:`GroupedExperts`):

- ``torch``: one fused autograd function for the whole expert MLP: one grouped GEMM per projection
  (gate and up fused), hand-written backward that writes each gradient once, straight into its
  stacked buffer. The grouped GEMM is ``torch._grouped_mm`` for bf16 rows where its kernels exist
  (:func:`~megamoe.moe.experts.grouped_mlp.grouped_mm_applies`; other dtypes and devices take the per-slot loop
  below). Under autocast the rows and weights are cast once to the autocast dtype, so that training with
  fp32 parameters and bf16 autocast runs the bf16 grouped GEMMs. On CPU it is
  one ``torch.mm(..., out=slice)`` per slot, each on all threads, the same serial loop as
  ``torch._grouped_mm`` on CPU but for any dtype (see :func:`_for_each_slot`; ``benchmarks/moe_layer.py``
  has both as rows).
- ``loop``: the reference: plain autograd over ``F.linear`` per slot, on ``split`` / ``unbind`` views
  (never ``weight[slot]`` indexing, whose backward materialises a zero-filled full-size gradient per
  slot).
- ``te``: TransformerEngine ``GroupedLinear`` (CUDA only; FP8-capable).
- ``auto``: ``te`` when TransformerEngine and a CUDA device are present, else ``torch``.

FP8 (``ExpertsConfig.fp8``, an :class:`~megamoe.moe.experts.fp8.FP8Config`) applies to a backend: ``te``
(``fp8_autocast``), ``torch`` (``torch._scaled_grouped_mm``, sm90+) or ``fp8_emulated``, the CPU
numerical reference (quantise, dequantise, fp32 GEMMs); ``auto`` picks ``te`` then ``torch`` and
raises rather than fall back to the emulation. See :mod:`megamoe.moe.experts.fp8_experts`.

gpt-oss experts (``ExpertsConfig.bias``, activation ``swiglu_clamped``: :mod:`megamoe.moe.experts.clamped_swiglu`):
biases on both projections, ``b_gate_up`` [S_local, G * F_shard] (sharded with the rows it is added
to) and ``b_down`` [S_local, H], added before the combine weights as in HF. The down bias is part of
an output the ETP group sums, so only ETP rank 0 adds it, while every rank's copy gets the full
gradient (the output gradient is the same on all of them), keeping the copies equal. Backends
``torch`` and ``loop``; TransformerEngine, FP8 and kept block-FP8 weights refuse biases (ValueError).

Kept block-FP8 weights (a checkpoint's e4m3 values and block scales, held as stored; set by
:meth:`GroupedExperts.keep_block_fp8`) run the ``block`` FP8 recipe on ``fp8_emulated`` or ``torch``, or
without an FP8 recipe dequantized per slot at run time: :mod:`megamoe.moe.experts.block_fp8_experts`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megamoe.gradients import main_grad
from megamoe.moe.experts import block_fp8_experts
from megamoe.moe.experts.clamped_swiglu import ClampedSwiGLU
from megamoe.moe.experts.expert_activations import activate as _activate
from megamoe.moe.experts.expert_activations import activation_forward as _activation_forward
from megamoe.moe.experts.fp8 import FP8AmaxReduction, FP8Config, FP8ScalingState, resolve_fp8_backend, te_fp8_recipe
from megamoe.moe.experts.grouped_mlp import GroupedMLPFunction, SlotGroups, _grouped_mlp, _host_sizes
from megamoe.moe.experts.kernel_probes import transformer_engine_problem
from megamoe.moe.experts.lora_experts import lora_grouped_mlp
from megamoe.moe.experts.loop_experts import loop_mlp as _loop_mlp
from megamoe.precision import active_autocast_dtype, in_autocast_dtype
from megamoe.quantization.block_fp8 import BlockFP8Config
from megamoe.transformer.recompute import checkpointed

__all__ = ["ExpertsConfig", "GroupedExperts"]

_ACTIVATIONS = ("swiglu", "gelu", "relu", "silu", "swiglu_clamped")
_BACKENDS = ("auto", "torch", "loop", "te", "fp8_emulated")
# Construction must not draw from the global RNG (the MoE layer seeds its layout-invariant expert
# init from it right after building its children), so the placeholder init uses its own generator.
_PLACEHOLDER_INIT_STD = 0.02
_PLACEHOLDER_INIT_SEED = 0


@dataclass
class ExpertsConfig:
    """Shape of this rank's experts: ``num_local_slots`` slots, each a full expert's ETP shard."""

    num_local_slots: int
    hidden_size: int
    ffn_hidden_size: int          # per-expert FFN size, FULL (before ETP sharding)
    activation: str = "swiglu"    # "swiglu" | "gelu" | "relu" | "silu"
    backend: str = "auto"         # "auto" | "torch" | "loop" | "te" | "fp8_emulated" (needs fp8)
    etp_size: int = 1
    etp_rank: int = 0
    fp8: FP8Config | None = None  # FP8 GEMMs on the chosen backend; see megamoe.moe.experts.fp8_experts
    bias: bool = False            # biases on gate/up and down (gpt-oss)
    swiglu_alpha: float = 1.702   # activation "swiglu_clamped" only (megamoe.moe.experts.clamped_swiglu)
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("num_local_slots", "hidden_size", "ffn_hidden_size", "etp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ExpertsConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"ExpertsConfig.activation must be one of {_ACTIVATIONS}, got {self.activation!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"ExpertsConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.backend == "fp8_emulated" and self.fp8 is None:
            raise ValueError("ExpertsConfig.backend='fp8_emulated' needs ExpertsConfig.fp8 (an FP8Config)")
        if self.backend == "loop" and self.fp8 is not None:
            raise ValueError("ExpertsConfig.backend='loop' is the high-precision reference: with fp8 use "
                             "backend='fp8_emulated' (the FP8 reference), 'torch', 'te' or 'auto'")
        if self.ffn_hidden_size % self.etp_size != 0:
            raise ValueError(
                f"ExpertsConfig.ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by etp_size "
                f"({self.etp_size}); change the ETP size")
        if not 0 <= self.etp_rank < self.etp_size:
            raise ValueError(f"ExpertsConfig.etp_rank must be in [0, {self.etp_size}), got {self.etp_rank}")
        if self.fp8 is not None and (self.bias or self.activation == "swiglu_clamped"):
            raise ValueError("ExpertsConfig.fp8: FP8 experts support neither expert biases (bias=True) nor the "
                             "'swiglu_clamped' activation (gpt-oss); run them in high precision (fp8=None)")
        if self.bias and self.backend == "te":
            raise ValueError("ExpertsConfig.bias: the 'te' backend has no expert biases; use backend 'torch' or 'loop'")
        if self.activation == "swiglu_clamped":
            ClampedSwiGLU(self.swiglu_alpha, self.swiglu_limit)           # validates the constants

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "swiglu_clamped")

    @property
    def activation_function(self) -> str | ClampedSwiGLU:
        """What the activation helpers take: the name, or the clamped SwiGLU with its constants."""
        if self.activation == "swiglu_clamped":
            return ClampedSwiGLU(self.swiglu_alpha, self.swiglu_limit)
        return self.activation

    @property
    def ffn_shard_size(self) -> int:
        """FFN columns of each expert held by this ETP rank."""
        return self.ffn_hidden_size // self.etp_size


def transformer_engine_usable(device: torch.device) -> bool:
    """TransformerEngine loads (:func:`~megamoe.moe.experts.kernel_probes.transformer_engine_problem`) and ``device``
    is a CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return transformer_engine_problem() is None


class GroupedExperts(nn.Module):
    """The expert MLPs of this rank's local slots; see the module docstring.

    Parameters (``torch`` / ``loop`` backends), stacked over local slots in nn.Linear / HF layout
    ``[out, in]``::

        w_gate_up  [S_local, G * F_shard, H]   rows: [gate shard; up shard] (G = 2), or gate (G = 1)
        w_down     [S_local, H, F_shard]

    Why this layout: each slot's slice is a contiguous nn.Linear weight, so ``F.linear`` (loop) and
    the checkpoint adapters (HF keys ``[F, H]`` / ``[H, F]``) use it without copies, as
    TransformerEngine's per-GEMM weights do; ``torch._grouped_mm`` takes it as a transposed
    (column-major) view, the operand layout its CUDA kernels (including the FP8 ones) are built
    for; and the fused backward writes the weight gradients directly in it (``dW = dY^T X`` per
    slot), so no transpose copy is ever made. On CPU every layout measured the same (MKL takes
    either operand transposed). Gate and up of one slot are stacked in one matrix so their GEMM is
    one GEMM with twice the columns, and ``chunk(2)`` of its output splits them without a copy.

    The ``te`` backend keeps TransformerEngine's own per-slot parameters (``te_gate_up.weight{s}``,
    ``te_down.weight{s}``) with the same per-slot shapes; use :meth:`load_expert_weights` /
    :meth:`expert_weight_shards` / :meth:`slot_parameters` to be layout-agnostic.

    Construction draws no numbers from the global RNG: the weights get a deterministic placeholder
    init, and the owner (the MoE layer) loads each expert's real, layout-invariant initial weights
    through :meth:`load_expert_weights`.

    ``fp8_amax_reduction``: the ETP and ETP x expert-DP groups over which the FP8 paths reduce amaxes
    (:class:`megamoe.moe.experts.fp8.FP8AmaxReduction`); the MoE layer passes its own groups.

    ``recompute_activation`` (selective ``moe_act``, set by the decoder layer; see
    :mod:`megamoe.transformer.recompute`): the activation between the two GEMMs keeps nothing for
    backward. The fused ``torch`` backend then saves ``h`` but not ``act(h)`` and recomputes it in its
    backward; the other backends run the activation under :func:`~megamoe.transformer.recompute.checkpointed`.
    """

    recompute_activation: bool = False
    # Kept block-FP8 weights (see :meth:`keep_block_fp8`); None: high-precision weights.
    weight_quantization: BlockFP8Config | None = None

    def __init__(self, config: ExpertsConfig, *, fp8_amax_reduction: FP8AmaxReduction = FP8AmaxReduction(),
                 device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.fp8_amax_reduction = fp8_amax_reduction      # groups FP8 amaxes are reduced over
        device = torch.device(device) if device is not None else torch.get_default_device()
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.backend = (self._resolve_backend(config.backend, device, te_allowed=not config.bias)
                        if config.fp8 is None else resolve_fp8_backend(config.backend, device, recipe=config.fp8.recipe))
        self.activation = config.activation_function
        self.adds_down_bias = config.etp_rank == 0      # the ETP group sums the outputs: add it once
        # FP8 scaling state: TE keeps its own; the torch / emulated paths keep theirs here (the block
        # recipe scales every tile from its own values: no state).
        self.fp8_state = (FP8ScalingState(config.fp8, config.num_local_slots, device=device)
                          if config.fp8 is not None and self.backend != "te" and config.fp8.recipe != "block"
                          else None)
        # TE reduces delayed-scaling amaxes over the slot group; over every rank if given none.
        self._te_fp8_recipe = (te_fp8_recipe(config.fp8, reduce_amax=fp8_amax_reduction.slot_group is not None)
                               if config.fp8 is not None and self.backend == "te" else None)
        S, H, Fs = config.num_local_slots, config.hidden_size, config.ffn_shard_size
        G = 2 if config.gated else 1
        generator = torch.Generator().manual_seed(_PLACEHOLDER_INIT_SEED)
        if self.backend == "te":
            import transformer_engine.pytorch as te

            def init_method(weight: torch.Tensor) -> None:
                _placeholder_init_(weight, generator)

            self.te_gate_up = te.GroupedLinear(S, H, G * Fs, bias=False, init_method=init_method,
                                               params_dtype=dtype, device=device)
            self.te_down = te.GroupedLinear(S, Fs, H, bias=False, init_method=init_method,
                                            params_dtype=dtype, device=device)
        else:
            self.w_gate_up = nn.Parameter(torch.empty(S, G * Fs, H, device=device, dtype=dtype))
            self.w_down = nn.Parameter(torch.empty(S, H, Fs, device=device, dtype=dtype))
            _placeholder_init_(self.w_gate_up, generator)
            _placeholder_init_(self.w_down, generator)
        if config.bias:
            self.b_gate_up = nn.Parameter(torch.zeros(S, G * Fs, device=device, dtype=dtype))
            self.b_down = nn.Parameter(torch.zeros(S, H, device=device, dtype=dtype))
            self.b_down.etp_replicated = True      # whole on every ETP rank: counted once in the gradient norm
        else:
            self.register_parameter("b_gate_up", None)
            self.register_parameter("b_down", None)

    @staticmethod
    def _resolve_backend(requested: str, device: torch.device, te_allowed: bool = True) -> str:
        if requested == "auto":
            return "te" if te_allowed and transformer_engine_usable(device) else "torch"
        if requested == "te" and not transformer_engine_usable(device):
            raise RuntimeError(
                f"ExpertsConfig.backend='te' needs TransformerEngine and a CUDA device (device is {device}, "
                f"CUDA available: {torch.cuda.is_available()}; {transformer_engine_problem() or 'TE loads'}): install "
                "it with `pip install .[te]` on a CUDA machine, or use backend='torch'")
        return requested

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, tokens_sorted: torch.Tensor, tokens_per_slot: torch.Tensor,
                rows_per_slot: list[int] | None = None) -> torch.Tensor:
        """``tokens_sorted`` [N, H], rows grouped by local slot (slot 0's first), ``tokens_per_slot``
        [S_local] int64 (sums to N) -> [N, H], a partial sum over the ETP group when ``etp_size > 1``.
        ``rows_per_slot``: the same counts as host ints when the caller already read them (the dispatcher
        does), so that no path here reads them again.

        Under autocast the ``torch`` backend casts the rows and the weights to the autocast dtype once, as
        autocast does for a matmul (``torch.mm(out=)`` and ``torch._grouped_mm`` are not autocast ops), so
        that bf16 autocast runs the bf16 grouped GEMMs; the output is in that dtype."""
        cfg = self.config
        if tokens_sorted.dim() != 2 or tokens_sorted.shape[1] != cfg.hidden_size:
            raise ValueError(f"tokens_sorted must be [N, {cfg.hidden_size}], got {tuple(tokens_sorted.shape)}")
        if tokens_per_slot.shape != (cfg.num_local_slots,) or tokens_per_slot.dtype not in (torch.int32,
                                                                                             torch.int64):
            raise ValueError(f"tokens_per_slot must be an integer tensor of shape [{cfg.num_local_slots}], got "
                             f"{tokens_per_slot.dtype} {tuple(tokens_per_slot.shape)}")
        lora = self._modules.get("lora_adapters")       # megamoe.lora.apply_lora: frozen base + expert adapters
        if lora is not None:
            return lora_grouped_mlp(self, lora, tokens_sorted, tokens_per_slot, rows_per_slot)
        if self.backend == "te":
            return self._forward_te(tokens_sorted, tokens_per_slot)
        if self.weight_quantization is not None or (cfg.fp8 is not None and cfg.fp8.recipe == "block"):
            sizes = _host_sizes(tokens_per_slot, len(tokens_sorted), rows_per_slot)
            return block_fp8_experts.kept_forward(self, tokens_sorted, sizes, self._activate)
        # Under autocast the dispatcher sends the rows in the autocast dtype (half the bytes of fp32 rows).
        if tokens_sorted.dtype not in (self.w_gate_up.dtype, active_autocast_dtype(tokens_sorted.device.type)):
            raise ValueError(f"tokens_sorted is {tokens_sorted.dtype} but the expert weights are "
                             f"{self.w_gate_up.dtype}: cast one of them, or run under autocast to {tokens_sorted.dtype}")
        if cfg.fp8 is not None:
            return self._forward_fp8(tokens_sorted, tokens_per_slot)
        if self.backend == "loop":            # F.linear: autocast casts per GEMM
            sizes = _host_sizes(tokens_per_slot, tokens_sorted.shape[0], rows_per_slot)
            biases = {} if self.b_gate_up is None else dict(
                gate_up_biases=self.b_gate_up.unbind(0), down_biases=self.b_down.unbind(0),
                add_down_bias=self.adds_down_bias)
            return _loop_mlp(tokens_sorted, self.w_gate_up.unbind(0), self.w_down.unbind(0), sizes,
                             self.activation, recompute_activation=self.recompute_activation, **biases)
        tokens, w_gate_up, w_down, b_gate_up, b_down = in_autocast_dtype(
            tokens_sorted, self.w_gate_up, self.w_down, self.b_gate_up, self.b_down)
        groups = SlotGroups.from_counts(tokens_per_slot.to(tokens.device), tokens.shape[0], dtype=tokens.dtype,
                                        known_sizes=rows_per_slot)
        biases = (b_gate_up, b_down, self.adds_down_bias)
        if torch.is_grad_enabled():
            return GroupedMLPFunction.apply(tokens, w_gate_up, w_down, groups, self.activation,
                                            self.recompute_activation, *biases)
        return _grouped_mlp(tokens, w_gate_up, w_down, groups, self.activation, *biases)[0]

    @property
    def supports_per_pair(self) -> bool:
        """Whether :meth:`forward_per_pair` is available (stacked high-precision weights)."""
        return (self.backend in ("torch", "loop") and self.config.fp8 is None and self.weight_quantization is None
                and "lora_adapters" not in self._modules)

    def forward_per_pair(self, tokens: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed output of few tokens, pair by pair, with static shapes (inference only).

        ``tokens`` [T, H], ``slot_ids`` [T, K] local slot ids (-1 or out of range: the pair is not
        computed here), ``weights`` [T, K] -> [T, H]: for each token, the sum over its pairs of
        weight * expert(token), accumulated in fp32 or wider (as the grouped path's combine); a
        partial sum over the ETP group when ``etp_size > 1``.

        Each pair is a matrix-vector product with its slot's weights, read by index: T * K slot
        weights are read (the grouped path reads each used slot once), but there is no sort, no
        host synchronisation and no data-dependent shape, so ``torch.compile`` captures a whole
        decode step. Worth it while T * K is at most about the number of local slots (decoding).
        """
        if not self.supports_per_pair:
            raise ValueError(f"forward_per_pair needs the 'torch' or 'loop' backend without FP8 or LoRA, this is "
                             f"{self.backend!r}{' with FP8' if self.config.fp8 is not None else ''}"
                             f"{' with LoRA' if 'lora_adapters' in self._modules else ''}")
        num_tokens, top_k = slot_ids.shape
        num_slots = self.config.num_local_slots
        valid = (slot_ids >= 0) & (slot_ids < num_slots)                        # [T, K]
        slots = torch.where(valid, slot_ids, 0).reshape(-1)                     # [T * K]
        rows = tokens.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, tokens.shape[-1], 1)   # [T * K, H, 1]
        hidden = torch.bmm(self.w_gate_up[slots], rows).squeeze(-1)             # [T * K, G * F_shard]
        if self.b_gate_up is not None:
            hidden = hidden + self.b_gate_up[slots]
        act = _activation_forward(hidden, self.activation)
        out = torch.bmm(self.w_down[slots], act.unsqueeze(-1)).squeeze(-1)      # [T * K, H]
        if self.b_down is not None and self.adds_down_bias:
            out = out + self.b_down[slots]
        out = out.view(num_tokens, top_k, -1)                                    # [T, K, H]
        acc_dtype = torch.promote_types(out.dtype, torch.float32)
        pair_weights = torch.where(valid, weights, 0).to(acc_dtype).unsqueeze(-1)
        return (out.to(acc_dtype) * pair_weights).sum(1).to(tokens.dtype)

    def _forward_te(self, tokens_sorted: torch.Tensor, tokens_per_slot: torch.Tensor) -> torch.Tensor:
        # FP8 first, rows or none: TE reduces amaxes over the slot group inside fp8_autocast, a collective
        # every rank of the group must join (te_fp8_grouped_mlp runs a rank without rows on zero rows).
        if self._te_fp8_recipe is not None:
            from megamoe.moe.experts.fp8_experts import te_fp8_grouped_mlp  # imports this module
            return te_fp8_grouped_mlp(self.te_gate_up, self.te_down, tokens_sorted, tokens_per_slot,
                                      self._activate, self._te_fp8_recipe, self.fp8_amax_reduction.slot_group)
        sizes = _host_sizes(tokens_per_slot, tokens_sorted.shape[0])
        if tokens_sorted.shape[0] == 0:
            # Keep every weight in the graph (zero gradients) without asking TE for empty GEMMs.
            return _loop_mlp(tokens_sorted, self._te_weights(self.te_gate_up),
                             self._te_weights(self.te_down), sizes, self.activation)
        hidden = self.te_gate_up(tokens_sorted, sizes)
        return self.te_down(self._activate(hidden), sizes)

    def _forward_fp8(self, tokens_sorted: torch.Tensor, tokens_per_slot: torch.Tensor) -> torch.Tensor:
        from megamoe.moe.experts.fp8_experts import fp8_grouped_mlp  # imports this module
        kernel = "scaled_grouped_mm" if self.backend == "torch" else "emulated"
        return fp8_grouped_mlp(tokens_sorted, self.w_gate_up, self.w_down, tokens_per_slot, self._activate,
                               self.config.fp8, self.fp8_state, kernel=kernel, reduction=self.fp8_amax_reduction)

    def keep_block_fp8(self, config: BlockFP8Config, name: str = "experts") -> None:
        """Hold the weights as kept block-FP8 ones, quantizing the current values (``name``: for errors)."""
        if self.config.bias:
            raise ValueError(f"{name}: kept block-FP8 experts have no biases (gpt-oss's experts are not FP8)")
        block_fp8_experts.keep_expert_weights(self, config, name)

    def expert_scale_shards(self, local_slot: int) -> dict[str, torch.Tensor]:
        """Kept block-FP8 weights: one slot's scale shards keyed like :meth:`expert_weight_shards`, else {}."""
        return {} if self.weight_quantization is None else block_fp8_experts.kept_scale_shards(self, local_slot)

    def _activate(self, hidden: torch.Tensor) -> torch.Tensor:
        return checkpointed(_activate, hidden, self.activation, enabled=self.recompute_activation)

    def _te_weights(self, module: nn.Module) -> list[torch.Tensor]:
        return [getattr(module, f"weight{s}") for s in range(self.config.num_local_slots)]

    # ---- per-slot weight access (checkpoints, migration, tests, layout-invariant init) --------
    def slot_parameters(self, local_slot: int) -> tuple[tuple[nn.Parameter, int | slice], ...]:
        """Every parameter holding part of ``local_slot``, with the index selecting that part:
        ``param[index]`` is the slot's tensor, and so is ``state[index]`` for any tensor shaped like
        ``param`` (its gradient, its optimizer moments). Stacked backends: ``(w_gate_up, s)``,
        ``(w_down, s)``; ``te``: the slot's own ``weight{s}`` parameters with ``slice(None)``. Layout
        agnostic: what :func:`megamoe.moe.placement.expert_migration.migrate_layer` moves. Kept block-FP8 weights add
        ``(w_gate_up_scale_inv, s)``, ``(w_down_scale_inv, s)``: the scales move with the weights."""
        scales = () if self.weight_quantization is None else ((self.w_gate_up_scale_inv, local_slot),
                                                              (self.w_down_scale_inv, local_slot))
        return (*self._weight_parameters(local_slot), *scales)

    def _weight_parameters(self, local_slot: int) -> tuple[tuple[nn.Parameter, int | slice], ...]:
        """The weight parameters of ``local_slot`` (not their block scales), as in :meth:`slot_parameters`."""
        if not 0 <= local_slot < self.config.num_local_slots:
            raise ValueError(f"local_slot must be in [0, {self.config.num_local_slots}), got {local_slot}")
        if self.backend == "te":
            return ((getattr(self.te_gate_up, f"weight{local_slot}"), slice(None)),
                    (getattr(self.te_down, f"weight{local_slot}"), slice(None)))
        if self.b_gate_up is not None:
            return ((self.w_gate_up, local_slot), (self.w_down, local_slot), (self.b_gate_up, local_slot),
                    (self.b_down, local_slot))
        return ((self.w_gate_up, local_slot), (self.w_down, local_slot))

    def slot_buffers(self, local_slot: int) -> tuple[torch.Tensor, ...]:
        """Per-slot state other than parameters that belongs to the slot's expert (views): the FP8
        scaling state (amax histories and scales) of the torch / emulated FP8 paths, else none.
        (TransformerEngine keeps its FP8 state inside its modules, per GEMM: not reachable here.)"""
        if self.fp8_state is None:
            return ()
        return self.fp8_state.slot_state(local_slot)

    def _slot_weights(self, local_slot: int, grad: bool = False) -> tuple[torch.Tensor, ...]:
        """(gate_up [G * F_shard, H], down [H, F_shard], then with biases gate_up bias [G * F_shard] and
        down bias [H]) of one slot: the parameters, or their gradients with ``grad=True``."""
        params = self._weight_parameters(local_slot)
        if not grad:
            return tuple(p.detach()[index] for p, index in params)
        # The accumulated gradient: fp32 ``main_grad`` for bf16 parameters under the distributed optimizer.
        grads = [main_grad(p) for p, _ in params]
        if any(g is None for g in grads):
            raise ValueError("the expert weights have no gradient yet: run a backward pass first")
        return tuple(g[index] for g, (_, index) in zip(grads, params))

    @torch.no_grad()
    def load_expert_weights(self, local_slot: int, gate: torch.Tensor, up: torch.Tensor | None,
                            down: torch.Tensor, *, gate_bias: torch.Tensor | None = None,
                            up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> None:
        """Write one expert's FULL weights (HF nn.Linear layout: ``gate`` / ``up`` [F, H], ``down``
        [H, F]; ``up`` is None for a non-gated activation) into ``local_slot``, keeping this rank's
        ETP shard. With ``ExpertsConfig.bias``: the biases ``gate_bias`` / ``up_bias`` [F] and
        ``down_bias`` [H] (None: zeros)."""
        cfg = self.config
        F_, H = cfg.ffn_hidden_size, cfg.hidden_size
        if cfg.gated and up is None:
            raise ValueError(f"activation {cfg.activation!r} is gated: pass the up projection weight")
        if not cfg.gated and up is not None:
            raise ValueError(f"activation {cfg.activation!r} is not gated: pass up=None (the input projection "
                             "is `gate`)")
        for name, tensor, shape in (("gate", gate, (F_, H)), ("up", up, (F_, H)), ("down", down, (H, F_))):
            if tensor is not None and tuple(tensor.shape) != shape:
                raise ValueError(f"{name} must be the full expert weight of shape {list(shape)} (HF layout), got "
                                 f"{list(tensor.shape)}")
        if self.weight_quantization is not None:
            block_fp8_experts.load_kept_expert_weights(self, local_slot, gate, up, down)
            return
        views = self._slot_weights(local_slot)
        gate_up, w_down = views[:2]
        shard = self._shard()
        Fs = cfg.ffn_shard_size
        gate_up[:Fs].copy_(gate[shard])
        if cfg.gated:
            gate_up[Fs:].copy_(up[shard])
        w_down.copy_(down[:, shard])
        if cfg.bias:
            b_gate_up, b_down = views[2:]
            for name, bias, target, size in (("gate_bias", gate_bias, b_gate_up[:Fs], F_),
                                             ("up_bias", up_bias, b_gate_up[Fs:], F_),
                                             ("down_bias", down_bias, b_down, H)):
                if bias is not None and tuple(bias.shape) != (size,):
                    raise ValueError(f"{name} must be the full expert bias of shape [{size}], got {list(bias.shape)}")
                if bias is None:
                    target.zero_()
                else:
                    target.copy_(bias if size == H else bias[shard])

    def expert_weight_shards(self, local_slot: int, grad: bool = False) -> dict[str, torch.Tensor]:
        """This rank's shards of one slot in HF layout: ``{"gate": [F_shard, H], "up": [F_shard, H],
        "down": [H, F_shard]}`` (no "up" when not gated); ``grad=True`` gives their gradients.
        The tensors are detached views of the stacked storage: clone before modifying."""
        views = self._slot_weights(local_slot, grad=grad)
        gate_up, down = views[:2]
        Fs = self.config.ffn_shard_size
        shards = {"gate": gate_up[:Fs]}
        if self.config.gated:
            shards["up"] = gate_up[Fs:]
        shards["down"] = down
        if self.config.bias:        # this rank's bias shards: gate / up [F_shard], down [H] (the whole bias)
            shards["gate_bias"] = views[2][:Fs]
            shards["up_bias"] = views[2][Fs:]
            shards["down_bias"] = views[3]
        return shards

    def _shard(self) -> slice:
        Fs = self.config.ffn_shard_size
        return slice(self.config.etp_rank * Fs, (self.config.etp_rank + 1) * Fs)

    def extra_repr(self) -> str:
        c = self.config
        return (f"slots={c.num_local_slots}, hidden={c.hidden_size}, ffn={c.ffn_hidden_size}, "
                f"activation={c.activation}, backend={self.backend}, etp={c.etp_rank}/{c.etp_size}")


@torch.no_grad()
def _placeholder_init_(weight: torch.Tensor, generator: torch.Generator) -> None:
    """N(0, 0.02) drawn in fp32 on CPU from ``generator``: deterministic on every device and dtype."""
    values = torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, _PLACEHOLDER_INIT_STD, generator=generator)
    weight.copy_(values)
