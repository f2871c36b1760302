"""Context parallelism (megamoe.transformer.context_parallel).

The in-process cases; those that spawn ranks or run scripts end to end are in
tests/multirank/test_context_parallel.py."""

import pytest
import torch

from megamoe.transformer.context_parallel import check_context_parallel_length, cp_token_index
from tests.helpers.context_parallel import config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunk_index_covers_every_position_once(cp):
    seq = 16
    chunk = seq // (2 * cp)
    held = [cp_token_index(seq, r, cp) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    for r, index in enumerate(held):
        assert index.shape == (seq // cp,)
        if cp > 1:   # chunks r and 2 cp - 1 - r, in that order
            mirror = 2 * cp - 1 - r
            assert index.tolist() == [*range(r * chunk, (r + 1) * chunk), *range(mirror * chunk, (mirror + 1) * chunk)]
    if cp == 2:
        assert held[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15] and held[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_bad_sequence_lengths_name_the_numbers():
    with pytest.raises(ValueError, match=r"seq_len=6 .*2\*cp \(cp=2\)"):
        cp_token_index(6, 0, 2)
    with pytest.raises(ValueError, match=r"seq_len=12 .*2\*cp \(cp=4\)"):
        check_context_parallel_length(12, 4)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\), got 2"):
        cp_token_index(8, 2, 2)
    check_context_parallel_length(7, 1)          # cp 1: any length


def test_script_accepts_cp_and_refuses_a_sequence_2cp_does_not_divide(demo, tmp_path):
    base = ["--work-dir", str(tmp_path / "work"), "--save-dir", str(tmp_path / "ckpt"), "--seq-len", "64"]
    demo.check_arguments(demo.parse_args([*base, "--cp", "2", "--ep", "2"]), world_size=4)
    demo.check_arguments(demo.parse_args([*base, "--cp", "2", "--tp", "2", "--sequence-parallel"]), world_size=4)
    with pytest.raises(demo.UsageError, match=r"--cp 3 .*--seq-len 64 must be divisible by 6"):
        demo.check_arguments(demo.parse_args([*base, "--cp", "3"]), world_size=3)
    with pytest.raises(demo.UsageError, match=r"--tp 2 --cp 4 .*does not fit 4 rank"):
        demo.check_arguments(demo.parse_args([*base, "--cp", "4", "--tp", "2"]), world_size=4)
    # dp = world / (tp * cp * pp): 8 ranks at cp 2 hold 4 data-parallel replicas.
    demo.check_arguments(demo.parse_args([*base, "--cp", "2", "--global-batch", "8", "--micro-batch", "2"]),
                         world_size=8)
    with pytest.raises(demo.UsageError, match=r"--global-batch 12 must be a multiple of dp \* --micro-batch = 4\*2"):
        demo.check_arguments(demo.parse_args([*base, "--cp", "2", "--global-batch", "12", "--micro-batch", "2"]),
                             world_size=8)
    with pytest.raises(demo.UsageError, match=r"--cp must be >= 1, got 0"):
        demo.check_arguments(demo.parse_args([*base, "--cp", "0"]), world_size=1)


def test_custom_attention_without_cp_group_is_refused_under_cp():
    from megamoe.models import LayerSpec

    class OldAttention(torch.nn.Module):            # written before context parallelism
        def __init__(self, config, *, tp_group=None, device=None, dtype=None):
            super().__init__()

    built = {}

    def new_attention(config, *, tp_group=None, cp_group=None, device=None, dtype=None):
        built["cp_group"] = cp_group
        return torch.nn.Identity()

    attention = config("gqa").attention
    LayerSpec(attention=OldAttention).build_attention(attention, tp_group=None)        # cp 1: unchanged
    with pytest.raises(ValueError, match=r"'OldAttention' takes no cp_group keyword.*cp=1"):
        LayerSpec(attention=OldAttention).build_attention(attention, tp_group=None, cp_group=object())
    marker = object()
    LayerSpec(attention=new_attention).build_attention(attention, tp_group=None, cp_group=marker)
    assert built["cp_group"] is marker


def test_script_error_line_for_a_bad_cp(demo, tmp_path, capsys, monkeypatch):
    from megamoe.cli.launch import run_script
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["--work-dir", tmp_path / "work", "--save-dir", tmp_path / "ckpt", "--cp", "2", "--seq-len", "30"]
    code = run_script(demo.main, [str(a) for a in argv], prog=demo.PROG)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("pretrain_moe.py: error: --cp 2 "), err
    assert "--seq-len 30 must be divisible by 4" in lines[0] and not out and not (tmp_path / "work").exists()
