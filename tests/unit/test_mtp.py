"""DeepSeek-V3 multi-token prediction (megamoe.models.mtp): HF checkpoints with MTP layers (built here: transformers
saves none) import and export bit-exact under tp2 / pp2 / ep2, the main logits stay transformers', the MTP forward,
loss and gradients equal a plain-torch reference of the formula, and a training step under tp2 / pp2 / ep2 equals
one process."""

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from megamoe.hf.adapters import AdapterError, adapter_for
from megamoe.models import GPTMoEModel
from megamoe.models.hf_loading import load_logical_state
from megamoe.models.mtp import mtp_targets
from parallel_state import ParallelState
from tests.helpers.hf_models import V, lazy_transformers
from tests.helpers.mtp import DEPTHS, L, S, _config, _ids, _labels, _save_hf_with_mtp, hf_tensors

# The spawned ranks import this module for their worker: what only this process runs (conversion CLI, generation,
# whose torch.compile pulls in inductor) is imported where it is used.

pytestmark = pytest.mark.usefixtures("one_thread")
ATOL = 1e-4


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference(hf_dir, hf, ids):
    """Plain torch over transformers' modules: (main logits, [depth k's logits]) by the formula of
    megamoe.models.mtp, reading the MTP weights straight from the HF file; differentiable into ``hf``."""
    t = lazy_transformers()
    state = hf_tensors(hf_dir)
    cfg = hf.config
    captured = {}
    handle = hf.model.norm.register_forward_hook(lambda module, args, out: captured.update(h=out) and None)
    main = hf(input_ids=ids).logits
    handle.remove()
    h, eps = captured["h"], cfg.rms_norm_eps
    B = ids.shape[0]
    positions = torch.arange(S).expand(B, S)
    causal = torch.full((S, S), float("-inf")).triu(1).expand(B, 1, S, S)
    depths = []
    for k in range(1, DEPTHS + 1):
        p = f"model.layers.{L + k - 1}."
        layer = t.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(cfg, L + k - 1).eval()
        fused = {}
        E = cfg.n_routed_experts
        for name in layer.state_dict():
            if name == "mlp.experts.gate_up_proj":
                fused[name] = torch.stack([torch.cat([state[f"{p}mlp.experts.{e}.gate_proj.weight"],
                                                      state[f"{p}mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
            elif name == "mlp.experts.down_proj":
                fused[name] = torch.stack([state[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(E)])
            else:
                fused[name] = state[p + name]
        layer.load_state_dict(fused)
        tokens = torch.cat([ids[:, k:], torch.zeros(B, k, dtype=ids.dtype)], dim=1)     # t[i + k], 0 past the end
        embeds = hf.model.embed_tokens(tokens)           # the main embedding: shared
        x = torch.cat([_rms(embeds, state[p + "enorm.weight"], eps), _rms(h, state[p + "hnorm.weight"], eps)], -1)
        x = x @ state[p + "eh_proj.weight"].t()
        rope = hf.model.rotary_emb(x, positions)
        out = layer(x, attention_mask=causal, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        h = _rms(out, state[p + "shared_head.norm.weight"], eps)
        depths.append(hf.lm_head(h))                     # the main output layer: shared
    return main, depths


def _transformers_mtp_logits(hf, ids, monkeypatch, depths=DEPTHS):
    """transformers 5.24's own MTP module (``modeling_layers.MtpModel``, which its ``generate(use_mtp=True)``
    drafts with) on our checkpoint: each depth's logits over the whole sequence, position i embedding
    t[i + k] at RoPE position i, from the final norm's output of the main model."""
    from transformers.modeling_layers import MtpModel
    # Its DeepSeek-V3 MTP key pattern names layer 61 (the full model's); the tiny model's are 3 and 4.
    layers = hf.config.num_hidden_layers
    monkeypatch.setattr(hf, "_keys_to_ignore_on_load_unexpected", [rf"model\.layers\.{layers + k}\..*"
                                                                    for k in range(depths)])
    mtp = MtpModel.from_pretrained(hf).eval()
    B = ids.shape[0]
    positions = torch.arange(S).expand(B, S)
    hidden = hf(input_ids=ids, output_hidden_states=True).hidden_states[-1]        # after the final norm
    logits = []
    for k in range(1, depths + 1):
        tokens = torch.cat([ids[:, k:], torch.zeros(B, k, dtype=ids.dtype)], dim=1)
        hidden = mtp.forward_layer(k - 1, hidden, positions, None, input_ids=tokens)
        logits.append(mtp._project_to_logits(hidden))
    return logits


def _hf_model(hf_dir):
    t = lazy_transformers()
    return t.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()


def _plain_loss(main, depths, labels, coeff):
    """The main mean token loss + coeff * the mean over depths of each depth's mean token loss, where depth k's
    target at i is labels[i + k] (none past the end)."""
    loss = F.cross_entropy(main.flatten(0, 1), labels.flatten(), ignore_index=-100)
    mtp = []
    for k, logits in enumerate(depths, start=1):
        valid = labels[:, k:] != -100
        mtp.append(F.cross_entropy(logits[:, :S - k][valid], labels[:, k:][valid]))
    return loss + coeff * torch.stack(mtp).mean() if mtp else loss


# ----------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------
def test_config_and_targets(mtp_hf_dir):
    from megamoe.hf.import_hf import model_config_from_hf
    config = _config(mtp_hf_dir)
    assert config.mtp_num_layers == DEPTHS and list(config.mtp_layer_ids) == [3, 4]
    assert {3, 4} <= set(config.moe_layer_ids)           # MoE by DeepSeek's rule (i >= first_k_dense_replace)
    # config.json declares an MTP layer (transformers writes 1) but the weights hold none: none is built.
    plain = json.loads((mtp_hf_dir / "config.json").read_text())
    main_keys = [k for k in hf_tensors(mtp_hf_dir) if not k.startswith(("model.layers.3.", "model.layers.4."))]
    assert model_config_from_hf(plain, "x", hf_keys=main_keys).mtp_num_layers == 0
    assert model_config_from_hf({**plain, "num_nextn_predict_layers": 0}, "x", hf_keys=[]).mtp_num_layers == 0
    assert model_config_from_hf(plain, "x").mtp_num_layers == 0          # a config.json alone: none
    with pytest.raises(ValueError, match="mtp_num_layers"):
        dataclasses.replace(config, mtp_num_layers=-1)
    with pytest.raises(ValueError, match="mtp_loss_coeff"):
        dataclasses.replace(config, mtp_loss_coeff=float("nan"))
    # Targets: labels[i + k], none past the end, none across documents, ignored labels stay ignored.
    labels = torch.tensor([[10, 11, -100, 13, 14, 15]])
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert mtp_targets(labels, 1).tolist() == [[11, -100, 13, 14, 15, -100]]
    assert mtp_targets(labels, 2, docs).tolist() == [[-100, -100, -100, 15, -100, -100]]


def test_mtp_forward_loss_and_gradients_match_plain_torch(mtp_hf_dir, monkeypatch):
    hf = _hf_model(mtp_hf_dir)
    config = dataclasses.replace(_config(mtp_hf_dir, expert_backend="torch"), mtp_loss_coeff=0.3)
    model = GPTMoEModel(config, ParallelState.single_process())
    logical = adapter_for("deepseek_v3").hf_to_megamoe(hf_tensors(mtp_hf_dir), config)
    assert load_logical_state(model, logical) == []
    ids = _ids()
    main_ref, depths_ref = _reference(mtp_hf_dir, hf, ids)

    # The main logits are transformers' (the MTP layers change nothing there), eval and train mode alike.
    model.eval()
    with torch.no_grad():
        logits, _ = model(ids)
        hidden, _ = model.run_layers(ids)
        states, _ = model.mtp_hidden_states(hidden, ids)
        theirs = _transformers_mtp_logits(hf, ids, monkeypatch)
    assert (logits - main_ref).abs().max().item() <= ATOL
    for k, (state, expected, transformers_logits) in enumerate(zip(states, depths_ref, theirs), start=1):
        ours = model.logits(state, norm=False)
        diff = (ours - expected).abs().max().item()
        assert diff <= ATOL, f"depth {k}: MTP logits differ from the plain-torch formula by {diff:.2e}"
        diff = (ours - transformers_logits).abs().max().item()
        assert diff <= ATOL, f"depth {k}: MTP logits differ from transformers' MtpModel by {diff:.2e}"
    labels = _labels(ids)
    with torch.no_grad():
        eval_loss, _ = model(ids, labels=labels)         # eval: the language-model loss alone
    assert abs(eval_loss.item() - _plain_loss(main_ref, [], labels, 0.0).item()) <= 1e-5

    # Training: loss and gradients (shared embedding and head included) equal the plain-torch computation's.
    model.train()
    loss, _ = model(ids, labels=labels)
    loss.backward()
    hf.zero_grad()
    main_ref, depths_ref = _reference(mtp_hf_dir, hf, ids)
    expected = _plain_loss(main_ref, depths_ref, labels, 0.3)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5, (loss.item(), expected.item())
    params = dict(model.named_parameters())
    for ours, theirs in (("embed_tokens.weight", hf.model.embed_tokens.weight), ("lm_head.weight", hf.lm_head.weight),
                         ("layers.0.self_attn.o_proj.weight", hf.model.layers[0].self_attn.o_proj.weight)):
        diff = (params[ours].grad - theirs.grad).abs().max().item()
        assert diff <= 1e-5, f"{ours}: gradient differs by {diff:.2e}"
    assert params["layers.4.eh_proj.weight"].grad.abs().max() > 0


def test_bad_mtp_copies_and_missing_layers_fail(mtp_hf_dir):
    config = _config(mtp_hf_dir)
    adapter = adapter_for("deepseek_v3")
    state = hf_tensors(mtp_hf_dir)
    bad = dict(state)
    bad["model.layers.3.embed_tokens.weight"] = bad["model.layers.3.embed_tokens.weight"] + 1
    with pytest.raises(AdapterError, match=r"model.layers.3.embed_tokens.weight.*differs from 'model.embed_tokens"):
        adapter.hf_to_megamoe(bad, config)
    missing = {k: v for k, v in state.items() if k != "model.layers.4.eh_proj.weight"}
    with pytest.raises(AdapterError, match="layers.4.eh_proj.weight"):
        adapter.hf_to_megamoe(missing, config)


@pytest.mark.parametrize("layout", [["--tp", 2, "--pp", 1, "--ep", 1], ["--tp", 1, "--pp", 2, "--ep", 1],
                                    ["--tp", 1, "--pp", 1, "--ep", 2, "--num-expert-slots", 12]],
                         ids=["tp2", "pp2", "ep2"])
def test_round_trip_is_bit_exact(mtp_hf_dir, tmp_path, layout, capsys):
    from tests.helpers.hf_checkpoints import assert_same_tensors, convert
    assert convert("import-hf", mtp_hf_dir, tmp_path / "ckpt", *layout) == 0
    if "--pp" in layout and layout[layout.index("--pp") + 1] == 2:
        assert convert("inspect", tmp_path / "ckpt") == 0
        assert "3 layers + 2 MTP" in capsys.readouterr().out
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "hf_out") == 0
    assert_same_tensors(hf_tensors(tmp_path / "hf_out"), hf_tensors(mtp_hf_dir), f"import {layout} -> export")
    assert json.loads((tmp_path / "hf_out" / "config.json").read_text()) == json.loads(
        (mtp_hf_dir / "config.json").read_text())


def test_import_refuses_differing_copies(mtp_hf_dir, tmp_path, capsys):
    from tests.helpers.hf_checkpoints import convert
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(mtp_hf_dir):
        if name != "model.safetensors":
            (bad / name).write_bytes((mtp_hf_dir / name).read_bytes())
    state = hf_tensors(mtp_hf_dir)
    state["model.layers.4.shared_head.head.weight"] = state["model.layers.4.shared_head.head.weight"] * 2
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    assert convert("import-hf", bad, tmp_path / "ckpt", "--tp", 1, "--pp", 1, "--ep", 1) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "error:" in err and "model.layers.4.shared_head.head.weight" in err, err
    assert not os.path.exists(tmp_path / "ckpt")


def test_mtp_draft_generation_is_plain_greedy(mtp_hf_dir, monkeypatch):
    """Self-speculative decoding gives plain greedy's tokens with the MTP layers' own drafts (random weights:
    mostly rejected), with drafts forced right (every one kept) and with only depth 1 forced right (partial
    acceptance): the cache roll-backs and commits are exercised every way."""
    from megamoe.inference import mtp_draft
    from megamoe.inference.generation import GenerationConfig, generate
    config = _config(mtp_hf_dir, expert_backend="torch")
    logical = adapter_for("deepseek_v3").hf_to_megamoe(hf_tensors(mtp_hf_dir), config)
    # A padded vocabulary (V = 64 -> 96 rows): the padding never wins a draft or a verification.
    padded = GPTMoEModel(dataclasses.replace(config, make_vocab_size_divisible_by=48),
                         ParallelState.single_process()).eval()
    load_logical_state(padded, logical)
    model = GPTMoEModel(config, ParallelState.single_process()).eval()
    load_logical_state(model, logical)
    prompts, new = [[5, 9, 2, 7, 11], [3]], 10
    plain = generate(model, ParallelState.single_process(), prompts, GenerationConfig(max_new_tokens=new)).token_ids
    for prompt, expected in zip(prompts, plain):
        out = mtp_draft.generate_with_mtp_draft(model, prompt, new)
        assert out.token_ids == expected and out.finish_reason == "length"
        assert mtp_draft.generate_with_mtp_draft(padded, prompt, new).token_ids == expected
        assert out.drafted > 0 and out.main_forwards <= new
        stop = expected[4]
        first = expected.index(stop)
        stopped = mtp_draft.generate_with_mtp_draft(model, prompt, new, stop_token_ids=[stop])
        assert stopped.token_ids == expected[:first + 1] and stopped.finish_reason == "stop"
    # What generate() refuses (the model has 64 positions, a vocabulary of 64).
    with pytest.raises(ValueError, match=r"max_new_tokens 60 needs 65 positions, more than the model's 64"):
        mtp_draft.generate_with_mtp_draft(model, prompts[0], 60)
    with pytest.raises(ValueError, match=r"stop_token_ids \[64\] are outside the model's vocabulary"):
        mtp_draft.generate_with_mtp_draft(model, prompts[0], new, stop_token_ids=[64])

    # Forced drafts: the oracle is plain greedy's continuation. forward_mtp records (depth, last position).
    seen = {}
    real_argmax = mtp_draft._argmax
    for k, layer_id in enumerate(model.mtp_layer_ids, start=1):
        layer = model.layers[str(layer_id)]
        real = layer.forward_mtp

        def recording(embeds, previous, positions, *args, _real=real, _k=k, **kwargs):
            seen["last"] = (_k, int(positions[0, -1]))
            return _real(embeds, previous, positions, *args, **kwargs)
        monkeypatch.setattr(layer, "forward_mtp", recording)
    for right_depths in ({1, 2}, {1}):
        for prompt, expected in zip(prompts, plain):
            full = prompt + expected + [0] * 4

            def oracle(model_, hidden, norm=True, _full=full, _right=right_depths):
                if norm:
                    return real_argmax(model_, hidden, norm)
                k, last = seen["last"]              # position n - 1 of depth k drafts x[n + k]
                token = _full[last + 1 + k]
                return torch.tensor([token if k in _right else (token + 1) % V])
            monkeypatch.setattr(mtp_draft, "_argmax", oracle)
            out = mtp_draft.generate_with_mtp_draft(model, prompt, new)
            assert out.token_ids == expected, (right_depths, prompt)
            if right_depths == {1, 2}:
                assert out.accepted == out.drafted and out.main_forwards == 1 + math.ceil((new - 1) / 3)
            else:
                assert 0 < out.accepted < out.drafted


def test_glm_mtp_layer_imports_runs_as_transformers_and_round_trips(tmp_path, monkeypatch):
    """GLM-4.5 stores its MTP layer as DeepSeek-V3 does (over GQA attention with partial rotary): imported,
    its logits are transformers' MtpModel's, and import -> export is bit-exact under tp 2 x ep 2."""
    from tests.helpers.hf_checkpoints import assert_same_tensors, convert
    hf_dir = _save_hf_with_mtp(tmp_path / "glm4_moe", "glm4_moe", 1)
    config = _config(hf_dir, expert_backend="torch")
    assert config.mtp_num_layers == 1 and config.num_layers in config.moe_layer_ids
    model = GPTMoEModel(config, ParallelState.single_process()).eval()
    assert load_logical_state(model, adapter_for("glm4_moe").hf_to_megamoe(hf_tensors(hf_dir), config)) == []
    hf = _hf_model(hf_dir)
    ids = _ids()
    with torch.no_grad():
        logits, _ = model(ids)
        assert (logits - hf(input_ids=ids).logits).abs().max().item() <= ATOL
        states, _ = model.mtp_hidden_states(model.run_layers(ids)[0], ids)
        diff = (model.logits(states[0], norm=False) - _transformers_mtp_logits(hf, ids, monkeypatch, 1)[0]).abs().max()
    assert diff.item() <= ATOL, f"GLM MTP logits differ from transformers' MtpModel by {diff:.2e}"
    assert convert("import-hf", hf_dir, tmp_path / "ckpt", "--tp", 2, "--pp", 1, "--ep", 2) == 0
    assert convert("export-hf", tmp_path / "ckpt", tmp_path / "out") == 0
    assert_same_tensors(hf_tensors(tmp_path / "out"), hf_tensors(hf_dir), "glm4_moe MTP import -> export")
