"""Shared by tests/unit/test_tensor_parallel.py and tests/multirank/test_tensor_parallel.py: the builders and
constants of the tensor parallel tests."""

import torch
import torch.nn.functional as F

from megamoe import comms
from megamoe.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                     allreduce_sequence_parallel_grads, vocab_parallel_cross_entropy)

S, B, H, F_OUT, V = 8, 3, 16, 24, 32
ATOL = 1e-5


def _close(a, b, what):
    assert torch.allclose(a, b, atol=ATOL, rtol=1e-5), f"{what}: max diff {(a - b).abs().max().item():.3e}"


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _chunk(t, dim, group):
    return t.chunk(comms.group_size(group), dim=dim)[comms.group_rank(group)]


def check_column_and_row(group):
    for bias in (True, False):
        for gather in (False, True):
            torch.manual_seed(1)
            ref = ColumnParallelLinear(H, F_OUT, bias=bias)              # tp=1: the unsharded layer
            torch.nn.init.normal_(ref.bias) if bias else None
            torch.manual_seed(1)
            par = ColumnParallelLinear(H, F_OUT, tp_group=group, bias=bias, gather_output=gather)
            _close(par.weight, _chunk(ref.weight, 0, group), "column init is TP-invariant")
            if bias:
                with torch.no_grad():
                    par.bias.copy_(_chunk(ref.bias, 0, group))
            x_ref = _data(2, S, B, H).requires_grad_()
            x_par = x_ref.detach().clone().requires_grad_()
            y_ref = F.linear(x_ref, ref.weight, ref.bias)
            y_par = par(x_par)
            _close(y_par, y_ref if gather else _chunk(y_ref, -1, group), "column forward")
            dy = _data(3, S, B, F_OUT)
            y_ref.backward(dy)
            y_par.backward(dy if gather else _chunk(dy, -1, group))
            _close(x_par.grad, x_ref.grad, "column input grad")
            _close(par.weight.grad, _chunk(ref.weight.grad, 0, group), "column weight grad")
            if bias:
                _close(par.bias.grad, _chunk(ref.bias.grad, 0, group), "column bias grad")
        # skip_bias_add returns the bias separately
        par = ColumnParallelLinear(H, F_OUT, tp_group=group, skip_bias_add=True)
        out, b = par(_data(4, S, H))
        assert b is par.bias and out.shape == (S, F_OUT // comms.group_size(group))

    for input_is_parallel in (True, False):
        torch.manual_seed(5)
        ref = torch.nn.Linear(F_OUT, H)
        par = RowParallelLinear(F_OUT, H, tp_group=group, input_is_parallel=input_is_parallel)
        with torch.no_grad():
            par.weight.copy_(_chunk(ref.weight, 1, group))
            par.bias.copy_(ref.bias)
        x_ref = _data(6, S, B, F_OUT).requires_grad_()
        x_in = _chunk(x_ref.detach(), -1, group) if input_is_parallel else x_ref.detach()
        x_par = x_in.clone().requires_grad_()
        y_ref, y_par = ref(x_ref), par(x_par)
        _close(y_par, y_ref, "row forward")
        dy = _data(7, S, B, H)
        y_ref.backward(dy)
        y_par.backward(dy)
        expected_dx = _chunk(x_ref.grad, -1, group) if input_is_parallel else x_ref.grad
        _close(x_par.grad, expected_dx, "row input grad")
        _close(par.weight.grad, _chunk(ref.weight.grad, 1, group), "row weight grad")
        _close(par.bias.grad, ref.bias.grad, "row bias grad")


def check_mlp_and_comm_volume(group):
    """column -> gelu -> row, with and without sequence parallelism, and the collectives it issues."""
    tp = comms.group_size(group)
    torch.manual_seed(11)
    fc1, fc2 = torch.nn.Linear(H, F_OUT), torch.nn.Linear(F_OUT, H)
    x_full, dy_full = _data(12, S, B, H), _data(13, S, B, H)
    x_ref = x_full.clone().requires_grad_()
    y_ref = fc2(F.gelu(fc1(x_ref)))
    y_ref.backward(dy_full)
    for sp in (False, True):
        col = ColumnParallelLinear(H, F_OUT, tp_group=group, sequence_parallel=sp)
        row = RowParallelLinear(F_OUT, H, tp_group=group, sequence_parallel=sp)
        with torch.no_grad():
            col.weight.copy_(_chunk(fc1.weight, 0, group))
            col.bias.copy_(_chunk(fc1.bias, 0, group))
            row.weight.copy_(_chunk(fc2.weight, 1, group))
            row.bias.copy_(fc2.bias)
        x = (_chunk(x_full, 0, group) if sp else x_full).clone().requires_grad_()
        with comms.comm_counter() as fwd:
            y = row(F.gelu(col(x)))
        with comms.comm_counter() as bwd:
            y.backward(_chunk(dy_full, 0, group) if sp else dy_full)
        _close(y, _chunk(y_ref, 0, group) if sp else y_ref, f"mlp forward sp={sp}")
        _close(x.grad, _chunk(x_ref.grad, 0, group) if sp else x_ref.grad, f"mlp input grad sp={sp}")
        _close(col.weight.grad, _chunk(fc1.weight.grad, 0, group), f"mlp fc1 grad sp={sp}")
        _close(row.weight.grad, _chunk(fc2.weight.grad, 1, group), f"mlp fc2 grad sp={sp}")
        allreduce_sequence_parallel_grads(row, group)
        _close(row.bias.grad, fc2.bias.grad, f"mlp fc2 bias grad sp={sp}")

        full_bytes = S * B * H * 4
        if tp == 1:
            assert fwd.calls() == 0 and bwd.calls() == 0
        elif not sp:
            assert fwd.kinds() == {"all_reduce": 1} and fwd.bytes() == full_bytes, fwd.kinds()
            assert bwd.kinds() == {"all_reduce": 1} and bwd.bytes() == full_bytes, bwd.kinds()
        else:
            expected = {"all_gather": 1, "reduce_scatter": 1}
            assert fwd.kinds() == expected and bwd.kinds() == expected, (fwd.kinds(), bwd.kinds())
            assert fwd.bytes("all_gather") == full_bytes // tp and fwd.bytes("reduce_scatter") == full_bytes
            assert bwd.bytes("all_gather") == full_bytes // tp and bwd.bytes("reduce_scatter") == full_bytes
            assert fwd.calls(group=group) == 2


def check_embedding_and_cross_entropy(group):
    ids = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(21))
    torch.manual_seed(22)
    ref = VocabParallelEmbedding(V, H)
    for sp in (False, True):
        torch.manual_seed(22)
        par = VocabParallelEmbedding(V, H, tp_group=group, sequence_parallel=sp)
        _close(par.weight, _chunk(ref.weight, 0, group), "embedding init is TP-invariant")
        ref.weight.grad = None
        y_ref = F.embedding(ids, ref.weight)
        y_par = par(ids)
        _close(y_par, _chunk(y_ref, 0, group) if sp else y_ref, f"embedding forward sp={sp}")
        dy = _data(23, S, B, H)
        y_ref.backward(dy)
        y_par.backward(_chunk(dy, 0, group) if sp else dy)
        _close(par.weight.grad, _chunk(ref.weight.grad, 0, group), f"embedding grad sp={sp}")

    logits_full = (_data(24, S, B, V) * 5).requires_grad_()
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(25))
    target[0, 0] = target[3, 1] = -100
    loss_ref = F.cross_entropy(logits_full.reshape(-1, V), target.reshape(-1), reduction="none").view(S, B)
    logits_local = _chunk(logits_full.detach(), -1, group).clone().requires_grad_()
    loss_par = vocab_parallel_cross_entropy(logits_local, target, group)
    _close(loss_par, loss_ref, "cross-entropy forward")
    assert loss_par[0, 0] == 0 and loss_par[3, 1] == 0
    w = _data(26, S, B)
    (loss_ref * w).sum().backward()
    (loss_par * w).sum().backward()
    _close(logits_local.grad, _chunk(logits_full.grad, -1, group), "cross-entropy grad")


def check_all(group):
    check_column_and_row(group)
    check_mlp_and_comm_volume(group)
    check_embedding_and_cross_entropy(group)
