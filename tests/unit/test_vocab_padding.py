"""Any vocabulary size under any TP size (megamoe.tensor_parallel.vocab_padding).

The in-process cases; those that spawn ranks or run scripts end to end are in tests/multirank/test_vocab_padding.py."""

import pytest
import torch
import torch.nn.functional as F

from megamoe.checkpoint_state import sharded_state_dict
from megamoe.inference.pipeline_forward import pipeline_logits
from megamoe.models import GPTMoEModel
from megamoe.sharding import ShardSpec
from megamoe.tensor_parallel import initialize_parameters, vocab_parallel_cross_entropy
from megamoe.tensor_parallel.vocab_padding import padded_vocab_size
from megamoe.training.memory_estimate import stage_parameters
from tests.helpers.vocab_padding import (H, REL_TOL, SOLO, _generated, _grad_chunks, _padding_grads_are_zero, _rel,
                                         batch, config, reference)

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------
def test_padded_vocab_size():
    assert [padded_vocab_size(67, tp) for tp in (1, 2, 3, 4)] == [67, 68, 69, 68]
    assert padded_vocab_size(61, 4) == 64 and padded_vocab_size(64, 4) == 64
    assert padded_vocab_size(67, 2, 4) == 72 and padded_vocab_size(67, 1, 128) == 128      # Megatron's default
    assert padded_vocab_size(32001, 8, 128) == 32768 and padded_vocab_size(151669, 8, 1) == 151672
    with pytest.raises(ValueError, match="vocab_size 5 padded to 8 .* leaves TP rank 3 with only padding rows"):
        padded_vocab_size(5, 4)
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by must be an int >= 1, got 0"):
        padded_vocab_size(67, 2, 0)
    with pytest.raises(ValueError, match="GPTMoEConfig.make_vocab_size_divisible_by must be an int >= 1"):
        config(67, tie=False, divisible_by=0)
    # The memory estimate holds the padded rows (72 / 2 per rank), as the model does.
    counts = {p.name: p.numel for p in stage_parameters(config(67, tie=False, divisible_by=4), tp=2)}
    assert counts["embed_tokens.weight"] == counts["lm_head.weight"] == 36 * H


def test_padded_shard_spec_describes_the_real_rows():
    full = torch.arange(67 * 3, dtype=torch.float32).view(67, 3)
    last = ShardSpec((67, 3), 0, 1, 2, padded_size=72)
    assert (last.local_shape, last.logical_shape, last.offsets) == ((36, 3), (31, 3), (36, 0))
    assert torch.equal(last.slice_of(full), full[36:])
    assert last.logical_part(torch.zeros(36, 3)).shape == (31, 3)
    first = ShardSpec((67, 3), 0, 0, 2, padded_size=72)
    assert (first.logical_shape, first.offsets) == ((36, 3), (0, 0)) and torch.equal(first.slice_of(full), full[:36])
    for bad, match in ((dict(padded_size=66), "must be >= the logical size 67"),
                       (dict(padded_size=71), "divisible into 2 shards"), (dict(), "not divisible into 2")):
        with pytest.raises(ValueError, match=match):
            ShardSpec((67, 3), 0, 0, 2, **bad)
    with pytest.raises(ValueError, match="a replicated tensor"):
        ShardSpec((67, 3), padded_size=72)


def test_cross_entropy_masks_the_padding_columns():
    """Padding columns holding the largest logits (as unmasked garbage would): the loss and gradient are
    the unpadded vocabulary's, the padding gets exactly zero gradient; without vocab_size they would win."""
    g = torch.Generator().manual_seed(0)
    real = torch.randn(6, 67, generator=g, dtype=torch.float64)
    target = torch.randint(0, 67, (6,), generator=g)
    target[2] = -100
    padded = torch.cat([real, torch.full((6, 5), 50.0, dtype=torch.float64)], dim=1).requires_grad_()
    loss = vocab_parallel_cross_entropy(padded, target, vocab_size=67)
    unpadded = real.clone().requires_grad_()
    expected = F.cross_entropy(unpadded, target, reduction="none")
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    loss.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(padded.grad[:, :67], unpadded.grad, rtol=1e-12, atol=1e-12)
    assert not padded.grad[:, 67:].count_nonzero()
    assert torch.equal(padded.detach()[:, 67:], torch.full((6, 5), 50.0, dtype=torch.float64))   # left as given
    assert (vocab_parallel_cross_entropy(padded.detach(), target) - expected).abs().max() > 10


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_one_process_padding_is_invisible(tie):
    """Padded to 72 rows (make_vocab_size_divisible_by 8 under tp 1) against no padding, same seed."""
    want = reference(67, tie=tie)
    model = GPTMoEModel(config(67, tie=tie, divisible_by=8), SOLO)
    initialize_parameters(model, seed=67)
    weight = model.embed_tokens.weight if tie else model.lm_head.weight
    assert weight.shape == (72, H) and not weight[67:].count_nonzero()
    inputs, labels = batch(67)
    with torch.no_grad():
        local, _ = model(inputs)
        logits = pipeline_logits(model, SOLO, inputs)
    assert local.shape[-1] == 72 and bool((local[..., 67:] == float("-inf")).all())
    assert torch.equal(logits, want["logits"])
    loss, _ = model(inputs, labels=labels)
    assert torch.equal(loss.detach(), want["loss"])
    loss.backward()
    assert _padding_grads_are_zero(model)
    grads = _grad_chunks(model)
    assert {name for name, _, _ in grads} == set(want["grads"])
    for name, _, grad in grads:
        assert _rel(grad, want["grads"][name]) <= REL_TOL, name
    chunks = sharded_state_dict(model)
    assert all(torch.equal(c.tensor, want["logical"][c.name]) for c in chunks)
    assert _generated(model, SOLO) == want["generated"]
