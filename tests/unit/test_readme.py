"""The README's code that users copy must run."""

import re
from pathlib import Path

import torch

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def _block_after(heading: str) -> str:
    start = README.index(heading)
    return re.search(r"```python\n(.*?)```", README[start:], re.S).group(1)


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert first_block[0].startswith("make demo") and first_block[1].startswith("make test")


def _readme_part_of_the_example() -> str:
    example = (Path(__file__).resolve().parents[2] / "examples" / "custom_layers.py").read_text()
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


def test_readme_documents_every_flag_of_the_training_script(monkeypatch):
    import importlib.util
    import sys
    path = Path(__file__).resolve().parents[2] / "examples" / "pretrain_moe.py"
    spec = importlib.util.spec_from_file_location("pretrain_moe_flags", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)       # its dataclasses look their module up
    spec.loader.exec_module(module)
    section = README[README.index("## Training on your data"):README.index("## Testing multi-rank code")]
    flags = {option for action in module.build_parser()._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"}
    missing = sorted(flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", section))
    assert not missing, f"README's training section does not mention {missing}"
