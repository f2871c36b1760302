"""The README's code that users copy must run."""

import re
from pathlib import Path

import torch

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _block_after(heading: str) -> str:
    start = README.index(heading)
    return re.search(r"```python\n(.*?)```", README[start:], re.S).group(1)


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert first_block[0].startswith("make demo") and first_block[1].startswith("make test")


def test_subclassing_example_runs_single_rank():
    namespace: dict = {}
    exec(_block_after("Subclassing a layer in your own model"), namespace)
    mlp = namespace["MLP"](16, 32, tp_group=None)
    out = mlp(torch.randn(4, 16))
    assert out.shape == (4, 16)
    out.sum().backward()
    assert mlp.up.gate.grad is not None
