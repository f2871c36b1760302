"""Activation recomputation (megamoe.transformer.recompute): every mode gives the losses and gradients of
``none`` bit for bit (GQA and MLA models with a dense layer, MoE layers and shared experts; the loop and FP8
emulated expert backends too), records expert loads, aux-loss metrics and FP8 amax histories once, keeps
fewer activations for backward (measured with saved-tensor hooks), leaves generation alone, and re-issues
the MoE dispatcher's collectives in backward exactly once (2 ranks, EP 2, counted)."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from megamoe import comms
from megamoe.inference.generation import GenerationConfig, generate
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.experts.fp8 import FP8Config
from megamoe.training.checkpoint import _config_differences
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer.recompute import (RECOMPUTE_MODULES, RecomputeConfig, checkpointed, forward_value,
                                           is_recomputing)
from parallel_state import ParallelState
from tests.helpers.recompute import B, NONE, S, build, model_config, tokens

pytestmark = pytest.mark.usefixtures("one_thread")
MODES = [RecomputeConfig("full"), *(RecomputeConfig("selective", (m,)) for m in RECOMPUTE_MODULES),
         RecomputeConfig("selective", ("core_attn", "moe_act")), RecomputeConfig("selective", RECOMPUTE_MODULES)]


def forward_backward(model, inputs):
    """(loss, aux, {name: grad}, [per-expert load of each MoE layer])."""
    loss, aux = model(inputs, labels=inputs)
    (loss + aux).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    loads = [layer.load_counter.per_expert.clone() for layer in model.moe_layers().values()]
    return loss.detach(), aux.detach(), grads, loads


def assert_identical(got, want, what):
    (loss, aux, grads, loads), (loss0, aux0, grads0, loads0) = got, want
    assert torch.equal(loss, loss0) and torch.equal(aux, aux0), f"{what}: loss {loss} / {loss0}, aux {aux} / {aux0}"
    different = [n for n in grads0 if not torch.equal(grads[n], grads0[n])]
    assert not different, f"{what}: gradients differ for {different}"
    assert all(torch.equal(a, b) for a, b in zip(loads, loads0)), f"{what}: expert loads {loads} != {loads0}"


@pytest.mark.parametrize("attention", ["gqa", "mla", "mla_direct_q"])
def test_every_mode_gives_the_losses_gradients_and_loads_of_none(attention):
    inputs = tokens()
    want = forward_backward(build(model_config(attention)), inputs)
    assert sum(int(load.sum()) for load in want[3]) == 2 * B * S * 2       # 2 MoE layers, top-2: counted once
    for mode in MODES:
        assert_identical(forward_backward(build(model_config(attention, mode)), inputs), want, mode)


@pytest.mark.parametrize("backend,fp8", [("loop", None),
                                         ("fp8_emulated", FP8Config(recipe="delayed", amax_history_len=4))])
def test_other_expert_backends_match_none_and_advance_fp8_histories_once(backend, fp8):
    """Two steps, so that the delayed recipe's second forward quantises with the scale its first recorded:
    a recomputed forward must quantise like its original and push no amax of its own."""
    modes = [RecomputeConfig("full"), RecomputeConfig("selective", ("moe",)),
             RecomputeConfig("selective", ("moe_act",)), RecomputeConfig("selective", ("moe", "moe_act"))]

    def two_steps(mode):
        model = build(model_config(recompute=mode, backend=backend, fp8=fp8))
        steps = [forward_backward(model, tokens(seed)) for seed in (0, 1)]
        for p in model.parameters():
            p.grad = None
        states = [layer.experts.fp8_state for layer in model.moe_layers().values()]
        return steps, [(s.amax_history.clone(), s.scale.clone()) for s in states if s is not None]

    want_steps, want_fp8 = two_steps(NONE)
    if fp8 is not None and fp8.recipe == "delayed":
        assert want_fp8 and all(bool((history[:, :, :2] > 0).all()) for history, _ in want_fp8)   # both steps
    for mode in modes:
        steps, fp8_states = two_steps(mode)
        for got, want in zip(steps, want_steps):
            assert_identical(got, want, f"{backend} {mode}")
        assert all(torch.equal(a, b) and torch.equal(s, t) for (a, s), (b, t) in zip(fp8_states, want_fp8)), mode


def test_trainer_counts_loads_once_and_updates_the_expert_bias_as_with_none():
    def run(mode):
        model = build(model_config(recompute=mode))
        trainer = Trainer(model, ParallelState.single_process(), TrainConfig(lr=1e-2))
        metrics = []
        for seed in (0, 1):
            batch = tokens(seed, batch=4, seq=S + 1)
            metrics.append(trainer.train_step([(mb[:, :-1], mb[:, 1:]) for mb in batch.split(B)]))
        biases = [layer.router.expert_bias.clone() for layer in model.moe_layers().values()]
        return metrics, biases

    want, want_biases = run(NONE)
    assert all(sum(m.tokens_per_expert) == 4 * S * 2 for step in want for m in step.moe_layers.values())
    assert any(bool(b.abs().sum() > 0) for b in want_biases)               # the bias did move
    for mode in (RecomputeConfig("full"), RecomputeConfig("selective", ("moe", "moe_act", "layernorm"))):
        got, biases = run(mode)
        for g, w in zip(got, want):
            assert (g.loss, g.aux_loss, g.grad_norm) == (w.loss, w.aux_loss, w.grad_norm), mode
            assert {i: (m.aux_loss, m.tokens_per_expert) for i, m in g.moe_layers.items()} == \
                   {i: (m.aux_loss, m.tokens_per_expert) for i, m in w.moe_layers.items()}, mode
        assert all(torch.equal(b, c) for b, c in zip(biases, want_biases)), mode


def saved_activation_bytes(config, inputs) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one forward, parameters excluded."""
    model = build(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, aux = model(inputs, labels=inputs)
    (loss + aux).backward()
    return sum(storages.values())


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_recomputation_keeps_fewer_activations(attention):
    inputs = tokens(seq=32)
    saved = {mode: saved_activation_bytes(model_config(attention, mode), inputs) for mode in [NONE, *MODES]}
    full, core_attn = saved[RecomputeConfig("full")], saved[RecomputeConfig("selective")]
    assert full < core_attn < saved[NONE], saved
    assert full < 0.2 * saved[NONE], saved                                 # layer inputs only (3 layers)
    for module in RECOMPUTE_MODULES:
        alone = saved[RecomputeConfig("selective", (module,))]
        if module == "mla_up_proj" and attention == "gqa":
            assert alone == saved[NONE]                                    # GQA has no up projections
        else:
            assert alone < saved[NONE], (module, saved)
    assert saved[RecomputeConfig("selective", RECOMPUTE_MODULES)] < saved[RecomputeConfig("selective", ("core_attn",
                                                                                                       "moe_act"))]


def test_a_custom_attention_without_the_flag_is_named_in_a_warning(caplog):
    from megamoe.models import LayerSpec
    from megamoe.transformer import Attention

    class WrappedAttention(torch.nn.Module):        # no recompute_core_attn flag of its own
        def __init__(self, config, *, tp_group=None, device=None, dtype=None):
            super().__init__()
            self.inner = Attention(config, tp_group=tp_group, device=device, dtype=dtype)

        def forward(self, hidden, position_ids, kv_cache=None, attention_mask=None, position_embeddings=None,
                    document_ids=None):
            return self.inner(hidden, position_ids, kv_cache, attention_mask, position_embeddings,
                              document_ids=document_ids)

    with caplog.at_level("WARNING", logger="megamoe.transformer.recompute"):
        GPTMoEModel(model_config(recompute=RecomputeConfig("selective", ("core_attn", "moe"))),
                    ParallelState.single_process(), layer_spec=LayerSpec(attention=WrappedAttention))
    messages = [r.getMessage() for r in caplog.records]
    # One per layer, for core_attn only: moe is recomputed by the decoder layer itself.
    assert len(messages) == 3 and all(m.startswith("core_attn: WrappedAttention has no 'recompute_core_attn' flag")
                                      for m in messages), messages


def test_generation_is_unaffected():
    prompts, config = [[1, 2, 3], [4, 5, 6, 7]], GenerationConfig(max_new_tokens=4)
    state = ParallelState.single_process()
    want = generate(build(model_config("mla")), state, prompts, config).token_ids
    for mode in (RecomputeConfig("full"), RecomputeConfig("selective", RECOMPUTE_MODULES)):
        assert generate(build(model_config("mla", mode)), state, prompts, config).token_ids == want


def test_checkpointed_preserves_the_rng_and_replays_forward_values():
    seen, values = [], iter(range(3, 100))

    def region(x):
        seen.append(is_recomputing())
        return F.dropout(x, 0.5) * forward_value(lambda: next(values))

    x = torch.randn(64, requires_grad=True)
    torch.manual_seed(0)
    region(x).sum().backward()
    want = x.grad.clone()
    x.grad = None
    torch.manual_seed(0)
    checkpointed(region, x).sum().backward()
    # The same dropout mask; the recomputation got the forward's value (4), not a new one (5).
    assert torch.equal(x.grad, want / 3 * 4)
    assert seen == [False, False, True] and not is_recomputing()          # plain, forward, recomputation
    with torch.no_grad():
        checkpointed(region, x)
    assert seen[-1] is False and len(seen) == 4


@pytest.mark.parametrize("kwargs,field", [
    (dict(granularity="some"), "RecomputeConfig.granularity"),
    (dict(granularity="selective", modules=("attention",)), "RecomputeConfig.modules"),
    (dict(granularity="full", modules=("moe",)), "RecomputeConfig.modules"),
    (dict(granularity="selective", modules="moe"), "RecomputeConfig.modules"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RecomputeConfig(**kwargs)


def test_config_defaults_round_trip_and_resume_with_another_choice():
    assert RecomputeConfig("selective").modules == ("core_attn",)
    assert RecomputeConfig("selective", ["moe_act", "core_attn", "moe_act"]).modules == ("core_attn", "moe_act")
    config = model_config("mla", RecomputeConfig("selective", ("moe", "layernorm")))
    assert GPTMoEConfig.from_dict(config.to_dict()) == config
    old = config.to_dict()
    del old["recompute"]                                                   # saved before recomputation existed
    assert GPTMoEConfig.from_dict(old).recompute == NONE
    assert _config_differences(old, config.to_dict()) == []
    assert _config_differences(model_config("mla", RecomputeConfig("full")).to_dict(), config.to_dict()) == []
    with pytest.raises(ValueError, match="recompute"):
        GPTMoEConfig.from_dict({**config.to_dict(), "recompute": {"granularity": "full", "layers": 1}})
    # Export to HF compares the model's fields with the HF config's: recomputation is not one of them.
    from megamoe.hf.export_hf import _model_fields
    assert _model_fields(config) == _model_fields(dataclasses.replace(config, recompute=NONE))


def test_nested_comm_counters_close_by_identity():
    """The per-region counters above nest inside a step's: closing one that saw the same calls as its
    parent (equal dataclasses) must close that one, not the parent."""
    with comms.comm_counter() as outer:
        with comms.comm_counter() as inner:
            pass
        comms._record("all_reduce", None, torch.zeros(4))
    assert (outer.calls(), inner.calls()) == (1, 0) and not comms._active_counters


# ---- the training script: --recompute / --recompute-modules -------------------------------------------
def _train(demo, tmp_path, capsys, config_file, data, tokenizer, steps, *flags):
    from megamoe.cli.launch import run_script
    argv = ["--model-config", config_file, "--tokenizer", tokenizer, "--data", data, "--steps", steps,
            "--seq-len", S, "--global-batch", 4, "--micro-batch", 2, "--lr", "1e-2", "--work-dir", tmp_path / "work",
            "--save-dir", tmp_path / "ckpt", "--save-every", 2, "--sample-tokens", 0, "--expert-backend", "torch",
            *flags]
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    records = [json.loads(line) for line in (tmp_path / "work" / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "step" in r]


@pytest.mark.slow
def test_pretrain_script_recomputes_and_resumes_under_another_choice(demo, tmp_path, capsys):
    """A run with selective recompute resumed under full recompute has the loss curve of a run without."""
    from megamoe.data.token_dataset import build_token_file
    from megamoe.data.tokenizer import Tokenizer
    from tests.helpers.hf_start import save_tokenizer, sentences
    save_tokenizer(tmp_path / "tokenizer")
    build_token_file(sentences(40), Tokenizer.from_path(tmp_path / "tokenizer"), tmp_path / "tokens.bin")
    (tmp_path / "model.json").write_text(json.dumps(model_config("mla").to_dict()))
    common = (tmp_path / "model.json", tmp_path / "tokens.bin", tmp_path / "tokenizer")
    want = _train(demo, tmp_path / "plain", capsys, *common, 3)
    first = _train(demo, tmp_path / "re", capsys, *common, 2, "--recompute", "selective", "--recompute-modules",
                   "core_attn", "moe_act", "layernorm")
    again = _train(demo, tmp_path / "re", capsys, *common, 3, "--recompute", "full")
    assert len(want) == 3 and first + again[2:] == want, (first, again, want)


def test_pretrain_script_recompute_flag_errors_are_one_line(demo, tmp_path, capsys):
    from megamoe.cli.launch import run_script
    code = run_script(demo.main, ["--work-dir", str(tmp_path / "work"), "--recompute", "full", "--recompute-modules",
                                  "moe"], prog=demo.PROG)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "--recompute-modules applies to --recompute selective" in err[0], err
    assert not (tmp_path / "work").exists()
