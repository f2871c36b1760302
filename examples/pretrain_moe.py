"""Pretrain or fine-tune a MoE language model with tensor, pipeline, data and expert parallelism.

Runs anywhere with no download: by default it trains a sentencepiece tokenizer and a small model on the
Python standard library's own source files. Launch with torchrun, e.g. on 4 CPU ranks::

    torchrun --nproc-per-node 4 examples/pretrain_moe.py --tp 2 --ep 2 --dispatcher allgather
    torchrun --nproc-per-node 4 examples/pretrain_moe.py --pp 2 --ep 2 --dispatcher alltoall
    torchrun --nproc-per-node 4 examples/pretrain_moe.py --pp 2 --virtual-pipeline-stages 2 --layers 4
    torchrun --nproc-per-node 4 examples/pretrain_moe.py --tp 2 --etp 1 --ep 4 --dispatcher alltoall
    torchrun --nproc-per-node 4 examples/pretrain_moe.py --cp 2 --ep 2 --dispatcher alltoall

Real runs: --data (text, JSON Lines, Parquet, token files, Megatron datasets; blended by --data-weights),
--hf-model (start from a HuggingFace model) or --model-config (a model of that shape from scratch),
--lr-schedule, --eval-fraction / --eval-data, --export-hf (end as a HuggingFace model).

It logs loss, LR, grad norm, tokens/s, model TFLOP/s and MFU, aux loss and expert-load balancedness per
step (to --log-json, and --tensorboard / --wandb-project), skips non-finite steps, saves checkpoints,
and prints a greedy sample and a few temperature samples. With matplotlib installed it also plots the
run.

Rerunning in the same directories continues the run: a --save-dir that holds checkpoints is resumed
from its newest one (with --steps reached, nothing is trained). --overwrite starts afresh instead,
after moving the old checkpoints aside. Each run appends a "run_start" record to the JSON log.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint_tools.format import CheckpointError, read_manifest
from checkpoint_tools.placements import build_placements
from megamoe import comms
from megamoe.after_torchrun import note_newest_checkpoint
from megamoe.data.corpus import stdlib_corpus_files
from megamoe.data.data_arguments import (add_data_arguments, check_data_arguments, data_vocab_size, on_rank_0,
                                         prepare_training_data)
from megamoe.data.eval_split import eval_batches
from megamoe.data.packing import add_packing_arguments, packed_micro_batch, packing_config_from_args
from megamoe.data.resumable_sampler import ResumableSampler
from megamoe.data.token_dataset import build_token_file, recorded_tokenizer, sidecar_path, token_file_matches
from megamoe.data.tokenizer import Tokenizer, train_sentencepiece
from megamoe.inference.generation import GenerationConfig, generate
from megamoe.inference.sampling import SamplingConfig
from megamoe.launch import (HelpFormatter, ScriptArgumentParser, UsageError, add_device_argument,
                           add_launch_arguments, add_no_verify_checksums_argument, default_autocast, init_distributed,
                           launch_world_size, resolve_device, run_script)
from megamoe.machine_memory import available_memory_bytes, format_bytes
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.models.gpt_moe import check_moe_layout_on_grid, default_etp
from megamoe.moe.eplb_arguments import add_eplb_arguments, eplb_config_from_args
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.pipeline import describe_pipeline_schedule
from megamoe.tensor_parallel import initialize_parameters
from megamoe.tensor_parallel.vocab_padding import padded_vocab_size
from megamoe.training.checkpoint import (HFProvenance, checkpoint_path, checkpoint_run_id,
                                         expert_placements_from_checkpoint, foreign_checkpoint_differences,
                                         list_checkpoints, load_training_checkpoint, new_run_id, prune_checkpoints,
                                         resolve_resume_checkpoint, save_training_checkpoint,
                                         verify_resume_checkpoint)
from megamoe.training.checkpoint_health import Health, HealthMonitor
from megamoe.training.grad_sync import global_param_norm
from megamoe.training.hf_export import (export_final_checkpoint, provenance_for_export, tokenizer_side_files,
                                        with_tokenizer)
from megamoe.training.non_finite import NonFiniteTrainingError
from megamoe.training.save_dir_lock import lock_save_dir
from megamoe.training.hf_start import hf_start_config, start_from_hf
from megamoe.training.model_config_file import read_model_config_file
from megamoe.training.evaluation import evaluate_loss
from megamoe.training.metric_sinks import step_record
from megamoe.training.metrics_arguments import (add_metrics_arguments, check_metrics_arguments,
                                                metric_sinks_from_arguments)
from megamoe.training.memory_estimate import estimate_memory, model_parameter_counts
from megamoe.training.mfu import resolve_peak_tflops
from megamoe.training.optim_arguments import add_optim_arguments, param_dtype, train_config_kwargs
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer import AttentionConfig, MLPConfig, RopeConfig
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.recompute_arguments import add_recompute_arguments, recompute_config_from_args
from parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from parallel_state.rank_grid import compute_rank_groups

logger = logging.getLogger("pretrain_moe")

PROG = "pretrain_moe.py"
HEADS = 4
# A few samples at a moderate temperature show what the model learnt better than the greedy one alone,
# which a small model soon locks into a loop (e.g. a run of digits).
SAMPLE_TEMPERATURE, SAMPLE_TOP_K, NUM_SAMPLES = 0.8, 40, 3


def build_parser() -> argparse.ArgumentParser:
    p = ScriptArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    g = p.add_argument_group("parallel layout (world size = tp * cp * pp * dp; dp is what is left)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (attention heads, MLPs, vocab)")
    g.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (1F1B schedule; interleaved with --virtual-pipeline-stages)")
    g.add_argument("--virtual-pipeline-stages", type=int, default=1, metavar="V",
                   help="model chunks per pipeline rank: interleaved 1F1B (Megatron-Core's schedule), bubble "
                        "(pp-1)/(V*m+pp-1) instead of (pp-1)/(m+pp-1) for m micro-batches per step; needs --pp > 1, "
                        "the layers divisible by pp*V, and m a multiple of --pp")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size (expert slots are split over it)")
    g.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size; default: tp for alltoall, 1 for allgather")
    g.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall",
                   help="alltoall: EP over data-parallel ranks, etp dividing tp (etp < tp: MoE parallel "
                        "folding, each TP rank dispatches its own share of the tokens, e.g. --tp 2 --etp 1 "
                        "--ep 4); allgather: EP inside the TP group (ep * etp divides tp), one all-reduce per "
                        "MoE layer")
    g.add_argument("--expert-backend", choices=("auto", "torch", "loop", "te"), default="auto",
                   help="grouped-GEMM experts implementation")
    g.add_argument("--num-expert-slots", type=int, default=None,
                   help="expert slots per MoE layer (>= experts, multiple of ep); extra slots replicate experts; "
                        "default: one per expert")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism (needs --tp > 1): norms and residuals on [B, S/tp, H] chunks, an "
                        "all-gather and a reduce-scatter around each TP block instead of all-reduces; --seq-len "
                        "must be a multiple of --tp")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=1, metavar="N",
                   help="pad the embedding and output layer internally to a multiple of N * tp rows (Megatron's "
                        "flag; its default is 128): any vocabulary runs under any --tp, the padding is masked out "
                        "of the loss and of sampling and never saved. Default 1: padded to a multiple of --tp only")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: each CP rank holds 2 load-balanced chunks of every sequence "
                        "(S/cp tokens) and attention all-gathers keys and values over CP; --seq-len must be a "
                        "multiple of 2*cp; dp = world / (tp * cp * pp). No samples at the end (generation needs cp 1)")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="alltoall with --ep > 1: compute the shared experts' GEMMs while the dispatch and combine "
                        "all-to-alls are in flight (same results)")
    add_launch_arguments(p)
    add_device_argument(p)
    p.add_argument("--autocast", choices=("auto", "none", "bf16", "fp16"), default="auto",
                   help="mixed precision of the matmuls, with fp32 master weights: auto is bf16 where its matmul "
                        "peak measured at startup is >= 4x fp32's (logged), else none (fp32); fp16 uses dynamic "
                        "loss scaling")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=120, help="train until this optimizer step")
    t.add_argument("--global-batch", type=int, default=16, help="sequences per step, over all DP ranks")
    t.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    t.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    t.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate")
    t.add_argument("--seed", type=int, default=1234, help="seed of the weights, the data order and the samples")
    t.add_argument("--save-dir", type=Path, default=None,
                   help="checkpoints are written here (atomically, keeping the last --keep-checkpoints of this run "
                        "and the newest good one); if it holds checkpoints already, the run resumes from the newest; "
                        "locked while the run lasts (a second run into it is refused) "
                        "(default: checkpoints/ in --work-dir)")
    t.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                   help="checkpoints of this run kept in --save-dir (older ones are deleted; the newest good one, "
                        "written before any divergence, is always kept)")
    t.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and at the end)")
    t.add_argument("--load-dir", type=Path, default=None,
                   help="start from the newest checkpoint in this directory, or from this checkpoint folder (a "
                        "step_N folder; any layout); default: --save-dir's newest, if any")
    t.add_argument("--load-step", type=int, default=None, metavar="N",
                   help="start from the checkpoint of step N (in --load-dir, else --save-dir) instead of the newest; "
                        "resuming an earlier step of --save-dir moves its later checkpoints aside into "
                        "<save-dir>/replaced_<run id>/")
    t.add_argument("--allow-foreign-checkpoint", action="store_true",
                   help="resume a checkpoint although it was saved with another model config or tokenizer than this "
                        "run's (refused by default, naming what differs)")
    add_no_verify_checksums_argument(t)
    t.add_argument("--overwrite", action="store_true",
                   help="start afresh although --save-dir holds checkpoints: they are first moved aside into "
                        "<save-dir>/replaced_<run id>/ (nothing is deleted)")
    t.add_argument("--mtp-loss-coeff", type=float, default=None, metavar="C",
                   help="weight of the multi-token-prediction loss (Megatron's: the mean over MTP depths of each "
                        "depth's mean token loss, added to the loss times C); needs MTP layers (--mtp-layers, or "
                        "a DeepSeek-V3 --hf-model / --model-config with them); default: the model config's, 0.1")
    add_packing_arguments(t)
    add_optim_arguments(p)
    add_eplb_arguments(p, unit="steps")
    add_recompute_arguments(p)
    add_data_arguments(p, default_data_help="; default: the Python standard library's sources")
    add_metrics_arguments(p)
    d = p.add_argument_group("model, tokenizer, outputs")
    d.add_argument("--work-dir", type=Path, default=Path("runs/pretrain_moe"),
                   help="tokenizer, token file, logs and plots go here (reused by later runs)")
    d.add_argument("--corpus-bytes", type=int, default=3_000_000,
                   help="bytes of the Python standard library's sources to train on")
    d.add_argument("--vocab-size", type=int, default=2048, help="sentencepiece vocabulary size")
    d.add_argument("--hidden", type=int, default=128, help=f"model width (a multiple of {2 * HEADS})")
    d.add_argument("--layers", type=int, default=4, help="decoder layers (layer 0 dense, the rest MoE)")
    d.add_argument("--mtp-layers", type=int, default=0, metavar="N",
                   help="DeepSeek-V3-style multi-token-prediction layers after the decoder layers (MoE like them), "
                        "on the last pipeline stage; trained with --mtp-loss-coeff (default 0: none)")
    d.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    d.add_argument("--top-k", type=int, default=2, help="experts per token")
    d.add_argument("--hf-model", type=Path, default=None, metavar="DIR",
                   help="start from this HuggingFace model directory (config, weights, tokenizer), loaded in "
                        "process into the run's layout; the model flags (--hidden, --layers, --experts, --top-k, "
                        "--vocab-size) do not apply")
    d.add_argument("--allow-non-finite", action="store_true",
                   help="load --hf-model weights holding NaN or Inf (a warning names each) instead of refusing them")
    d.add_argument("--model-config", type=Path, default=None, metavar="FILE",
                   help="train from scratch a model sized by this JSON file: an HF config.json of a supported "
                        "family, or megamoe config fields (GPTMoEConfig.to_dict, as checkpoints store it); "
                        "--hidden, --layers, --experts and --top-k do not apply")
    d.add_argument("--expert-load", type=Path, default=None, metavar="FILE",
                   help="per-layer expert loads (megamoe.moe.expert_slots.save_expert_load): balanced expert "
                        "placements over the slots, as megamoe-convert import-hf applies them")
    d.add_argument("--tokenizer", type=Path, default=None, metavar="PATH",
                   help="tokenizer file or directory (sentencepiece .model or HF tokenizer.json); default: the "
                        "--hf-model directory's own; with --data token files, the tokenizer their sidecars record "
                        "(when it is still there, unchanged); without --data, a sentencepiece model trained on the "
                        "corpus")
    d.add_argument("--export-hf", type=Path, default=None, metavar="OUT",
                   help="at the end, write the final checkpoint as a HuggingFace model directory (with the "
                        "tokenizer and side files) that transformers loads; OUT must not exist")
    d.add_argument("--log-json", type=Path, default=None,
                   help="append one JSON object per step here, after a run_start record; default: "
                        "<work-dir>/log.jsonl")
    d.add_argument("--sample-tokens", type=int, default=32,
                   help="tokens of each sample printed at the end (0: no samples)")
    d.add_argument("--sample-prompt", default="def ", help="the prompt of the samples")
    return p


# The flags that size the demo's own model, and those of them that also size its tokenizer: a model read from
# a file has its own sizes (and --hf-model its own tokenizer), so giving them there is a mistake, not a wish.
_MODEL_SHAPE_FLAGS = ("hidden", "layers", "experts", "top_k", "mtp_layers", "vocab_size")
_TOKENIZER_SHAPE_FLAGS = ("vocab_size",)


def parse_args(argv=None) -> argparse.Namespace:
    """The flags; UsageError for a model-shape flag given next to what already decides it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = _given_flags(parser, argv)
    for chooser, value, ignored in (
            ("--hf-model", args.hf_model, _MODEL_SHAPE_FLAGS),
            ("--model-config", args.model_config,
             tuple(f for f in _MODEL_SHAPE_FLAGS if f not in _TOKENIZER_SHAPE_FLAGS)),
            ("--tokenizer", args.tokenizer, _TOKENIZER_SHAPE_FLAGS)):
        conflicting = [f"--{name.replace('_', '-')}" for name in ignored if name in given]
        if value is not None and conflicting:
            decided = "the vocabulary is that tokenizer's" if chooser == "--tokenizer" else \
                "the model's sizes (its MTP layers included) are that model's"
            raise UsageError(f"{', '.join(conflicting)} cannot be combined with {chooser} {value}: {decided}; drop "
                             + ("it" if len(conflicting) == 1 else "them"))
    if args.save_dir is None:       # each --work-dir its own checkpoints: another run never resumes the demo's
        args.save_dir = args.work_dir / "checkpoints"
    return args


def _given_flags(parser: argparse.ArgumentParser, argv) -> set[str]:
    """The destinations of the flags on the command line (a default value given explicitly included)."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def model_config(args, vocab_size: int) -> GPTMoEConfig:
    H = args.hidden
    return GPTMoEConfig(
        family="custom", vocab_size=vocab_size, hidden_size=H, num_layers=args.layers,
        attention=AttentionConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=2,
                                  head_dim=H // HEADS, rope=RopeConfig(dim=H // HEADS), qk_norm="per_head"),
        moe=MoEConfig(
            router=RouterConfig(hidden_size=H, num_experts=args.experts, top_k=args.top_k, norm_topk_prob=True,
                                aux_loss_coeff=1e-2, use_expert_bias=True),
            ffn_hidden_size=H, num_expert_slots=args.num_expert_slots, dispatcher=args.dispatcher,
            expert_backend=args.expert_backend, shared_experts=SharedExpertsConfig(H, H, gate=True)),
        moe_layer_ids=tuple(range(1, args.layers + args.mtp_layers)),
        dense_mlp=MLPConfig(hidden_size=H, intermediate_size=4 * H), sequence_parallel=args.sequence_parallel,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, mtp_num_layers=args.mtp_layers)


# ----------------------------------------------------------------------------------------------
# Validation: everything a user can get wrong fails here, in one line, before any expensive work
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The model of --hf-model or --model-config (``config``; None: the demo's own, sized by the model
    flags and the tokenizer), the HF provenance its checkpoints carry (None: not exportable), and the
    tokenizer given by --tokenizer or --hf-model (None: one is trained)."""

    config: GPTMoEConfig | None
    provenance: HFProvenance | None
    tokenizer: Tokenizer | None
    footprint: "Footprint | None" = None        # set by check_arguments


@dataclasses.dataclass(frozen=True)
class Footprint:
    """The model's parameter counts and the estimated bytes each rank holds (for the start's log line)."""

    total_params: int
    active_params: int
    bytes_per_rank: int


def _model_flag(args) -> str:
    """What chose the model, as error messages name it."""
    if args.hf_model is not None:
        return f"--hf-model {args.hf_model}"
    if args.model_config is not None:
        return f"--model-config {args.model_config}"
    return "the demo's own model (no --hf-model or --model-config)"


def model_source(args) -> ModelSource:
    """Reads the model's config (no weights) and the tokenizer; raises UsageError naming the flag."""
    engine = dict(dispatcher=args.dispatcher, num_expert_slots=args.num_expert_slots,
                  expert_backend=args.expert_backend)
    config = provenance = tokenizer = None
    try:
        if args.hf_model is not None:
            start = hf_start_config(args.hf_model, **engine)
            config, provenance = start.config, start.provenance
        elif args.model_config is not None:
            file = read_model_config_file(args.model_config, **engine)
            config = file.config
            provenance = HFProvenance(file.hf_config, {}) if file.hf_config is not None else None
    except ValueError as e:
        raise UsageError(f"{_model_flag(args).split()[0]}: {e}") from None
    tokenizer_path = args.tokenizer if args.tokenizer is not None else args.hf_model
    if tokenizer_path is None:
        tokenizer_path = data_tokenizer_path(args)
    if tokenizer_path is not None:
        try:
            tokenizer = Tokenizer.from_path(tokenizer_path)
        except (ValueError, OSError, ImportError) as e:
            raise UsageError(f"--tokenizer {tokenizer_path}: {e}") from None
    return ModelSource(config, provenance, tokenizer)


def data_tokenizer_path(args) -> Path | None:
    """The tokenizer the sidecars of the --data / --eval-data token files record, when they all record the
    same one and it is still there unchanged (None otherwise: --tokenizer is needed, as before)."""
    tokenizers = [recorded_tokenizer(path) for path in [*(args.data or []), *args.eval_data]
                  if sidecar_path(path).is_file()]
    if not tokenizers or None in tokenizers or len({t.sha256 for t in tokenizers}) != 1:
        return None
    logger.info("tokenizer: %s, which the --data token files record", tokenizers[0].path)
    return tokenizers[0].path


def _check_model_source(args, source: ModelSource) -> tuple[GPTMoEConfig, HFProvenance | None]:
    """The checks of a model given by a file, of the tokenizer and the data against the model; returns
    the model config (for the demo's own model: with the vocabulary the tokenizer will have) and the
    HF provenance its checkpoints carry (with --export-hf, written for a model that has none)."""
    provenance = source.provenance
    config = source.config
    if config is not None and config.weight_quantization is not None:
        # Kept block-FP8 weights are frozen e4m3 values with block scales: an inference format.
        raise UsageError(f"{_model_flag(args)} holds kept block-FP8 weights (weight_quantization), which are for "
                         "inference only and cannot be trained: import the checkpoint with `import-hf --dtype bf16` "
                         "(or fp32) and train from that")
    data_vocab = data_vocab_size(args, source.tokenizer)
    if data_vocab is None and source.tokenizer is None and args.data is not None and config is None:
        raise UsageError("--data names only Megatron datasets, which record no vocabulary: give the tokenizer that "
                         "made them (--tokenizer), or the model (--hf-model / --model-config)")
    if source.tokenizer is not None:
        vocab = source.tokenizer.vocab_size
    else:
        vocab = data_vocab if data_vocab is not None else args.vocab_size
    what = (f"the tokenizer {source.tokenizer.path}" if source.tokenizer is not None else
            f"--data {args.data} (its token ids)" if args.data is not None else f"--vocab-size {args.vocab_size}")
    if config is None:
        config = model_config(args, vocab)
    else:
        if vocab > config.vocab_size:
            raise UsageError(f"{what} has a vocabulary of {vocab} tokens, more than the model's vocab_size "
                             f"{config.vocab_size}: its ids would index past the embedding; use a tokenizer of at "
                             "most that many tokens (--tokenizer) or a model config with a larger vocab_size")
    if args.mtp_loss_coeff is not None and not config.mtp_num_layers:
        raise UsageError(f"--mtp-loss-coeff {args.mtp_loss_coeff:g} weighs the MTP layers' loss, but the model has "
                         "none: add --mtp-layers N (the demo's model) or start from a DeepSeek-V3 checkpoint holding them")
    if data_vocab is not None and data_vocab > config.vocab_size:
        raise UsageError(f"--data was tokenized with a vocabulary of {data_vocab} tokens, more than the model's "
                         f"vocab_size {config.vocab_size}: tokenize it with the model's tokenizer")
    if args.data is not None and source.tokenizer is None and args.sample_tokens:
        raise UsageError("--data without a tokenizer: give --tokenizer (or --hf-model) for the samples, or "
                         "--sample-tokens 0")
    if args.export_hf is not None:
        if args.export_hf.exists():
            raise UsageError(f"--export-hf {args.export_hf} already exists; remove it or choose another path")
        try:
            provenance = provenance_for_export(config, provenance, _model_flag(args))
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.expert_load is not None:
        try:
            build_placements(config, args.ep, expert_load=args.expert_load)
        except ValueError as e:
            raise UsageError(f"--expert-load {args.expert_load}: {e}") from None
    return config, provenance


def check_arguments(args, world_size: int, device: torch.device = torch.device("cpu")) -> ModelSource:
    """Flag values, the layout against ``world_size`` ranks and the memory it needs on ``device``; raises
    UsageError naming the flag. Returns the model source (read from --hf-model / --model-config /
    --tokenizer: configs, no weights) with its footprint."""
    for flag in ("steps", "global_batch", "micro_batch", "seq_len", "save_every", "corpus_bytes", "hidden",
                 "layers", "experts", "top_k", "cp"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.sample_tokens < 0:
        raise UsageError(f"--sample-tokens must be >= 0, got {args.sample_tokens}")
    if args.seed < 0:           # now, not when the samples' SamplingConfig refuses it after the run
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.sample_tokens and not args.sample_prompt:
        raise UsageError("--sample-prompt is empty: the samples continue a prompt; give one, or --sample-tokens 0 "
                         "for no samples")
    if not 0 < args.lr < float("inf"):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if args.hidden % (2 * HEADS):
        raise UsageError(f"--hidden must be a multiple of {2 * HEADS} ({HEADS} heads of even size), got {args.hidden}")
    if args.hf_model is not None and args.model_config is not None:
        raise UsageError("--hf-model and --model-config both choose the model; give one of them")
    check_data_arguments(args)
    train_config_kwargs(args, train_steps=args.steps)            # the schedule flags: UsageError naming the flag
    recompute_config_from_args(args)                             # the recompute flags: the same
    try:
        check_metrics_arguments(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.mtp_layers < 0:
        raise UsageError(f"--mtp-layers must be >= 0, got {args.mtp_layers}")
    if args.mtp_loss_coeff is not None and not 0 <= args.mtp_loss_coeff < float("inf"):
        raise UsageError(f"--mtp-loss-coeff must be a finite number >= 0, got {args.mtp_loss_coeff}")
    if args.top_k > args.experts:
        raise UsageError(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if args.make_vocab_size_divisible_by < 1:
        raise UsageError(f"--make-vocab-size-divisible-by must be >= 1, got {args.make_vocab_size_divisible_by}")
    if args.sequence_parallel and args.tp < 2:
        raise UsageError(f"--sequence-parallel splits the sequence over the TP group: it needs --tp > 1, got --tp "
                         f"{args.tp}")
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        raise UsageError(f"--cp {args.cp} splits every sequence into 2*cp = {2 * args.cp} load-balanced chunks: "
                         f"--seq-len {args.seq_len} must be divisible by {2 * args.cp}")
    if args.sequence_parallel and (args.seq_len // args.cp) % args.tp:
        raise UsageError(f"--sequence-parallel: --seq-len {args.seq_len} / --cp {args.cp} must be divisible by --tp "
                         f"{args.tp}")
    if args.moe_shared_expert_overlap and args.dispatcher != "alltoall":
        raise UsageError("--moe-shared-expert-overlap overlaps the shared experts with the dispatch all-to-all: it "
                         f"needs --dispatcher alltoall, got --dispatcher {args.dispatcher}")
    source = model_source(args)
    if source.tokenizer is not None:
        try:
            packing_config_from_args(args, source.tokenizer.eos_id)
        except ValueError as e:
            raise UsageError(str(e)) from None
    etp = default_etp(args.tp, args.dispatcher, args.etp)
    try:
        grid = compute_rank_groups(world_size, tp=args.tp, pp=args.pp, ep=args.ep, etp=etp, cp=args.cp)
    except ValueError as e:
        cp_flag = f" --cp {args.cp}" if args.cp > 1 else ""
        raise UsageError(f"the layout --tp {args.tp}{cp_flag} --pp {args.pp} --ep {args.ep} (etp {etp}) does not fit "
                         f"{world_size} rank(s): {e}; change the flags or the number of ranks "
                         "(torchrun --nproc-per-node)") from None
    if source.config is None:
        layers, experts, layers_flag, experts_flag = args.layers, args.experts, "--layers", "--experts"
    else:
        moe = source.config.moe
        layers, experts = source.config.num_layers, moe.num_experts if moe else 0
        layers_flag, experts_flag = "the model's layers", "the model's experts"
    if args.pp > layers:
        raise UsageError(f"--pp {args.pp} exceeds {layers_flag} ({layers}): each stage needs a layer")
    v = args.virtual_pipeline_stages
    if v < 1:
        raise UsageError(f"--virtual-pipeline-stages must be >= 1, got {v}")
    if v > 1 and args.pp < 2:
        raise UsageError(f"--virtual-pipeline-stages {v} interleaves model chunks over a pipeline: it needs --pp > 1, "
                         f"got --pp {args.pp}")
    if v > 1 and layers % (args.pp * v):
        raise UsageError(f"--virtual-pipeline-stages {v} with --pp {args.pp}: {layers_flag} ({layers}) must split into "
                         f"pp * V = {args.pp * v} virtual stages of equal size")
    slots = args.num_expert_slots if args.num_expert_slots is not None else experts
    if eplb_config_from_args(args) is not None and not experts:
        raise UsageError(f"--eplb-interval: {_model_flag(args)} has no MoE layer, so there is no expert to "
                         "rebalance")
    if experts and (slots < experts or slots % args.ep):
        raise UsageError(f"--num-expert-slots ({slots}) must be >= {experts_flag} ({experts}) and a multiple of "
                         f"--ep ({args.ep})")
    dp = world_size // (args.tp * args.cp * args.pp)
    if args.global_batch % (dp * args.micro_batch):
        raise UsageError(f"--global-batch {args.global_batch} must be a multiple of dp * --micro-batch = "
                         f"{dp}*{args.micro_batch} = {dp * args.micro_batch}")
    micro_batches = args.global_batch // (dp * args.micro_batch)
    if v > 1 and micro_batches % args.pp:
        raise UsageError(f"--virtual-pipeline-stages {v}: the interleaved schedule needs the micro-batches per step "
                         f"(m = --global-batch / (dp * --micro-batch) = {micro_batches}) to be a multiple of --pp "
                         f"{args.pp}")
    try:
        config, provenance = _check_model_source(args, source)
    except ValueError as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"model flags: {e}") from None
    config = dataclasses.replace(config, sequence_parallel=args.sequence_parallel,
                                 make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    try:
        padded_vocab_size(config.vocab_size, args.tp, args.make_vocab_size_divisible_by)
    except ValueError as e:
        raise UsageError(f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} with --tp {args.tp}: "
                         f"{e}") from None
    try:
        check_moe_layout_on_grid(config, grid)
    except ValueError as e:
        raise UsageError(f"--dispatcher {args.dispatcher} with --tp {args.tp} --ep {args.ep} (etp {etp}): "
                         f"{e}") from None
    heads = config.attention.num_attention_heads
    if heads % args.tp:
        raise UsageError(f"--tp {args.tp} splits the attention heads over the TP ranks: {_model_flag(args)} has "
                         f"{heads} heads, not divisible by {args.tp}; choose a --tp that divides {heads}")
    footprint = _check_memory(args, config, world_size=world_size, dp=dp, etp=etp, micro_batches=micro_batches,
                              device=device)
    return dataclasses.replace(source, provenance=provenance, footprint=footprint)


def _check_memory(args, config: GPTMoEConfig, *, world_size: int, dp: int, etp: int, micro_batches: int,
                  device: torch.device) -> Footprint:
    """Refuse a run whose estimated memory exceeds what the machine has, before anything is allocated (sizes
    like --hidden 65536 otherwise end in an allocator traceback or the OOM killer). The estimate is a floor
    (weights, gradients, optimizer state, saved activations, the samples' KV cache; no temporaries), so a
    run it lets through may still not fit."""
    total, active = model_parameter_counts(config)
    # Counted at once, and a floor of what a rank holds: its share of the weights alone. Sizes far too large
    # are refused by it before the per-layer estimate, which takes seconds for 10^5 layers.
    weights_share = total * param_dtype(args).itemsize // (args.tp * args.pp * args.ep)
    available, what = available_memory_bytes(device)
    try:
        estimate = None if available is not None and weights_share > available else estimate_memory(
            config, tp=args.tp, pp=args.pp, ep=args.ep, etp=etp, dp=dp, cp=args.cp, micro_batch=args.micro_batch,
            seq_len=args.seq_len, num_micro_batches=micro_batches, distributed_optimizer=args.distributed_optimizer,
            zero_stage=args.zero_stage, recompute=recompute_config_from_args(args),
            sequence_parallel=args.sequence_parallel, param_dtype=param_dtype(args),
            num_expert_slots=args.num_expert_slots)
    except ValueError as e:
        raise UsageError(f"{_model_flag(args)} under --tp {args.tp} --pp {args.pp} --ep {args.ep}: {e}") from None
    if estimate is None:
        per_rank, held = weights_share, "its share of the weights alone"
    else:
        state = estimate.param_bytes + estimate.grad_bytes + estimate.optimizer_bytes
        per_rank = max(estimate.total, state + _sample_cache_bytes(args, config))
        held = (f"weights, gradients, optimizer state, activations of --micro-batch {args.micro_batch} x --seq-len "
                f"{args.seq_len}, the samples' KV cache")
    # CPU ranks of a node share its memory; each GPU is its rank's own.
    sharing = 1 if device.type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if available is not None and per_rank * sharing > available:
        ranks = f" x {sharing} ranks = {format_bytes(per_rank * sharing)}" if sharing > 1 else ""
        raise UsageError(f"the run needs at least {format_bytes(per_rank)} per rank{ranks} ({held}; "
                         f"{total:,} parameters) but the {what} is {format_bytes(available)}: choose smaller sizes, "
                         "more ranks (--tp / --pp / --ep), or --distributed-optimizer / --recompute")
    return Footprint(total, active, per_rank)


def _sample_cache_bytes(args, config: GPTMoEConfig) -> int:
    """The KV cache of the samples printed at the end: NUM_SAMPLES sequences of the prompt (at most one
    token per byte, plus BOS) and --sample-tokens, over this rank's layers and KV heads."""
    if not args.sample_tokens or args.cp > 1:
        return 0
    attention = config.attention
    if isinstance(attention, MLAConfig):
        per_token = attention.kv_lora_rank + attention.qk_rope_head_dim
    else:
        per_token = 2 * -(-attention.num_key_value_heads // args.tp) * attention.head_dim
    positions = len(args.sample_prompt.encode()) + 1 + args.sample_tokens
    layers = -(-(config.num_layers + config.mtp_num_layers) // args.pp)
    return NUM_SAMPLES * positions * layers * per_token * param_dtype(args).itemsize


def log_path(args) -> Path:
    return args.log_json if args.log_json is not None else args.work_dir / "log.jsonl"


def _check_directory_flag(flag: str, path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} exists and is not a directory")


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """Where a run starts: ``resume_from`` (a checkpoint, or None: fresh weights), whether that is one of
    --save-dir's own checkpoints, and which of --save-dir's checkpoints are moved aside first: those of
    steps after ``move_aside_after`` (None: none; -1: all, --overwrite; a step: the later ones, when a run
    resumes an earlier step of its own directory)."""

    resume_from: str | None
    resumes_save_dir: bool
    move_aside_after: int | None


def _resume_checkpoint(flag: str, location: Path, step: int | None) -> str:
    try:
        return resolve_resume_checkpoint(location, step)
    except CheckpointError as e:
        raise UsageError(f"{flag} {e}") from None


def plan_start(args) -> StartPlan:
    """Check the output paths and decide where the run starts; reads, never writes."""
    _check_directory_flag("--work-dir", args.work_dir)
    _check_directory_flag("--save-dir", args.save_dir)
    if args.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be >= 1, got {args.keep_checkpoints}")
    if args.load_step is not None and args.load_step < 0:
        raise UsageError(f"--load-step must be >= 0, got {args.load_step}")
    log = log_path(args)
    if log.is_dir():
        raise UsageError(f"--log-json {log} is a directory; name a file")
    if args.log_json is not None and not log.parent.is_dir():
        raise UsageError(f"--log-json {log}: folder {log.parent} does not exist; create it or choose another path")
    saved = list_checkpoints(args.save_dir)
    save_dir = args.save_dir.resolve()
    # --load-dir naming --save-dir, or one of its step folders, continues this directory's run.
    own = args.load_dir is not None and (args.load_dir.resolve() == save_dir or (
        args.load_dir.resolve().parent == save_dir and args.load_dir.name.startswith("step_")))
    if args.overwrite and own:
        raise UsageError(f"--overwrite with --load-dir {args.load_dir} in --save-dir ({args.save_dir}) would move "
                         "aside the checkpoint to load; drop one of them")
    if args.load_dir is not None and not own:
        resume_from = _resume_checkpoint("--load-dir", args.load_dir, args.load_step)
        if saved and not args.overwrite:
            raise UsageError(f"--save-dir {args.save_dir} already holds checkpoints of another run (newest: step "
                             f"{saved[-1][0]}); pass --overwrite to move them aside, or choose another --save-dir")
        plan = StartPlan(resume_from, False, -1 if args.overwrite else None)
    elif args.overwrite:
        if args.load_step is not None:
            raise UsageError(f"--load-step {args.load_step} with --overwrite: --overwrite starts afresh; drop one of "
                             "them (or give --load-dir to start from another directory's checkpoint)")
        plan = StartPlan(None, False, -1)
    elif saved or own or args.load_step is not None:
        resume_from = (_resume_checkpoint("--load-dir", args.load_dir, args.load_step) if own else
                       _resume_checkpoint("--save-dir" if args.load_step is None else
                                          f"--load-step {args.load_step}: --save-dir", args.save_dir, args.load_step))
        step = next((s for s, path in saved if Path(path).resolve() == Path(resume_from).resolve()), None)
        later = step is not None and step < saved[-1][0]
        plan = StartPlan(resume_from, True, step if later else None)
    else:
        plan = StartPlan(None, False, None)
    if plan.resume_from is not None:
        manifest = read_manifest(plan.resume_from)              # a cut or foreign manifest fails here, early
        if not isinstance(manifest.get("extra"), dict) or "step" not in manifest["extra"]:
            raise UsageError(f"{plan.resume_from} is not a training checkpoint (its manifest has no step); "
                             "pass --load-dir with one saved by this script")
    return plan


# ----------------------------------------------------------------------------------------------
# Data, checkpoints, samples
# ----------------------------------------------------------------------------------------------
def stdlib_token_file(args, rank: int, world_group, tokenizer: Tokenizer | None) -> tuple[Tokenizer, Path]:
    """The demo's data: rank 0 tokenizes --corpus-bytes of the standard library's sources (training a
    sentencepiece model first unless ``tokenizer`` is given), or reuses what an earlier run made."""
    def build() -> Path:
        if tokenizer is not None:
            token_file = args.work_dir / f"tokens_{tokenizer.sha256[:12]}_{args.corpus_bytes}.bin"
            if not token_file_matches(token_file, tokenizer):
                build_token_file(stdlib_corpus_files(max_bytes=args.corpus_bytes), tokenizer, token_file)
            return token_file
        prefix = args.work_dir / f"tokenizer_{args.vocab_size}_{args.corpus_bytes}"
        token_file = args.work_dir / f"tokens_{args.vocab_size}_{args.corpus_bytes}.bin"
        files = None
        if prefix.with_suffix(".model").is_file():
            logger.info("reusing tokenizer %s", prefix.with_suffix(".model"))
        else:
            files = stdlib_corpus_files(max_bytes=args.corpus_bytes)
            logger.info("training a %d-token sentencepiece model on %d stdlib files", args.vocab_size, len(files))
            train_sentencepiece(files, prefix, args.vocab_size)
        trained = Tokenizer.from_path(prefix.with_suffix(".model"))
        if token_file_matches(token_file, trained):
            logger.info("reusing token file %s", token_file)
        else:
            build_token_file(files or stdlib_corpus_files(max_bytes=args.corpus_bytes), trained, token_file)
        return token_file

    token_file = Path(on_rank_0(build, rank, world_group))
    if tokenizer is None:
        tokenizer = Tokenizer.from_path(args.work_dir / f"tokenizer_{args.vocab_size}_{args.corpus_bytes}.model")
    return tokenizer, token_file


def move_aside(save_dir: Path, run_id: str, after_step: int = -1) -> None:
    """Move --save-dir's checkpoints of steps after ``after_step`` (and what interrupted saves of those steps
    left) out of the way, into ``<save_dir>/replaced_<run_id>/``, which checkpoint listing and pruning
    ignore: all of them for --overwrite (-1), the later ones when a run resumes an earlier step of its own
    directory (they belong to the timeline it abandons, and would otherwise be pruned or resumed as its own)."""
    entries = sorted(entry for entry in save_dir.glob("step_*") if _step_of_entry(entry) > after_step) \
        if save_dir.is_dir() else []
    if not entries:
        return
    destination, attempt = save_dir / f"replaced_{run_id}", 1
    while destination.exists():         # a run that rolls back twice keeps both timelines it abandoned
        attempt += 1
        destination = save_dir / f"replaced_{run_id}.{attempt}"
    destination.mkdir()
    for entry in entries:
        os.replace(entry, destination / entry.name)
    logger.info("%s: moved %d entries of the previous run to %s", "--overwrite" if after_step < 0 else
                f"resuming step {after_step}", len(entries), destination)


def _step_of_entry(entry: Path) -> int:
    """The step of a ``step_<N>[.old|.tmp-...]`` entry of a save directory (-1: none)."""
    digits = entry.name.removeprefix("step_").split(".")[0]
    return int(digits) if digits.isdigit() else -1


def print_samples(model, state, tokenizer: Tokenizer, args, rank: int) -> None:
    """Greedy and temperature samples of --sample-prompt: collective, every rank generates (under
    --sequence-parallel with a copy of the model built without it: decoding cannot split the sequence)."""
    model = model.without_sequence_parallel()
    prompt = tokenizer.encode(args.sample_prompt)
    greedy = generate(model, state, [prompt], GenerationConfig(max_new_tokens=args.sample_tokens))
    sampling = SamplingConfig(temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K, seed=args.seed)
    sampled = generate(model, state, [prompt] * NUM_SAMPLES,
                       GenerationConfig(max_new_tokens=args.sample_tokens, sampling=sampling))
    if rank == 0:
        text = [f"--- greedy sample ---\n{args.sample_prompt}{tokenizer.decode(greedy.token_ids[0])}"]
        # One batch, one seed: each request draws from its own stream, seeded by (seed, request number).
        text += [f"--- sample {i + 1} (temperature {SAMPLE_TEMPERATURE}, top-k {SAMPLE_TOP_K}, seed {args.seed} "
                 f"request {i}) ---\n{args.sample_prompt}{tokenizer.decode(ids)}"
                 for i, ids in enumerate(sampled.token_ids)]
        print("\n" + "\n".join(text) + "\n---------------------", flush=True)


def check_same_model(args, checkpoint: str, model, tokenizer_files: dict[str, bytes] | None) -> None:
    """Refuse (UsageError naming what differs) to resume a checkpoint of another model config or tokenizer
    than this run's, unless --allow-foreign-checkpoint (then a warning)."""
    differences = foreign_checkpoint_differences(checkpoint, model.config.to_dict(), tokenizer_files)
    if not differences:
        return
    if args.allow_foreign_checkpoint:
        logger.warning("--allow-foreign-checkpoint: resuming %s, saved with another model: %s", checkpoint,
                       "; ".join(differences))
        return
    raise UsageError(f"{checkpoint} was saved with another model or tokenizer than this run's: "
                     f"{'; '.join(differences[:8])}{'; ...' if len(differences) > 8 else ''}. Give this run its own "
                     "--save-dir (or --work-dir), --overwrite to move those checkpoints aside, or "
                     "--allow-foreign-checkpoint to load them anyway")


def _suspect_reason(checkpoint: str) -> str:
    extra = read_manifest(checkpoint).get("extra") or {}
    recorded = Health.from_dict(extra.get("health"))
    return recorded.suspect if recorded is not None and recorded.suspect else "not verified finite"


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


def _json_args(args) -> dict:
    return {k: (os.fspath(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    source = check_arguments(args, launch_world_size(), device)
    plan = plan_start(args)
    rank, world = init_distributed(comm_timeout_s=args.comm_timeout, device=device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    # after the thread count is set and logging is on: auto measures the matmul peaks of this rank, logs why
    autocast = default_autocast(device) if args.autocast == "auto" else None if args.autocast == "none" else args.autocast
    world_group = dist.group.WORLD if world > 1 else None
    etp = default_etp(args.tp, args.dispatcher, args.etp)
    state = (initialize_model_parallel(tp=args.tp, pp=args.pp, ep=args.ep, etp=etp, cp=args.cp,
                                       timeout=datetime.timedelta(seconds=args.comm_timeout))
             if dist.is_initialized() else ParallelState.single_process())
    logger.info("world %d: tp %d cp %d pp %d dp %d ep %d etp %d, dispatcher %s; device %s%s, autocast %s", world,
                args.tp, state.cp.size, args.pp, state.dp.size, args.ep, etp, args.dispatcher, device,
                f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "", autocast or "none (fp32)")
    footprint = source.footprint
    logger.info("model: %s parameters, %s active per token; estimated memory per rank %s (weights, gradients, "
                "optimizer state, saved activations; temporaries come on top)", f"{footprint.total_params:,}",
                f"{footprint.active_params:,}", format_bytes(footprint.bytes_per_rank))
    # A run resumed from its own save directory continues that run's id, so it prunes the older
    # checkpoints of the run; a fresh start (or another --load-dir) is a new run.
    inherited = checkpoint_run_id(plan.resume_from) if plan.resumes_save_dir else None
    run_id = comms.all_gather_object(inherited or new_run_id(), world_group)[0]

    # Token ids are checked against the tokenizer's vocabulary where there is one: the model's may be
    # larger (padded, or an HF config's round number), and would let ids no tokenizer makes train silently.
    known_vocab = (source.tokenizer.vocab_size if source.tokenizer is not None else
                   source.config.vocab_size if source.config is not None else None)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, default_paths = source.tokenizer, []
    if args.data is None:
        tokenizer, token_file = stdlib_token_file(args, rank, world_group, tokenizer)
        default_paths = [token_file]
    data = prepare_training_data(args, rank, world_group, tokenizer, vocab_size=known_vocab, work_dir=args.work_dir,
                                 default_train_paths=default_paths)
    packing = packing_config_from_args(args, tokenizer.eos_id if tokenizer is not None else
                                       data.sources[0].source.eos_id)
    # Every checkpoint carries the tokenizer, as a conversion's does: generate.py finds it there.
    tokenizer_files = tokenizer_side_files(tokenizer) if tokenizer is not None else None
    logger.info("packed documents: %s", packing or "off (plain causal rows)")
    torch.manual_seed(args.seed)
    provenance = source.provenance
    if provenance is not None and tokenizer is not None:
        provenance = with_tokenizer(provenance, tokenizer)      # the HF directory's own, or the run's
    # A resumed run keeps the placements its checkpoint reached (e.g. by --eplb-interval) where the slots and
    # the EP size are the same.
    saved = expert_placements_from_checkpoint(plan.resume_from) if plan.resume_from is not None else None
    if args.hf_model is not None:
        # Resuming: the checkpoint overwrites every weight, so the HF tensors are not read.
        model, _ = start_from_hf(args.hf_model, state, dispatcher=args.dispatcher,
                                 num_expert_slots=args.num_expert_slots, expert_load=args.expert_load,
                                 expert_backend=args.expert_backend, device=device, dtype=param_dtype(args),
                                 load_weights=plan.resume_from is None, saved_placements=saved,
                                 recompute=recompute_config_from_args(args), sequence_parallel=args.sequence_parallel,
                                 virtual_pipeline_stages=args.virtual_pipeline_stages,
                                 make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                 allow_non_finite=args.allow_non_finite)
        logger.info("started from %s (%s)%s", args.hf_model, model.config.family,
                    "" if plan.resume_from is None else ": model only, the weights come from the checkpoint")
    else:
        config = source.config
        if config is None:
            config = model_config(args, tokenizer.vocab_size if tokenizer is not None else max(
                dataset.meta.vocab_size for dataset in data.sources if dataset.meta is not None))
        # Recomputation, sequence parallelism and the vocabulary padding are the engine's choices, whatever
        # the model source (a checkpoint resumes under any).
        config = dataclasses.replace(config, recompute=recompute_config_from_args(args),
                                     sequence_parallel=args.sequence_parallel,
                                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        placements = build_placements(config, state.ep.size, expert_load=args.expert_load, saved=saved)
        model = GPTMoEModel(config, state, placements=placements, device=device, dtype=param_dtype(args),
                            virtual_pipeline_stages=args.virtual_pipeline_stages)
        initialize_parameters(model, args.seed)
    if args.mtp_loss_coeff is not None:         # a training choice: the model is the same
        model.config = dataclasses.replace(model.config, mtp_loss_coeff=args.mtp_loss_coeff)
    # An engine choice (like the dispatcher), whatever the model source: a checkpoint resumes under either.
    for layer in model.moe_layers().values():
        layer.config = dataclasses.replace(layer.config, shared_expert_overlap=args.moe_shared_expert_overlap)
    if plan.resume_from is not None:
        # A checkpoint of this run carries the provenance it started with (the HF model's, or a config.json's).
        provenance = HFProvenance.of_checkpoint(plan.resume_from) or provenance
    matmul_dtype = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[autocast]
    peak = resolve_peak_tflops(device, matmul_dtype, explicit_tflops=args.peak_tflops)
    trainer = Trainer(model, state, TrainConfig(lr=args.lr, autocast=autocast, eplb=eplb_config_from_args(args),
                                                **train_config_kwargs(args, train_steps=args.steps)),
                      world_group=world_group, peak_tflops=peak.tflops)
    sampler = ResumableSampler(len(data.train), global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
                               dp_rank=state.dp.rank, dp_size=state.dp.size, seed=args.seed)   # CP ranks: the same
    logger.info("%s", describe_pipeline_schedule(state.pp.size, sampler.num_micro_batches,
                                                 args.virtual_pipeline_stages))
    if plan.resume_from is not None:
        check_same_model(args, plan.resume_from, model, tokenizer_files)
        if args.verify_checksums:
            verify_resume_checkpoint(plan.resume_from, world_group=world_group)
        extra = load_training_checkpoint(plan.resume_from, trainer, world_group=world_group,
                                         verify_checksums=args.verify_checksums,
                                         override_lr_schedule=args.override_opt_param_scheduler)
        sampler.load_state_dict(extra["sampler_state"])
        logger.info("resuming from %s at step %d (run %s)", plan.resume_from, trainer.step, run_id)
        note_newest_checkpoint(plan.resume_from)      # named if torchrun stops the job (a rank killed)
    # Before the first write into --save-dir (and after every check a user error can fail: none leaves it behind).
    save_dir_lock = lock_save_dir(args.save_dir, run_id, world_group=world_group)
    if rank == 0 and plan.move_aside_after is not None:
        move_aside(args.save_dir, run_id, plan.move_aside_after)
    if trainer.step >= args.steps:
        logger.info("nothing to train: the run is at step %d and --steps is %d (raise --steps to train further)",
                    trainer.step, args.steps)

    def packed(micro_batches):
        if packing is None:
            return micro_batches
        return [packed_micro_batch(inputs, labels, packing) for inputs, labels in micro_batches]

    def evaluate() -> float:
        """The loss of the first --eval-iters global batches of held-out data (all of it for 0)."""
        num_samples = min(len(data.eval), args.eval_iters * args.global_batch) if args.eval_iters else None
        batches = eval_batches(data.eval, global_batch_size=args.global_batch, micro_batch_size=args.micro_batch,
                               dp_rank=state.dp.rank, dp_size=state.dp.size, num_samples=num_samples)
        return evaluate_loss(model, state, packed([mb for step in batches for mb in step]), world_group=world_group,
                             autocast_dtype=trainer.autocast_dtype)

    health = HealthMonitor.resuming(plan.resume_from)
    if plan.resume_from is not None and health.reference_path != plan.resume_from:
        logger.warning("%s is not a good checkpoint (%s). %s", plan.resume_from,
                       _suspect_reason(plan.resume_from), health.rollback_advice())
    records, last_saved = [], plan.resume_from
    with metric_sinks_from_arguments(args, rank=rank, jsonl_path=log_path(args), run_config=_json_args(args)) as sinks:
        sinks.start_run({"run_id": run_id, "resumed_from": plan.resume_from,
                         "resumed_from_step": trainer.step if plan.resume_from is not None else None,
                         "args": _json_args(args)})
        while trainer.step < args.steps:
            try:
                m = trainer.train_step(packed([data.train.batch(indices) for indices in sampler.next_micro_batches()]))
            except NonFiniteTrainingError as e:
                raise NonFiniteTrainingError(f"{e}. {health.rollback_advice()}") from None
            health.record(m)
            record = step_record(m)
            record.pop("eplb")                  # a rebalance has its own line, below
            records.append(record)
            sinks.write(record)
            if m.eplb is not None:
                sinks.write({"step": m.step, "eplb_moved_slots": m.eplb.moved_slots,
                             "eplb_moved_bytes": m.eplb.moved_bytes, "eplb_local_copies": m.eplb.local_copies,
                             "eplb_layers": list(m.eplb.layers), "balancedness_before": m.eplb.balancedness_before,
                             "balancedness_after": m.eplb.balancedness_after, "eplb_seconds": m.eplb.seconds})
            logger.info("step %4d  loss %.4f  lr %.3g  grad-norm %.3f  %7.0f tok/s  %.3g TFLOP/s  MFU %.1f%%  "
                        "aux %.4f  balance %.3f%s", m.step, m.loss, m.lr, m.grad_norm, m.tokens_per_s, m.tflops,
                        100 * m.mfu, m.aux_loss, m.balancedness, "  SKIPPED (non-finite)" if m.skipped else "")
            if data.eval is not None and (m.step % args.eval_every == 0 or m.step == args.steps):
                eval_loss = evaluate()
                sinks.write({"step": m.step, "eval_loss": eval_loss})
                logger.info("step %4d  eval loss %.4f", m.step, eval_loss)
            if m.step % args.save_every == 0 or m.step == args.steps:
                path = checkpoint_path(args.save_dir, m.step)
                verdict = health.judge(global_param_norm(model, state, world_group,
                                                         tied_params=model.tied_parameters()))
                save_training_checkpoint(path, trainer, sampler_state=sampler.state_dict(), world_group=world_group,
                                         run_id=run_id, hf_provenance=provenance, side_files=tokenizer_files,
                                         health=verdict.to_dict())
                health.saved(verdict, path)
                if rank == 0:
                    prune_checkpoints(args.save_dir, keep_last=args.keep_checkpoints, run_id=run_id)
                if verdict.suspect is None:
                    logger.info("saved %s", path)
                else:
                    logger.warning("saved %s, marked suspect: %s. %s", path, verdict.suspect, health.rollback_advice())
                last_saved = path
                note_newest_checkpoint(path)

    if args.export_hf is not None:
        summary = export_final_checkpoint(last_saved, args.export_hf, world_group=world_group,
                                          verify_checksums=args.verify_checksums)
        logger.info("exported %s (step %d) to %s: %d tensors, %s", last_saved, trainer.step, summary["out_dir"],
                    summary["tensors"], ", ".join(summary["side_files"]) or "no side files")
    if args.sample_tokens and state.cp.size > 1:
        logger.info("no samples: generation cannot split the sequence over --cp %d; the checkpoints in %s "
                    "generate under any layout with cp 1", state.cp.size, args.save_dir)
    elif args.sample_tokens:
        print_samples(model, state, tokenizer, args, rank)
    if rank == 0 and records:
        plot(records, args.work_dir / "loss.png")
    if save_dir_lock is not None:
        save_dir_lock.release()
    if dist.is_initialized():
        destroy_model_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main, prog=PROG))
