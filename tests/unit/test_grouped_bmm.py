"""The padded-batch expert GEMMs (megamoe.moe.experts.grouped_bmm): bf16 rows on CPU run ONE torch.bmm per
projection and gradient for all slots, with the per-slot loop's results (fp64 oracle), and the choice between
the two layouts."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megamoe.moe.experts.clamped_swiglu import ClampedSwiGLU
from megamoe.moe.experts.grouped_bmm import CALL_COST_FLOPS, PaddedSlots, padded_bmm_applies
from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
from megamoe.moe.experts.grouped_mlp import GroupedMLPFunction, SlotGroups

S, H, FFN = 4, 16, 8
CPU = torch.device("cpu")


class _CountOps(TorchDispatchMode):
    """How often each aten op ran."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _mlp_grads(sizes, activation, gated, bias, padded, recompute=False):
    g = torch.Generator().manual_seed(0)
    n, columns = sum(sizes), (2 if gated else 1) * FFN
    leaves = [torch.randn(n, H, generator=g, dtype=torch.float64), torch.randn(S, columns, H, generator=g,
              dtype=torch.float64), torch.randn(S, H, FFN, generator=g, dtype=torch.float64)]
    if bias:
        leaves += [torch.randn(S, columns, generator=g, dtype=torch.float64),
                   torch.randn(S, H, generator=g, dtype=torch.float64)]
    leaves = [t.requires_grad_() for t in leaves]
    grad_out = torch.randn(n, H, generator=g, dtype=torch.float64)
    groups = SlotGroups.from_counts(torch.tensor(sizes), n, use_grouped_mm=False, use_padded_bmm=padded)
    assert (groups.padded is not None) == (padded and n > 0)
    biases = leaves[3:] if bias else [None, None]
    out = GroupedMLPFunction.apply(*leaves[:3], groups, activation, recompute, *biases, True)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


@pytest.mark.parametrize("sizes", [(3, 0, 5, 2), (4, 4, 4, 4), (0, 0, 6, 0)])
@pytest.mark.parametrize("activation,gated,bias", [("swiglu", True, False), ("gelu", False, True),
                                                   (ClampedSwiGLU(1.702, 1.0), True, True)])
def test_padded_batch_gives_the_per_slot_loops_output_and_gradients(sizes, activation, gated, bias):
    """fp64, so that only the layout differs: zero rows add nothing to any gradient (biases included), empty
    slots get zero weight gradients, a batch of full slots needs no copy."""
    expected = _mlp_grads(sizes, activation, gated, bias, padded=False)
    for recompute in (False, True):
        got = _mlp_grads(sizes, activation, gated, bias, padded=True, recompute=recompute)
        for name, a, b in zip(("out", "tokens", "w_gate_up", "w_down", "b_gate_up", "b_down"), got, expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_bf16_experts_on_cpu_run_one_bmm_per_gemm_and_no_per_slot_gemm():
    """The issue-33 case: the expert GEMMs of bf16 rows are one batched GEMM per projection and gradient
    (2 forward, 4 backward), never one GEMM per slot; the result is the fp32 experts' within bf16 rounding."""
    experts = GroupedExperts(ExpertsConfig(S, H, FFN, backend="torch"))
    reference = GroupedExperts(ExpertsConfig(S, H, FFN, backend="torch"))
    experts.to(torch.bfloat16)
    reference.load_state_dict({k: v.float() for k, v in experts.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 9, 3])
    tokens = torch.randn(17, H, generator=g)
    grad_out = torch.randn(17, H, generator=g)
    x = tokens.to(torch.bfloat16).requires_grad_()
    with _CountOps() as ops:
        experts(x, counts).backward(grad_out.to(torch.bfloat16))
    assert ops.counts.get("bmm") == 6 and "mm" not in ops.counts and "_grouped_mm" not in ops.counts, ops.counts
    x32 = tokens.clone().requires_grad_()
    out32 = reference(x32, counts)
    out32.backward(grad_out)
    torch.testing.assert_close(experts(x, counts).float(), out32, rtol=0.05, atol=0.02)
    torch.testing.assert_close(x.grad.float(), x32.grad, rtol=0.05, atol=0.02)
    torch.testing.assert_close(experts.w_gate_up.grad.float(), reference.w_gate_up.grad, rtol=0.05, atol=0.05)


def test_the_layout_is_chosen_by_the_work_padding_wastes_against_the_calls_it_saves():
    row_flops = 2 * H * 3 * FFN
    assert padded_bmm_applies([3, 0, 5], CPU, torch.bfloat16, row_flops)
    assert padded_bmm_applies([3, 0, 5], CPU, torch.float16, row_flops)
    assert not padded_bmm_applies([3, 0, 5], CPU, torch.float32, row_flops)       # fp32: the per-slot loop
    assert not padded_bmm_applies([3, 0, 5], torch.device("meta"), torch.bfloat16, row_flops)
    assert not padded_bmm_applies([0, 0], CPU, torch.bfloat16, row_flops)
    # 2 busy slots save 2 GEMM calls each; the padding wastes 3 + 5 rows of `row_flops`
    budget = 2 * 2 * CALL_COST_FLOPS
    assert padded_bmm_applies([8, 5, 0], CPU, torch.bfloat16, int(budget // 11))
    assert not padded_bmm_applies([8, 5, 0], CPU, torch.bfloat16, int(budget // 11) + 1)


def test_padded_slots_round_trip():
    rows = torch.arange(12.0).view(6, 2)
    padded = PaddedSlots.from_sizes([1, 0, 3, 2], CPU)
    batch = padded.pad(rows)
    assert batch.shape == (4, 3, 2)
    assert batch[1].abs().sum() == 0 and batch[0, 1:].abs().sum() == 0 and batch[3, 2].abs().sum() == 0
    assert torch.equal(batch[2], rows[1:4])
    assert torch.equal(padded.unpad(batch), rows)
    full = PaddedSlots.from_sizes([2, 2], CPU)
    assert full.positions is None and full.pad(rows[:4]).data_ptr() == rows.data_ptr()
