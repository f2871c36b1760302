"""examples/generate.py as a user meets it: a mistake (missing or damaged checkpoint, a cut manifest, a
missing prompt file or tokenizer, bad --prompt-ids, an output in a missing folder or that is not a
regular file, a layout the world size or the dispatcher cannot run, a prompt or --max-new-tokens past
the model's positions, a temperature, stop token or seed it cannot use, a run the free memory cannot
hold, a write that fails) is ONE ``generate.py: error:`` line naming the problem and the flag, exit
code 1, no traceback, nothing written; without --dispatcher a layout the checkpoint's
dispatcher cannot run picks the one that can (and generates the single-process tokens); decode
tokens/s leave the compile time out; --help shows every default.

The user-error cases run the script's ``__main__`` in this process (runpy): they fail before any
weight is read. Cases that need two ranks go through torchrun (slow).
"""

import dataclasses
import errno
import json
import os
import runpy
import shutil
import sys

import pytest
import torch

from megamoe.checkpoint.format import save_checkpoint
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.inference.generation import GenerationOutput
from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from megamoe.transformer.rope import RopeConfig
from parallel_state import ParallelState
from tests.helpers.atomic_file import NOT_REGULAR  # FIFO, links to /dev/null and /dev/full, a directory
from tests.helpers.tiny_model import V, tiny_config  # a tiny MoE model (4 experts, top-2, a dense first layer)
from tests.helpers.generate_script import NEW, SCRIPT, _assert_one_error_line, _prompt_args, _save_tiny_checkpoint
from megamoe.inference.generation_memory import estimate_generation_memory


@pytest.fixture(scope="module")
def checkpoint_512(tmp_path_factory):
    """The same model declaring 512 positions (max_position_embeddings, as an HF model does)."""
    config = tiny_config("allgather")
    attention = dataclasses.replace(config.attention, rope=RopeConfig(dim=8, max_position_embeddings=512))
    return _save_tiny_checkpoint(tmp_path_factory.mktemp("generate") / "ckpt512",
                                 dataclasses.replace(config, attention=attention))


def _run_main(argv, monkeypatch, capsys) -> tuple[int, str]:
    """The script run as ``python examples/generate.py ARGV``, in this process: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", [SCRIPT, *map(str, argv)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(SCRIPT, run_name="__main__")
    return exited.value.code, capsys.readouterr().err


def _cut_manifest(path):
    manifest = path / "manifest.json"
    manifest.write_text(manifest.read_text()[:200])


def _edit_manifest_by_hand(path):
    """Change top-k in manifest.json as a text editor would (its digest left as it was)."""
    manifest = path / "manifest.json"
    text = manifest.read_text()
    assert '"top_k": 2' in text
    manifest.write_text(text.replace('"top_k": 2', '"top_k": 1', 1))


def _flip_a_weight_byte(path):
    """Flip the lowest mantissa byte of one stored float (the file's header stays readable)."""
    shard = next(p for p in sorted(path.iterdir()) if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    header_bytes = int.from_bytes(data[:8], "little")
    position = 8 + header_bytes + 4 * ((len(data) - 8 - header_bytes) // 8)
    data[position] ^= 0x01
    shard.write_bytes(bytes(data))


# case -> (the checkpoint: None missing, "ckpt" the fixture, "ckpt512" the one with 512 positions, "copy" a copy
#          damaged by the third field;
#          the arguments after it ({tmp}: the test's folder); what the error line holds)
USER_ERRORS = {
    "missing checkpoint": (None, _prompt_args(), None, ["no checkpoint at"]),
    "cut manifest": ("copy", _prompt_args(), _cut_manifest, ["manifest.json"]),
    "manifest edited by hand": ("copy", _prompt_args(), _edit_manifest_by_hand,
                                ["manifest.json was edited or damaged", "megamoe-convert edit-config"]),
    "missing prompt file": ("ckpt", ["--prompt-file", "{tmp}/prompts.txt"], None, ["--prompt-file", "no such file"]),
    "prompt ids not integers": ("ckpt", ["--prompt-ids", "1,x"], None, ["--prompt-ids '1,x'", "integer"]),
    "prompt id outside the vocabulary": ("ckpt", ["--prompt-ids", f"1,{V}"], None, [f"[{V}]", "vocabulary"]),
    "missing tokenizer": ("ckpt", ["--prompt", "def f(x):"], None, ["text prompts need a tokenizer",
                                                                   "--tokenizer", "--prompt-ids"]),
    "tokenizer path missing": ("ckpt", ["--prompt", "hi", "--tokenizer", "{tmp}/tok.json"], None,
                               ["--tokenizer", "does not exist"]),
    "output json in a missing folder": ("ckpt", [*_prompt_args(), "--output-json", "{tmp}/no/out.json"], None,
                                        ["--output-json", "does not exist"]),
    "expert load in a missing folder": ("ckpt", [*_prompt_args(), "--record-expert-load", "{tmp}/no/load.json"],
                                        None, ["--record-expert-load", "does not exist"]),
    "a layout for more ranks": ("ckpt", [*_prompt_args(), "--tp", "2"], None, ["--tp 2", "torchrun"]),
    "damaged checkpoint": ("copy", [*_prompt_args(), "--output-json", "{tmp}/out.json"], _flip_a_weight_byte,
                           ["checksum"]),
    "eplb with --compile": ("ckpt", [*_prompt_args(), "--eplb-interval", "2", "--compile"], None,
                            ["--eplb-interval with --compile"]),
    "eplb flag without an interval": ("ckpt", [*_prompt_args(), "--eplb-max-layers", "1"], None,
                                      ["--eplb-max-layers need --eplb-interval"]),
    "prompt longer than the positions": ("ckpt512", ["--prompt-ids", ",".join(["1"] * 20000)], None,
                                         ["prompt 0 (20000 tokens)", "the model's 512 (max_position_embeddings)",
                                          "shorten it to at most 511 tokens"]),
    "new tokens past the positions": ("ckpt512", [*_prompt_args(), "--max-new-tokens", "40000"], None,
                                      ["prompt 0 (4 tokens) with --max-new-tokens 40000 needs 40004 positions",
                                       "at most 508 new tokens fit after it"]),
    "infinite temperature": ("ckpt", [*_prompt_args(), "--temperature", "inf"], None,
                             ["--temperature must be a finite number >= 0", "got inf"]),
    "NaN temperature": ("ckpt", [*_prompt_args(), "--temperature", "nan"], None,
                        ["--temperature must be a finite number >= 0", "got nan"]),
    "negative temperature": ("ckpt", [*_prompt_args(), "--temperature", "-0.5"], None,
                             ["--temperature must be a finite number >= 0", "got -0.5"]),
    "stop token outside the vocabulary": ("ckpt", [*_prompt_args(), "--stop-token-id", "3", "--stop-token-id", str(V)],
                                          None, [f"--stop-token-id [{V}]", f"outside the model's vocabulary [0, {V})"]),
    "negative seed": ("ckpt", [*_prompt_args(), "--temperature", "1", "--seed", "-1"], None,
                      ["--seed must be an integer >= 0, got -1"]),
}
if not torch.cuda.is_available():
    USER_ERRORS["cuda without a GPU"] = ("ckpt", [*_prompt_args(), "--device", "cuda"], None,
                                         ["--device cuda", "no CUDA device", "--device cpu"])


@pytest.mark.parametrize("case", USER_ERRORS)
def test_user_error_is_one_line(case, checkpoint, tmp_path, monkeypatch, capsys, request):
    source, args, damage, expected = USER_ERRORS[case]
    path = tmp_path / "missing"
    if source == "ckpt":
        path = checkpoint
    elif source == "ckpt512":
        path = request.getfixturevalue("checkpoint_512")
    elif source == "copy":
        path = tmp_path / "ckpt"
        shutil.copytree(checkpoint, path)
        damage(path)
    argv = [path, *(a.format(tmp=tmp_path) for a in args)]
    code, stderr = _run_main(argv, monkeypatch, capsys)
    _assert_one_error_line(code, stderr, *expected)
    assert not (tmp_path / "out.json").exists(), "an output was written by a failed run"


@pytest.mark.parametrize("flag", ["--output-json", "--record-expert-load"])
@pytest.mark.parametrize("target", [name for name in NOT_REGULAR if name != "directory"])
def test_an_output_that_is_not_a_regular_file_is_refused_untouched(flag, target, checkpoint, tmp_path, monkeypatch,
                                                                    capsys):
    """A FIFO or a character device (/dev/null, /dev/full, through links in the test's folder) would be
    replaced by a regular file: refused before anything is loaded, and left as it was."""
    make, kind = NOT_REGULAR[target]
    path = make(tmp_path)
    before = os.lstat(path)
    code, stderr = _run_main([checkpoint, *_prompt_args(), flag, path], monkeypatch, capsys)
    _assert_one_error_line(code, stderr, f"{flag} {path} is {kind}", "name a regular file or a new path")
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert os.listdir(tmp_path) == [path.name]


def test_a_tokenizer_eos_outside_the_vocabulary_is_one_line(checkpoint, tmp_path, monkeypatch, capsys):
    """The default stop token, the tokenizer's EOS, is no token of the model (another model's tokenizer)."""
    from tokenizers import Tokenizer as TokenizerFile
    from tokenizers.models import WordLevel
    TokenizerFile(WordLevel({f"t{i}": i for i in range(V + 8)}, unk_token="t0")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{V + 7}"}))
    code, stderr = _run_main([checkpoint, *_prompt_args(), "--tokenizer", tmp_path], monkeypatch, capsys)
    _assert_one_error_line(code, stderr, f"the tokenizer's EOS id {V + 7} (the default stop token) is outside the "
                           f"model's vocabulary [0, {V})", "--stop-token-id")


def test_a_failed_output_write_is_one_line_naming_the_file(checkpoint, tmp_path, monkeypatch, capsys):
    """A full disk when --output-json is synced: one error line naming the file, no "wrote", the old file
    kept."""
    out = tmp_path / "out.json"
    out.write_text("old")

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full_disk)
    code, stderr = _run_main([checkpoint, *_prompt_args(), "--max-new-tokens", 2, "--output-json", out],
                             monkeypatch, capsys)
    _assert_one_error_line(code, stderr, f"writing {out} failed: No space left on device")
    assert f"wrote {out}" not in stderr and out.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


# flags -> what the error line holds, with 1 GiB free
MEMORY_ERRORS = {
    "max new tokens": (["--max-new-tokens", 10**9], ["--max-new-tokens 1000000000", "GiB of KV cache",
                                                     "2 prompt(s) x 1000000004 positions"]),
    "expert slots": (["--num-expert-slots", 10**6], ["are expert slots, 1000000 per MoE layer"]),
}


@pytest.mark.parametrize("case", MEMORY_ERRORS)
def test_a_run_the_memory_cannot_hold_is_refused_before_loading(case, checkpoint, monkeypatch, capsys):
    """The parameters (expert slots included) and KV caches against the memory free (1 GiB here), before
    anything is allocated."""
    args, expected = MEMORY_ERRORS[case]
    monkeypatch.setattr("megamoe.cli.generate.available_memory_bytes", lambda device: (2**30, "free memory"))
    code, stderr = _run_main([checkpoint, *_prompt_args(), *args], monkeypatch, capsys)
    _assert_one_error_line(code, stderr, *expected, "against 1 GiB of free memory",
                           "lower --max-new-tokens or --num-expert-slots")


def test_the_ranks_of_a_host_share_its_memory(checkpoint, tmp_path, monkeypatch, capsys):
    """Free memory for two ranks' parameters and caches but not four: one rank generates, four ranks on
    the host (LOCAL_WORLD_SIZE) are refused."""
    needed = estimate_generation_memory(tiny_config("allgather"), batch=2, sequence_length=4 + 2).total
    monkeypatch.setattr("megamoe.cli.generate.available_memory_bytes", lambda device: (2 * needed, "free memory"))
    run = [checkpoint, *_prompt_args(), "--max-new-tokens", 2]
    code, stderr = _run_main(run, monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    code, stderr = _run_main(run, monkeypatch, capsys)
    _assert_one_error_line(code, stderr, "x 4 ranks on this host")


def test_damaged_checkpoint_loads_with_no_verify_checksums(checkpoint, tmp_path, monkeypatch, capsys):
    """--no-verify-checksums reaches the loader: the same damaged copy then generates."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    _flip_a_weight_byte(path)
    code, stderr = _run_main([path, *_prompt_args(), "--max-new-tokens", 2, "--no-verify-checksums"],
                             monkeypatch, capsys)
    assert code == 0, stderr[-3000:]


def test_a_checkpoint_with_a_nan_weight_is_refused_unless_allowed(tmp_path, monkeypatch, capsys, caplog):
    """Saved with verification off (the library's save_checkpoint does not scan): the load scans what it
    fills and refuses by name; --allow-non-finite generates anyway."""
    config = tiny_config("allgather")
    model = GPTMoEModel(config, ParallelState.single_process())
    initialize_parameters(model, seed=0)
    with torch.no_grad():
        model.norm.weight[1] = float("nan")
    save_checkpoint(tmp_path / "ckpt", sharded_state_dict(model), manifest_fields={"model_config": config.to_dict()})
    argv = [tmp_path / "ckpt", *_prompt_args(), "--max-new-tokens", 2]
    code, stderr = _run_main(argv, monkeypatch, capsys)
    _assert_one_error_line(code, stderr, "norm.weight holds 1 NaN and 0 infinite values", "--allow-non-finite")
    code, stderr = _run_main([*argv, "--allow-non-finite"], monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    assert "norm.weight holds 1 NaN and 0 infinite values" in caplog.text


def test_eplb_rounds_are_in_the_output_json(checkpoint, tmp_path, monkeypatch, capsys):
    """--eplb-interval 2: a round after forward passes 2 and 4 (of 1 prefill + 4 decode steps), each in the
    JSON (one EP rank here: nothing moves; tests/multirank/test_eplb.py moves slots over 4 ranks)."""
    out = tmp_path / "out.json"
    code, stderr = _run_main([checkpoint, *_prompt_args(), "--max-new-tokens", NEW, "--eplb-interval", 2,
                              "--output-json", out], monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    rounds = json.loads(out.read_text())["eplb"]
    assert [r["step"] for r in rounds] == [2, 4] and all(r["moved_slots"] == 0 for r in rounds)


# world size, layout arguments -> what the error line holds
DISPATCHER_ERRORS = {
    "explicit dispatcher that does not fit": ("2", ["--ep", "2", "--dispatcher", "allgather"],
                                              ["--dispatcher allgather", "ep * etp must divide tp",
                                               "--dispatcher alltoall"]),
    "no dispatcher fits": ("4", ["--tp", "2", "--ep", "4"], ["no MoE dispatcher fits", "allgather:", "alltoall:"]),
}


@pytest.mark.parametrize("case", DISPATCHER_ERRORS)
def test_layout_no_dispatcher_can_run_names_the_flag(case, checkpoint, monkeypatch, capsys):
    """As rank 0 of a torchrun job (WORLD_SIZE set): the error comes before any process group is joined;
    an explicit --dispatcher that cannot run the layout names the one that can."""
    world, args, expected = DISPATCHER_ERRORS[case]
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    code, stderr = _run_main([checkpoint, *_prompt_args(), *args], monkeypatch, capsys)
    _assert_one_error_line(code, stderr, *expected)


def test_decode_tokens_per_second_leave_compile_time_out():
    """Two data-parallel ranks' outputs: tokens add up, the slowest rank sets each time, and decode
    tokens/s are over the decode time without the steps spent compiling."""
    from megamoe.cli.generate import timings_of
    outs = [GenerationOutput(token_ids=[[1, 2, 3, 4]], finish_reasons=["length"], prompt_tokens=3,
                             prefill_seconds=0.5, decode_seconds=13.0, decode_steps=3, compile_seconds=12.0,
                             compile_tokens=1),
            GenerationOutput(token_ids=[[5, 6, 7, 8], [9]], finish_reasons=["length", "stop"], prompt_tokens=6,
                             prefill_seconds=1.0, decode_seconds=12.5, decode_steps=3, compile_seconds=11.0,
                             compile_tokens=1)]
    timings = timings_of(outs)
    assert timings["decode_tokens"] == 6 and timings["prompt_tokens"] == 9
    assert timings["decode_seconds"] == 13.0 and timings["compile_seconds"] == 12.0
    assert timings["decode_seconds_excluding_compile"] == 1.5          # rank 1: 12.5 - 11
    assert timings["decode_tokens_excluding_compile"] == 4             # each rank's compiling step made 1
    assert timings["decode_tokens_per_second"] == pytest.approx(4 / 1.5)
    assert timings["prefill_tokens_per_second"] == pytest.approx(9 / 1.0)


def test_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(SCRIPT, run_name="__main__")
    assert exited.value.code == 0
    shown = "".join(capsys.readouterr().out.split())     # argparse wraps lines, at hyphens too
    from megamoe.cli import generate                  # the command the script runs
    parser = generate.build_parser("generate.py")
    documented = 0
    for action in parser._actions:
        # Shown unless there is nothing to show: no default, an on/off flag, a help naming its default.
        if (action.option_strings and action.default not in (None, "==SUPPRESS==")
                and not isinstance(action.default, bool) and "default" not in action.help):
            assert f"(default:{action.default})" in shown, action.option_strings
            documented += 1
    assert documented >= 10
    assert "".join(generate.__doc__.split()) in shown, "the description is cut"
