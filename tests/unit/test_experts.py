"""GroupedExperts: the fused `torch` backend against the `loop` reference and against a per-token
F.linear reference on HF-layout weights; ETP shards against the unsharded experts; weight I/O;
errors."""

import pytest
import torch
import torch.nn.functional as F

from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
from megamoe.moe.experts.grouped_mlp import GroupedMLPFunction, SlotGroups

H, FFN = 12, 8
ACTIVATIONS = ("swiglu", "gelu", "relu", "silu")
ATOL = 1e-5


def _experts(activation="swiglu", backend="torch", slots=5, etp_size=1, etp_rank=0):
    return GroupedExperts(ExpertsConfig(slots, H, FFN, activation=activation, backend=backend,
                                        etp_size=etp_size, etp_rank=etp_rank))


def _full_weights(num_slots, gated, seed=0):
    """Per slot: FULL HF-layout weights {gate [F, H], up [F, H] or None, down [H, F]}."""
    g = torch.Generator().manual_seed(seed)
    return [{"gate": torch.randn(FFN, H, generator=g) * 0.3,
             "up": torch.randn(FFN, H, generator=g) * 0.3 if gated else None,
             "down": torch.randn(H, FFN, generator=g) * 0.3} for _ in range(num_slots)]


def _load(module, weights):
    for slot, w in enumerate(weights):
        module.load_expert_weights(slot, w["gate"], w["up"], w["down"])
    return module


def _run(module, tokens, counts, grad_out):
    """Output and gradients (input, w_gate_up, w_down) of one forward + backward."""
    x = tokens.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x, counts)
    out.backward(grad_out)
    return out.detach(), x.grad, module.w_gate_up.grad, module.w_down.grad


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.allclose(a, b, atol=ATOL, rtol=1e-5), f"{what}: max diff {(a - b).abs().max().item():.3e}"


def _inputs(counts, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = int(sum(counts))
    return torch.randn(n, H, generator=g), torch.tensor(counts, dtype=torch.int64), torch.randn(n, H, generator=g)


COUNTS = [(3, 0, 7, 1, 0), (0, 0, 0, 0, 9), (0, 0, 0, 0, 0), (2, 2, 2, 2, 2)]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("counts", COUNTS)
def test_torch_backend_matches_loop(activation, counts):
    weights = _full_weights(5, activation == "swiglu")
    loop, fused = _load(_experts(activation, "loop"), weights), _load(_experts(activation, "torch"), weights)
    tokens, counts_t, grad_out = _inputs(counts)
    expected, got = _run(loop, tokens, counts_t, grad_out), _run(fused, tokens, counts_t, grad_out)
    for name, e, g in zip(("output", "input grad", "w_gate_up grad", "w_down grad"), expected, got):
        _close(g, e, name)
    if 0 in counts:  # empty slots get exact zero weight gradients
        empty = torch.tensor(counts) == 0
        assert torch.count_nonzero(got[2][empty]) == 0 and torch.count_nonzero(got[3][empty]) == 0


@pytest.mark.parametrize("counts", COUNTS)
def test_inference_forward_matches_the_autograd_forward(counts):
    """Under no_grad the torch backend skips its autograd node: the same output, bit for bit."""
    experts = _load(_experts("swiglu", "torch"), _full_weights(5, True))
    tokens, counts_t, _ = _inputs(counts)
    with_graph = experts(tokens, counts_t)
    with torch.no_grad():
        inference = experts(tokens, counts_t)
    assert with_graph.grad_fn is not None and inference.grad_fn is None
    assert torch.equal(inference, with_graph.detach())


@pytest.mark.parametrize("activation", ("swiglu", "gelu"))
@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_mm_kernel_path_matches_mm_loop_path(activation, counts):
    """The torch._grouped_mm code path (used on accelerators) computes what the CPU mm loop does."""
    module = _load(_experts(activation, "torch"), _full_weights(5, activation == "swiglu"))
    tokens, counts_t, grad_out = _inputs(counts)
    results = []
    for use_grouped_mm in (False, True):
        groups = SlotGroups.from_counts(counts_t, tokens.shape[0], use_grouped_mm=use_grouped_mm)
        assert (groups.sizes is None) == use_grouped_mm
        x = tokens.clone().requires_grad_()
        w1 = module.w_gate_up.detach().clone().requires_grad_()
        w2 = module.w_down.detach().clone().requires_grad_()
        out = GroupedMLPFunction.apply(x, w1, w2, groups, activation)
        out.backward(grad_out)
        results.append((out.detach(), x.grad, w1.grad, w2.grad))
    for name, a, b in zip(("output", "input grad", "w_gate_up grad", "w_down grad"), *results):
        _close(b, a, name)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("backend", ("torch", "loop"))
def test_matches_per_token_reference(activation, backend):
    """Independent reference: each row through its slot's HF-layout weights with plain F.linear."""
    counts = (4, 0, 3, 1, 2)
    weights = _full_weights(5, activation == "swiglu")
    module = _load(_experts(activation, backend), weights)
    tokens, counts_t, _ = _inputs(counts)
    act = {"swiglu": F.silu, "gelu": F.gelu, "relu": F.relu, "silu": F.silu}[activation]
    slot_of_row = torch.repeat_interleave(torch.arange(5), counts_t)
    expected = []
    for row, slot in zip(tokens, slot_of_row.tolist()):
        w = weights[slot]
        hidden = act(F.linear(row, w["gate"]))
        if w["up"] is not None:
            hidden = hidden * F.linear(row, w["up"])
        expected.append(F.linear(hidden, w["down"]))
    _close(module(tokens, counts_t).detach(), torch.stack(expected), "output")


@pytest.mark.parametrize("activation", ("swiglu", "relu"))
@pytest.mark.parametrize("etp_size", (2, 4))
@pytest.mark.parametrize("backend", ("torch", "loop"))
def test_etp_shards_sum_to_unsharded(activation, etp_size, backend):
    weights = _full_weights(5, activation == "swiglu", seed=3)
    counts = (3, 0, 5, 1, 2)
    tokens, counts_t, grad_out = _inputs(counts)
    full = _run(_load(_experts(activation, backend), weights), tokens, counts_t, grad_out)
    shards = [_load(_experts(activation, backend, etp_size=etp_size, etp_rank=r), weights) for r in range(etp_size)]
    results = [_run(m, tokens, counts_t, grad_out) for m in shards]
    _close(sum(r[0] for r in results), full[0], "summed partial outputs")
    _close(sum(r[1] for r in results), full[1], "summed input grads")
    # Weight gradients of each shard are the matching slices of the unsharded gradients.
    unsharded = _experts(activation, backend)
    unsharded.w_gate_up.grad, unsharded.w_down.grad = full[2], full[3]
    fs = FFN // etp_size
    for rank, module in enumerate(shards):
        rows = slice(rank * fs, (rank + 1) * fs)
        for slot in range(5):
            mine, ref = module.expert_weight_shards(slot, grad=True), unsharded.expert_weight_shards(slot, grad=True)
            _close(mine["gate"], ref["gate"][rows], f"rank {rank} slot {slot} gate grad")
            _close(mine["down"], ref["down"][:, rows], f"rank {rank} slot {slot} down grad")
            if activation == "swiglu":
                _close(mine["up"], ref["up"][rows], f"rank {rank} slot {slot} up grad")
            else:
                assert "up" not in mine


@pytest.mark.parametrize("activation", ("swiglu", "gelu"))
def test_load_and_export_round_trip(activation):
    gated = activation == "swiglu"
    weights = _full_weights(3, gated, seed=5)
    fs = FFN // 2
    for rank in range(2):
        module = _load(_experts(activation, slots=3, etp_size=2, etp_rank=rank), weights)
        for slot, w in enumerate(weights):
            shards = module.expert_weight_shards(slot)
            assert set(shards) == ({"gate", "up", "down"} if gated else {"gate", "down"})
            rows = slice(rank * fs, (rank + 1) * fs)
            assert torch.equal(shards["gate"], w["gate"][rows])
            assert torch.equal(shards["down"], w["down"][:, rows])
            if gated:
                assert torch.equal(shards["up"], w["up"][rows])
            # Layout of the stacked parameters: [gate shard; up shard] rows, down's columns.
            assert torch.equal(module.w_gate_up[slot, :fs], w["gate"][rows])
            assert torch.equal(module.w_down[slot], w["down"][:, rows])
    # Loading is not an autograd operation.
    assert module.w_gate_up.grad_fn is None and module.w_gate_up.requires_grad


def test_cpu_slot_gemms_run_on_the_calling_thread_at_any_thread_count():
    """On CPU the torch backend's per-slot GEMMs run on the calling thread (each on all of torch's
    threads): the loop reference's numbers at every thread count, and FlopCounterMode, which sees only
    its own thread's ops, counts every expert FLOP of the forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    counts = (3, 1, 7, 1, 2, 4, 5, 2)
    weights = _full_weights(8, True)
    module = _load(_experts("swiglu", "torch", slots=8), weights)
    reference = _run(_load(_experts("swiglu", "loop", slots=8), weights), *_inputs(counts))
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            got = _run(module, *_inputs(counts))
            assert torch.get_num_threads() == num_threads
            for name, e, g in zip(("output", "input grad", "w_gate_up grad", "w_down grad"), reference, got):
                _close(g, e, f"{num_threads} threads: {name}")
    finally:
        torch.set_num_threads(threads)
    tokens, counts_t, _ = _inputs(counts)
    hidden, ffn = module.w_down.shape[1], module.w_down.shape[2]
    forward = 2 * tokens.shape[0] * hidden * 3 * ffn          # gate and up [2F, H], down [H, F]
    with FlopCounterMode(display=False) as counter:
        module(tokens.requires_grad_(), counts_t).sum().backward()
    assert counter.get_total_flops() == 3 * forward           # forward, input and weight gradients


def test_stride_zero_gradient_and_no_input_grad():
    """`out.sum().backward()` hands the experts a broadcast gradient; inputs may not need grads."""
    module = _load(_experts("swiglu", "torch"), _full_weights(5, True))
    tokens, counts_t, _ = _inputs((3, 0, 2, 2, 1))
    for use_grouped_mm in (False, True):
        groups = SlotGroups.from_counts(counts_t, tokens.shape[0], use_grouped_mm=use_grouped_mm)
        module.zero_grad(set_to_none=True)
        GroupedMLPFunction.apply(tokens, module.w_gate_up, module.w_down, groups, "swiglu").sum().backward()
        assert module.w_gate_up.grad is not None and torch.isfinite(module.w_gate_up.grad).all()
    loop = _load(_experts("swiglu", "loop"), _full_weights(5, True))
    loop(tokens, counts_t).sum().backward()
    _close(module.w_down.grad, loop.w_down.grad, "w_down grad")


def test_construction_draws_nothing_from_the_global_rng():
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    first = _experts()
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(first.w_gate_up, _experts().w_gate_up)  # deterministic placeholder init
    assert first.w_gate_up.abs().sum() > 0


def test_auto_backend_on_cpu_is_torch():
    assert _experts(backend="auto").backend == "torch"


@pytest.mark.parametrize("field, kwargs", [
    ("num_local_slots", dict(num_local_slots=0)),
    ("hidden_size", dict(hidden_size=0)),
    ("ffn_hidden_size", dict(ffn_hidden_size=-1)),
    ("activation", dict(activation="geglu")),
    ("backend", dict(backend="cuda")),
    ("etp_size", dict(etp_size=0)),
    ("ffn_hidden_size", dict(etp_size=3)),
    ("etp_rank", dict(etp_size=2, etp_rank=2)),
    ("etp_rank", dict(etp_rank=-1)),
])
def test_config_errors_name_the_field(field, kwargs):
    args = dict(num_local_slots=2, hidden_size=H, ffn_hidden_size=FFN) | kwargs
    with pytest.raises(ValueError, match=f"ExpertsConfig.{field}"):
        ExpertsConfig(**args)


def test_te_backend_without_transformer_engine_or_cuda_names_the_fix():
    with pytest.raises(RuntimeError, match=r"pip install \.\[te\]"):
        _experts(backend="te")


def test_load_errors():
    gated, plain = _experts("swiglu", slots=2), _experts("gelu", slots=2)
    w = _full_weights(1, True)[0]
    with pytest.raises(ValueError, match="gate must be the full expert weight of shape"):
        gated.load_expert_weights(0, w["gate"][:4], w["up"], w["down"])
    with pytest.raises(ValueError, match="down must be the full expert weight of shape"):
        gated.load_expert_weights(0, w["gate"], w["up"], w["down"].t())
    with pytest.raises(ValueError, match="pass the up projection"):
        gated.load_expert_weights(0, w["gate"], None, w["down"])
    with pytest.raises(ValueError, match="pass up=None"):
        plain.load_expert_weights(0, w["gate"], w["up"], w["down"])
    with pytest.raises(ValueError, match="local_slot must be in"):
        gated.load_expert_weights(2, w["gate"], w["up"], w["down"])
    with pytest.raises(ValueError, match="no gradient yet"):
        gated.expert_weight_shards(0, grad=True)


@pytest.mark.parametrize("backend", ("torch", "loop"))
def test_forward_errors(backend):
    module = _experts(backend=backend, slots=2)
    x = torch.randn(4, H)
    with pytest.raises(ValueError, match="tokens_sorted must be"):
        module(torch.randn(4, H + 1), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="tokens_per_slot must be an integer tensor of shape"):
        module(x, torch.tensor([4]))
    with pytest.raises(ValueError, match="sum to the number of rows"):
        module(x, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="cast one of them"):
        module(x.double(), torch.tensor([2, 2]))


@pytest.mark.parametrize("activation", ("swiglu", "gelu"))
@pytest.mark.parametrize("backend", ("torch", "loop"))
def test_forward_per_pair_matches_grouped_forward_and_combine(activation, backend):
    """The static-shape decode path: each token's weighted sum over its pairs, pairs whose slot is -1
    or out of range contribute nothing, equals sorting the pairs, the grouped forward and the sum."""
    module = _load(_experts(activation, backend), _full_weights(5, activation == "swiglu", seed=4))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randn(4, H, generator=g)
    slot_ids = torch.tensor([[0, 3], [2, -1], [4, 4], [7, 1]])          # -1 and 7: not computed here
    weights = torch.rand(4, 2, generator=g)
    expected = torch.zeros(4, H)
    for t in range(4):
        for k in range(2):
            slot = int(slot_ids[t, k])
            if 0 <= slot < 5:
                counts = torch.zeros(5, dtype=torch.int64)
                counts[slot] = 1
                expected[t] += weights[t, k] * module(tokens[t:t + 1], counts)[0].detach()
    with torch.no_grad():
        _close(module.forward_per_pair(tokens, slot_ids, weights), expected, "per-pair output")
    fp8_like = _experts()
    fp8_like.backend = "te"
    with pytest.raises(ValueError, match="forward_per_pair needs the 'torch' or 'loop' backend"):
        fp8_like.forward_per_pair(tokens, slot_ids, weights)


class _RecordedGemms(torch.utils._python_dispatch.TorchDispatchMode):
    """The GEMM ops run inside the block with the dtypes of their operands: (op name, (dtypes))."""

    GEMMS = {"aten::mm", "aten::_grouped_mm", "aten::addmm", "aten::bmm"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.GEMMS:
            self.calls.append((func._schema.name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _training_forward_backward(module, tokens, counts):
    x = tokens.clone().requires_grad_()
    with _RecordedGemms() as gemms:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x, counts)
        out.float().square().sum().backward()
    return out, x.grad, gemms.calls


def test_autocast_training_runs_the_expert_gemms_in_bf16_through_grouped_mm(monkeypatch):
    """Default training: fp32 parameters and fp32 rows (RMSNorm keeps the residual's dtype) under bf16
    autocast. The rows and weights are cast once, and the grouped op runs forward and backward in bf16
    where the availability check allows it (simulated: CPU has no grouped kernels of its own)."""
    counts = torch.tensor([3, 0, 5, 1, 2])                   # slot 1 empty
    hidden = 16                                               # torch._grouped_mm: 16-byte row strides in bf16
    tokens = torch.randn(int(counts.sum()), hidden, generator=torch.Generator().manual_seed(3))
    module = GroupedExperts(ExpertsConfig(5, hidden, 8, backend="torch"))
    reference = module(tokens, counts)

    monkeypatch.setattr("megamoe.moe.experts.grouped_mlp.grouped_mm_applies",
                        lambda device, dtype: dtype == torch.bfloat16)
    out, dx, calls = _training_forward_backward(module, tokens, counts)
    assert out.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert module.w_gate_up.grad.dtype == torch.float32
    assert calls and all(name == "aten::_grouped_mm" for name, _ in calls), calls
    assert all(dtypes == (torch.bfloat16, torch.bfloat16, torch.int32) for _, dtypes in calls), calls
    assert len(calls) == 6                                    # 2 forward, 4 backward (dX and dW of both)
    assert torch.allclose(out.float(), reference, atol=0.02, rtol=0.02)
    grouped = (dx, module.w_gate_up.grad.clone(), module.w_down.grad.clone())

    monkeypatch.undo()                  # CPU: one bmm per GEMM over the padded slots (grouped_bmm), also in bf16
    module.zero_grad(set_to_none=True)
    out_loop, dx_loop, calls = _training_forward_backward(module, tokens, counts)
    assert len(calls) == 6 and all(name == "aten::bmm" and set(dtypes) == {torch.bfloat16}
                                   for name, dtypes in calls), calls
    assert torch.allclose(out_loop.float(), out.float(), atol=1e-2, rtol=1e-2)
    for a, b in zip((dx_loop, module.w_gate_up.grad, module.w_down.grad), grouped):
        assert torch.allclose(a, b, atol=1e-2, rtol=1e-2)


def test_fp32_without_autocast_runs_the_fp32_slot_loop_unchanged():
    from megamoe.moe.experts.grouped_mlp import _grouped_mlp
    counts = torch.tensor([3, 0, 5, 1, 2])
    tokens = torch.randn(int(counts.sum()), H, generator=torch.Generator().manual_seed(4))
    module = _load(_experts(), _full_weights(5, gated=True))
    with _RecordedGemms() as gemms:
        out = module(tokens, counts)
    assert gemms.calls == [("aten::mm", (torch.float32, torch.float32))] * 8   # 4 slots with rows x 2
    groups = SlotGroups.from_counts(counts, tokens.shape[0], use_grouped_mm=False)
    with torch.no_grad():
        assert torch.equal(out, _grouped_mlp(tokens, module.w_gate_up, module.w_down, groups, "swiglu")[0])
