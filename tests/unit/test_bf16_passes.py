"""The bf16 training path's elementwise passes and gradient plumbing (issue 33): the fused RMSNorm and SwiGLU
nodes against the unfused ops (fp64 gradients, bit-identical values in bf16), expert weight gradients added
straight into the fp32 ``main_grad``, and no per-call cast of any weight in a bf16 training step."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megamoe.moe.experts.grouped_mlp import GroupedMLPFunction, SlotGroups
from megamoe.transformer.norm import RMSNorm, RMSNormFunction
from megamoe.transformer.swiglu import SwiGLUFunction, swiglu
from tests.helpers.distributed_optimizer import build_model, global_batch, MICRO_BATCH

EPS = 1e-6


def _decomposed_rms_norm(x, weight):
    """RMSNorm's decomposed autograd form (its fp32 path, HF's order of roundings)."""
    x_up = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * (x_up * torch.rsqrt(x_up.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def test_fused_rms_norm_matches_the_decomposed_norm():
    """fp64: gradcheck, and the decomposed norm's gradients; bf16 / fp16: the same forward bit for bit and
    gradients as close to the fp64 ones as autograd's; the module runs the node on bf16 rows only."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(16, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, EPS), (x, w))
    grad = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    fused = torch.autograd.grad(RMSNormFunction.apply(x, w, EPS), (x, w), grad)
    for got, want in zip(fused, torch.autograd.grad(_decomposed_rms_norm(x, w), (x, w), grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for dtype in (torch.bfloat16, torch.float16):
        xl, wl, gl = (t.detach().to(dtype).requires_grad_(t.requires_grad) for t in (x, w, grad))
        assert torch.equal(RMSNormFunction.apply(xl, wl, EPS), _decomposed_rms_norm(xl, wl))
        ours = torch.autograd.grad(RMSNormFunction.apply(xl, wl, EPS), (xl, wl), gl)
        theirs = torch.autograd.grad(_decomposed_rms_norm(xl, wl), (xl, wl), gl)
        x64, w64 = xl.detach().double().requires_grad_(), wl.detach().double().requires_grad_()
        exact = torch.autograd.grad(_decomposed_rms_norm(x64, w64), (x64, w64), gl.double())
        for a, b, e in zip(ours, theirs, exact):
            assert (a.double() - e).abs().max() <= (b.double() - e).abs().max() * 1.05 + 1e-3 * e.abs().max()
    norm = RMSNorm(16, eps=EPS)
    assert "RMSNormFunction" in norm.to(torch.bfloat16)(xl.detach().bfloat16()).grad_fn.name()
    assert "RMSNormFunction" not in norm.float()(x.detach().float()).grad_fn.name()


def test_fused_swiglu_matches_autograd_and_saves_only_its_inputs():
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(7, 12, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (gate, up))
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        a, b = (t.detach().to(dtype).requires_grad_() for t in (gate, up))
        grad = torch.randn(7, 12, generator=g).to(dtype)
        out = swiglu(a, b)
        assert torch.equal(out, F.silu(a) * b)
        assert (out.grad_fn.name() == "SwiGLUFunctionBackward") == (dtype in (torch.bfloat16, torch.float16))
        ours = torch.autograd.grad(SwiGLUFunction.apply(a, b), (a, b), grad)
        for got, want in zip(ours, torch.autograd.grad(F.silu(a) * b, (a, b), grad)):
            assert torch.equal(got, want), dtype          # the same kernels: bit for bit in every dtype
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate.bfloat16(), up.bfloat16())
    assert len(saved) == 2              # autograd's form keeps silu(gate) as well


@pytest.mark.parametrize("padded", [True, False])
def test_expert_weight_gradients_go_straight_into_main_grad(padded):
    """A bf16 expert weight with an fp32 main_grad: the backward adds its gradient there (the values autograd's
    bf16 gradient would add, bit for bit) and gives autograd none (its accumulation hooks still fire); a weight
    used by two nodes gets both gradients."""
    sizes, hidden, ffn = [3, 0, 5, 2], 16, 8
    g = torch.Generator().manual_seed(2)
    tokens = torch.randn(sum(sizes), hidden, generator=g).bfloat16()
    weights = [torch.randn(4, 2 * ffn, hidden, generator=g).bfloat16(),
               torch.randn(4, hidden, ffn, generator=g).bfloat16()]
    grad_out = torch.randn(sum(sizes), hidden, generator=g).bfloat16()
    groups = SlotGroups.from_counts(torch.tensor(sizes), sum(sizes), use_grouped_mm=False, use_padded_bmm=padded)

    def run(with_main_grad: bool, uses: int = 1):
        leaves = [w.clone().requires_grad_() for w in weights]
        main, hooks = [torch.full(w.shape, 0.5) for w in weights], []
        for leaf, buffer in zip(leaves, main):
            leaf.register_post_accumulate_grad_hook(hooks.append)
            if with_main_grad:
                leaf.main_grad_provider = lambda buffer=buffer: buffer
        out = sum(GroupedMLPFunction.apply(tokens, *leaves, groups, "swiglu") for _ in range(uses))
        out.backward(grad_out)
        assert len(hooks) == 2
        return leaves, main

    reference, _ = run(with_main_grad=False)
    leaves, main = run(with_main_grad=True)
    for leaf, buffer, ref in zip(leaves, main, reference):
        assert leaf.grad is None and ref.grad is not None
        assert torch.equal(buffer, 0.5 + ref.grad.float())
    _, main = run(with_main_grad=True, uses=2)
    for buffer, ref in zip(main, reference):
        torch.testing.assert_close(buffer, 0.5 + 2 * ref.grad.float(), rtol=0, atol=1e-6)


def test_dense_weight_gradients_go_straight_into_main_grad():
    """megamoe.tensor_parallel.main_grad_linear.linear: F.linear's output and input / bias gradients bit for bit,
    the weight's added into its main_grad; a weight without one (fp32, no optimizer) takes F.linear itself."""
    from megamoe.tensor_parallel.main_grad_linear import linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 16, generator=g).bfloat16()
    w, b = torch.randn(24, 16, generator=g).bfloat16(), torch.randn(24, generator=g).bfloat16()
    grad = torch.randn(2, 5, 24, generator=g).bfloat16()
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    F.linear(*ref).backward(grad)
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    buffer = torch.zeros(24, 16)
    ours[1].main_grad_provider = lambda: buffer
    out = linear(*ours)
    assert out.grad_fn.name() == "_LinearIntoMainGradBackward" and torch.equal(out, F.linear(*ref))
    out.backward(grad)
    assert torch.equal(ours[0].grad, ref[0].grad) and torch.equal(ours[2].grad, ref[2].grad)
    assert ours[1].grad is None and torch.equal(buffer, ref[1].grad.float())
    assert linear(x.float(), w.float().requires_grad_()).grad_fn.name() != "_LinearIntoMainGradBackward"


class _WeightCasts(TorchDispatchMode):
    """Casts (dtype-changing ``_to_copy`` / ``copy_``) that READ a parameter's storage, by op and shape."""

    def __init__(self, params):
        super().__init__()
        self.pointers, self.seen = {p.data_ptr() for p in params}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._to_copy, torch.ops.aten.copy_):
            copy = func.overloadpacket is torch.ops.aten.copy_
            source = args[1] if copy else args[0]
            dtype = args[0].dtype if copy else (kwargs or {}).get("dtype", source.dtype)
            if source.data_ptr() in self.pointers and dtype != source.dtype:
                self.seen.append((func.overloadpacket.__name__, tuple(source.shape)))
        return func(*args, **(kwargs or {}))


def test_a_bf16_training_step_casts_no_weight():
    """bf16 parameters with fp32 masters (the Trainer's distributed optimizer): a whole step (forward, backward,
    gradient sync, optimizer step) reads no parameter through a cast or copy: the GEMMs take the bf16 weights,
    the router holds its gate in fp32, the expert weight gradients land in main_grad."""
    from parallel_state import ParallelState
    from megamoe.training.trainer import TrainConfig, Trainer

    state = ParallelState.single_process()
    model = build_model(state, dtype=torch.bfloat16)
    trainer = Trainer(model, state, TrainConfig(lr=1e-2))
    batch = global_batch()[:MICRO_BATCH]
    trainer.train_step([(batch[:, :-1], batch[:, 1:])])          # creates the masters (one copy each)
    counter = _WeightCasts(model.parameters())
    with counter:
        trainer.train_step([(batch[:, :-1], batch[:, 1:])])
    assert counter.seen == []


def test_the_shared_experts_gate_is_held_in_fp32():
    """The Qwen2-MoE shared-expert gate computes in fp32: a bf16 model holds it in fp32 (built so or converted),
    so its gate casts no weight per call, while the projections stay bf16."""
    from megamoe.moe.shared_experts import SharedExperts, SharedExpertsConfig

    config = SharedExpertsConfig(hidden_size=16, ffn_hidden_size=32, gate=True)
    for experts in (SharedExperts(config, dtype=torch.bfloat16), SharedExperts(config).to(torch.bfloat16)):
        assert experts.gate_weight.dtype == torch.float32 and experts.up_proj.dtype == torch.bfloat16
        counter = _WeightCasts(experts.parameters())
        tokens = torch.randn(5, 16).bfloat16()
        with counter:
            experts(tokens, experts.gate(tokens)).float().sum().backward()
        assert counter.seen == [] and experts.gate_weight.grad.dtype == torch.float32


def test_the_bf16_combine_casts_the_rows_only_where_a_product_needs_them():
    """The MoE combine of bf16 expert rows with fp32 routing weights: forward, the weighted product promotes the rows
    as it reads them (no fp32 copy of the rows); backward, the gathered gradient is cast once for both products
    (the weights' gradient and the rows'), the rows once for their dot products, the rows' gradient down once: 3
    dtype casts of [N, H] in all, were 5 (forward 1, backward 4)."""
    from megamoe.moe.permutation import _WeightedCombine

    g = torch.Generator().manual_seed(4)
    tokens, top_k, hidden = 6, 2, 16
    rows = torch.randn(tokens * top_k, hidden, generator=g).bfloat16().requires_grad_()
    weights = torch.rand(tokens, top_k, generator=g).requires_grad_()
    token_index, pair_index = torch.arange(tokens).repeat_interleave(top_k), torch.arange(tokens * top_k)

    class RowCasts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._to_copy and tuple(args[0].shape) == tuple(rows.shape):
                RowCasts.count += (kwargs or {}).get("dtype", args[0].dtype) != args[0].dtype
            return func(*args, **(kwargs or {}))

    with RowCasts():
        out = _WeightedCombine.apply(rows, weights, token_index, pair_index, True)
        out.backward(torch.randn(tokens, hidden, generator=g).bfloat16())
    assert RowCasts.count == 3
    want = (rows.detach().float() * weights.detach().reshape(-1, 1)).view(tokens, top_k, hidden).sum(1).bfloat16()
    assert torch.equal(out, want)
