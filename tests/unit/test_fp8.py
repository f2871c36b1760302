"""FP8 experts: the scaling math and delayed-scaling history, quantisation error bounds, the CPU
emulation (error vs fp32 with a derived bound, padding invariance, gradients, a short training run),
configuration errors; the TE path against a stand-in for TE (the slot group's amax reduction, joined by a rank
without rows too); the kernel probes' fallbacks (a TE that does not load, torch._grouped_mm, block-FP8
torch._scaled_mm); ETP and expert-DP layouts against one rank (amax reduction); GPU paths (TE,
torch._scaled_grouped_mm) against the emulation on a GPU."""

import math
from dataclasses import replace

import pytest
import torch

from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
from megamoe.moe.experts.fp8 import (FP8AmaxReduction, FP8Config, FP8ScalingState, compute_scale, dequantize, fp8_max,
                             quantize, resolve_fp8_backend)
from megamoe.moe.experts.fp8_experts import FP8GroupedLinearFunction, PaddedRows, fp8_grouped_mlp
from tests.helpers.fp8 import CURRENT_RECIPES, FFN, H, RECIPES, SLOTS

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
COUNTS = (37, 0, 64, 19)


def _experts(backend="fp8_emulated", fp8=None, activation="swiglu", seed=0):
    module = GroupedExperts(ExpertsConfig(SLOTS, H, FFN, activation=activation, backend=backend, fp8=fp8))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.w_gate_up.copy_(torch.randn(module.w_gate_up.shape, generator=g) * H ** -0.5)
        module.w_down.copy_(torch.randn(module.w_down.shape, generator=g) * FFN ** -0.5)
    return module


def _tokens(counts=COUNTS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(counts), H, generator=g), torch.tensor(counts)


# ---- scaling math -------------------------------------------------------------------------------
def test_scale_is_fp8_max_over_amax_over_two_to_the_margin():
    amax = torch.tensor([1.0, 3.5, 1e-3, 0.0, float("inf")])
    for dtype in (E4M3, E5M2):
        for margin in (0, 2):
            scale = compute_scale(amax, dtype, margin, fallback=7.0)
            expected = [fp8_max(dtype) / a / 2 ** margin for a in (1.0, 3.5, 1e-3)] + [7.0, 7.0]
            assert torch.allclose(scale, torch.tensor(expected), rtol=1e-6), (dtype, margin, scale)
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0


@pytest.mark.parametrize("algo", ("max", "most_recent"))
def test_delayed_history_rolls_and_the_scale_uses_only_past_steps(algo):
    config = FP8Config(recipe="delayed", amax_history_len=3, amax_compute_algo=algo, margin=1)
    state = FP8ScalingState(config, num_slots=2)
    assert torch.equal(state.current_scale("fc1_input"), torch.ones(2)), "step 0 has no history: scale 1"
    steps = [torch.tensor([8.0, 1.0]), torch.tensor([2.0, 4.0]), torch.tensor([1.0, 0.5]), torch.tensor([0.25, 0.0])]
    for n, amax in enumerate(steps):
        state.record("fc1_input", amax)
        window = torch.stack(steps[max(0, n - 2):n + 1][::-1], dim=1)        # [S, <=L], newest first
        assert torch.equal(state.amax_history[0][:, :window.shape[1]], window)
        reduced = window.amax(dim=1) if algo == "max" else window[:, 0]
        expected = 448.0 / reduced / 2
        if algo == "most_recent" and n == 3:
            expected[1] = 448.0 / 0.5 / 2   # amax 0: keep the previous scale
        assert torch.allclose(state.current_scale("fc1_input"), expected, rtol=1e-6), (n, algo)
    grad_index = 2  # fc1_grad_output keeps its own history and uses e5m2's range
    state.record("fc1_grad_output", torch.tensor([1.0, 1.0]))
    assert torch.allclose(state.scale[grad_index], torch.full((2,), 57344.0 / 2))
    before = state.scale.clone()
    state.eval()
    state.record("fc1_input", torch.tensor([100.0, 100.0]))
    assert torch.equal(state.scale, before), "evaluation must not move the scales"


def test_delayed_scaling_quantises_step_n_with_the_scale_of_step_n_minus_1():
    """Identity weights make the GEMM output the dequantised input: 3.3 rounds to 3.25 at step 0
    (scale 1, no history) and is exact at step 1 (scale 448 / 3.3 maps it onto 448)."""
    config = FP8Config(recipe="delayed", amax_history_len=4)
    state = FP8ScalingState(config, num_slots=1)
    x, eye = torch.full((16, 8), 3.3), torch.eye(8).unsqueeze(0)
    rows = PaddedRows.build(torch.tensor([16]), 16, 16, exact=True)
    outputs = [FP8GroupedLinearFunction.apply(x, eye, rows, "fc1", config, state, "emulated",
                                              FP8AmaxReduction()) for _ in range(2)]
    assert torch.allclose(outputs[0], torch.full_like(x, 3.25))
    assert torch.allclose(outputs[1], x, rtol=1e-6)


# ---- quantisation -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, mantissa_bits", ((E4M3, 3), (E5M2, 2)))
def test_round_trip_relative_error_is_at_most_half_an_ulp_in_the_normal_range(dtype, mantissa_bits):
    """Round-to-nearest with m mantissa bits: |x - deq(q(x))| <= 2^-(m+1) |x| for normal values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.exp(torch.randn(4096, generator=g))
    scale = compute_scale(x.abs().max(), dtype, margin=0)
    back = dequantize(quantize(x, scale, dtype), scale)
    normal = (x * scale).abs() >= torch.finfo(dtype).smallest_normal
    rel = ((back - x).abs() / x.abs())[normal]
    assert normal.float().mean() > 0.99
    assert rel.max() <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6), rel.max()
    assert rel.max() > 2.0 ** -(mantissa_bits + 2), "the bound should be tight, else the test checks nothing"


def test_quantise_saturates_instead_of_overflowing():
    big = torch.tensor([1e6, -1e6, 500.0])
    assert torch.equal(dequantize(quantize(big, torch.tensor(1.0), E4M3), torch.tensor(1.0)),
                       torch.tensor([448.0, -448.0, 448.0]))
    assert torch.equal(dequantize(quantize(big, torch.tensor(1.0), E5M2), torch.tensor(1.0)),
                       torch.tensor([57344.0, -57344.0, 512.0]))


# ---- emulated expert GEMMs vs fp32 ---------------------------------------------------------------
@pytest.mark.parametrize("recipe", CURRENT_RECIPES)
def test_emulated_fp8_gemm_error_bound(recipe):
    """One FP8 GEMM ``y = x w^T`` against fp32, K = H = 64.

    Elementwise (rigorous): e4m3 rounds to nearest with 3 mantissa bits, so each operand element
    carries ``|dx| <= 2^-4 |x| + 2^-10 / s_x`` (the second term: half the smallest subnormal step
    2^-9, for values below the normal range), likewise w; then ``|dy| <= |dx||w| + |x||dw| +
    |dx||dw|`` summed over K, plus fp32 rounding.

    Relative Frobenius (statistical): the per-element relative errors are independent, zero-mean,
    with RMS sigma ~= 2^-4 / sqrt(3) * sqrt(0.81) ~= 0.026 (uniform rounding error over a binade).
    Each output is a sum of K terms ``x_k w_k (1 + dx_k + dw_k)`` with random signs, so the error
    sum and the output itself both grow like sqrt(K): the relative error is ~ sqrt(2) sigma ~= 0.037,
    independent of K (it does not shrink like 1/sqrt(K), because the output does not grow like K).
    Asserted: between 0.02 and 0.05.
    """
    config = FP8Config(recipe=recipe)
    g = torch.Generator().manual_seed(3)
    counts = torch.tensor(COUNTS)
    x, w = torch.randn(int(counts.sum()), H, generator=g), torch.randn(SLOTS, FFN, H, generator=g)
    rows = PaddedRows.build(counts, x.shape[0], 16, exact=True)
    y = FP8GroupedLinearFunction.apply(x, w, rows, "fc1", config, None, "emulated", FP8AmaxReduction())
    slot = rows.slot_of_row
    exact = torch.einsum("nk,nok->no", x, w[slot])
    err = (y - exact).abs()
    sx = compute_scale(x.abs().amax(1) if recipe == "rowwise" else
                       torch.zeros(SLOTS).scatter_reduce(0, slot, x.abs().amax(1), "amax")[slot], E4M3, 0)
    sw = compute_scale(w.abs().amax(2) if recipe == "rowwise" else w.abs().amax((1, 2))[:, None].expand(-1, FFN),
                       E4M3, 0)[slot]                                                   # [N, O]
    dx = 2.0 ** -4 * x.abs() + 2.0 ** -10 / sx[:, None]                                  # [N, K]
    dw = 2.0 ** -4 * w[slot].abs() + 2.0 ** -10 / sw[:, :, None]                         # [N, O, K]
    bound = torch.einsum("nk,nok->no", dx, w[slot].abs() + dw) + torch.einsum("nk,nok->no", x.abs(), dw)
    assert (err <= bound * (1 + 1e-5) + 1e-5).all(), (err - bound).max()
    relative = (err.norm() / exact.norm()).item()
    assert 0.02 < relative < 0.05, relative


@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_fp8_experts_track_fp32_and_gradients_flow(recipe):
    """The two-GEMM SwiGLU MLP: fc1's output error (~0.037) reaches fc2's input through the gate
    and the up halves, and fc2 adds its own (~0.037): ~ sqrt(3) * 0.037 ~= 0.064 expected relative
    Frobenius error; asserted < 0.1 for the output and, with e5m2 gradients (2 mantissa bits, twice
    e4m3's rounding error), < 0.15 for the gradients. The delayed recipe is warmed up for two steps
    so its scales come from a history (step 0 uses scale 1)."""
    fp8 = _experts(fp8=FP8Config(recipe=recipe))
    reference = _experts(backend="torch")
    x, counts = _tokens()
    grad_out = torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(2))
    results = []
    for module in (reference, fp8):
        for _ in range(3 if module is fp8 and recipe == "delayed" else 1):
            module.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_()
            out = module(xr, counts)
            out.backward(grad_out)
        results.append((out.detach(), xr.grad, module.w_gate_up.grad, module.w_down.grad))
    for name, want, got, tol in zip(("output", "input grad", "w_gate_up grad", "w_down grad"), *results,
                                    (0.1, 0.15, 0.15, 0.15)):
        assert torch.isfinite(got).all(), name
        relative = ((got - want).norm() / want.norm()).item()
        assert 0.005 < relative < tol, f"{recipe} {name}: relative error {relative:.4f}"
    empty = torch.tensor(COUNTS) == 0
    assert torch.count_nonzero(results[1][2][empty]) == 0 and torch.count_nonzero(results[1][3][empty]) == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_padding_rows_to_multiples_of_16_never_changes_results(recipe):
    """Zero rows have zero amax (no scale moves) and add nothing to the weight gradients; their
    outputs are dropped. Outputs, gradients and the delayed recipe's histories match padding 1."""
    config = FP8Config(recipe=recipe, amax_history_len=4)
    x, counts = _tokens()
    module = _experts(fp8=config)
    runs = []
    for multiple in (1, 16, 48):
        state = FP8ScalingState(config, SLOTS)
        for _ in range(2):  # the second step uses the first step's delayed scales
            xr = x.clone().requires_grad_()
            wg, wd = module.w_gate_up.detach().clone().requires_grad_(), module.w_down.detach().clone().requires_grad_()
            out = fp8_grouped_mlp(xr, wg, wd, counts, module._activate, config, state, pad_multiple=multiple)
            out.backward(torch.ones_like(out))
        rows = PaddedRows.build(counts, x.shape[0], multiple, exact=True)
        assert rows.num_padded_rows == sum(math.ceil(c / multiple) * multiple for c in COUNTS)
        runs.append((out.detach(), xr.grad, wg.grad, wd.grad, state.amax_history.clone(), state.scale.clone()))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()


def test_padded_rows_layout():
    rows = PaddedRows.build(torch.tensor([3, 0, 17]), 20, 16, exact=True)
    assert rows.padded_counts.tolist() == [16, 0, 32] and rows.padded_offsets.tolist() == [16, 16, 48]
    assert rows.destination.tolist() == [0, 1, 2] + list(range(16, 33))
    x = torch.arange(20.0).unsqueeze(1)
    padded = rows.pad(x)
    assert padded.shape == (48, 1) and padded[3:16].eq(0).all() and torch.equal(rows.unpad(padded), x)
    q = quantize(x, torch.tensor(1.0), E4M3)
    assert torch.equal(rows.unpad(rows.pad(q)).view(torch.uint8), q.view(torch.uint8))
    bound = PaddedRows.build(torch.tensor([3, 0, 17]), 20, 16, exact=False)
    assert bound.num_padded_rows == 20 + 3 * 15 and torch.equal(bound.destination, rows.destination)


def test_fp8_emulated_handles_no_tokens_and_non_gated_activations():
    for activation in ("gelu", "relu"):
        module = _experts(fp8=FP8Config(recipe="tensorwise", format="e4m3"), activation=activation)
        x = torch.zeros(0, H, requires_grad=True)
        out = module(x, torch.zeros(SLOTS, dtype=torch.int64))
        out.sum().backward()
        assert out.shape == (0, H) and module.w_down.grad.abs().sum() == 0
        x, counts = _tokens()
        reference = _experts(backend="torch", activation=activation)
        got, want = module(x, counts), reference(x, counts)
        assert ((got - want).norm() / want.norm()) < 0.1


# ---- configuration errors -------------------------------------------------------------------------
def test_configuration_errors_name_the_fix():
    with pytest.raises(ValueError, match="recipe"):
        FP8Config(recipe="mxfp4")
    with pytest.raises(ValueError, match="format"):
        FP8Config(format="e5m2")
    with pytest.raises(ValueError, match="amax_compute_algo"):
        FP8Config(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        FP8Config(amax_history_len=0)
    with pytest.raises(ValueError, match="margin"):
        FP8Config(margin=-1)
    with pytest.raises(ValueError, match="needs ExpertsConfig.fp8"):
        ExpertsConfig(SLOTS, H, FFN, backend="fp8_emulated")
    with pytest.raises(ValueError, match="fp8_emulated"):
        ExpertsConfig(SLOTS, H, FFN, backend="loop", fp8=FP8Config())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors raised where no FP8 GPU exists")
def test_fp8_without_a_capable_gpu_or_te_raises_a_value_error_naming_the_fix():
    for backend, match in (("te", "TransformerEngine|capability >= 8.9"), ("torch", "_scaled_grouped_mm"),
                           ("auto", "fp8_emulated")):
        with pytest.raises(ValueError, match=match) as error:
            GroupedExperts(ExpertsConfig(SLOTS, H, FFN, backend=backend, fp8=FP8Config()))
        assert "fp8_emulated" in str(error.value)


def test_te_recipe_without_transformer_engine_names_the_fix():
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        from megamoe.moe.experts.fp8 import te_fp8_recipe
        with pytest.raises(ValueError, match="pip install"):
            te_fp8_recipe(FP8Config())
        return
    from megamoe.moe.experts.fp8 import te_fp8_recipe
    with pytest.raises(ValueError, match="rowwise"):
        te_fp8_recipe(FP8Config(recipe="rowwise"))
    assert type(te_fp8_recipe(FP8Config())).__name__ == "DelayedScaling"


class _FakeGroupedLinear(torch.nn.Module):
    """TE's GroupedLinear as far as the experts use it: ``weight{s}`` per slot, ``forward(x, m_splits)``;
    records every call's split sizes, forward and backward, and whether fp8_autocast was open."""

    def __init__(self, num_gemms, in_features, out_features, bias, init_method, params_dtype, device, log):
        super().__init__()
        for s in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
            init_method(weight)
            self.register_parameter(f"weight{s}", weight)
        self.num_gemms, self.log = num_gemms, log

    def forward(self, x, m_splits):
        log = self.log

        class Recorded(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                log["calls"].append(("forward", list(m_splits), log["autocast_depth"] > 0))
                return x

            @staticmethod
            def backward(ctx, grad):
                log["calls"].append(("backward", list(m_splits), log["autocast_depth"] > 0))
                return grad
        weights = [getattr(self, f"weight{s}") for s in range(self.num_gemms)]
        return Recorded.apply(torch.cat([torch.nn.functional.linear(part, w)       # the output: needs grad
                                         for part, w in zip(x.split(m_splits), weights)]))


def _fake_transformer_engine(monkeypatch):
    """A stand-in for TransformerEngine (which needs CUDA), installed in sys.modules: its recipes are
    (name, kwargs) pairs, fp8_autocast records its arguments, GroupedLinear is :class:`_FakeGroupedLinear`."""
    import contextlib
    import functools
    import sys
    import types

    log = {"autocast": [], "autocast_depth": 0, "calls": []}
    recipe_module = types.SimpleNamespace(Format=types.SimpleNamespace(HYBRID="hybrid", E4M3="e4m3"),
                                          DelayedScaling=lambda **kwargs: ("DelayedScaling", kwargs))

    @contextlib.contextmanager
    def fp8_autocast(**kwargs):
        log["autocast"].append(kwargs)
        log["autocast_depth"] += 1
        try:
            yield
        finally:
            log["autocast_depth"] -= 1
    te = types.ModuleType("transformer_engine")
    te.common = types.SimpleNamespace(recipe=recipe_module)
    te.pytorch = types.SimpleNamespace(fp8_autocast=fp8_autocast,
                                       GroupedLinear=functools.partial(_FakeGroupedLinear, log=log))
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", te.common)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    return log


def test_te_paths_reduce_delayed_amaxes_over_the_slot_group_only(monkeypatch):
    """TE's delayed recipe reduces amaxes over fp8_autocast's fp8_group, every rank when it is None: the TE
    path passes the slot group, and a recipe for a one-rank slot group does not reduce at all. Checked
    against a stand-in for TransformerEngine (which needs CUDA) that records what it is given."""
    from megamoe.moe.experts.fp8 import te_fp8_recipe
    from megamoe.moe.experts.fp8_experts import te_fp8_grouped_mlp

    log = _fake_transformer_engine(monkeypatch)
    for reduce_amax in (True, False):
        name, kwargs = te_fp8_recipe(FP8Config(amax_history_len=8), reduce_amax=reduce_amax)
        assert name == "DelayedScaling" and kwargs["reduce_amax"] is reduce_amax and kwargs["amax_history_len"] == 8
    group = object()
    x, counts = _tokens()
    out = te_fp8_grouped_mlp(lambda t, sizes: 2 * t, lambda t, sizes: t + 1, x, counts, torch.relu, "recipe", group)
    assert log["autocast"] == [{"enabled": True, "fp8_recipe": "recipe", "fp8_group": group}]
    torch.testing.assert_close(out, torch.relu(2 * x) + 1)


def test_a_te_rank_without_rows_still_joins_the_delayed_amax_reduction(monkeypatch):
    """Issue 29 row 5: with the delayed recipe TE reduces amaxes over the slot group inside fp8_autocast, in
    the GroupedLinear modules' forward and backward. A rank whose slots got no rows must run them too (on
    zero rows, which change no amax), else its peers wait forever in the reduction."""
    import megamoe.moe.experts.grouped_experts as experts_module

    log = _fake_transformer_engine(monkeypatch)
    monkeypatch.setattr(experts_module, "resolve_fp8_backend", lambda backend, device, recipe=None: "te")
    group = object()
    monkeypatch.setattr("megamoe.comms.group_size", lambda group: 1 if group is None else 2)   # a stand-in group
    module = GroupedExperts(ExpertsConfig(SLOTS, H, FFN, backend="te", fp8=FP8Config()),
                            fp8_amax_reduction=FP8AmaxReduction(slot_group=group))
    x = torch.zeros(0, H, requires_grad=True)
    out = module(x, torch.zeros(SLOTS, dtype=torch.int64))
    assert out.shape == (0, H)
    (out.sum() + 0 * x.sum()).backward()
    assert [kwargs["fp8_group"] for kwargs in log["autocast"]] == [group]
    fp8_rows = [16] + [0] * (SLOTS - 1)      # one FP8-aligned block of zero rows in slot 0
    assert log["calls"] == [("forward", fp8_rows, True), ("forward", fp8_rows, True),
                            ("backward", fp8_rows, False), ("backward", fp8_rows, False)], log["calls"]
    assert module.te_gate_up.weight0.grad is not None and not module.te_gate_up.weight0.grad.any()


# ---- kernel probes: a kernel that cannot run here means a fallback with a reason, never a crash (issue 29 row 7) --
def _pretend_cuda(monkeypatch, capability, torch_version=None, cuda_version=None):
    """Make the probes see a CUDA GPU of ``capability`` (and, when given, torch / CUDA versions)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if torch_version is not None:
        monkeypatch.setattr(torch, "__version__", torch_version)
    if cuda_version is not None:
        monkeypatch.setattr(torch.version, "cuda", cuda_version)


@pytest.mark.parametrize("error", [OSError("libtransformer_engine.so: undefined symbol: _ZN3c10"),
                                   RuntimeError("TransformerEngine was built for torch 2.4")])
def test_a_transformer_engine_that_does_not_load_falls_back_with_the_reason(monkeypatch, caplog, error):
    """A TE built for another torch raises OSError / RuntimeError on import, not ImportError."""
    import sys

    from megamoe.moe.experts import kernel_probes
    from megamoe.moe.experts.fp8 import te_fp8_recipe

    class BrokenTransformerEngine:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "transformer_engine":
                raise error
            return None
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [BrokenTransformerEngine(), *sys.meta_path])
    monkeypatch.setattr(kernel_probes, "_logged", set())
    _pretend_cuda(monkeypatch, (9, 0))
    with caplog.at_level("WARNING", logger="megamoe.moe.experts.kernel_probes"):
        assert GroupedExperts._resolve_backend("auto", torch.device("cuda")) == "torch"
    assert f"{type(error).__name__}: {error}" in caplog.text
    with pytest.raises(RuntimeError, match="does not load"):
        GroupedExperts._resolve_backend("te", torch.device("cuda"))
    with pytest.raises(ValueError, match="does not load|pip install"):
        resolve_fp8_backend("te", torch.device("cuda"))
    with pytest.raises(ValueError, match="pip install"):
        te_fp8_recipe(FP8Config())


@pytest.mark.parametrize("torch_version, capability, runs", [
    ("2.8.0", (9, 0), True), ("2.8.0", (8, 0), False), ("2.8.0", (10, 0), False),
    ("2.9.0", (8, 0), True), ("2.9.0", (7, 5), False), ("2.10.1+cu128", (12, 0), True)])
def test_grouped_mm_runs_only_where_torch_has_it_for_the_gpu(monkeypatch, caplog, torch_version, capability, runs):
    from megamoe.moe.experts import kernel_probes
    from megamoe.moe.experts.grouped_mlp import grouped_mm_applies

    monkeypatch.setattr(kernel_probes, "_logged", set())
    _pretend_cuda(monkeypatch, capability, torch_version=torch_version)
    with caplog.at_level("WARNING", logger="megamoe.moe.experts.kernel_probes"):
        assert grouped_mm_applies(torch.device("cuda"), torch.bfloat16) is runs
    assert ("one torch.mm per slot" in caplog.text) is not runs, caplog.text
    assert not grouped_mm_applies(torch.device("cuda"), torch.float32)        # bf16 rows only
    assert not grouped_mm_applies(torch.device("cpu"), torch.bfloat16)
    monkeypatch.delattr(torch, "_grouped_mm")                                 # torch < 2.8 (setup.py allows 2.4)
    assert not grouped_mm_applies(torch.device("cuda"), torch.bfloat16)
    assert not grouped_mm_applies(torch.device("meta"), torch.bfloat16)


@pytest.mark.parametrize("capability, cuda_version, problem", [
    ((9, 0), "12.9", None), ((9, 0), "13.0", None), ((9, 0), "12.8", "cuBLASLt >= 12.9"),
    ((8, 9), "12.9", "only on sm90"), ((10, 0), "12.9", "only on sm90"), ((12, 0), "13.0", "only on sm90")])
def test_block_fp8_scaled_mm_is_gated_on_sm90_and_cublaslt_12_9(monkeypatch, capability, cuda_version, problem):
    _pretend_cuda(monkeypatch, capability, cuda_version=cuda_version)
    cuda = torch.device("cuda")
    if problem is None:
        assert resolve_fp8_backend("torch", cuda, recipe="block") == "torch"
        assert resolve_fp8_backend("auto", cuda, recipe="block") == "torch"
        return
    for backend in ("torch", "auto"):
        with pytest.raises(ValueError, match=problem) as refused:
            resolve_fp8_backend(backend, cuda, recipe="block")
        assert "fp8_emulated" in str(refused.value)


def test_block_fp8_scaled_mm_gets_weight_scales_with_a_leading_dimension_padded_to_4(monkeypatch):
    """Some cuBLASLt builds reject block scales whose leading dimension is not 16-byte aligned: scale_b is
    [K / 128, N / 128] column-major, so the stride between its columns must be a multiple of 4."""
    from megamoe.moe.experts import block_fp8_experts
    from megamoe.quantization.block_fp8 import BlockFP8Config, quantize_block_fp8

    seen = {}

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        seen.update(scale_a=scale_a, scale_b=scale_b)
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)
    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3 * 128, 5 * 128, generator=g)                   # N = 384, K = 640: 3 x 5 blocks
    w_q, w_scale = quantize_block_fp8(weight, (128, 128), "float")
    block_fp8_experts._scaled_mm(torch.randn(2, 5 * 128, generator=g), w_q, w_scale, BlockFP8Config())
    scale_b = seen["scale_b"]
    assert scale_b.shape == (5, 3) and scale_b.dtype == torch.float32
    assert scale_b.stride(0) == 1 and scale_b.stride(1) % 4 == 0, scale_b.stride()
    assert torch.equal(scale_b, w_scale.float().t())


# ---- training ------------------------------------------------------------------------------------
def _fp8_curve(fp8):
    """Loss per step of tests/helpers/tiny_model.py's tiny model, with emulated FP8 experts
    (``MoEConfig.expert_fp8``) when ``fp8`` is given; 5 steps on a fixed batch."""
    from parallel_state import ParallelState
    from megamoe.models import GPTMoEModel
    from megamoe.tensor_parallel import initialize_parameters
    from megamoe.training.trainer import TrainConfig, Trainer
    from tests.helpers.tiny_model import MICRO_BATCH, global_batches, tiny_config

    state = ParallelState.single_process()
    config = tiny_config()
    if fp8 is not None:
        config.moe = replace(config.moe, expert_backend="fp8_emulated", expert_fp8=fp8)
    model = GPTMoEModel(config, state)
    initialize_parameters(model, seed=0)
    trainer = Trainer(model, state, TrainConfig(lr=1e-2))
    batch = global_batches()[0]
    return [trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(MICRO_BATCH)]).loss
            for _ in range(5)]


def test_tiny_model_training_with_emulated_fp8_experts_tracks_the_fp32_loss_curve():
    reference = _fp8_curve(None)
    assert reference[-1] < reference[0]
    # The delayed recipe (the default): the stateful one, and the hardest start (scale 1 at step 0).
    curve = _fp8_curve(FP8Config(recipe="delayed", amax_history_len=16))
    assert curve != reference, "the FP8 experts must actually run"
    for step, (got, want) in enumerate(zip(curve, reference)):
        assert abs(got - want) <= 0.02 * abs(want), f"step {step}: {got} vs fp32 {want}"


# ---- GPU paths (need CUDA; checked against the CPU emulation) -------------------------------------
def _gpu_capability():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


@pytest.mark.cuda
@pytest.mark.skipif(_gpu_capability() < (9, 0) or not hasattr(torch, "_scaled_grouped_mm"),
                    reason="torch._scaled_grouped_mm FP8 needs a CUDA GPU of compute capability >= 9.0")
@pytest.mark.parametrize("recipe", RECIPES)
def test_torch_scaled_grouped_mm_matches_the_emulation(recipe):
    """Same quantised operands; the GPU multiplies FP8 with fp32 accumulation into bf16 output and
    its backward runs in bf16: agreement to bf16 rounding (~2^-8) plus accumulation order."""
    _check_gpu_backend_against_emulation("torch", FP8Config(recipe=recipe), tol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(_gpu_capability() < (8, 9), reason="TransformerEngine FP8 needs compute capability >= 8.9")
@pytest.mark.parametrize("recipe", ("delayed", "tensorwise"))
def test_te_fp8_matches_the_emulation(recipe):
    """TE quantises per GEMM (per slot) like the emulation; its delayed recipe also starts at
    scale 1, but the exact amax/scale update timing is TE's: compare after one step, loosely."""
    pytest.importorskip("transformer_engine")
    _check_gpu_backend_against_emulation("te", FP8Config(recipe=recipe), tol=5e-2)


def _check_gpu_backend_against_emulation(backend, fp8, tol):
    x, counts = _tokens()
    emulated = _experts(fp8=fp8)
    gpu = GroupedExperts(ExpertsConfig(SLOTS, H, FFN, backend=backend, fp8=fp8), device="cuda",
                         dtype=torch.bfloat16)
    for slot in range(SLOTS):
        shards = emulated.expert_weight_shards(slot)
        gpu.load_expert_weights(slot, shards["gate"].cuda(), shards["up"].cuda(), shards["down"].cuda())
    emulated = emulated.to(torch.bfloat16).float()  # the same bf16-rounded weights
    want = emulated(x, counts)
    got = gpu(x.cuda().bfloat16(), counts.cuda()).float().cpu()
    assert ((got - want).norm() / want.norm()) < tol


def test_model_config_with_fp8_experts_round_trips_through_json():
    import json
    from tests.helpers.tiny_model import tiny_config
    from megamoe.models import GPTMoEConfig
    config = tiny_config()
    config.moe = replace(config.moe, expert_backend="fp8_emulated", expert_fp8=FP8Config(recipe="tensorwise"))
    assert GPTMoEConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
