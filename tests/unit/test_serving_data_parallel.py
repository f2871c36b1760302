"""Data-parallel attention in the serving engine (megamoe.serving.data_parallel), in process: a rank's step report
round-trips exactly, rank 0 assigns each request to the least loaded rank, the layouts the engine cannot run
with it are refused naming the field, an empty step packs, and /metrics lists every data-parallel rank. The
engine and ``megamoe serve`` under dp 2 x ep 2 are tests/multirank/test_serving_layouts.py and
tests/multirank/test_serve_command.py."""

from types import SimpleNamespace

import pytest
import torch

from megamoe.serving import EngineMetrics, SamplingParams
from megamoe.serving.data_parallel import (DataParallelSteps, RankReport, RemoteOutput, check_data_parallel_layout,
                                           check_moe_input, decode_report, encode_report, least_loaded)
from megamoe.serving.http.metrics import ServingStats, render_metrics
from megamoe.serving.metrics import DataParallelRankMetrics
from megamoe.serving.paged_kv_cache import pack_step
from megamoe.serving.request import Request


def test_a_rank_report_round_trips_exactly():
    report = RankReport((RemoteOutput(7, (3,), (-0.1 - 0.2,), None, 4), RemoteOutput(9, (5,), (-2.5,), "length", 0),
                         RemoteOutput(11, (2,), (-1e-300,), "stop", 8)),
                        DataParallelRankMetrics(running=2, waiting=1, kv_blocks_used=5, kv_blocks_total=64,
                                                step_tokens=13), 40, 16, 24, 1)
    back = decode_report(encode_report(report))
    assert back == report
    assert back.outputs[0].logprobs[0] == -0.1 - 0.2                       # the exact double
    assert decode_report(encode_report(RankReport((), report.state))).outputs == ()
    with pytest.raises(RuntimeError, match="format"):
        decode_report([1, 2, 3])
    values = encode_report(report)
    values[12] = 9                                                            # the first output's finish code
    with pytest.raises(RuntimeError, match="unknown finish code 9"):
        decode_report(values)


def _request(request_id, prompt_len, max_tokens, dp_rank):
    return Request(request_id, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), torch.Generator(), request_id,
                   dp_rank=dp_rank)


def test_rank_0_assigns_each_request_to_the_least_loaded_rank_by_tokens():
    assert least_loaded([], 3) == 0                                          # ties: the lowest rank
    requests = [_request(0, 10, 20, 0), _request(1, 3, 4, 1), _request(2, 2, 2, 1)]
    assert least_loaded(requests, 3) == 2
    assert least_loaded(requests, 2) == 1                                    # 11 tokens against 30
    assert least_loaded(requests + [_request(3, 20, 1, 1)], 2) == 0         # 32 against 30


def test_layouts_it_cannot_run_are_refused_naming_the_field():
    check_data_parallel_layout(tp=1, pp=1, speculative_tokens=0)
    for tp, pp, spec, words in [(2, 1, 0, "got tp=2 pp=1"), (1, 2, 0, "got tp=1 pp=2"), (1, 1, 2, "speculation")]:
        with pytest.raises(ValueError, match="EngineConfig.data_parallel_attention") as error:
            check_data_parallel_layout(tp=tp, pp=pp, speculative_tokens=spec)
        assert words in str(error.value)
    sharded = SimpleNamespace(config=SimpleNamespace(moe=SimpleNamespace(input_sharded=True)))
    state = SimpleNamespace(ep_etp=SimpleNamespace(size=2))
    check_moe_input(sharded, state, data_parallel_attention=True)
    with pytest.raises(ValueError, match="set EngineConfig.data_parallel_attention=True"):
        check_moe_input(sharded, state, data_parallel_attention=False)


def test_an_idle_rank_packs_an_empty_step():
    writes, packed = pack_step([], block_size=4, windows={None, 5}, device="cpu")
    assert set(writes) == set(packed) == {None, 5}
    assert all(slots.shape == (0,) for slots in writes.values())
    assert all(keys.gather_slots.shape == (0,) and keys.segments.segments == () for keys in packed.values())


def test_metrics_add_up_and_list_every_data_parallel_rank():
    state = SimpleNamespace(dp=SimpleNamespace(group=None, rank=0, size=2))
    steps = DataParallelSteps(state, "cpu", num_blocks=10)
    steps.reports[0] = RankReport((), DataParallelRankMetrics(1, 0, 3, 10, step_tokens=4))
    steps.reports[1] = RankReport((), DataParallelRankMetrics(2, 1, 6, 10, step_tokens=0), 30, 8, 22, 1)
    local = EngineMetrics(running=1, waiting=0, kv_blocks_used=3, kv_blocks_total=10, prefix_cache_queries=10,
                          prefix_cache_hits=4, prompt_tokens_computed=6, generated_tokens=9, preemptions=0)
    metrics = steps.combined_metrics(local)
    assert (metrics.running, metrics.waiting, metrics.kv_blocks_used, metrics.kv_blocks_total) == (3, 1, 9, 20)
    assert (metrics.prefix_cache_queries, metrics.prefix_cache_hits, metrics.prompt_tokens_computed,
            metrics.preemptions, metrics.generated_tokens) == (40, 12, 28, 1, 9)
    text = render_metrics(metrics, ServingStats())
    for line in ('megamoe_dp_running{dp_rank="1"} 2', 'megamoe_dp_waiting{dp_rank="1"} 1',
                 'megamoe_dp_kv_blocks_used{dp_rank="0"} 3', 'megamoe_dp_kv_blocks_total{dp_rank="1"} 10',
                 'megamoe_dp_step_tokens{dp_rank="0"} 4', 'megamoe_dp_step_tokens{dp_rank="1"} 0',
                 "megamoe_running 3", "megamoe_kv_blocks_used 9"):
        assert line in text.splitlines(), line
    assert "megamoe_dp_" not in render_metrics(local, ServingStats())        # none without data-parallel attention
