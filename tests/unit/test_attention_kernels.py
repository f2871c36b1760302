"""Which SDPA kernel attention's masks reach under GQA (megamoe.transformer.attention, issue 29 row 12).

Every mask kind (padding, packed documents, a sliding window, sinks, CP's query positions, a cached
chunk, a padded decoding step, and a mix) with grouped query heads:

- off CPU (the meta device stands for CUDA), no masked call keeps ``enable_gqa``: each one passes the
  head check of CUDA's memory-efficient kernel (:func:`cuda_backend`, a model of torch 2.13's
  ``sdp_utils.cpp`` selection), so none is left to the math kernel;
- the expanded-KV path (forced on CPU) computes the same output and q / k / v / sink gradients as
  attention written out (the oracle: fp64 scores, the math), run on a fused CPU kernel only; so does
  CPU's own path (``enable_gqa``), sinks included (their gradient no longer rides on a float mask,
  which CPU's flash kernel refused).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megamoe.transformer import attention as attention_module
from megamoe.transformer.attention import causal_attention
from megamoe.transformer.context_parallel import cp_token_index

B, HEADS, KV_HEADS, S, D = 2, 4, 2, 8, 8


def _mask_kinds() -> dict:
    """kind -> (query length, causal_attention keyword arguments); keys are always S long."""
    left_padded = torch.ones(B, S, dtype=torch.bool)
    left_padded[1, :3] = False
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    return {
        "padding": (S, dict(attention_mask=left_padded)),
        "documents": (S, dict(document_ids=documents)),
        "sliding_window": (S, dict(sliding_window=3)),
        "sinks": (S, dict(sinks=sinks)),
        "context_parallel": (S // 2, dict(query_positions=cp_token_index(S, 0, 2))),
        "cached_chunk": (3, {}),
        "padded_decode": (1, dict(attention_mask=left_padded)),
        "documents_window_sinks": (S, dict(document_ids=documents, sliding_window=3, sinks=sinks)),
    }


KINDS = sorted(_mask_kinds())


def _inputs(q_len: int, device="cpu", kv_heads=KV_HEADS):
    generator = torch.Generator().manual_seed(q_len)
    q = torch.randn(B, HEADS, q_len, D, generator=generator)
    k, v = (torch.randn(B, kv_heads, S, D, generator=generator) for _ in range(2))
    return [t.to(device).requires_grad_() for t in (q, k, v)]


def cuda_backend(query, key, value, attn_mask=None, is_causal=False, enable_gqa=False, **_) -> str:
    """The kernel CUDA's SDPA picks for a call (torch 2.13, default order flash > efficient > math >
    cuDNN, fp16/bf16, head dims that fit): flash refuses any ``attn_mask`` (``check_for_attn_mask``);
    memory-efficient takes a mask but refuses grouped query heads
    (``check_batch_size_and_num_heads_dense<false>``); the math kernel takes everything."""
    grouped = query.shape[1] != key.shape[1]
    if grouped and not enable_gqa:
        raise AssertionError("grouped query heads without enable_gqa: SDPA refuses the call")
    if attn_mask is None:
        return "flash"
    return "math" if grouped else "efficient"


def _recorded_calls(monkeypatch) -> list:
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        calls.append((query, key, value, kwargs))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", recording)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_masked_gqa_calls_off_cpu_keep_a_fused_kernel(kind, monkeypatch):
    q_len, kwargs = _mask_kinds()[kind]
    calls = _recorded_calls(monkeypatch)
    q, k, v = _inputs(q_len, "meta")
    meta_kwargs = {name: t.to("meta") if isinstance(t, torch.Tensor) else t for name, t in kwargs.items()}
    out = causal_attention(q, k, v, D ** -0.5, **meta_kwargs)
    assert out.shape == (B, HEADS, q_len, D)
    assert len(calls) == 1
    query, key, value, call = calls[0]
    assert call["attn_mask"] is not None             # every kind here needs an explicit mask ...
    assert key.shape[1] == value.shape[1] == HEADS and not call.get("enable_gqa")
    assert cuda_backend(query, key, value, **call) == "efficient"    # ... and keeps the fused kernel


def test_unmasked_gqa_calls_keep_the_kv_heads_and_the_flash_kernel(monkeypatch):
    calls = _recorded_calls(monkeypatch)
    for q_len in (S, 1):         # a full causal forward, a decoding step without padding
        q, k, v = _inputs(q_len, "meta")
        causal_attention(q, k, v, D ** -0.5, sliding_window=S)
    assert [key.shape[1] for _, key, _, _ in calls] == [KV_HEADS, KV_HEADS]
    assert [cuda_backend(*call[:3], **call[3]) for call in calls] == ["flash", "flash"]


def test_cpu_keeps_grouped_kv_heads_under_a_mask(monkeypatch):
    """CPU's flash kernel takes a mask with enable_gqa: no expanded copies there."""
    calls = _recorded_calls(monkeypatch)
    q_len, kwargs = _mask_kinds()["documents"]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        causal_attention(*_inputs(q_len), D ** -0.5, **kwargs)
    (_, key, _, call), = calls
    assert key.shape[1] == KV_HEADS and call["enable_gqa"]


def _reference(q, k, v, scale, sliding_window=None, attention_mask=None, query_positions=None, document_ids=None,
               sinks=None):
    """Attention written out (fp64 scores): query ``i`` (key index ``q_pos[i]``) sees key ``j`` iff
    ``j <= q_pos[i]``, within the window, a real token (or itself) and of its document; the sink joins
    every softmax as a column with no value."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    q_pos = torch.arange(k_len - q_len, k_len) if query_positions is None else query_positions
    i, j = q_pos[:, None], torch.arange(k_len)[None, :]
    visible = (j <= i) & (j > i - (sliding_window or k_len))
    visible = visible.expand(q.shape[0], 1, q_len, k_len)
    if attention_mask is not None:
        visible = visible & attention_mask[:, None, None, :] | (j == i)
    if document_ids is not None:
        visible = visible & (document_ids[:, q_pos][:, None, :, None] == document_ids[:, None, None, :])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    return (scores.softmax(-1)[..., :k_len] @ v).to(q.dtype)


def _output_and_grads(attend, q_len: int, kwargs: dict, kv_heads: int):
    q, k, v = _inputs(q_len, kv_heads=kv_heads)
    sinks = kwargs.get("sinks")
    if sinks is not None:
        kwargs = dict(kwargs, sinks=sinks.clone().requires_grad_())
    out = attend(q, k, v, D ** -0.5, **kwargs)
    out_grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    leaves = [q, k, v] + ([kwargs["sinks"]] if sinks is not None else [])
    return [out, *torch.autograd.grad(out, leaves, out_grad)]


@pytest.mark.parametrize("kv_heads", [KV_HEADS, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_expanded_kv_heads_match_attention_written_out(kind, kv_heads, monkeypatch):
    q_len, kwargs = _mask_kinds()[kind]
    expected = _output_and_grads(_reference, q_len, kwargs, kv_heads)
    monkeypatch.setattr(attention_module, "masked_attention_expands_kv_heads", lambda device: True)
    calls = _recorded_calls(monkeypatch)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):      # the expanded call on a fused CPU kernel only
        got = _output_and_grads(causal_attention, q_len, kwargs, kv_heads)
    (query, key, _, call), = calls
    assert key.shape[1] == HEADS and not call["enable_gqa"] and call["attn_mask"].dtype == torch.bool
    # fp32 against fp64 scores: each output and gradient entry sums at most S + 1 (keys, sink)
    # products of D-long dot products
    tol = (S + 1) * D * torch.finfo(torch.float32).eps
    for name, a, b in zip(("output", "q grad", "k grad", "v grad", "sinks grad"), got, expected):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{kind} {name}: {m}")


def test_the_cpu_path_matches_attention_written_out_on_the_fused_kernel():
    """CPU's own path (enable_gqa, no expansion), every mask kind at once, on CPU's flash kernel."""
    tol = (S + 1) * D * torch.finfo(torch.float32).eps
    for kind, (q_len, kwargs) in _mask_kinds().items():
        expected = _output_and_grads(_reference, q_len, kwargs, KV_HEADS)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            got = _output_and_grads(causal_attention, q_len, kwargs, KV_HEADS)
        for name, a, b in zip(("output", "q grad", "k grad", "v grad", "sinks grad"), got, expected):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{kind} {name}: {m}")
