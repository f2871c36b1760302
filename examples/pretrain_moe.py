"""Pretrain a small MoE language model with tensor, pipeline, data and expert parallelism.

Runs anywhere with no download: by default it trains a sentencepiece tokenizer and the model on the
Python standard library's own source files. Launch with torchrun, e.g. on 4 CPU ranks::

    torchrun --nproc-per-node 4 examples/pretrain_moe.py --tp 2 --ep 2 --dispatcher allgather
    torchrun --nproc-per-node 4 examples/pretrain_moe.py --pp 2 --ep 2 --dispatcher alltoall

It logs loss, tokens/s, aux loss and expert-load balancedness per step (and to --log-json), saves a
checkpoint, and prints a short greedy sample. With matplotlib installed it also plots the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megamoe import comms
from megamoe.data.corpus import stdlib_corpus_files
from megamoe.data.resumable_sampler import ResumableSampler
from megamoe.data.token_dataset import TokenDataset, build_token_file
from megamoe.data.tokenizer import Tokenizer, train_sentencepiece
from megamoe.inference.pipeline_forward import greedy_generate_uncached
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.checkpoint import (checkpoint_path, latest_checkpoint, load_training_checkpoint,
                                        prune_checkpoints, save_training_checkpoint)
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, MLPConfig, RopeConfig
from parallel_state import destroy_model_parallel, initialize_model_parallel

logger = logging.getLogger("pretrain_moe")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("parallel layout (world size = tp * pp * dp; dp is what is left)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (attention heads, MLPs, vocab)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B schedule)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size (expert slots are split over it)")
    g.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size; default: tp for alltoall, 1 for allgather")
    g.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall",
                   help="alltoall: EP over data-parallel ranks (needs etp == tp); allgather: EP inside the TP "
                        "group (ep * etp divides tp), one all-reduce per MoE layer")
    g.add_argument("--expert-backend", choices=("auto", "torch", "loop", "te"), default="auto",
                   help="grouped-GEMM experts implementation")
    g.add_argument("--num-expert-slots", type=int, default=None,
                   help="expert slots per MoE layer (>= experts, multiple of ep); extra slots replicate experts")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=120, help="optimizer steps")
    t.add_argument("--global-batch", type=int, default=16, help="sequences per step, over all DP ranks")
    t.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    t.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    t.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate")
    t.add_argument("--seed", type=int, default=1234, help="seed of the weights and the data order")
    t.add_argument("--save-dir", type=Path, default=Path("runs/pretrain_moe/checkpoints"),
                   help="checkpoints are written here (atomically, keeping the last complete one)")
    t.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and at the end)")
    t.add_argument("--load-dir", type=Path, default=None,
                   help="resume from the newest checkpoint in this directory (any layout)")
    d = p.add_argument_group("data and model")
    d.add_argument("--work-dir", type=Path, default=Path("runs/pretrain_moe"),
                   help="tokenizer, token file, logs and plots go here")
    d.add_argument("--corpus-bytes", type=int, default=3_000_000,
                   help="bytes of the Python standard library's sources to train on")
    d.add_argument("--vocab-size", type=int, default=2048, help="sentencepiece vocabulary size")
    d.add_argument("--hidden", type=int, default=128, help="model width")
    d.add_argument("--layers", type=int, default=4, help="decoder layers (layer 0 dense, the rest MoE)")
    d.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    d.add_argument("--top-k", type=int, default=2, help="experts per token")
    d.add_argument("--log-json", type=Path, default=None,
                   help="write one JSON object per step here (default: <work-dir>/log.jsonl)")
    d.add_argument("--sample-tokens", type=int, default=32, help="greedy tokens to print at the end")
    return p.parse_args(argv)


def model_config(args, vocab_size: int) -> GPTMoEConfig:
    H, heads = args.hidden, 4
    return GPTMoEConfig(
        family="custom", vocab_size=vocab_size, hidden_size=H, num_layers=args.layers,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=heads, num_key_value_heads=2,
                                  head_dim=H // heads, rope=RopeConfig(dim=H // heads), qk_norm="per_head"),
        moe=MoEConfig(
            router=RouterConfig(hidden_size=H, num_experts=args.experts, top_k=args.top_k, norm_topk_prob=True,
                                aux_loss_coeff=1e-2, use_expert_bias=True),
            ffn_hidden_size=H, num_expert_slots=args.num_expert_slots, dispatcher=args.dispatcher,
            expert_backend=args.expert_backend, shared_experts=SharedExpertsConfig(H, H, gate=True)),
        moe_layer_ids=tuple(range(1, args.layers)), dense_mlp=MLPConfig(hidden_size=H, intermediate_size=4 * H))


def prepare_data(args, rank: int, world_group) -> tuple[Tokenizer, TokenDataset]:
    """Rank 0 trains the tokenizer and tokenizes the corpus once; the others wait and reuse them."""
    args.work_dir.mkdir(parents=True, exist_ok=True)
    prefix = args.work_dir / f"tokenizer_{args.vocab_size}"
    token_file = args.work_dir / f"tokens_{args.vocab_size}_{args.corpus_bytes}.bin"
    if rank == 0 and not token_file.with_suffix(".json").exists():
        files = stdlib_corpus_files(max_bytes=args.corpus_bytes)
        logger.info("training a %d-token sentencepiece model on %d stdlib files", args.vocab_size, len(files))
        model_path = train_sentencepiece(files, prefix, args.vocab_size)
        build_token_file(files, Tokenizer.from_path(model_path), token_file)
    comms.barrier(world_group)
    return Tokenizer.from_path(prefix.with_suffix(".model")), TokenDataset(token_file, args.seq_len)


def plot(records: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: no plot")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in records]
    a.plot(steps, [r["loss"] for r in records])
    a.set(xlabel="step", ylabel="loss", title="training loss")
    b.plot(steps, [r["tokens_per_s"] for r in records])
    b.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    fig.savefig(path)
    logger.info("wrote %s", path)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    world_group = dist.group.WORLD if world > 1 else None
    etp = args.etp if args.etp is not None else (args.tp if args.dispatcher == "alltoall" else 1)
    state = initialize_model_parallel(tp=args.tp, pp=args.pp, ep=args.ep, etp=etp)
    logger.info("world %d: tp %d pp %d dp %d ep %d etp %d, dispatcher %s", world, args.tp, args.pp,
                state.dp_cp.size, args.ep, etp, args.dispatcher)

    tokenizer, dataset = prepare_data(args, rank, world_group)
    config = model_config(args, tokenizer.vocab_size + (-tokenizer.vocab_size) % args.tp)
    torch.manual_seed(args.seed)
    model = GPTMoEModel(config, state)
    initialize_parameters(model, args.seed)
    trainer = Trainer(model, state, TrainConfig(lr=args.lr), world_group=world_group)
    sampler = ResumableSampler(len(dataset), global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
                               dp_rank=state.dp_cp.rank, dp_size=state.dp_cp.size, seed=args.seed)
    if args.load_dir is not None:
        checkpoint = latest_checkpoint(args.load_dir)
        if checkpoint is None:
            raise SystemExit(f"--load-dir {args.load_dir}: no complete checkpoint found there")
        extra = load_training_checkpoint(checkpoint, trainer, world_group=world_group)
        sampler.load_state_dict(extra["sampler_state"])
        logger.info("resumed from %s at step %d", checkpoint, trainer.step)

    log_path = args.log_json or args.work_dir / "log.jsonl"
    records = []
    with open(log_path, "a") if rank == 0 else open(os.devnull, "w") as log:
        while trainer.step < args.steps:
            micro_batches = [dataset.batch(indices) for indices in sampler.next_micro_batches()]
            m = trainer.train_step(micro_batches)
            record = dict(step=m.step, loss=m.loss, aux_loss=m.aux_loss, grad_norm=m.grad_norm,
                          tokens_per_s=m.tokens_per_s, balancedness=m.balancedness, time=time.time())
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            logger.info("step %4d  loss %.4f  aux %.4f  grad-norm %.3f  %7.0f tok/s  balance %.3f",
                        m.step, m.loss, m.aux_loss, m.grad_norm, m.tokens_per_s, m.balancedness)
            if m.step % args.save_every == 0 or m.step == args.steps:
                path = checkpoint_path(args.save_dir, m.step)
                save_training_checkpoint(path, trainer, sampler_state=sampler.state_dict(), world_group=world_group)
                if rank == 0:
                    prune_checkpoints(args.save_dir, keep_last=2)
                logger.info("saved %s", path)

    prompt = "def "
    new_ids = greedy_generate_uncached(model, state, tokenizer.encode(prompt), args.sample_tokens)
    if rank == 0:
        print(f"\n--- greedy sample ---\n{prompt}{tokenizer.decode(new_ids)}\n---------------------", flush=True)
        if records:
            plot(records, args.work_dir / "loss.png")
    destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
