"""The serving engine on 2 gloo ranks with EP 2 (all-to-all): the same offline load served with every rank running
the same batch (replicated attention, rank 0's schedule broadcast) and with data-parallel attention (each rank
its own requests, :mod:`megamoe.serving.data_parallel`).

    python benchmarks/serving_dp.py [--quick] [--requests N] [--new-tokens N] [--repeats N] [--json out.json]

The model (:data:`MODEL`): Qwen3-MoE-like, random weights (the same on both ranks and both systems), fp32, one
thread per rank. The load: ``--requests`` prompts of 32-128 random tokens (seeded), every one queued at once,
``--new-tokens`` greedy tokens each; block size 16, a step budget of 256 tokens per rank.

Per system, over ``--repeats`` measured runs after one warm-up, interleaved run by run (the host's noise then
hits both): the wall time of serving the whole load (min and median: other processes only add time, judge on the
minimum), output tokens/s on the minimum, engine steps, and the tokens each rank computed (attention and MoE
routing): all of them on both ranks with replicated attention, each rank its own with data-parallel attention.
The verdict is data-parallel attention's tokens/s over the replicated one's, on the minima. The script checks that
both systems generate the same token ids (greedy: the rank that serves a request does not change its tokens).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time

from common import NOISY_SPREAD, argument_parser, write_results

from megamoe.spawned_ranks import run_on_ranks

MODEL = dict(vocab_size=4096, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             num_hidden_layers=4, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
             intermediate_size=512, max_position_embeddings=512)
QUICK_MODEL = dict(MODEL, hidden_size=64, num_hidden_layers=2, moe_intermediate_size=32, num_experts=8,
                   intermediate_size=64, head_dim=16, vocab_size=512)
SYSTEMS = {"replicated attention": False, "data-parallel attention": True}


def model_config(fields: dict):
    """The GPTMoEConfig of the Qwen3-MoE config ``fields``, all-to-all dispatch (built once, in the launcher: the
    ranks need no transformers)."""
    import transformers

    from megamoe.models.families import config_from_hf
    config = config_from_hf(transformers.Qwen3MoeConfig(**fields))
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, dispatcher="alltoall"))


def _serve(rank, world_size, config, prompts, new_tokens, repeats):
    """One rank: every system ``repeats + 1`` times (the first a warm-up), interleaved; per run (system, seconds,
    tokens this rank computed, steps, generated ids by request on rank 0)."""
    import torch

    from megamoe.models import GPTMoEModel
    from megamoe.serving import Engine, EngineConfig, SamplingParams
    from parallel_state import destroy_model_parallel, initialize_model_parallel
    state = initialize_model_parallel(ep=2)
    torch.manual_seed(0)
    model = GPTMoEModel(config, state)
    runs = []
    for repeat in range(repeats + 1):
        for name, data_parallel in SYSTEMS.items():
            engine = Engine(model, state, EngineConfig(block_size=16, kv_cache_memory=64 << 20,
                                                       max_num_batched_tokens=256,
                                                       data_parallel_attention=data_parallel))
            computed = [0]
            forward = engine._forward

            def counting_forward(schedule, forward=forward):
                computed[0] += sum(count for _, count in schedule.chunks)
                return forward(schedule)
            engine._forward = counting_forward
            torch.distributed.barrier()
            started, steps, ids = time.perf_counter(), 0, {}
            if rank == 0:
                for request_id, prompt in enumerate(prompts):
                    engine.add_request(request_id, prompt, SamplingParams(max_tokens=new_tokens))
                while engine.has_unfinished():
                    for output in engine.step():
                        if output.finished:
                            ids[output.request_id] = output.token_ids
                    steps += 1
                engine.shutdown()
            else:
                engine.follow()
            if repeat:
                runs.append((name, time.perf_counter() - started, computed[0], steps, ids))
    destroy_model_parallel()
    return runs


def main(argv=None) -> int:
    p = argument_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a tiny model and load (the test suite's smoke run)")
    p.add_argument("--requests", type=int, default=64, help="requests, all queued at once")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per request")
    p.add_argument("--repeats", type=int, default=5, help="measured runs per system (after one warm-up)")
    p.add_argument("--json", default="benchmarks/results/serving_dp.json", help="write the results here")
    args = p.parse_args(argv)
    model = QUICK_MODEL if args.quick else MODEL
    rng = random.Random(0)
    prompts = [[rng.randrange(1, model["vocab_size"]) for _ in range(rng.randrange(32, 129))]
               for _ in range(args.requests)]
    per_rank = run_on_ranks(_serve, 2, args=(model_config(model), prompts, args.new_tokens, args.repeats),
                            timeout_s=3600)
    rows, ids = {}, {}
    for name in SYSTEMS:
        mine = [run for run in per_rank[0] if run[0] == name]
        times = [run[1] for run in mine]
        ids[name] = mine[0][4]
        rows[name] = {"times_s": times, "min_s": min(times), "median_s": statistics.median(times),
                      "spread": statistics.median(times) / min(times),
                      "output_tokens_per_s": args.requests * args.new_tokens / min(times), "steps": mine[0][3],
                      "tokens_computed_per_rank": [[run for run in runs if run[0] == name][0][2] for runs in per_rank]}
    if ids["replicated attention"] != ids["data-parallel attention"]:
        raise SystemExit("the two systems generated different token ids: data-parallel attention changed a "
                         "request's tokens")
    ratio = rows["data-parallel attention"]["output_tokens_per_s"] / rows["replicated attention"]["output_tokens_per_s"]
    print(f"{args.requests} requests of 32-128 prompt tokens, {args.new_tokens} new tokens each, 2 gloo ranks, EP 2 "
          f"all-to-all, {'quick' if args.quick else 'Qwen3-MoE-like'} model {model['hidden_size']}/"
          f"{model['num_hidden_layers']} layers/{model['num_experts']} experts, fp32")
    print(f"{'system':26} {'min s':>8} {'median s':>9} {'tokens/s':>9} {'steps':>6}  tokens computed per rank")
    for name, row in rows.items():
        print(f"{name:26} {row['min_s']:8.3f} {row['median_s']:9.3f} {row['output_tokens_per_s']:9.1f} "
              f"{row['steps']:6d}  {row['tokens_computed_per_rank']}")
    print(f"data-parallel attention / replicated: {ratio:.2f}x output tokens/s (on the minima)")
    noisy = [name for name, row in rows.items() if row["spread"] > NOISY_SPREAD]
    if noisy:
        print(f"WARNING: median/min above {NOISY_SPREAD} for {noisy}: the host was busy")
    write_results(args.json, {"requests": args.requests, "new_tokens": args.new_tokens, "repeats": args.repeats,
                              "model": model, "rows": rows, "noisy_rows": noisy,
                              "verdicts": {"dp_attention_tokens_per_s_over_replicated": ratio}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
