"""Transformer blocks against transformers' own modules (fp32, one rank).

The cases that spawn ranks or run scripts end to end; the in-process ones are in
tests/unit/test_transformer_blocks.py."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.models.families import attention_config, mla_config, mlp_config
from megamoe.sharding import get_shard_spec
from megamoe.spawned_ranks import run_on_ranks
from megamoe.transformer import MLP, Attention, AttentionConfig, MLPConfig, MultiHeadLatentAttention, RopeConfig
from tests.helpers.transformer_blocks import B, H, POSITIONS, S, _close, _data, _load_full, _randomize, hf_configs


# ----------------------------------------------------------------------------------------------
# Tensor parallelism: every block under TP equals the single-rank block
# ----------------------------------------------------------------------------------------------
BLOCK_TYPES = {"attention": Attention, "mla": MultiHeadLatentAttention, "mlp": MLP}


def _tp_cases():
    """(name, block type, config, (forward, backward) all-reduces expected under TP=2), built in the
    parent from the HF configs and shipped to the ranks."""
    configs = hf_configs()
    return [
        ("mixtral", "attention", attention_config(configs["mixtral"]), (1, 1)),
        ("qwen2_moe", "attention", attention_config(configs["qwen2_moe"]), (1, 1)),
        ("qwen3_moe", "attention", attention_config(configs["qwen3_moe"]), (1, 3)),   # + per-head norm weight grads
        ("olmoe", "attention", attention_config(configs["olmoe"]), (3, 3)),   # + q/k sums of squares, each way
        # One KV head on every rank: k/v/k_norm weight grads summed over TP (3 more backward all-reduces).
        ("olmoe_mqa", "attention", dataclasses.replace(attention_config(configs["olmoe"]), num_key_value_heads=1),
         (3, 6)),
        ("deepseek_v2", "mla", mla_config(configs["deepseek_v2"]), (1, 2)),   # q_proj input grad + kv latents
        ("deepseek_v3", "mla", mla_config(configs["deepseek_v3"]), (1, 1)),   # one all-reduce for all latents
        ("mlp", "mlp", mlp_config(configs["deepseek_v2"]), (1, 1)),
        ("plain_mlp", "mlp", MLPConfig(H, 24, activation="relu", gated=False), (1, 1)),
    ]


def _check_block_under_tp(name, block_type, config, expected_calls, group):
    tp = comms.group_size(group)
    ref = BLOCK_TYPES[block_type](config)
    par = BLOCK_TYPES[block_type](config, tp_group=group)
    ref.reset_parameters(torch.Generator().manual_seed(11))
    par.reset_parameters(torch.Generator().manual_seed(11))
    ref_params = dict(ref.named_parameters())
    for pname, p in par.named_parameters():          # seeded init is layout-invariant
        _close(p, get_shard_spec(p).slice_of(ref_params[pname]), f"{name} tp={tp} init of {pname}", atol=0)
    _randomize(ref, seed=12)                           # beyond ones / zeros, so every weight matters
    _load_full(par, {k: v.detach() for k, v in ref_params.items()})

    call = (lambda m, x: m(x)) if block_type == "mlp" else (lambda m, x: m(x, POSITIONS))
    x_ref = _data(1, B, S, H).requires_grad_()
    x_par = x_ref.detach().clone().requires_grad_()
    dy = _data(2, B, S, H) * 0.1
    y_ref = call(ref, x_ref)
    y_ref.backward(dy)
    with comms.comm_counter() as forward:
        y_par = call(par, x_par)
    with comms.comm_counter() as backward:
        y_par.backward(dy)
    _close(y_par, y_ref, f"{name} tp={tp} output")
    _close(x_par.grad, x_ref.grad, f"{name} tp={tp} input grad")
    for pname, p in par.named_parameters():
        _close(p.grad, get_shard_spec(p).slice_of(ref_params[pname].grad), f"{name} tp={tp} grad of {pname}")
    assert set(forward.kinds()) == set(backward.kinds()) == {"all_reduce"}, (forward.kinds(), backward.kinds())
    if tp == 2:
        assert (forward.calls(), backward.calls()) == expected_calls, (name, forward.calls(), backward.calls())


def _tp_worker(rank, world_size, cases):
    # TP = 4 (world: 2 KV heads, so each is replicated on 2 ranks) and TP = 2 (pairs) in one spawn.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for group in (dist.group.WORLD, pairs[rank // 2]):
        for case in cases:
            _check_block_under_tp(*case, group)
    rope = RopeConfig(dim=8)
    errors = []
    for heads, kv_heads in [(6, 6), (8, 3)]:           # heads not divisible by 4; 3 KV heads vs TP 4
        try:
            Attention(AttentionConfig(hidden_size=H, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      head_dim=8, rope=rope), tp_group=dist.group.WORLD)
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.slow
def test_blocks_under_tensor_parallelism():
    for errors in run_on_ranks(_tp_worker, 4, args=(_tp_cases(),)):
        assert len(errors) == 2
        assert "num_attention_heads (6)" in errors[0] and "tensor-parallel size (4)" in errors[0]
        assert "num_key_value_heads (3)" in errors[1]
