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

from megamoe.cli.convert import main
from megamoe.inference.pipeline_forward import pipeline_logits
from megamoe.models import GPTMoEModel
from megamoe.models.gpt_moe import expert_token_replicas
from megamoe.models.hf_loading import load_logical_state
from megamoe.spawned_ranks import run_on_ranks
from megamoe.training.grad_sync import GradientSync
from tests.helpers.vocab_padding import (B, H, REL_TOL, S, _generated, _grad_chunks, _padding_grads_are_zero, _rel,
                                         batch, config, reference)

pytestmark = pytest.mark.usefixtures("one_thread")
ATOL = 1e-4             # against transformers


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
    from tests.helpers.hf_checkpoints import SIDE_FILES
    from tests.helpers.hf_models import hf_config, lazy_transformers
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
    from tests.helpers.hf_checkpoints import assert_same_tensors, hf_tensors
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
