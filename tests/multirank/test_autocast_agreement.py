"""`--autocast auto` on several ranks: each measures its own matmul peaks, and the job runs one dtype."""

import torch

from megamoe.spawned_ranks import run_on_ranks


def _agree(rank, world_size, choices):
    import torch.distributed as dist
    from megamoe.training.pretrain import agreed_autocast
    return agreed_autocast(choices[rank], dist.group.WORLD, torch.device("cpu"))


def test_ranks_run_bf16_only_where_every_rank_chose_it():
    assert run_on_ranks(_agree, 2, args=(["bf16", None],), timeout_s=120) == [None, None]
    assert run_on_ranks(_agree, 2, args=(["bf16", "bf16"],), timeout_s=120) == ["bf16", "bf16"]
