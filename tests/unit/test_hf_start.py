"""A training run's HF starting and end points: an HF Qwen3-MoE directory loaded in process (1 rank; 2 ranks
with EP 2, replica slots and an expert-load file) gives transformers' logits and reads only each rank's
tensors; --model-config takes an HF config.json or megamoe fields and names the file and field on error;
pretrain_moe.py fine-tunes the HF model on a token file and exports a directory transformers loads, whose
loss on that data has clearly fallen; bad input ends in one error line before any work.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megamoe.data.tokenizer import Tokenizer
from megamoe.cli.launch import run_script
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.training.model_config_file import read_model_config_file
from parallel_state import ParallelState
from tests.helpers.hf_models import V, hf_config, lazy_transformers
from tests.helpers.hf_start import ATOL, _train_args, ids, save_tokenizer


# ----------------------------------------------------------------------------------------------
# In process, one rank
# ----------------------------------------------------------------------------------------------
def test_start_from_hf_gives_transformers_logits_and_keeps_the_provenance(hf_dir):
    from megamoe.training.hf_start import start_from_hf
    directory, expected = hf_dir
    model, start = start_from_hf(directory, ParallelState.single_process(), expert_backend="torch",
                                 num_expert_slots=12)
    with torch.no_grad():
        logits, _ = model.eval()(ids())
    assert (logits - expected).abs().max().item() <= ATOL
    assert model.config.moe.num_expert_slots == 12 and model.config.family == "qwen3_moe"
    assert model.config.moe.router.aux_loss_coeff > 0, "the training config: the family's balancing loss is on"
    with open(os.path.join(directory, "config.json")) as f:
        assert start.provenance.config == json.load(f)
    assert set(start.provenance.files) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert Tokenizer.from_path(directory).vocab_size <= model.config.vocab_size

    # A run resuming with --hf-model keeps the placements its checkpoint reached (e.g. by rebalancing), where
    # the slots and the EP size match; else it takes the default. Replicas are one expert: the same logits.
    layer_id = model.config.moe_layer_ids[0]
    num_experts = model.config.moe.num_experts
    rebalanced = ExpertPlacement(list(range(num_experts))[::-1] + [0] * (12 - num_experts), num_experts, 1)
    for saved, expected_placement in (({layer_id: rebalanced}, rebalanced),
                                      ({layer_id: ExpertPlacement.default(num_experts, 16, 1)},
                                       ExpertPlacement.default(num_experts, 12, 1))):
        kept, _ = start_from_hf(directory, ParallelState.single_process(), expert_backend="torch",
                                num_expert_slots=12, saved_placements=saved)
        assert kept.moe_layers()[layer_id].placement == expected_placement
        with torch.no_grad():
            assert (kept.eval()(ids())[0] - expected).abs().max().item() <= ATOL


def test_start_from_hf_takes_the_recompute_choice(hf_dir):
    """--hf-model with --recompute: the engine's choice reaches the model, whose loss and gradients stay
    those of the plain model."""
    from megamoe.training.hf_start import start_from_hf
    from megamoe.transformer.recompute import RecomputeConfig
    results = []
    for recompute in (None, RecomputeConfig("full"), RecomputeConfig("selective", ("core_attn", "moe", "layernorm"))):
        model, _ = start_from_hf(hf_dir[0], ParallelState.single_process(), expert_backend="torch",
                                 recompute=recompute)
        assert model.config.recompute == (recompute or RecomputeConfig())
        loss, aux = model(ids(), labels=ids())
        (loss + aux).backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0]) and all(torch.equal(g, r) for g, r in zip(grads, results[0][1]))


def test_hf_start_errors_name_the_problem(hf_dir, tmp_path):
    from megamoe.checkpoint.errors import ConversionError
    from megamoe.training.hf_start import hf_start_config, start_from_hf
    directory, _ = hf_dir
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(Path(directory, "config.json").read_text())
    with pytest.raises(ConversionError, match="no safetensors weights"):
        start_from_hf(tmp_path / "empty", ParallelState.single_process())
    with pytest.raises(ConversionError, match=r"config.json: MoEConfig.num_expert_slots \(7\) must be >= num_experts"):
        hf_start_config(directory, num_expert_slots=7)
    # An absurd size is refused against the weight files' headers before the model is built (allocated).
    shutil.copytree(directory, tmp_path / "huge")
    config = json.loads((tmp_path / "huge" / "config.json").read_text())
    (tmp_path / "huge" / "config.json").write_text(json.dumps({**config, "hidden_size": 10**9}))
    with pytest.raises(ConversionError, match="hidden_size is 1000000000, but model.embed_tokens.weight"):
        hf_start_config(tmp_path / "huge")


def test_start_from_hf_refuses_non_finite_weights_unless_allowed(hf_dir, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    from megamoe.checkpoint.errors import ConversionError
    from megamoe.training.hf_start import start_from_hf
    directory = tmp_path / "nan"
    shutil.copytree(hf_dir[0], directory)
    state = load_file(directory / "model.safetensors")
    key = "model.layers.1.mlp.experts.5.down_proj.weight"
    state[key][3, 4] = float("nan")
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=rf"{key} holds 1 NaN and 0 infinite values \(of 512\); refusing to "
                                              r"load non-finite weights \(pass --allow-non-finite"):
        start_from_hf(directory, ParallelState.single_process(), expert_backend="torch")
    model, _ = start_from_hf(directory, ParallelState.single_process(), expert_backend="torch", allow_non_finite=True)
    assert f"{key} holds 1 NaN" in caplog.text
    assert any(torch.isnan(p).any() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# --model-config files
# ----------------------------------------------------------------------------------------------
def test_model_config_file_reads_hf_configs_and_megamoe_fields(hf_dir, tmp_path):
    from megamoe.models.families import config_from_hf
    directory, _ = hf_dir
    hf = read_model_config_file(os.path.join(directory, "config.json"), num_expert_slots=10, dispatcher="allgather")
    assert hf.config == config_from_hf(hf_config("qwen3_moe"), num_expert_slots=10, dispatcher="allgather")
    assert hf.hf_config["model_type"] == "qwen3_moe"
    fields = hf.config.to_dict()
    del fields["attention"]["kind"]                 # as training checkpoints store it
    (tmp_path / "fields.json").write_text(json.dumps(fields))
    own = read_model_config_file(tmp_path / "fields.json", expert_backend="torch")
    assert own.hf_config is None and own.config.moe.expert_backend == "torch"
    assert own.config.moe.num_expert_slots == 10 and own.config.moe.dispatcher == "allgather"   # the file's
    fields["moe"]["router"]["top_k"] = 99
    (tmp_path / "bad_field.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=r"bad_field.json.*top_k"):
        read_model_config_file(tmp_path / "bad_field.json")
    (tmp_path / "neither.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match=r"neither.json is neither an HF config.json"):
        read_model_config_file(tmp_path / "neither.json")


def _run(demo, argv, capsys):
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    return code, out, err


def _model_config_json(kind):
    """An HF config.json of a DeepSeek-V3 shape, or the megamoe config fields of a Qwen3-MoE one."""
    from megamoe.models.families import config_from_hf
    if kind == "deepseek_v3 config.json":
        return hf_config("deepseek_v3").to_dict()
    return config_from_hf(hf_config("qwen3_moe")).to_dict()


@pytest.mark.parametrize("kind", ["deepseek_v3 config.json", "qwen3_moe megamoe fields"])
def test_model_config_trains_from_scratch_and_exports(demo, kind, hf_dir, token_file, tmp_path, capsys):
    """The exported directory (a config.json written for the family, for megamoe fields) loads in
    transformers and computes what the final checkpoint computes."""
    from megamoe.checkpoint.model_loading import build_model_from_checkpoint
    from megamoe.training.checkpoint import latest_checkpoint
    (tmp_path / "config.json").write_text(json.dumps(_model_config_json(kind)))
    argv = ["--model-config", tmp_path / "config.json", "--tokenizer", hf_dir[0], "--export-hf", tmp_path / "out",
            *_train_args(tmp_path, token_file, 3)]
    code, _, err = _run(demo, argv, capsys)
    assert code == 0, err[-3000:]
    records = [json.loads(line) for line in (tmp_path / "work" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records[1:]] == [1, 2, 3] and all(r["loss"] > 0 for r in records[1:])
    final = latest_checkpoint(tmp_path / "ckpt")
    ours = build_model_from_checkpoint(final, ParallelState.single_process(), expert_backend="torch").eval()
    hf = lazy_transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        diff = (ours(ids())[0] - hf.eval()(input_ids=ids()).logits).abs().max().item()
    assert diff <= ATOL, f"the exported model's logits differ by {diff:.2e}"
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == Path(hf_dir[0], "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == kind.split()[0]


def _bad_inputs(tmp_path, hf_dir):
    (tmp_path / "llama.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (tmp_path / "cut.json").write_text('{"model_type": "qwen3_moe", "hidden_')
    save_tokenizer(tmp_path / "big_tokenizer", extra_words=[f"w{i}" for i in range(V)])
    fields = read_model_config_file(os.path.join(hf_dir, "config.json")).config.to_dict()
    (tmp_path / "fields.json").write_text(json.dumps(fields))
    fields["moe"]["router"]["score_func"] = "sigmoid"           # no qwen3_moe config.json says that
    (tmp_path / "sigmoid.json").write_text(json.dumps(fields))


BAD = {   # name: (arguments, fragments of the error line)
    "unknown family": (["--model-config", "{tmp}/llama.json"],
                       ["--model-config", "llama.json", "model_type 'llama' is not supported", "qwen3_moe"]),
    "bad JSON": (["--model-config", "{tmp}/cut.json"], ["cannot read model config", "cut.json"]),
    "tokenizer too big": (["--hf-model", "{hf}", "--tokenizer", "{tmp}/big_tokenizer"],
                          ["big_tokenizer/tokenizer.json has a vocabulary of 91 tokens", f"vocab_size {V}"]),
    "both models": (["--hf-model", "{hf}", "--model-config", "{tmp}/fields.json"], ["give one of them"]),
    "custom family export": (["--export-hf", "{tmp}/out"], ["family 'custom' has no HuggingFace equivalent"]),
    "inexpressible export": (["--model-config", "{tmp}/sigmoid.json", "--tokenizer", "{hf}", "--export-hf",
                              "{tmp}/out"], ["sigmoid.json", "differing fields: moe.router.score_func"]),
    "export exists": (["--hf-model", "{hf}", "--export-hf", "{hf}"], ["already exists"]),
    "vocab padding": (["--hf-model", "{hf}", "--make-vocab-size-divisible-by", "0"],
                      ["--make-vocab-size-divisible-by must be >= 1, got 0"]),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_model_input_ends_in_one_error_line_before_any_work(demo, case, hf_dir, tmp_path, capsys):
    _bad_inputs(tmp_path, hf_dir[0])
    extra, fragments = BAD[case]
    argv = [a.format(tmp=tmp_path, hf=hf_dir[0]) for a in extra]
    code, out, err = _run(demo, ["--work-dir", tmp_path / "work", "--save-dir", tmp_path / "ckpt", *argv], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("pretrain_moe.py: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_a_resumed_hf_run_reads_no_hf_weights_and_still_exports(demo, hf_dir, token_file, tmp_path, capsys,
                                                                 monkeypatch):
    """The rerun resumes from its checkpoint (which carries the HF provenance): the HF tensors are not
    read again, and the export is the checkpoint's model with the original config.json."""
    import megamoe.training.hf_start as hf_start
    from megamoe.checkpoint.model_loading import build_model_from_checkpoint
    from megamoe.training.checkpoint import latest_checkpoint
    directory, _ = hf_dir
    argv = ["--hf-model", directory, *_train_args(tmp_path, token_file, 2)]
    code, _, err = _run(demo, argv, capsys)
    assert code == 0, err[-3000:]

    def must_not_run(*args, **kwargs):
        raise AssertionError("a resumed run must not read the HF weights")

    monkeypatch.setattr(hf_start, "load_hf_weights", must_not_run)
    argv = ["--hf-model", directory, "--export-hf", tmp_path / "out", *_train_args(tmp_path, token_file, 3)]
    code, _, err = _run(demo, argv, capsys)
    assert code == 0, err[-3000:]
    final = latest_checkpoint(tmp_path / "ckpt")
    assert final.endswith("step_00000003")
    ours = build_model_from_checkpoint(final, ParallelState.single_process(), expert_backend="torch").eval()
    hf = lazy_transformers().AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    with torch.no_grad():
        diff = (ours(ids())[0] - hf.eval()(input_ids=ids()).logits).abs().max().item()
    assert diff <= ATOL, f"the exported model's logits differ by {diff:.2e}"
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads(
        Path(directory, "config.json").read_text())
