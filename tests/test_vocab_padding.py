"""Any vocabulary size under any TP size (megamoe.tensor_parallel.vocab_padding): the embedding and output
layer are padded internally, the padding is invisible. The oracle is one process without padding.

- The padded size, the padded ShardSpec (real rows only in the chunk), the vocab-parallel cross entropy
  given padding columns that would win (it equals the unpadded loss, zero gradient on the padding).
- One process: a model padded to 72 rows equals the unpadded one in logits, loss, gradients (zero on the
  padding rows), checkpoint chunks, greedy and sampled generation.
- One spawn of 4 ranks: vocab 67 (untied) and 61 (tied) under tp 2, tp 4, tp 2 + SP (padded by
  make_vocab_size_divisible_by 4) and tp 2 + pp 2: logits, loss, every synchronised gradient, greedy and
  sampled generation equal one process; an HF qwen3_moe with vocab 67 imported under --tp 3 loads under
  tp 4 / 2 / 1 with transformers' logits, and reshards (--tp 4, then --tp 2) and exports bit-exact.
"""

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megamoe.cli.convert import main
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.inference.generation import GenerationConfig, generate
from megamoe.inference.pipeline_forward import pipeline_logits
from megamoe.inference.sampling import SamplingConfig
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.models.gpt_moe import expert_token_replicas
from megamoe.models.hf_loading import gather_logical_state, load_logical_state
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.sharding import ShardSpec, get_shard_spec
from megamoe.spawned_ranks import run_on_ranks
from megamoe.tensor_parallel import initialize_parameters, vocab_parallel_cross_entropy
from megamoe.tensor_parallel.vocab_padding import padded_vocab_size
from megamoe.training.grad_sync import GradientSync
from megamoe.training.memory_estimate import stage_parameters
from megamoe.transformer import AttentionConfig, RopeConfig
from megamoe.transformer.mlp import MLPConfig
from parallel_state import ParallelState

pytestmark = pytest.mark.usefixtures("one_thread")

H, S, B = 32, 8, 2
SOLO = ParallelState.single_process()
PROMPTS = [[5, 9, 12, 3, 40], [22, 8], [33, 17, 60]]
NEW = 4
SAMPLING = SamplingConfig(temperature=0.9, top_k=20, top_p=0.95, seed=3)
REL_TOL = 2e-6          # fp32: another summation order only
ATOL = 1e-4             # against transformers


def config(vocab: int, *, tie: bool, divisible_by: int = 1, sp: bool = False) -> GPTMoEConfig:
    """Two layers (dense, MoE), weights N(0, 0.5^2) so that the logits spread (a padding logit of 0
    would win a real one often if it were not masked)."""
    return GPTMoEConfig(
        family="custom", vocab_size=vocab, hidden_size=H, num_layers=2,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  rope=RopeConfig(dim=8)),
        moe=MoEConfig(router=RouterConfig(hidden_size=H, num_experts=4, top_k=2), ffn_hidden_size=16,
                      dispatcher="allgather", expert_backend="torch"),
        moe_layer_ids=(1,), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=32), tie_word_embeddings=tie,
        init_std=0.5, sequence_parallel=sp, make_vocab_size_divisible_by=divisible_by)


def batch(vocab: int):
    ids = torch.randint(0, vocab, (B, S + 1), generator=torch.Generator().manual_seed(vocab))
    return ids[:, :-1], ids[:, 1:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _grad_chunks(model) -> list:
    """(logical name, offsets, gradient) of every chunk the model holds: its gradients cut exactly like its
    weights (the parameters' data swapped with their gradients while the chunks are listed)."""
    params = [p for p in model.parameters() if p.grad is not None]
    for p in params:
        p.data, p.grad = p.grad, p.data
    try:
        return [(c.name, c.offsets, c.tensor.clone()) for c in sharded_state_dict(model)]
    finally:
        for p in params:
            p.data, p.grad = p.grad, p.data


def _padding_grads_are_zero(model) -> bool:
    """Whether the padding rows of the embedding / output layer have exactly zero gradient."""
    for module in (getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)):
        if module is not None and module.weight.grad is not None:
            real = get_shard_spec(module.weight).logical_shape[0]
            if module.weight.grad[real:].count_nonzero():
                return False
    return True


def _generated(model, state) -> tuple[list, list]:
    greedy = generate(model, state, PROMPTS, GenerationConfig(max_new_tokens=NEW)).token_ids
    sampled = generate(model, state, PROMPTS, GenerationConfig(max_new_tokens=NEW, sampling=SAMPLING)).token_ids
    return greedy, sampled


def reference(vocab: int, *, tie: bool) -> dict:
    """One process, no padding: logits, loss, logical gradients, generated tokens, and the weights."""
    model = GPTMoEModel(config(vocab, tie=tie), SOLO)
    initialize_parameters(model, seed=vocab)
    inputs, labels = batch(vocab)
    with torch.no_grad():
        logits = pipeline_logits(model, SOLO, inputs)
    loss, _ = model(inputs, labels=labels)
    loss.backward()
    grads = {name: grad for name, _, grad in _grad_chunks(model)}
    return dict(logical=gather_logical_state(model), logits=logits, loss=loss.detach(), grads=grads,
                generated=_generated(model, SOLO))


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


# ----------------------------------------------------------------------------------------------
# 4 ranks
# ----------------------------------------------------------------------------------------------
# name -> (layout sizes, sequence parallel, make_vocab_size_divisible_by)
LAYOUTS = {
    "tp2": (dict(tp=2), False, 1),
    "tp4": (dict(tp=4), False, 1),
    "tp2-sp": (dict(tp=2), True, 4),
    "tp2-pp2": (dict(tp=2, pp=2), False, 1),
}
VOCABS = {67: False, 61: True}       # vocab -> tied embeddings
CHECKPOINT_LAYOUTS = {"tp4": dict(tp=4), "tp2": dict(tp=2), "tp1": dict()}


def _loss_and_backward(model, state, inputs, labels):
    """The micro-batch's loss (last stage; None elsewhere) after the backward through the pipeline."""
    if state.pp.size == 1:
        loss, _ = model(inputs, labels=labels)
        loss.backward()
        return loss.detach()
    if state.is_first_pp_stage:
        hidden, _ = model(inputs)
        dist.send(hidden.detach().contiguous(), dst=state.pp_next_rank)
        grad = torch.empty_like(hidden)
        dist.recv(grad, src=state.pp_next_rank)
        hidden.backward(grad)
        return None
    hidden = torch.empty(B, S, H)
    dist.recv(hidden, src=state.pp_prev_rank)
    hidden.requires_grad_()
    loss, _ = model(hidden, labels=labels)
    loss.backward()
    dist.send(hidden.grad.contiguous(), dst=state.pp_prev_rank)
    return loss.detach()


def _layouts_worker(rank, world_size, references, checkpoint, hf_case):
    from megamoe.checkpoint.model_loading import build_model_from_checkpoint
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    results = []
    for name, (sizes, sp, divisible_by) in LAYOUTS.items():
        state = initialize_model_parallel(**sizes)
        for vocab, want in references.items():
            model = GPTMoEModel(config(vocab, tie=VOCABS[vocab], divisible_by=divisible_by, sp=sp), state)
            load_logical_state(model, want["logical"])
            inputs, labels = batch(vocab)
            with torch.no_grad():
                logits = pipeline_logits(model.without_sequence_parallel(), state, inputs)
            loss = _loss_and_backward(model, state, inputs, labels)
            GradientSync(model, state, tied_params=model.tied_parameters(),
                         expert_token_replicas=expert_token_replicas(model.config, state)).sync()
            grad_errors = {n: _rel(g, want["grads"][n][tuple(slice(o, o + s) for o, s in zip(offsets, g.shape))])
                           for n, offsets, g in _grad_chunks(model)}
            results.append(dict(
                case=f"vocab {vocab} under {name}", logits=_rel(logits, want["logits"]),
                loss=None if loss is None else _rel(loss, want["loss"]), grads=grad_errors,
                padding_grads_zero=_padding_grads_are_zero(model),
                generated=_generated(model.without_sequence_parallel(), state) == want["generated"]))
        destroy_model_parallel()
    for name, sizes in CHECKPOINT_LAYOUTS.items():       # written under tp 3 by megamoe-convert
        state = initialize_model_parallel(**sizes)
        model = build_model_from_checkpoint(checkpoint, state, expert_backend="torch")
        logits = pipeline_logits(model.eval(), state, hf_case[0])
        results.append(dict(case=f"checkpoint of tp 3 under {name}", hf_diff=(logits - hf_case[1]).abs().max().item()))
        destroy_model_parallel()
    return results


def _save_hf_vocab_67(directory):
    """A tiny random untied qwen3_moe of vocabulary 67, 12 query heads and one KV head (so tp 1 to 4 split it);
    returns (ids, its logits)."""
    from test_convert import SIDE_FILES
    from test_hf_families import hf_config, lazy_transformers
    cfg = hf_config("qwen3_moe")
    cfg.vocab_size, cfg.tie_word_embeddings = 67, False
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 12, 1, 4
    torch.manual_seed(0)
    model = lazy_transformers().AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(67)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=g) * 0.2
            tensor.copy_(1.0 + noise if "norm" in name else noise)
        ids = torch.randint(0, 67, (2, 9), generator=g)
        logits = model(input_ids=ids).logits
    model.save_pretrained(directory)
    for name, text in SIDE_FILES.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)
    return ids, logits


@pytest.mark.slow
def test_any_vocabulary_under_tensor_parallel_layouts(tmp_path):
    from test_convert import assert_same_tensors, hf_tensors
    hf_dir, ckpt = tmp_path / "hf", {tp: str(tmp_path / f"ckpt_tp{tp}") for tp in (2, 3, 4)}
    hf_ids = _save_hf_vocab_67(hf_dir)
    common = ["--pp", 1, "--ep", 1, "--etp", 1, "--dispatcher", "allgather"]
    assert main([str(a) for a in ("import-hf", hf_dir, ckpt[3], "--tp", 3, *common)]) == 0
    assert main([str(a) for a in ("reshard", ckpt[3], ckpt[4], "--tp", 4, *common)]) == 0
    assert main([str(a) for a in ("reshard", ckpt[4], ckpt[2], "--tp", 2, *common)]) == 0
    original = hf_tensors(hf_dir)
    assert original["model.embed_tokens.weight"].shape == original["lm_head.weight"].shape == (67, H)
    for tp in (4, 2):
        assert main([str(a) for a in ("export-hf", ckpt[tp], tmp_path / f"hf_tp{tp}")]) == 0
        assert_same_tensors(hf_tensors(tmp_path / f"hf_tp{tp}"), original,
                            f"import --tp 3 -> reshard --tp {tp} -> export")

    # The padding is an engine choice: a checkpoint trained with any still describes the HF config.
    from megamoe.hf.export_hf import check_hf_config_describes
    from megamoe.hf.import_hf import model_config_from_hf
    hf_config = json.loads((hf_dir / "config.json").read_text())
    padded = dataclasses.replace(model_config_from_hf(hf_config, "config.json"), make_vocab_size_divisible_by=128)
    check_hf_config_describes(hf_config, padded, "here", "the checkpoint")

    references = {vocab: reference(vocab, tie=tie) for vocab, tie in VOCABS.items()}
    results = [r for per_rank in run_on_ranks(_layouts_worker, 4, args=(references, ckpt[3], hf_ids))
               for r in per_rank]
    checked = set()
    for r in results:
        case = r["case"]
        checked.add(case)
        if "hf_diff" in r:
            assert r["hf_diff"] <= ATOL, f"{case}: logits differ from transformers by {r['hf_diff']:.2e}"
            continue
        assert r["logits"] <= REL_TOL, f"{case}: logits differ by {r['logits']:.2e} (relative)"
        assert r["loss"] is None or r["loss"] <= REL_TOL, f"{case}: loss differs by {r['loss']:.2e}"
        bad = {n: e for n, e in r["grads"].items() if not e <= REL_TOL}
        assert not bad, f"{case}: gradients differ: {bad}"
        assert r["padding_grads_zero"], f"{case}: a padding row got a gradient"
        assert r["generated"], f"{case}: generated tokens differ from one process"
    expected = {f"vocab {v} under {n}" for v in VOCABS for n in LAYOUTS}
    assert checked == expected | {f"checkpoint of tp 3 under {n}" for n in CHECKPOINT_LAYOUTS}
    # every rank of the last stage reported its loss
    assert sum(r.get("loss") is not None for r in results) == 4 * len(VOCABS) * (len(LAYOUTS) - 1) + 2 * len(VOCABS)
