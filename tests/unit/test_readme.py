"""The README and the docs/ pages: the code that users copy must run, the commands they type must exist.

- every fenced ``bash`` command is checked against the parsers: its program (and subcommand) exists and
  every ``--flag`` it passes is one that parser defines (``megamoe train``'s ``--section.key`` overrides
  included); the cheap ones (``--print-config``, the README's conversion lines) are also run;
- every fenced ``python`` block runs, here or in the test named in ``PYTHON_BLOCKS_RUN_ELSEWHERE``;
- every relative link resolves, to a file and (with ``#anchor``) to one of its headings;
- every flag of ``megamoe train`` is documented in docs/training.md.
"""

import argparse
import contextlib
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megamoe.errors import UsageError
from megamoe.serving.http.protocol import APIError

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text()
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}

# python blocks that need a checkpoint or ranks this module does not build: (page, heading the block follows)
# -> the test that runs it as written.
PYTHON_BLOCKS_RUN_ELSEWHERE = {
    ("docs/generation.md", "# Generation"): "tests/multirank/test_inference.py",
    ("README.md", "## Serving"): "tests/unit/test_serve_http.py",
    ("docs/serving_engine.md", "# The serving engine (`megamoe.serving`)"): "tests/unit/test_serving_engine.py",
}

# Packages the pages tell users to pip-install by name, outside this package's extras.
PIP_PACKAGES = {"torch", "wandb"}


def _fenced(text: str, lang: str) -> list[tuple[str, str]]:
    """(heading above it, code) of every ```lang block of a page."""
    blocks = []
    for match in re.finditer(r"^```" + lang + r"\n(.*?)^```", text, re.S | re.M):
        headings = re.findall(r"^#+ .*$", re.sub(r"^```.*?^```", "", text[:match.start()], flags=re.S | re.M),
                              re.M)
        blocks.append((headings[-1] if headings else "", match.group(1)))
    return blocks


def _block_after(heading: str, page: str = "docs/design.md") -> str:
    text = PAGES[page]
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def _commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, split at ``&&`` / ``;``."""
    commands, pending = [], ""
    for line in code.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)     # a quoted argument may span lines
        except ValueError:
            continue
        pending = ""
        command: list[str] = []
        for word in words + [";"]:
            if word in ("&&", ";", "&"):
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    return commands


BASH_COMMANDS = [(page, command) for page, text in PAGES.items()
                 for _, code in _fenced(text, "bash") for command in _commands(code)]


# --- parsers of the programs the pages run ------------------------------------------------------------------

class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


@contextlib.contextmanager
def _intercepted_parsing():
    """The first argparse parser an entry point parses with, instead of running it."""
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, *args, **kwargs):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = capture
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_known_args = original


def _parser_of(entry) -> argparse.ArgumentParser:
    with _intercepted_parsing(), pytest.raises(_Parsed) as parsed:
        entry(["--help"])
    return parsed.value.parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            assert name in action.choices, f"{parser.prog} has no subcommand {name!r}"
            return action.choices[name]
    raise AssertionError(f"{parser.prog} has no subcommands")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _check_flags(parser: argparse.ArgumentParser, args: list[str], where: str) -> None:
    known = _options(parser)
    for arg in args:
        if arg.startswith("-") and not re.fullmatch(r"-\d.*", arg):
            assert arg.split("=", 1)[0] in known, f"{where}: {parser.prog} has no flag {arg}"


def _check_train(args: list[str], where: str) -> None:
    from megamoe.cli import train
    from megamoe.cli.run_config import split_dotted_overrides
    _, rest = split_dotted_overrides(args)            # an unknown --section.key raises, naming it
    _check_flags(train.build_parser(), rest, where)


def _check_megamoe(args: list[str], where: str) -> None:
    from megamoe.cli import convert as convert_cli
    from megamoe.cli import generate, preprocess, serve
    from megamoe.cli.main import SUBCOMMANDS
    name, rest = args[0], args[1:]
    assert name in SUBCOMMANDS, f"{where}: megamoe has no subcommand {name!r}"
    if name == "train":
        _check_train(rest, where)
    elif name == "generate":
        _check_flags(generate.build_parser(), rest, where)
    elif name == "serve":
        _check_flags(serve.build_parser(), rest, where)
    elif name == "convert":
        _check_flags(_subparser(convert_cli.build_parser(), rest[0]), rest[1:], where)
    elif name == "inspect":
        _check_flags(_subparser(convert_cli.build_parser(), "inspect"), rest, where)
    else:
        assert name == "preprocess", name
        _check_flags(_parser_of(preprocess.main), rest, where)


EXAMPLES = {"examples/pretrain_moe.py": ["train"], "examples/generate.py": ["generate"]}
MODULES = {"megamoe": [], "megamoe.cli.preprocess": ["preprocess"]}


def _check_python(args: list[str], where: str) -> None:
    """``python3 SCRIPT ...``, ``python3 -m MODULE ...``, ``python3 -c CODE``."""
    if args[0] == "-c":
        compile(args[1], where, "exec")
    elif args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "venv":
            assert rest == [".venv"], where
        elif module == "pip":
            _check_pip(rest, where)
        else:
            assert module in MODULES, f"{where}: no module {module} among {sorted(MODULES)}"
            _check_megamoe(MODULES[module] + rest, where)
    else:
        script, rest = args[0], args[1:]
        assert (ROOT / script).is_file(), f"{where}: no file {script}"
        if script in EXAMPLES:
            _check_megamoe(EXAMPLES[script] + rest, where)
        else:
            raise AssertionError(f"{where}: no check for the script {script}")


def _check_torchrun(args: list[str], where: str) -> None:
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    takes_value = {option for action in parser._actions if action.nargs != 0 for option in action.option_strings}
    i = 0
    while args[i].startswith("-") and args[i] != "-m":
        assert args[i].split("=", 1)[0] in _options(parser), f"{where}: torchrun has no flag {args[i]}"
        i += 1 if "=" in args[i] or args[i] not in takes_value else 2
    _check_python(args[i:], where)


def _check_pip(args: list[str], where: str) -> None:
    extras = re.search(r"extras_require=\{(.*?)\n    \}", (ROOT / "setup.py").read_text(), re.S).group(1)
    assert args[0] == "install", where
    for arg in args[1:]:
        if arg.startswith("-") or arg.startswith("https://"):
            continue
        if arg.startswith("."):
            for extra in re.fullmatch(r"\.(?:\[(.*)\])?", arg).group(1).split(","):
                assert re.search(rf'"{extra}": \[', extras), f"{where}: setup.py has no extra {extra!r}"
        else:
            assert arg in PIP_PACKAGES, f"{where}: pip package {arg} is not one the docs may name"


def _check_curl(args: list[str], where: str) -> None:
    """``curl URL [-H HEADER] [-d JSON]`` against ``megamoe serve``: an endpoint of the server, and a body its
    request model accepts (tests/unit/test_serve_http.py also sends these requests to a running server)."""
    from megamoe.serving.http.app import ENDPOINTS
    from megamoe.serving.http.protocol import parse_request
    urls = [arg for arg in args if arg.startswith("http")]
    assert len(urls) == 1 and urls[0].startswith("http://127.0.0.1:8000/"), f"{where}: one URL of the server"
    path = urls[0].removeprefix("http://127.0.0.1:8000")
    assert path in ENDPOINTS, f"{where}: megamoe serve has no endpoint {path}"
    options = dict(zip(args[::2], args[1::2])) if args[0] != urls[0] else dict(zip(args[1::2], args[2::2]))
    assert set(options) <= {"-H", "-d"}, f"{where}: curl options other than -H / -d"
    if "-d" in options:
        assert ENDPOINTS[path] is not None, f"{where}: {path} takes no body"
        parse_request(ENDPOINTS[path], json.loads(options["-d"]))


def _check_command(command: list[str], where: str) -> None:
    program, args = command[0], command[1:]
    if program == "make":
        targets = re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
        assert args and all(arg in targets for arg in args), f"{where}: make has no target {args}"
    elif program in ("python", "python3"):
        _check_python(args, where)
    elif program == "torchrun":
        _check_torchrun(args, where)
    elif program == "megamoe":
        _check_megamoe(args, where)
    elif program == "megamoe-convert":
        _check_megamoe(["convert", *args], where)
    elif program == "megamoe-preprocess":
        _check_megamoe(["preprocess", *args], where)
    elif program == "pip":
        _check_pip(args, where)
    elif program == "curl":
        _check_curl(args, where)
    elif program == ".":
        assert args == [".venv/bin/activate"], where
    else:
        raise AssertionError(f"{where}: no check for the program {program!r}")


@pytest.mark.parametrize("page,command", BASH_COMMANDS, ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60])
def test_every_documented_command_exists_with_its_flags(page, command):
    _check_command(command, f"{page}: {shlex.join(command)}")


def test_the_command_check_refuses_a_misspelt_flag_or_program():
    for command in (["megamoe", "train", "--learning-rate", "1"], ["megamoe", "train", "--optimizer.lrate", "1"],
                    ["megamoe", "convert", "import-hf", "a", "b", "--tp-size", "2"],
                    ["megamoe", "serve", "ckpt", "--prot", "8000"], ["curl", "http://127.0.0.1:8000/v1/complete"],
                    ["curl", "http://127.0.0.1:8000/v1/completions", "-d", '{"prompt": "a", "n": 2}'],
                    ["torchrun", "--nodes", "2", "-m", "megamoe", "train"], ["make", "demos"],
                    ["pip", "install", "-e", ".[gpu]"], ["python3", "examples/pretrain.py"]):
        with pytest.raises((AssertionError, UsageError, APIError)):   # an unknown --section.key, a bad request
            _check_command(command, "test")


def test_print_config_commands_run_and_print_toml_that_config_reads(tmp_path, monkeypatch, capsys):
    """The documented ``--print-config`` lines, run as written (in process, nothing is trained), and what they
    print fed back to ``--config`` prints the same config."""
    from megamoe.cli.main import main
    from megamoe.training.run_config_file import SECTIONS
    commands = [command for _, command in BASH_COMMANDS if "--print-config" in command]
    assert commands
    monkeypatch.chdir(ROOT)
    for command in commands:
        args = command[command.index("megamoe") + 1:]
        assert main(args[:args.index(">")] if ">" in args else args) == 0
        printed = capsys.readouterr().out
        assert set(tomllib.loads(printed)) == set(SECTIONS)
        (tmp_path / "run.toml").write_text(printed)
        assert main(["train", "--config", str(tmp_path / "run.toml"), "--print-config"]) == 0
        assert capsys.readouterr().out == printed


def test_readme_convert_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The README's conversion lines, run in order (in process) on a tiny random Qwen3-MoE at their HF path."""
    import transformers
    from megamoe.cli.main import main
    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2)
    monkeypatch.chdir(tmp_path)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained("path/to/qwen3_moe")
    section = README[README.index("## Converting checkpoints"):README.index("## Generating text")]
    commands = [command for _, code in _fenced(section, "bash") for command in _commands(code)]
    assert [command[:3] for command in commands] == [["megamoe", "convert", "import-hf"], ["megamoe", "inspect", "ckpt"],
                                                     ["megamoe", "convert", "reshard"], ["megamoe", "convert", "export-hf"]]
    for command in commands:
        assert main(command[1:]) == 0, command
    assert "12 slots over EP 2" in capsys.readouterr().out
    got = transformers.AutoModelForCausalLM.from_pretrained("path/to/hf_out").state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained("path/to/qwen3_moe").state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)    # bit for bit


# --- python blocks ---------------------------------------------------------------------------------------------

PYTHON_BLOCKS = [(page, heading, code) for page, text in PAGES.items() for heading, code in _fenced(text, "python")]


@contextlib.contextmanager
def _fake_world(world_size: int):
    """This process is rank 0 of ``world_size`` over torch's fake process group (collectives are no-ops that
    comms.comm_counter still counts); ``dist.init_process_group`` in the block then finds it joined."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from parallel_state import destroy_model_parallel
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    joined = dist.init_process_group
    dist.init_process_group = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.init_process_group = joined
        destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_block(code: str, world_size: int = 1) -> dict:
    namespace: dict = {"checked_lines": 0}
    with _fake_world(world_size) if world_size > 1 else contextlib.nullcontext():
        exec(compile(code, "<docs block>", "exec"), namespace)
        # A line `expression    # literal` states the expression's value: check it.
        for line in code.splitlines():
            match = re.fullmatch(r"(\S.*?)\s+# (\(.*\)|\{.*\})", line)
            if match and "=" not in match.group(1).replace("==", ""):
                assert eval(match.group(1), namespace) == eval(match.group(2)), line
                namespace["checked_lines"] += 1
    return namespace


def test_every_python_block_is_run():
    here = {"docs/parallelism.md": {"## parallel_state: explicit groups from a rank grid"},
            "docs/design.md": {"## Communication: `megamoe.comms`", "## Tensor-parallel layers"},
            "docs/moe.md": {"# Mixture of experts: experts vs expert slots"}}
    located = [(page, heading) for page, heading, _ in PYTHON_BLOCKS]
    assert len(located) == len(set(located)), "two python blocks under one heading: the tests run only the first"
    for page, heading, _ in PYTHON_BLOCKS:
        elsewhere = PYTHON_BLOCKS_RUN_ELSEWHERE.get((page, heading))
        assert heading in here.get(page, ()) or elsewhere, f"{page}: the python block under {heading!r} is not run"
        if elsewhere:
            assert page in (ROOT / elsewhere).read_text(), f"{elsewhere} does not read {page}"


def test_parallel_state_block_runs_on_8_ranks():
    namespace = _run_block(_block_after("## parallel_state", "docs/parallelism.md"), world_size=8)
    assert namespace["checked_lines"] == 2 and namespace["state"].pp.size == 2


def test_comm_counter_block_counts_the_tp_all_reduces():
    namespace = _run_block(_block_after("## Communication"), world_size=2)
    assert namespace["counter"].kinds() == {"all_reduce": 2}
    assert namespace["counter"].bytes("all_reduce", (0, 1)) == 2 * 4 * 16 * 4    # [4, 16] fp32, forward and backward


def test_moe_block_runs_single_process():
    namespace = _run_block(_block_after("# Mixture of experts", "docs/moe.md"))
    out, aux_loss = namespace["out"], namespace["aux_loss"]
    assert out.shape == namespace["hidden"].shape and torch.isfinite(out).all() and aux_loss.ndim == 0


def _readme_part_of_the_example() -> str:
    example = (ROOT / "examples" / "custom_layers.py").read_text()
    return re.search(r"# README: begin\n(.*?)# README: end\n", example, re.S).group(1)


def test_subclassing_example_is_the_tested_example_file():
    assert _block_after("Subclassing a layer in your own model") == _readme_part_of_the_example()


def test_subclassing_example_runs_single_rank():
    from megamoe.sharding import ShardSpec, get_shard_spec
    from megamoe.transformer import MLPConfig
    namespace: dict = {}
    exec(_block_after("Subclassing a layer in your own model"), namespace)
    mlp = namespace["GatedMLP"](MLPConfig(16, 32), tp_group=None)
    out = mlp(torch.randn(4, 16))
    assert out.shape == (4, 16)
    out.sum().backward()
    assert mlp.up.gate.grad is not None
    assert get_shard_spec(mlp.up.gate) == ShardSpec((32,), 0, 0, 1)
    on_meta = namespace["GatedMLP"](MLPConfig(16, 32), tp_group=None, device="meta", dtype=torch.bfloat16)
    assert {(p.device.type, p.dtype) for p in on_meta.parameters()} == {("meta", torch.bfloat16)}


# --- the README's shape, links, flags -------------------------------------------------------------------------

def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert first_block[0].startswith("make demo") and first_block[1].startswith("make test")


def test_readme_is_a_guide_of_about_300_lines():
    assert README.count("\n") <= 300


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip("# ").lower()).replace(" ", "-")


def test_every_link_resolves():
    for page, text in PAGES.items():
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"https?://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = ((ROOT / page).parent / path).resolve() if path else ROOT / page
            name = resolved.relative_to(ROOT).as_posix()
            assert resolved.exists(), f"{page}: the link {target} leads nowhere"
            if anchor:
                headings = re.findall(r"^#+ .*$", re.sub(r"^```.*?^```", "", resolved.read_text(), flags=re.S | re.M),
                                      re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{page}: {name} has no heading #{anchor}"


def test_docs_training_documents_every_flag_of_megamoe_train():
    from megamoe.cli import train as module           # `megamoe train`, which examples/pretrain_moe.py runs
    page = PAGES["docs/training.md"]
    flags = {option for action in module.build_parser()._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"}
    missing = sorted(flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", page))
    assert not missing, f"docs/training.md does not mention {missing}"
