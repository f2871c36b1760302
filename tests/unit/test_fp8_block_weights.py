"""Kept block-FP8 weights: the model holds a block-FP8 checkpoint's e4m3 weights and block scales as stored
and runs them (``GPTMoEConfig.weight_quantization``; megamoe.quantization.kept_weights,
megamoe.moe.experts.block_fp8_experts).

The checkpoints are built here: the tiny HF models of test_hf_families (DeepSeek-V3: MLA, shared experts, a
dense first layer; Qwen3-MoE: GQA, qk-norm, tied embeddings) quantized into DeepSeek's layout with small blocks
whose edges leave partial blocks (hidden 32, FFN 16, q_lora 12, ... against blocks of 16 x 12).

The oracle of the ``block`` recipe is transformers itself, given the dequantized weights, with each routed
expert's two GEMM inputs quantized per 1 x 12 tile by this file's own plain-torch quantizer: what DeepSeek's
inference computes. Dense linears are dequantized at run time (no activation quantization), as there.
"""

from __future__ import annotations

import copy
import dataclasses
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.layout import ParallelLayout
from megamoe.checkpoint.layout_plan import plan_layout
from megamoe.hf.adapters import adapter_for
from megamoe.inference.generation import GenerationConfig, generate
from megamoe.models import GPTMoEModel
from megamoe.models.hf_loading import gather_logical_state, load_logical_state
from megamoe.moe.experts.grouped_experts import ExpertsConfig, GroupedExperts
from megamoe.moe.experts.fp8 import FP8Config, resolve_fp8_backend
from megamoe.quantization.block_fp8 import BlockFP8Config
from megamoe.tensor_parallel import initialize_parameters
from tests.helpers.hf_models import _ids, hf_model
from tests.helpers.fp8_block_weights import BLOCK, SOLO, kept_case, kept_model

pytestmark = pytest.mark.usefixtures("one_thread")

FP8_MAX = 448.0              # float8_e4m3fn's largest finite value
REFERENCE_ATOL = 1e-5
# e4m3 keeps 3 mantissa bits: rounding a value to it moves it by at most 2^-4 of itself (half an ulp) in the
# normal range, where the tile scales put every element but the tile's tiniest. A routed expert quantizes the
# inputs of its two GEMMs, so its output may differ from the dequantized model's by up to about 2 x 2^-4 of
# itself (relative RMS over a layer's outputs). Checked on the first MoE layer, whose input is bit-identical
# in both models (the dense linears dequantize alike): further down, the tiny random model's routing decisions
# flip on such differences, so the logits carry no such bound.
FP8_RELATIVE_BOUND = 2 * 2.0 ** -4


def _bytes(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


# ---- the independent reference: transformers with block-FP8 experts --------------------------------
def _tile_fake_quant(x, tile, ue8m0):
    """``x`` [N, K] as an FP8 GEMM sees it: quantized to e4m3 per 1 x ``tile`` (amax / 448 per tile, a power
    of two rounded up for ue8m0; 1 for an all-zero tile), read back in fp32."""
    cols = x.shape[1]
    tiles = F.pad(x.float(), (0, -cols % tile)).unflatten(1, (-1, tile))
    amax = tiles.abs().amax(-1, keepdim=True)
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if ue8m0:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (tiles / scale_inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale_inv).flatten(1)[:, :cols]


def _block_fp8_experts_forward(tile, ue8m0):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, k = torch.where(top_k_index == expert)
            if token.numel():
                gate, up = F.linear(_tile_fake_quant(hidden_states[token], tile, ue8m0),
                                    self.gate_up_proj[expert]).chunk(2, dim=-1)
                down = F.linear(_tile_fake_quant(self.act_fn(gate) * up, tile, ue8m0), self.down_proj[expert])
                out.index_add_(0, token, down * top_k_weights[token, k, None])
        return out
    return forward


def reference_model(family, config, dequantized, block=BLOCK, scale_fmt="float"):
    """transformers' model of ``family`` holding the dequantized weights, its routed experts quantizing
    their GEMM inputs per tile (DeepSeek's inference with block-FP8 weights)."""
    hf = copy.deepcopy(hf_model(family)[0])
    missing, unexpected = hf.load_state_dict(adapter_for(family).megamoe_to_hf(dequantized, config, fused=True),
                                             strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)   # tied alias
    experts = [m for m in hf.modules() if type(m).__name__.endswith("Experts")]
    assert experts
    for module in experts:
        module.forward = types.MethodType(_block_fp8_experts_forward(block[1], scale_fmt == "ue8m0"), module)
    return hf


# ---- (a) logits, (d) bytes ---------------------------------------------------------------------------
@pytest.mark.parametrize("family, scale_fmt", [("deepseek_v3", "float"), ("deepseek_v3", "ue8m0"),
                                               ("qwen3_moe", "float")])
def test_kept_model_matches_block_fp8_reference(family, scale_fmt):
    config, kept, dequantized, plain_config = kept_case(family, scale_fmt=scale_fmt)
    model = kept_model(config, kept)
    quantized = [n for n in kept if config.weight_quantization.quantizes(n)]
    assert any(".experts." in n for n in quantized) and any("self_attn" in n for n in quantized)
    for name in quantized:                                       # held as stored: e4m3, frozen, with scales
        param = model.get_parameter(name) if ".experts." not in name else None
        if param is not None:
            assert param.dtype == torch.float8_e4m3fn and not param.requires_grad
    ids = _ids(2)
    dequantized_model = GPTMoEModel(plain_config, SOLO).eval()
    load_logical_state(dequantized_model, dequantized)
    first_moe = min(model.moe_layers())
    seen = {}
    for key, m in (("kept", model), ("dequantized", dequantized_model)):
        m.layers[str(first_moe)].mlp.register_forward_hook(lambda _, a, out, key=key: seen.update({key: (a, out)}))
    with torch.no_grad():
        logits, _ = model(ids)
        expected = reference_model(family, plain_config, dequantized, scale_fmt=scale_fmt)(input_ids=ids).logits
        dequantized_model(ids)
    diff = (logits - expected).abs().max().item()
    assert diff <= REFERENCE_ATOL, f"{family} {scale_fmt}: {diff:.2e} from the block-FP8 reference's logits"
    (kept_in,), (kept_out, _) = seen["kept"]
    (plain_in,), (plain_out, _) = seen["dequantized"]
    assert torch.equal(kept_in, plain_in)
    relative = ((kept_out - plain_out).norm() / plain_out.norm()).item()
    assert 0 < relative <= FP8_RELATIVE_BOUND, f"{family}: MoE layer output {relative:.3e} from the dequantized model's"

    # (d) the model gives back the very bytes and scales it loaded (bit-exact export needs them).
    gathered = gather_logical_state(model)
    assert set(gathered) == set(kept)
    for name, tensor in kept.items():
        assert gathered[name].dtype == tensor.dtype and torch.equal(_bytes(gathered[name]), _bytes(tensor)), name


def test_kept_model_checkpoint_round_trip(tmp_path):
    """A megamoe checkpoint of a kept model stores the e4m3 weights and scales as logical tensors; a fresh
    kept model (another slot count) loads the same bytes back."""
    from megamoe.checkpoint.load import load_checkpoint
    from megamoe.checkpoint.save import save_checkpoint
    from megamoe.checkpoint_state import sharded_state_dict

    config, kept, _, _ = kept_case("deepseek_v3")
    save_checkpoint(tmp_path / "ckpt", sharded_state_dict(kept_model(config, kept)), manifest_fields={})
    fresh = GPTMoEModel(dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_expert_slots=12)), SOLO)
    load_checkpoint(tmp_path / "ckpt", sharded_state_dict(fresh))
    gathered = gather_logical_state(fresh)
    assert set(gathered) == set(kept)
    for name, tensor in kept.items():
        assert gathered[name].dtype == tensor.dtype and torch.equal(_bytes(gathered[name]), _bytes(tensor)), name


def test_kept_weights_without_fp8_recipe_are_dequantized_at_run_time():
    """expert_fp8=None: the experts dequantize too, so the kept model IS the dequantized model (no activation
    quantization anywhere), within fp32 rounding; replica slots hold the scales as well."""
    config, kept, dequantized, plain_config = kept_case("deepseek_v3", recipe=None, slots_per_expert=2)
    model = kept_model(config, kept)
    reference = GPTMoEModel(plain_config, SOLO).eval()
    load_logical_state(reference, dequantized)
    ids = _ids(2)
    with torch.no_grad():
        assert (model(ids)[0] - reference(ids)[0]).abs().max().item() <= 1e-5


# ---- (c) generation ------------------------------------------------------------------------------------
def test_greedy_generation_with_kept_weights_matches_reference():
    config, kept, dequantized, plain_config = kept_case("deepseek_v3")
    model = kept_model(config, kept)
    prompts = [[3, 17, 40, 5, 9], [22, 8]]                      # left padding for the second
    out = generate(model, SOLO, prompts, GenerationConfig(max_new_tokens=5))
    hf = reference_model("deepseek_v3", plain_config, dequantized)
    for prompt, new in zip(prompts, out.token_ids):              # greedy, one row at a time: no padding in HF
        with torch.no_grad():
            full = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
        assert new == full[0, len(prompt):].tolist()


# ---- (e) the torch kernel's call contract (no GPU here) --------------------------------------------------
def test_scaled_mm_kernel_call_shapes_on_meta():
    """The ``torch`` backend's torch._scaled_mm calls (1x128 activation scales, 128x128 weight scales) pass
    torch's own meta shape checks for partial blocks; their numerics need an sm90 GPU (not verified here)."""
    from megamoe.moe.experts import block_fp8_experts

    config = dataclasses.replace(kept_case("deepseek_v3")[0], weight_quantization=BlockFP8Config())
    experts = GroupedExperts(ExpertsConfig(num_local_slots=2, hidden_size=320, ffn_hidden_size=208,
                                           backend="fp8_emulated", fp8=FP8Config(recipe="block")), device="meta")
    experts.keep_block_fp8(config.weight_quantization)
    assert experts.w_gate_up_scale_inv.shape == (2, 4, 3) and experts.w_down_scale_inv.shape == (2, 3, 2)   # partial
    tokens = torch.empty(7, 320, device="meta")
    out = block_fp8_experts.block_fp8_grouped_mlp(experts, tokens, [5, 2], experts._activate, "scaled_mm")
    assert out.shape == (7, 320) and out.is_meta


# ---- (f) configuration errors -----------------------------------------------------------------------------
def test_configuration_errors():
    config, kept, dequantized, plain_config = kept_case("deepseek_v3")
    block = FP8Config(recipe="block")
    with pytest.raises(ValueError, match="recipe='block' uses the stored block scales.*weight_quantization is None"):
        dataclasses.replace(plain_config, moe=dataclasses.replace(plain_config.moe, expert_fp8=block))
    with pytest.raises(ValueError, match="recipe='delayed' would re-quantize the kept block-FP8 weights"):
        dataclasses.replace(config, moe=dataclasses.replace(config.moe, expert_fp8=FP8Config()))
    with pytest.raises(ValueError, match="expert_backend='te' cannot hold kept block-FP8 weights"):
        dataclasses.replace(config, moe=dataclasses.replace(config.moe, expert_backend="te"))
    with pytest.raises(ValueError, match="margin must be 0 with recipe='block'"):
        FP8Config(recipe="block", margin=1)
    for backend, match in (("te", "cannot run on backend='te'"), ("torch", "needs torch._scaled_mm on a CUDA GPU"),
                           ("auto", "no FP8 expert backend runs here")):
        with pytest.raises(ValueError, match=match):
            resolve_fp8_backend(backend, torch.device("cpu"), recipe="block")
    # The block recipe on experts holding high-precision weights.
    experts = GroupedExperts(ExpertsConfig(num_local_slots=2, hidden_size=8, ffn_hidden_size=4,
                                           backend="fp8_emulated", fp8=block))
    with pytest.raises(ValueError, match="these experts hold high-precision weights"):
        experts(torch.zeros(3, 8), torch.tensor([2, 1]))
    # Values that are not the checkpoint's FP8 bytes, and random initialisation, are refused.
    model = kept_model(config, kept)
    with pytest.raises(ValueError, match="q_a_proj.weight' is torch.float32, the model holds it as torch.float8_e4m"):
        load_logical_state(model, dequantized | {n: t for n, t in kept.items() if n not in dequantized})
    with pytest.raises(ValueError, match="kept block-FP8 weight .* cannot be initialised"):
        initialize_parameters(model, seed=0)
    from megamoe.training.trainer import TrainConfig, Trainer
    with pytest.raises(ValueError, match="cannot be trained; import the checkpoint with `import-hf --dtype bf16`"):
        Trainer(model, SOLO, TrainConfig())


def test_shards_off_block_boundaries_are_refused():
    """A TP / ETP shard that would cut a block: ValueError naming the tensor, the sizes, the block and the fix."""
    config = kept_case("deepseek_v3")[0]
    assert not dist.is_initialized()
    with pytest.raises(ConversionError, match=r"layers\.0\.self_attn\.q_b_proj\.weight: its 48 rows split into 2 "
                                              r"shards of 24, which is not a multiple of the FP8 block \(16 .*"
                                              r"import-hf --dtype bf16"):
        plan_layout(config, ParallelLayout(tp=2), {})
    etp = dataclasses.replace(config, weight_quantization=BlockFP8Config(block_size=(4, 12)))
    with pytest.raises(ConversionError, match=r"layers\.1\.mlp\.experts: expert tensor parallelism splits "
                                              r"ffn_hidden_size 16 into 2 shards of 8, not a multiple .*12 down "):
        plan_layout(etp, ParallelLayout(tp=2, etp=2), {})
    # Whole blocks per shard: the scales are planned as logical tensors cut with their weights.
    plan = plan_layout(etp, ParallelLayout(tp=2, ep=2), {})
    assert plan.tensors["layers.0.self_attn.kv_b_proj.weight_scale_inv"].regions == (((0, 0), (7, 2)),
                                                                                    ((7, 0), (7, 2)))
    assert plan.tensors["layers.1.mlp.experts.5.down_proj.weight_scale_inv"].global_shape == (8, 2)


def test_training_a_kept_model_is_refused(demo, tmp_path, capsys):
    import json

    from megamoe.cli.launch import run_script
    config = kept_case("deepseek_v3")[0]
    path = tmp_path / "kept.json"
    path.write_text(json.dumps(config.to_dict()))
    argv = ["--work-dir", tmp_path / "work", "--save-dir", tmp_path / "ckpt", "--model-config", path]
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and not out and not (tmp_path / "work").exists(), err
    assert lines[0].startswith("pretrain_moe.py: error: --model-config ") and "import-hf --dtype bf16" in lines[0]
