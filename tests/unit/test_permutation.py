"""permute_by_slot / unpermute_and_combine / sort_by_slot against a naive per-pair reference: values
and gradients (tokens, expert outputs, routing weights), dropped pairs, empty dispatch."""

import pytest
import torch

from megamoe.moe.permutation import PermutationState, permute_by_slot, sort_by_slot, unpermute_and_combine

T, H, K, S = 9, 6, 3, 4


def _slot_ids(seed, drop_fraction):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, S, (T, K), generator=g)
    return ids.masked_fill(torch.rand(T, K, generator=g) < drop_fraction, -1)


def _naive(tokens, slot_ids, weights, expert_fn):
    """Pair by pair: out[t] = sum_k w[t, k] * f(slot, tokens[t]) over dispatched pairs."""
    out = tokens * 0.0 + weights.sum() * 0.0  # connected to both inputs even if nothing is dispatched
    for t in range(tokens.shape[0]):
        for k in range(slot_ids.shape[1]):
            slot = int(slot_ids[t, k])
            if 0 <= slot < S:
                out[t] = out[t] + weights[t, k] * expert_fn(slot, tokens[t])
    return out


def _expert_fn(slot, rows):
    """A per-slot nonlinear map, so gradients depend on which slot a row went to."""
    return torch.tanh(rows * (slot + 1.0)) + slot


@pytest.mark.parametrize("seed, drop_fraction", [(0, 0.0), (1, 0.3), (2, 0.8), (3, 1.0)])
def test_round_trip_matches_naive_values_and_gradients(seed, drop_fraction):
    slot_ids = _slot_ids(seed, drop_fraction)
    g = torch.Generator().manual_seed(100 + seed)
    tokens, weights = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    grad_out = torch.randn(T, H, generator=g)

    x, w = tokens.clone().requires_grad_(), weights.clone().requires_grad_()
    rows, tokens_per_slot, state = permute_by_slot(x, slot_ids, S)
    assert rows.shape == (int((slot_ids >= 0).sum()), H)
    slot_of_row = torch.repeat_interleave(torch.arange(S), tokens_per_slot)
    expert_out = torch.cat([_expert_fn(s, r) for s, r in zip(range(S), rows.split(tokens_per_slot.tolist()))])
    out = unpermute_and_combine(expert_out, w, state)
    out.backward(grad_out)

    xr, wr = tokens.clone().requires_grad_(), weights.clone().requires_grad_()
    expected = _naive(xr, slot_ids, wr, _expert_fn)
    expected.backward(grad_out)
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.allclose(x.grad, xr.grad, atol=1e-6)
    assert torch.allclose(w.grad, wr.grad, atol=1e-6)
    assert torch.all(w.grad[slot_ids < 0] == 0)
    # Rows are grouped by slot, in (token, k) order within a slot.
    assert torch.equal(slot_of_row, slot_ids.reshape(-1)[state.pair_index])
    assert torch.equal(state.token_index, state.pair_index // K)
    for s in range(S):
        pairs = state.pair_index[slot_of_row == s]
        assert torch.all(pairs[1:] > pairs[:-1])


def test_inference_combine_matches_the_autograd_combine():
    slot_ids = _slot_ids(4, 0.3)
    g = torch.Generator().manual_seed(7)
    tokens, weights = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g, requires_grad=True)
    rows, _, state = permute_by_slot(tokens, slot_ids, S)
    with_graph = unpermute_and_combine(rows * 2, weights, state)
    with torch.no_grad():
        inference = unpermute_and_combine(rows * 2, weights, state)
    assert with_graph.grad_fn is not None and inference.grad_fn is None
    assert torch.equal(inference, with_graph.detach())


def test_expert_output_gradient_is_weight_times_token_gradient():
    slot_ids = _slot_ids(4, 0.2)
    g = torch.Generator().manual_seed(7)
    tokens, weights = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    grad_out = torch.randn(T, H, generator=g)
    rows, _, state = permute_by_slot(tokens, slot_ids, S)
    expert_out = rows.clone().requires_grad_()
    unpermute_and_combine(expert_out, weights, state).backward(grad_out)
    row_weights = weights.reshape(-1)[state.pair_index].unsqueeze(1)
    assert torch.allclose(expert_out.grad, row_weights * grad_out[state.token_index])


def test_broadcast_gradient_and_weights_without_grad():
    slot_ids = _slot_ids(5, 0.2)
    tokens = torch.randn(T, H, requires_grad=True)
    rows, _, state = permute_by_slot(tokens, slot_ids, S)
    unpermute_and_combine(rows * 2.0, torch.rand(T, K), state).sum().backward()  # stride-0 grad_out
    assert tokens.grad is not None and torch.isfinite(tokens.grad).all()


def test_sort_by_slot_is_stable_and_puts_invalid_ids_last():
    ids = torch.tensor([2, -1, 0, 2, 5, 0, 1, 2, -3])
    permutation, tokens_per_slot = sort_by_slot(ids, 3)
    assert tokens_per_slot.tolist() == [2, 1, 3]
    assert permutation.tolist()[:6] == [2, 5, 6, 0, 3, 7]
    assert sorted(permutation.tolist()[6:]) == [1, 4, 8]
    empty_perm, empty_counts = sort_by_slot(torch.empty(0, dtype=torch.int64), 2)
    assert empty_perm.numel() == 0 and empty_counts.tolist() == [0, 0]


def test_sort_by_slot_matches_argsort_on_random_ids():
    ids = torch.randint(0, 7, (500,), generator=torch.Generator().manual_seed(0))
    permutation, tokens_per_slot = sort_by_slot(ids, 7)
    assert torch.equal(permutation, torch.argsort(ids, stable=True))
    assert torch.equal(tokens_per_slot, torch.bincount(ids, minlength=7))


def test_errors():
    tokens = torch.randn(T, H)
    with pytest.raises(ValueError, match="slot_ids must be"):
        permute_by_slot(tokens, torch.zeros(T + 1, K, dtype=torch.int64), S)
    with pytest.raises(ValueError, match="slot_ids_flat must be 1-D"):
        sort_by_slot(torch.zeros(2, 2, dtype=torch.int64), S)
    rows, _, state = permute_by_slot(tokens, _slot_ids(0, 0.0), S)
    with pytest.raises(ValueError, match="expert_output must be"):
        unpermute_and_combine(rows[1:], torch.rand(T, K), state)
    with pytest.raises(ValueError, match="weights must be"):
        unpermute_and_combine(rows, torch.rand(T - 1, K), state)
    assert isinstance(state, PermutationState) and state.num_tokens == T


def test_low_precision_expert_output_accumulates_in_fp32():
    slot_ids = _slot_ids(6, 0.1)
    g = torch.Generator().manual_seed(8)
    tokens, weights = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    grad_out = torch.randn(T, H, generator=g)
    rows, _, state = permute_by_slot(tokens, slot_ids, S)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        e, w = rows.to(dtype, copy=True).requires_grad_(), weights.clone().requires_grad_()
        out = unpermute_and_combine(e, w, state)
        out.backward(grad_out.to(dtype))
        assert out.dtype == dtype and e.grad.dtype == dtype and w.grad.dtype == torch.float32
        results[dtype] = (out.float(), e.grad.float(), w.grad)
    for a, b in zip(results[torch.float32], results[torch.bfloat16]):
        assert torch.allclose(a, b, atol=5e-2, rtol=2e-2)


def test_bf16_combine_multiplies_by_the_fp32_weight_and_rounds_once():
    """Weight 0.9 (fp32, as the router gives it) times 3.0 in bf16: bf16(2.7) = 2.703125 forward and backward,
    as Megatron-Core's unpermute (the product in fp32, rounded once); the weight rounded to bf16 first
    (0.8984375) gave 2.6875. Through the combine itself and through each dispatcher's combine."""
    from megamoe.moe.token_dispatcher import AllGatherDispatcher, AllToAllDispatcher
    exact = torch.tensor(2.7).bfloat16().item()
    assert exact == 2.703125
    slot_ids = torch.tensor([[0]])

    def through_the_combine(x, weights):
        rows, _, state = permute_by_slot(x, slot_ids, 1)
        return unpermute_and_combine(rows, weights, state)

    def through(dispatcher):
        def run(x, weights):
            expert_input, _ = dispatcher.dispatch(x, slot_ids, weights)
            return dispatcher.combine(expert_input)          # the identity as the expert
        return run

    paths = {"unpermute_and_combine": through_the_combine, "allgather": through(AllGatherDispatcher(1)),
             "alltoall": through(AllToAllDispatcher(1))}
    for name, path in paths.items():
        x = torch.full((1, 4), 3.0, dtype=torch.bfloat16, requires_grad=True)
        weights = torch.tensor([[0.9]], requires_grad=True)
        out = path(x, weights)
        assert out.dtype == torch.bfloat16 and out.tolist() == [[exact] * 4], (name, out)
        out.backward(torch.full((1, 4), 3.0, dtype=torch.bfloat16))
        assert x.grad.tolist() == [[exact] * 4], (name, x.grad)
        assert weights.grad.dtype == torch.float32 and weights.grad.item() == 36.0, (name, weights.grad)


# ---- the sums: fp32 accumulation, and the deterministic mode ---------------------------------------------
STEP = 2.0 ** -8        # half a bf16 ulp at 1.0: 1 + STEP rounds back to 1 in bf16, 1 + 2 * STEP does not


def test_bf16_sums_accumulate_in_fp32_and_round_once():
    """Three bf16 rows 1, 2^-8, 2^-8 of one token: added one by one in bf16 (as CUDA's atomics do) they give 1.0,
    each 2^-8 lost; in fp32 1 + 2^-7, exact in bf16. Both the combine (sum_rows) and the gradient of the
    dispatch gather. (The CPU's bf16 index_add_ already accumulates wider: the all-to-all combine's case, a sum
    rounded to bf16 before the shared output was added, is in tests/multirank/test_moe_layer.py.)"""
    from megamoe.moe.row_sums import sum_rows
    rows = torch.tensor([[1.0], [STEP], [STEP]], dtype=torch.bfloat16)
    assert ((rows[0] + rows[1]) + rows[2]).item() == 1.0
    for deterministic in (False, True):
        total = sum_rows(rows, torch.zeros(3, dtype=torch.int64), 1, max_per_out=3, deterministic=deterministic)
        assert total.dtype == torch.float32 and total.bfloat16().item() == 1.0 + 2 * STEP

        x = torch.ones(1, 1, dtype=torch.bfloat16, requires_grad=True)
        gathered, _, _ = permute_by_slot(x, torch.tensor([[0, 1, 2]]), 3, deterministic=deterministic)
        gathered.backward(rows)
        assert x.grad.dtype == torch.bfloat16 and x.grad.item() == 1.0 + 2 * STEP, x.grad


def _float_index_adds(run):
    """The floating-point index_add calls ``run()`` makes (the integer counts are exact in any order)."""
    calls = []

    class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name.startswith("aten::index_add") and args[0].is_floating_point():
                calls.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with Recorder():
        run()
    return len(calls)


@pytest.mark.parametrize("seed, drop_fraction", [(0, 0.0), (1, 0.3), (3, 1.0)])
def test_deterministic_sums_equal_the_default_bit_for_bit_on_cpu(seed, drop_fraction):
    """The deterministic mode adds each token's rows in row order without a scatter: on the CPU, whose
    index_add_ goes row after row, the same values bit for bit (values and every gradient), with K = 3 rows per
    token, where the order of the sum matters. Also when torch's deterministic algorithms ask for it."""
    from megamoe.moe.row_sums import uses_deterministic_sums
    slot_ids = _slot_ids(seed, drop_fraction)
    g = torch.Generator().manual_seed(200 + seed)
    tokens, weights = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    grad_out = torch.randn(T, H, generator=g)

    def run(deterministic):
        x, w = tokens.clone().requires_grad_(), weights.clone().requires_grad_()
        rows, _, state = permute_by_slot(x, slot_ids, S, deterministic=deterministic)
        out = unpermute_and_combine(torch.tanh(rows) * 3.0, w, state)
        out.backward(grad_out)
        return out, x.grad, w.grad

    default, deterministic = run(False), run(True)
    for a, b in zip(default, deterministic):
        assert torch.equal(a, b)
    assert _float_index_adds(lambda: run(True)) == 0
    if drop_fraction < 1.0:
        assert _float_index_adds(lambda: run(False)) == 2          # the combine and the token gradient
    assert not uses_deterministic_sums(False)
    torch.use_deterministic_algorithms(True)
    try:
        assert uses_deterministic_sums(False)
        assert _float_index_adds(lambda: run(False)) == 0
    finally:
        torch.use_deterministic_algorithms(False)
