"""The checks of a training run's config (:func:`megamoe.training.pretrain.pretrain`), before any process
group, weight or large file: everything a user can get wrong fails here as one
:class:`~megamoe.errors.UsageError` naming the flag (``--tp``; in a config file, ``parallel.tp``). Also
where the run starts (:func:`plan_start`: fresh, or resumed from which checkpoint) and the demo's own model
(:func:`model_config`).
"""

from __future__ import annotations


import dataclasses
import logging
import os
from pathlib import Path

import torch

from megamoe.checkpoint.format import CheckpointError, read_manifest
from megamoe.checkpoint.placements import build_placements
from megamoe.data.data_arguments import check_data_arguments, data_vocab_size
from megamoe.data.packing import packing_config_from_args
from megamoe.data.token_dataset import recorded_tokenizer, sidecar_path
from megamoe.data.tokenizer import Tokenizer
from megamoe.errors import UsageError
from megamoe.hf.adapters import ADAPTERS
from megamoe.machine_memory import available_memory_bytes, format_bytes
from megamoe.models import GPTMoEConfig
from megamoe.models.gpt_moe import check_moe_layout_on_grid
from megamoe.moe.placement.eplb_arguments import eplb_config_from_args
from megamoe.moe.moe_layer import MoEConfig
from megamoe.moe.router import RouterConfig
from megamoe.moe.shared_experts import SharedExpertsConfig
from megamoe.moe.token_dispatcher import dispatcher_class
from megamoe.parallel_plan import default_etp
from megamoe.tensor_parallel.vocab_padding import padded_vocab_size
from megamoe.training.checkpoint import HFProvenance, list_checkpoints, resolve_resume_checkpoint
from megamoe.training.hf_export import provenance_for_export
from megamoe.training.hf_start import hf_start_config
from megamoe.training.model_config_file import read_model_config_file
from megamoe.training.metrics_arguments import check_metrics_arguments
from megamoe.training.memory_estimate import estimate_memory, model_parameter_counts
from megamoe.training.optim_arguments import param_dtype, train_config_kwargs
from megamoe.transformer import AttentionConfig, MLPConfig, RopeConfig
from megamoe.transformer.mla import MLAConfig
from megamoe.transformer.recompute_arguments import recompute_config_from_args
from parallel_state.rank_grid import compute_rank_groups

logger = logging.getLogger(__name__)

HEADS = 4
# A few samples at a moderate temperature show what the model learnt better than the greedy one alone,
# which a small model soon locks into a loop (e.g. a run of digits).
SAMPLE_TEMPERATURE, SAMPLE_TOP_K, NUM_SAMPLES = 0.8, 40, 3


_MODEL_SHAPE_FLAGS = ("hidden", "layers", "experts", "top_k", "mtp_layers", "vocab_size")
_TOKENIZER_SHAPE_FLAGS = ("vocab_size",)


def check_model_shape_flags(args, given: set[str]) -> None:
    """UsageError for a model-shape flag given (``given``: the destinations set on the command line or in the
    config file) next to what already decides it (--hf-model, --model-config, --tokenizer)."""
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
    if args.export_peft is not None:
        if args.lora_rank is None:
            raise UsageError(f"--export-peft {args.export_peft} writes a LoRA run's adapters, and this run trains the "
                             "whole model: add --lora-rank R, or export it with --export-hf")
        if args.export_peft.exists():
            raise UsageError(f"--export-peft {args.export_peft} already exists; remove it or choose another path")
        if config.family not in ADAPTERS:
            raise UsageError(f"--export-peft: a model of family {config.family!r} has no HuggingFace equivalent for "
                             f"peft to load adapters onto (families with one: {', '.join(ADAPTERS)})")
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
    if args.moe_shared_expert_overlap and not dispatcher_class(args.dispatcher).overlaps_shared_experts:
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
                             "pass --load-dir with one saved by megamoe train")
    return plan


