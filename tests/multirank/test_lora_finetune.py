"""LoRA fine-tuning end to end (issue 32 item 4, last case): a tiny HF Qwen3-MoE fine-tuned on a chat JSONL file with
LoRA under EP 2 (torchrun, 2 ranks), exported for peft (``--export-peft``) and merged (``--export-hf``). The PEFT
export loaded with peft and the merged export loaded with transformers give the logits of megamoe's model loaded from
the run's checkpoint, and the assistant-token loss on held-out chats falls."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.hf_models import lazy_transformers
from tests.helpers.lora_finetune import chats, save_tiny_qwen3_moe, write_chats

REPO = Path(__file__).resolve().parents[2]
STEPS = 20
TOL = 1e-4          # fp32 logits (the merged weights round B @ A once more than the adapters do)


def _assistant_loss(model, tokenizer, records) -> float:
    """Mean next-token loss over the assistant tokens (transformers' assistant mask) of ``records``."""
    total, count = 0.0, 0
    for record in records:
        encoded = tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
        ids = torch.tensor([encoded["input_ids"]])
        mask = torch.tensor(encoded["assistant_masks"][1:], dtype=torch.bool)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        total, count = total + losses[mask].sum().item(), count + int(mask.sum())
    return total / count


def _megamoe_logits(checkpoint, ids):
    """megamoe's model loaded from the LoRA run's checkpoint in one process: the base, then its adapters."""
    from megamoe.checkpoint.format import iter_logical_tensors
    from megamoe.checkpoint.model_loading import build_model_from_checkpoint
    from megamoe.lora import LORA_SUFFIXES, LoRAConfig, apply_lora, load_lora_state_dict
    from parallel_state import ParallelState
    record = json.loads((Path(checkpoint) / "hf_files" / "lora.json").read_text())
    model = build_model_from_checkpoint(checkpoint, ParallelState.single_process())
    apply_lora(model, LoRAConfig.from_json(json.dumps(record["config"])))
    load_lora_state_dict(model, {name: tensor.clone() for name, tensor in iter_logical_tensors(checkpoint)
                                 if name.endswith(LORA_SUFFIXES) and not name.startswith("optim.")})
    with torch.no_grad():
        logits, _ = model.eval()(ids)
    return logits


@pytest.mark.slow
def test_lora_fine_tune_on_chats_under_ep2_exports_for_peft_and_transformers(tmp_path):
    from peft import PeftModel
    t = lazy_transformers()
    base_dir = save_tiny_qwen3_moe(tmp_path / "base")
    data = write_chats(tmp_path / "chats.jsonl", chats(96, seed=0))
    held_out = chats(12, seed=1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "megamoe", "train",
           "--hf-model", base_dir, "--data", data, "--lora-rank", "8", "--lora-alpha", "16", "--ep", "2",
           "--steps", STEPS, "--lr", "1e-2", "--seq-len", 128, "--global-batch", 8, "--micro-batch", 4,
           "--work-dir", tmp_path / "work", "--save-dir", tmp_path / "ckpt", "--save-every", STEPS,
           "--sample-tokens", 0, "--expert-backend", "torch", "--export-peft", tmp_path / "peft",
           "--export-hf", tmp_path / "merged"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    run = subprocess.run([str(c) for c in cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    checkpoint, = (tmp_path / "ckpt").glob(f"*{STEPS}")

    tokenizer = t.AutoTokenizer.from_pretrained(base_dir)
    encoded = [tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]
               for r in held_out[:2]]
    ids = torch.tensor([e[:min(map(len, encoded))] for e in encoded])
    ours = _megamoe_logits(checkpoint, ids)
    base = t.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
    before = _assistant_loss(base, tokenizer, held_out)
    merged = t.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    peft_model = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        merged_diff = (merged(input_ids=ids).logits - ours).abs().max().item()
        peft_diff = (peft_model(input_ids=ids).logits - ours).abs().max().item()
    after = _assistant_loss(merged, tokenizer, held_out)
    assert merged_diff <= TOL and peft_diff <= TOL, (merged_diff, peft_diff)
    assert after <= 0.5 * before, f"held-out assistant loss {before:.3f} -> {after:.3f}"
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(adapter_config["target_parameters"])
    print(f"held-out assistant loss {before:.4f} -> {after:.4f}; max |logit diff| merged {merged_diff:.1e}, "
          f"peft {peft_diff:.1e}")
