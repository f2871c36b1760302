"""The fused ``torch`` expert backend: grouped GEMMs over the local slots and one autograd function for
the whole expert MLP (see :mod:`megamoe.moe.experts.grouped_experts` for the backends and the layout).

``SlotGroups`` says which rows belong to which slot; ``grouped_linear`` and its two gradients are the
grouped GEMMs (``torch._grouped_mm`` where its kernels apply, else one GEMM per slot);
:class:`GroupedMLPFunction` runs gate/up, the activation and down forward, and writes each weight
gradient once, straight into its stacked buffer, backward. Low-precision rows on CPU run it on the
padded batch of slots instead (:mod:`megamoe.moe.experts.grouped_bmm`): one ``torch.bmm`` per projection
and gradient for all slots, the activation on the padded batch.

Weights whose gradient accumulates in an fp32 ``main_grad`` (bf16 parameters under the distributed
optimizer: :func:`megamoe.gradients.main_grad_target`) get it added there by the weight-gradient GEMMs
themselves (:func:`megamoe.gradients.add_matmul_`: one GEMM with fp32 output where the device has one),
and autograd None: no bf16 gradient tensor is handed to the accumulation hook to be cast-added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megamoe.gradients import add_matmul_, main_grad_target
from megamoe.host_values import even_split, host_ints
from megamoe.moe.experts.grouped_bmm import PaddedSlots, padded_bmm_applies
from megamoe.moe.experts.expert_activations import activation_backward as _activation_backward
from megamoe.moe.experts.expert_activations import activation_forward as _activation_forward
from megamoe.moe.experts.kernel_probes import grouped_mm_problem, log_fallback

__all__ = ["SlotGroups", "GroupedMLPFunction", "grouped_linear", "grouped_linear_input_grad",
           "grouped_linear_weight_grad", "grouped_mm_applies"]


# ---- row counts on the host (the loop backend, the per-slot GEMMs) ------------------------------
def _host_sizes(tokens_per_slot: torch.Tensor, num_rows: int, known: list[int] | None = None) -> list[int]:
    """The rows of every slot as host ints: ``known`` (the counts the dispatcher already read, checked
    against ``num_rows``) or one host read. A meta dry run (see megamoe.host_values) spreads the rows
    evenly over the slots."""
    num_slots = tokens_per_slot.numel()
    if known is not None and len(known) != num_slots:
        raise ValueError(f"rows_per_slot has {len(known)} entries for {num_slots} slots")
    sizes = list(known) if known is not None else host_ints(tokens_per_slot, on_meta=even_split(num_rows, num_slots))
    if sum(sizes) != num_rows or min(sizes) < 0:
        raise ValueError(f"tokens_per_slot {sizes} must be >= 0 and sum to the number of rows ({num_rows})")
    return sizes


# ---- fused backend ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SlotGroups:
    """How the sorted rows split into slots, in the two forms the grouped GEMMs use.

    ``sizes`` (host ints) selects the per-slot ``torch.mm`` loop; ``None`` selects
    ``torch._grouped_mm`` with the device-side ``offsets`` (no host sync). ``padded`` (with ``sizes``):
    :class:`GroupedMLPFunction` runs on the padded batch of slots (one ``torch.bmm`` per GEMM).
    """

    tokens_per_slot: torch.Tensor   # [S] int64
    offsets: torch.Tensor           # [S] int32 cumulative row ends (torch._grouped_mm's `offs`)
    sizes: list[int] | None
    num_rows: int
    padded: PaddedSlots | None = None

    @classmethod
    def from_counts(cls, tokens_per_slot: torch.Tensor, num_rows: int, use_grouped_mm: bool | None = None,
                    dtype: torch.dtype | None = None, known_sizes: list[int] | None = None,
                    row_flops: int | None = None, use_padded_bmm: bool | None = None):
        """``use_grouped_mm`` defaults to :func:`grouped_mm_applies` for the rows' device and ``dtype`` (else
        the per-slot loop, with the reason logged once). ``known_sizes``: the rows of every slot when the
        caller already read them (no host read here). ``use_padded_bmm`` (not with ``use_grouped_mm``)
        defaults to :func:`~megamoe.moe.experts.grouped_bmm.padded_bmm_applies` where ``row_flops`` (the
        forward GEMM work of one row) is given, else False."""
        if use_grouped_mm is None:
            use_grouped_mm = grouped_mm_applies(tokens_per_slot.device, dtype)
        offsets = torch.cumsum(tokens_per_slot, dim=0, dtype=torch.int32)
        if use_grouped_mm:
            if use_padded_bmm:
                raise ValueError("SlotGroups: use_grouped_mm and use_padded_bmm exclude each other")
            if tokens_per_slot.device.type == "cpu":
                _host_sizes(tokens_per_slot, num_rows, known_sizes)
            else:
                torch._assert_async(offsets[-1] == num_rows)
            return cls(tokens_per_slot, offsets, None, num_rows)
        sizes = _host_sizes(tokens_per_slot, num_rows, known_sizes)
        if use_padded_bmm is None:
            use_padded_bmm = row_flops is not None and padded_bmm_applies(sizes, tokens_per_slot.device, dtype,
                                                                          row_flops)
        padded = PaddedSlots.from_sizes(sizes, tokens_per_slot.device) if use_padded_bmm and num_rows else None
        return cls(tokens_per_slot, offsets, sizes, num_rows, padded)


def grouped_mm_applies(device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether the grouped GEMMs of rows of ``dtype`` on ``device`` go to ``torch._grouped_mm``: not on CPU (the
    per-slot loop is as fast there), not for other dtypes (its kernels and meta checks take bf16), not where it
    cannot run (:func:`~megamoe.moe.experts.kernel_probes.grouped_mm_problem`; the meta device stands in for a GPU).
    Everywhere else the per-slot ``torch.mm`` loop runs, which is correct on any device."""
    if device.type == "cpu" or dtype != torch.bfloat16:
        return False
    problem = grouped_mm_problem(device)
    if problem is not None:
        log_fallback(problem, "the expert GEMMs run one torch.mm per slot")
    return problem is None


def _for_each_slot(sizes: list[int], gemm: Callable[[int], object]) -> None:
    """Run ``gemm(s)`` for every slot with rows, on the calling thread, each GEMM on all of torch's
    threads (what ``torch._grouped_mm`` does on CPU, for any dtype and into ``out=`` slices).

    Measured in the full training step of ``benchmarks/train_step.py`` (2 threads, minima of 5
    interleaved repeats): spreading the slots over single-threaded worker threads instead made the step
    about 10% slower (1192 ms against 1063 ms), although the layer alone (``benchmarks/moe_layer.py``)
    ran about 5% faster that way. The step is what counts.
    """
    for s, n in enumerate(sizes):
        if n > 0:
            gemm(s)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: SlotGroups) -> torch.Tensor:
    """Per slot s: ``y_s = x_s @ weight[s].T``; x [N, I], weight [S, O, I] -> [N, O]."""
    if groups.num_rows == 0:
        return x.new_empty(0, weight.shape[1])
    if groups.sizes is None:
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=groups.offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    rows, out_rows = x.split(groups.sizes), out.split(groups.sizes)
    _for_each_slot(groups.sizes, lambda s: torch.mm(rows[s], weight[s].t(), out=out_rows[s]))
    return out


def grouped_linear_input_grad(grad_y: torch.Tensor, weight: torch.Tensor, groups: SlotGroups) -> torch.Tensor:
    """Per slot s: ``dx_s = dy_s @ weight[s]``; dy [N, O], weight [S, O, I] -> [N, I]."""
    if groups.num_rows == 0:
        return grad_y.new_empty(0, weight.shape[2])
    if groups.sizes is None:
        return torch._grouped_mm(grad_y, weight, offs=groups.offsets)
    out = grad_y.new_empty(grad_y.shape[0], weight.shape[2])
    rows, out_rows = grad_y.split(groups.sizes), out.split(groups.sizes)
    _for_each_slot(groups.sizes, lambda s: torch.mm(rows[s], weight[s], out=out_rows[s]))
    return out


def grouped_linear_weight_grad(grad_y: torch.Tensor, x: torch.Tensor, groups: SlotGroups) -> torch.Tensor:
    """Per slot s: ``dW[s] = dy_s^T @ x_s``; dy [N, O], x [N, I] -> [S, O, I], zero for empty slots."""
    num_slots = groups.tokens_per_slot.shape[0]
    if groups.num_rows == 0:
        return x.new_zeros(num_slots, grad_y.shape[1], x.shape[1])
    if groups.sizes is None:
        out = torch._grouped_mm(grad_y.t(), x, offs=groups.offsets)
        # A slot without rows is a K = 0 GEMM, which the grouped kernels do not promise to write.
        return out.masked_fill_((groups.tokens_per_slot == 0).view(-1, 1, 1), 0)
    out = x.new_empty(num_slots, grad_y.shape[1], x.shape[1])
    for s, n in enumerate(groups.sizes):
        if n == 0:
            out[s].zero_()
    dy_rows, x_rows = grad_y.split(groups.sizes), x.split(groups.sizes)
    _for_each_slot(groups.sizes, lambda s: torch.mm(dy_rows[s].t(), x_rows[s], out=out[s]))
    return out


def _weight_grad(weight: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor,
                 groups: SlotGroups) -> torch.Tensor | None:
    """``weight``'s gradient for autograd, per slot ``dy_s^T x_s``: :func:`grouped_linear_weight_grad`, or, where
    ``weight`` accumulates in an fp32 ``main_grad``, added into it slot by slot (None returned)."""
    target = main_grad_target(weight)
    if target is None:
        return grouped_linear_weight_grad(grad_y, x, groups)
    if groups.sizes is None or groups.num_rows == 0:
        target.add_(grouped_linear_weight_grad(grad_y, x, groups))
    else:
        dy_rows, x_rows = grad_y.split(groups.sizes), x.split(groups.sizes)
        _for_each_slot(groups.sizes, lambda s: add_matmul_(target[s], dy_rows[s].t(), x_rows[s]))
    return None


def _padded_weight_grad(weight: torch.Tensor, grad_batch: torch.Tensor, batch: torch.Tensor) -> torch.Tensor | None:
    """:func:`_weight_grad` on the padded batch: one ``bmm`` (into ``main_grad`` where there is one)."""
    target = main_grad_target(weight)
    if target is None:
        return torch.bmm(grad_batch.transpose(1, 2), batch)
    add_matmul_(target, grad_batch.transpose(1, 2), batch)
    return None


def _row_slots(groups: SlotGroups) -> torch.Tensor:
    """[N] the local slot of every sorted row (no host sync: the row count is known)."""
    counts = groups.tokens_per_slot
    return torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                   output_size=groups.num_rows)


def _grouped_mlp(tokens, w_gate_up, w_down, groups: SlotGroups, activation, b_gate_up=None, b_down=None,
                 add_down_bias: bool = True):
    """The expert MLP of all slots: (output [N, H], hidden [N, G * F], activation output [N, F]); on the
    padded batch (``groups.padded``): (output [N, H], padded tokens [S, C, H], hidden [S, C, G * F],
    activation output [S, C, F])."""
    if groups.padded is not None:
        return _padded_mlp(tokens, w_gate_up, w_down, groups.padded, activation, b_gate_up, b_down, add_down_bias)
    hidden = grouped_linear(tokens, w_gate_up, groups)                  # [N, G * F]
    rows = _row_slots(groups) if b_gate_up is not None else None
    if b_gate_up is not None:
        hidden += b_gate_up.index_select(0, rows)
    act = _activation_forward(hidden, activation)                       # [N, F]
    out = grouped_linear(act, w_down, groups)                           # [N, H]
    if b_down is not None and add_down_bias:
        out += b_down.index_select(0, rows)
    return out, hidden, act


def _padded_mlp(tokens, w_gate_up, w_down, padded: PaddedSlots, activation, b_gate_up, b_down, add_down_bias):
    """:func:`_grouped_mlp` on the padded batch: one ``torch.bmm`` per projection."""
    batch = padded.pad(tokens)                                               # [S, C, H]
    hidden = torch.bmm(batch, w_gate_up.transpose(1, 2))                    # [S, C, G * F]
    if b_gate_up is not None:
        hidden += b_gate_up.unsqueeze(1)
    act = _activation_forward(hidden, activation)                           # [S, C, F]
    out = torch.bmm(act, w_down.transpose(1, 2))                            # [S, C, H]
    if b_down is not None and add_down_bias:
        out += b_down.unsqueeze(1)
    return padded.unpad(out), batch, hidden, act


def _padded_mlp_backward(grad_out, batch, w_gate_up, w_down, hidden, act, padded: PaddedSlots, activation,
                         needs_input_grad, has_bias):
    """The gradients of :func:`_padded_mlp` (zero rows get zero gradients, so the sums over each slot's
    batch are over its real rows): (tokens, w_gate_up, w_down, b_gate_up, b_down)."""
    grad_batch = padded.pad(grad_out)                                       # [S, C, H]
    grad_w_down = _padded_weight_grad(w_down, grad_batch, act) if needs_input_grad[2] else None
    grad_hidden = _activation_backward(torch.bmm(grad_batch, w_down), hidden, activation)   # [S, C, G * F]
    grad_w_gate_up = _padded_weight_grad(w_gate_up, grad_hidden, batch) if needs_input_grad[1] else None
    grad_tokens = padded.unpad(torch.bmm(grad_hidden, w_gate_up)) if needs_input_grad[0] else None
    grad_b_gate_up, grad_b_down = (grad_hidden.sum(1), grad_batch.sum(1)) if has_bias else (None, None)
    return grad_tokens, grad_w_gate_up, grad_w_down, grad_b_gate_up, grad_b_down


class GroupedMLPFunction(torch.autograd.Function):
    """The whole expert MLP of all slots as one autograd node.

    Forward: ``h = X W1^T`` (grouped), ``a = act(h)``, ``y = a W2^T`` (grouped); saves X, h, a.
    Backward computes each gradient once into a fresh stacked buffer (no per-slot ``cat``, no
    zero-filled full-size gradient, no transpose copy): ``da = dY W2``, ``dW2 = dY^T a``,
    ``dh = act'(h) da`` (gate and up halves written in place), ``dX = dh W1``, ``dW1 = dh^T X``.
    Saving ``a`` instead of recomputing it trades N * F_shard of activation memory for one
    elementwise pass and one allocation in backward (measured faster on CPU); ``recompute_activation``
    (selective ``moe_act``) makes the other choice: ``a`` is not saved and backward recomputes it from
    ``h`` with the same kernel, so every gradient is bit-identical.
    """

    @staticmethod
    def forward(ctx, tokens, w_gate_up, w_down, groups: SlotGroups, activation,
                recompute_activation: bool = False, b_gate_up=None, b_down=None, add_down_bias: bool = True):
        out, *saved = _grouped_mlp(tokens, w_gate_up, w_down, groups, activation, b_gate_up, b_down, add_down_bias)
        if groups.padded is not None:           # the padded batch of the tokens is saved in their place
            tokens, hidden, act = saved
        else:
            hidden, act = saved
        ctx.has_bias = b_gate_up is not None
        ctx.recompute_activation = recompute_activation
        if recompute_activation:
            ctx.save_for_backward(tokens, w_gate_up, w_down, hidden)
        else:
            ctx.save_for_backward(tokens, w_gate_up, w_down, hidden, act)
        ctx.groups, ctx.activation = groups, activation
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.recompute_activation:
            tokens, w_gate_up, w_down, hidden = ctx.saved_tensors
            act = _activation_forward(hidden, ctx.activation) if ctx.needs_input_grad[2] else None
        else:
            tokens, w_gate_up, w_down, hidden, act = ctx.saved_tensors
        groups = ctx.groups
        # A broadcast (stride-0) gradient, e.g. from `out.sum().backward()`, breaks the GEMMs' stride
        # checks and their speed: make it a dense matrix first.
        grad_out = grad_out.contiguous()
        if groups.padded is not None:
            grad_tokens, grad_w_gate_up, grad_w_down, grad_b_gate_up, grad_b_down = _padded_mlp_backward(
                grad_out, tokens, w_gate_up, w_down, hidden, act, groups.padded, ctx.activation,
                ctx.needs_input_grad, ctx.has_bias)
            return grad_tokens, grad_w_gate_up, grad_w_down, None, None, None, grad_b_gate_up, grad_b_down, None
        grad_w_down = _weight_grad(w_down, grad_out, act, groups) if ctx.needs_input_grad[2] else None
        grad_hidden = _activation_backward(grouped_linear_input_grad(grad_out, w_down, groups), hidden,
                                           ctx.activation)
        grad_w_gate_up = _weight_grad(w_gate_up, grad_hidden, tokens, groups) if ctx.needs_input_grad[1] else None
        grad_tokens = (grouped_linear_input_grad(grad_hidden, w_gate_up, groups)
                       if ctx.needs_input_grad[0] else None)
        grad_b_gate_up = grad_b_down = None
        if ctx.has_bias:     # per-slot row sums; the down bias's reaches every ETP rank's copy
            rows = _row_slots(groups)
            num_slots = groups.tokens_per_slot.shape[0]
            grad_b_gate_up = grad_hidden.new_zeros(num_slots, grad_hidden.shape[1]).index_add_(0, rows, grad_hidden)
            grad_b_down = grad_out.new_zeros(num_slots, grad_out.shape[1]).index_add_(0, rows, grad_out)
        return grad_tokens, grad_w_gate_up, grad_w_down, None, None, None, grad_b_gate_up, grad_b_down, None
