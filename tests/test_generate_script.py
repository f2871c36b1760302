"""examples/generate.py as a user meets it: a mistake (missing or damaged checkpoint, a cut manifest, a
missing prompt file or tokenizer, bad --prompt-ids, an output in a missing folder, a layout the world
size or the dispatcher cannot run) is ONE ``generate.py: error:`` line naming the problem and the
flag, exit code 1, no traceback, nothing written; without --dispatcher a layout the checkpoint's
dispatcher cannot run picks the one that can (and generates the single-process tokens); decode
tokens/s leave the compile time out; --help shows every default.

The user-error cases run the script's ``__main__`` in this process (runpy): they fail before any
weight is read. Cases that need two ranks go through torchrun (slow).
"""

import json
import os
import re
import runpy
import shutil
import subprocess
import sys

import pytest
import torch

from checkpoint_tools.format import save_checkpoint
from checkpoint_tools.model_loading import build_model_from_checkpoint
from megamoe.checkpoint_state import sharded_state_dict
from megamoe.inference.generation import GenerationConfig, GenerationOutput, generate
from megamoe.models import GPTMoEModel
from megamoe.tensor_parallel import initialize_parameters
from parallel_state import ParallelState
from test_training import V, tiny_config   # a tiny MoE model (4 experts, top-2, a dense first layer)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "generate.py")
PROMPTS = [[5, 9, 12, 3], [22, 8]]
NEW = 5
# A script frame in a traceback (torchrun's own ChildFailedError summary names only torch files).
OUR_FRAME = re.compile(r'File ".*(examples|megamoe|checkpoint_tools|parallel_state)[/\\]')


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny MoE checkpoint saved single-process with the all-gather dispatcher (as the pretraining
    demo saves at tp=1): EP over 2 ranks then needs the all-to-all one."""
    path = tmp_path_factory.mktemp("generate") / "ckpt"
    config = tiny_config("allgather")
    model = GPTMoEModel(config, ParallelState.single_process())
    initialize_parameters(model, seed=0)
    save_checkpoint(path, sharded_state_dict(model), manifest_fields={"model_config": config.to_dict()})
    return path


def _prompt_args():
    return [arg for prompt in PROMPTS for arg in ("--prompt-ids", ",".join(map(str, prompt)))]


def _run_main(argv, monkeypatch, capsys) -> tuple[int, str]:
    """The script run as ``python examples/generate.py ARGV``, in this process: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", [SCRIPT, *map(str, argv)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(SCRIPT, run_name="__main__")
    return exited.value.code, capsys.readouterr().err


def _assert_one_error_line(code, stderr, *expected, torchrun=False):
    """Exit code 1 and one error line holding ``expected``; no traceback (torchrun: none of our code's,
    torchrun's own ChildFailedError summary is a traceback of its launcher)."""
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert code == 1, stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("generate.py: error: "), stderr[-3000:]
    assert not OUR_FRAME.search(stderr) and (torchrun or "Traceback" not in stderr), stderr[-3000:]
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


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


# case -> (the checkpoint: None missing, "ckpt" the fixture, "copy" a copy damaged by the third field;
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
}
if not torch.cuda.is_available():
    USER_ERRORS["cuda without a GPU"] = ("ckpt", [*_prompt_args(), "--device", "cuda"], None,
                                         ["--device cuda", "no CUDA device", "--device cpu"])


@pytest.mark.parametrize("case", USER_ERRORS)
def test_user_error_is_one_line(case, checkpoint, tmp_path, monkeypatch, capsys):
    source, args, damage, expected = USER_ERRORS[case]
    path = tmp_path / "missing"
    if source == "ckpt":
        path = checkpoint
    elif source == "copy":
        path = tmp_path / "ckpt"
        shutil.copytree(checkpoint, path)
        damage(path)
    argv = [path, *(a.format(tmp=tmp_path) for a in args)]
    code, stderr = _run_main(argv, monkeypatch, capsys)
    _assert_one_error_line(code, stderr, *expected)
    assert not (tmp_path / "out.json").exists(), "an output was written by a failed run"


def test_damaged_checkpoint_loads_with_no_verify_checksums(checkpoint, tmp_path, monkeypatch, capsys):
    """--no-verify-checksums reaches the loader: the same damaged copy then generates."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    _flip_a_weight_byte(path)
    code, stderr = _run_main([path, *_prompt_args(), "--max-new-tokens", 2, "--no-verify-checksums"],
                             monkeypatch, capsys)
    assert code == 0, stderr[-3000:]


def test_eplb_rounds_are_in_the_output_json(checkpoint, tmp_path, monkeypatch, capsys):
    """--eplb-interval 2: a round after forward passes 2 and 4 (of 1 prefill + 4 decode steps), each in the
    JSON (one EP rank here: nothing moves; tests/test_eplb.py moves slots over 4 ranks)."""
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
    generate_script = runpy.run_path(SCRIPT)
    outs = [GenerationOutput(token_ids=[[1, 2, 3, 4]], finish_reasons=["length"], prompt_tokens=3,
                             prefill_seconds=0.5, decode_seconds=13.0, decode_steps=3, compile_seconds=12.0,
                             compile_tokens=1),
            GenerationOutput(token_ids=[[5, 6, 7, 8], [9]], finish_reasons=["length", "stop"], prompt_tokens=6,
                             prefill_seconds=1.0, decode_seconds=12.5, decode_steps=3, compile_seconds=11.0,
                             compile_tokens=1)]
    timings = generate_script["timings_of"](outs)
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
    parser = runpy.run_path(SCRIPT)["build_parser"]()
    documented = 0
    for action in parser._actions:
        # Shown unless there is nothing to show: no default, an on/off flag, a help naming its default.
        if (action.option_strings and action.default not in (None, "==SUPPRESS==")
                and not isinstance(action.default, bool) and "default" not in action.help):
            assert f"(default:{action.default})" in shown, action.option_strings
            documented += 1
    assert documented >= 10
    assert "".join(runpy.run_path(SCRIPT)["__doc__"].split()) in shown, "the description is cut"


# ----------------------------------------------------------------------------------------------
# Two ranks (torchrun)
# ----------------------------------------------------------------------------------------------
def _torchrun(args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", SCRIPT,
                           *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow      # two ranks under torchrun, ~20 s
@pytest.mark.timeout(1200)
def test_default_dispatcher_fits_the_layout(checkpoint, tmp_path):
    """``torchrun --nproc-per-node 2 generate.py CKPT --ep 2`` on an all-gather checkpoint at tp 1: the
    all-to-all dispatcher is chosen (and logged), and the tokens are the single-process ones."""
    solo = build_model_from_checkpoint(checkpoint, ParallelState.single_process()).eval()
    expected = generate(solo, ParallelState.single_process(), PROMPTS, GenerationConfig(max_new_tokens=NEW)).token_ids
    run = _torchrun([checkpoint, *_prompt_args(), "--ep", 2, "--max-new-tokens", NEW, "--output-json", "out.json"],
                    tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the checkpoint's dispatcher allgather does not fit this layout" in run.stderr, run.stderr[-3000:]
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["layout"]["dispatcher"] == "alltoall" and document["layout"]["ep"] == 2
    assert document["layout"]["etp"] == 1
    assert [r["ids"] for r in document["requests"]] == expected


@pytest.mark.slow      # two ranks under torchrun, ~15 s
@pytest.mark.timeout(1200)
def test_world_size_that_does_not_fit_is_one_line_from_rank_0(checkpoint, tmp_path):
    """Both ranks find the mistake before joining a process group; rank 0 alone says so."""
    run = _torchrun([checkpoint, *_prompt_args(), "--tp", 2, "--pp", 2], tmp_path)
    _assert_one_error_line(run.returncode, run.stderr, "--tp 2 --pp 2", "do not fit 2 rank(s)", torchrun=True)
