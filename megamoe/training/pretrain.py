"""The training loop as a library function: :func:`pretrain` runs a training run described by its config
(the flags of ``megamoe train``, from the command line and a TOML file: :mod:`megamoe.cli.train` parses
them) on this process's rank, under torchrun or as one plain process::

    from megamoe.cli.train import parse_args
    from megamoe.training.pretrain import pretrain
    summary = pretrain(parse_args(["--config", "configs/demo.toml", "--steps", "40"]))

It checks the config first (:mod:`megamoe.training.pretrain_checks`), then joins the process group,
builds or loads the model, prepares the data, resumes the newest checkpoint of --save-dir (or
--load-dir), trains to --steps with evaluation, checkpoints, metrics and a progress line, and ends with
the samples, the optional HF export and a summary (:class:`~megamoe.training.run_summary.RunSummary`).
SIGTERM or Ctrl-C stop it at the next step boundary with a checkpoint of that step, and it returns normally
(:mod:`megamoe.training.preemption`); the same config then resumes it there.
"""

from __future__ import annotations


import argparse
import dataclasses
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megamoe.checkpoint.format import read_manifest
from megamoe.checkpoint.side_files import read_side_file
from megamoe.atomic_file import atomic_write
from megamoe.checkpoint.placements import build_placements
from megamoe import comms
from megamoe.after_torchrun import note_newest_checkpoint
from megamoe.data.chat_training_data import chat_encoder
from megamoe.data.corpus import stdlib_corpus_files
from megamoe.data.data_arguments import on_rank_0, prepare_training_data
from megamoe.data.eval_split import eval_batches
from megamoe.data.packing import packed_micro_batch, packing_config_from_args
from megamoe.data.resumable_sampler import ResumableSampler
from megamoe.data.token_dataset import build_token_file, token_file_matches
from megamoe.data.tokenizer import Tokenizer, train_sentencepiece
from megamoe.inference.generation import GenerationConfig, generate
from megamoe.inference.sampling import SamplingConfig
from megamoe.errors import UsageError
from megamoe.lora import apply_lora
from megamoe.machine_memory import format_bytes
from megamoe.models import GPTMoEModel
from megamoe.moe.placement.eplb_arguments import eplb_config_from_args
from megamoe.parallel_plan import default_etp
from megamoe.pipeline import describe_pipeline_schedule
from megamoe.process_group import default_autocast, init_distributed, launch_world_size, resolve_device
from megamoe.tensor_parallel import initialize_parameters
from megamoe.training.checkpoint import (HFProvenance, checkpoint_path, checkpoint_run_id,
                                         expert_placements_from_checkpoint, foreign_checkpoint_differences,
                                         load_training_checkpoint, new_run_id, prune_checkpoints,
                                         save_training_checkpoint, verify_resume_checkpoint)
from megamoe.training.checkpoint_health import Health, HealthMonitor
from megamoe.training.grad_sync import global_param_norm
from megamoe.training.hf_export import export_final_checkpoint, tokenizer_side_files, with_tokenizer
from megamoe.training.non_finite import NonFiniteTrainingError
from megamoe.training.save_dir_lock import lock_save_dir
from megamoe.training.hf_start import start_from_hf
from megamoe.training.evaluation import evaluate_loss
from megamoe.training.metric_sinks import step_record
from megamoe.training.metrics_arguments import metric_sinks_from_arguments
from megamoe.training.mfu import resolve_peak_tflops
from megamoe.training.lora_run import LORA_FILE, check_lora_file, lora_config_from_args, lora_file
from megamoe.training.optim_arguments import param_dtype, train_config_kwargs
from megamoe.training.preemption import StopSignals
from megamoe.training.trainer import TrainConfig, Trainer
from megamoe.transformer.recompute_arguments import recompute_config_from_args
from parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from megamoe.training.pretrain_checks import (NUM_SAMPLES, SAMPLE_TEMPERATURE, SAMPLE_TOP_K, check_arguments,
                                              log_path, model_config, plan_start)
from megamoe.training.run_config_file import (RUN_CONFIG_FILE, read_run_config, render_run_config,
                                              run_config_differences)
from megamoe.training.run_summary import RunSummary, TrainingProgress

logger = logging.getLogger(__name__)


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


def print_samples(model, state, tokenizer: Tokenizer, args, rank: int, chat: bool = False) -> None:
    """Greedy and temperature samples of --sample-prompt: collective, every rank generates (under
    --sequence-parallel with a copy of the model built without it: decoding cannot split the sequence).
    A chat run (``chat``) samples its answer to --sample-prompt as a user turn in the tokenizer's chat template,
    as it was trained."""
    model = model.without_sequence_parallel()
    if chat:
        shown, prompt = chat_encoder(tokenizer).generation_prompt([{"role": "user", "content": args.sample_prompt}],
                                                                  where="--sample-prompt")
    else:
        shown, prompt = args.sample_prompt, tokenizer.encode(args.sample_prompt)
    greedy = generate(model, state, [prompt], GenerationConfig(max_new_tokens=args.sample_tokens))
    sampling = SamplingConfig(temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K, seed=args.seed)
    sampled = generate(model, state, [prompt] * NUM_SAMPLES,
                       GenerationConfig(max_new_tokens=args.sample_tokens, sampling=sampling))
    if rank == 0:
        text = [f"--- greedy sample ---\n{shown}{tokenizer.decode(greedy.token_ids[0])}"]
        # One batch, one seed: each request draws from its own stream, seeded by (seed, request number).
        text += [f"--- sample {i + 1} (temperature {SAMPLE_TEMPERATURE}, top-k {SAMPLE_TOP_K}, seed {args.seed} "
                 f"request {i}) ---\n{shown}{tokenizer.decode(ids)}"
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



def agreed_autocast(autocast: str | None, group, device: torch.device) -> str | None:
    """``--autocast auto``'s choice for the whole job: each rank measured its own matmul peaks, and ranks that
    chose differently would run different dtypes; bf16 only where every rank of ``group`` chose it."""
    chose_bf16 = torch.tensor([1 if autocast == "bf16" else 0], dtype=torch.int32, device=device)
    return "bf16" if comms.all_reduce_(chose_bf16, group, op=dist.ReduceOp.MIN).item() else None


def pretrain(config: argparse.Namespace) -> RunSummary:
    """Run the training run ``config`` describes (the namespace :func:`megamoe.cli.train.parse_args` returns:
    every field of :data:`~megamoe.training.run_config_file.SECTIONS`) on this process's rank; collective over
    the torchrun job. Returns the run's summary (rank 0 also logs it). Raises
    :class:`~megamoe.errors.UsageError` for a config it cannot run, before any expensive work."""
    args = config
    device = resolve_device(args.device)
    source = check_arguments(args, launch_world_size(), device)
    plan = plan_start(args)
    lora = lora_config_from_args(args)
    rank, world = init_distributed(comm_timeout_s=args.comm_timeout, device=device)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # After the thread count is set: auto measures this rank's matmul peaks (and logs why it chose).
    autocast = default_autocast(device) if args.autocast == "auto" else None if args.autocast == "none" else args.autocast
    if args.autocast == "auto" and world > 1:
        autocast = agreed_autocast(autocast, dist.group.WORLD, device)
    world_group = dist.group.WORLD if world > 1 else None
    etp = default_etp(args.tp, args.dispatcher, args.etp)
    # The groups inherit the world's timeout (on CUDA --comm-timeout plus the collective watchdog's reserve).
    state = (initialize_model_parallel(tp=args.tp, pp=args.pp, ep=args.ep, etp=etp, cp=args.cp)
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
    # Chat SFT rows come packed with their own document masks (the packing flags are refused with chat data).
    packing = None if data.chat else packing_config_from_args(args, tokenizer.eos_id if tokenizer is not None else
                                                              data.sources[0].source.eos_id)
    # Every checkpoint carries the tokenizer, as a conversion's does: generate.py finds it there.
    tokenizer_files = tokenizer_side_files(tokenizer) if tokenizer is not None else None
    logger.info("packed documents: %s", "chat conversations, each attending to itself; the loss is the mean over "
                "the global batch's assistant tokens" if data.chat else packing or "off (plain causal rows)")
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
    lora_side_files = {}
    if lora is not None:             # after the base weights are in: the adapters' A is seeded, B zero
        if plan.resume_from is not None:
            check_lora_file(read_side_file(plan.resume_from, LORA_FILE), lora, args, plan.resume_from)
        try:
            apply_lora(model, lora, seed=args.seed)
        except ValueError as e:
            raise UsageError(f"--lora-*: {e}") from None
        lora_side_files = {LORA_FILE: lora_file(lora, args)}
    elif plan.resume_from is not None:
        check_lora_file(read_side_file(plan.resume_from, LORA_FILE), None, args, plan.resume_from)
    if plan.resume_from is not None:
        # A checkpoint of this run carries the provenance it started with (the HF model's, or a config.json's).
        provenance = HFProvenance.of_checkpoint(plan.resume_from) or provenance
    matmul_dtype = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[autocast]
    peak = resolve_peak_tflops(device, matmul_dtype, explicit_tflops=args.peak_tflops)
    trainer = Trainer(model, state, TrainConfig(lr=args.lr, autocast=autocast, eplb=eplb_config_from_args(args),
                                                per_token_loss=data.chat,
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

    train_rows = data.train.micro_batch if data.chat else data.train.batch

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
    config_text = render_run_config(args).encode()
    if rank == 0:
        if plan.resume_from is not None:
            log_config_changes(plan.resume_from, config_text)
        with atomic_write(args.work_dir / RUN_CONFIG_FILE, "wb") as f:
            f.write(config_text)
    summary = RunSummary(start_step=trainer.step, save_dir=os.fspath(args.save_dir))
    progress = TrainingProgress(start_step=trainer.step, end_step=args.steps, enabled=args.progress, rank=rank)
    started = time.perf_counter()

    def save(step: int) -> str:
        path = checkpoint_path(args.save_dir, step)
        verdict = health.judge(global_param_norm(model, state, world_group, tied_params=model.tied_parameters()))
        save_training_checkpoint(path, trainer, sampler_state=sampler.state_dict(), world_group=world_group,
                                 run_id=run_id, hf_provenance=provenance,
                                 side_files={**(tokenizer_files or {}), **lora_side_files,
                                             RUN_CONFIG_FILE: config_text},
                                 health=verdict.to_dict())
        health.saved(verdict, path)
        if rank == 0:
            prune_checkpoints(args.save_dir, keep_last=args.keep_checkpoints, run_id=run_id)
        if verdict.suspect is None:
            logger.info("saved %s", path)
        else:
            logger.warning("saved %s, marked suspect: %s. %s", path, verdict.suspect, health.rollback_advice())
        summary.saved(path)
        note_newest_checkpoint(path)
        return path

    # SIGTERM / Ctrl-C: save at the next step boundary (where every rank agrees to stop) and return normally.
    stopped_by = None
    with StopSignals() as stop, metric_sinks_from_arguments(args, rank=rank, jsonl_path=log_path(args),
                                                             run_config=_json_args(args)) as sinks:
        sinks.start_run({"run_id": run_id, "resumed_from": plan.resume_from,
                         "resumed_from_step": trainer.step if plan.resume_from is not None else None,
                         "args": _json_args(args)})
        while trainer.step < args.steps:
            try:
                m = trainer.train_step(packed([train_rows(indices) for indices in sampler.next_micro_batches()]))
            except NonFiniteTrainingError as e:
                raise NonFiniteTrainingError(f"{e}. {health.rollback_advice()}") from None
            health.record(m)
            summary.step(m.step, m.loss, args.global_batch * args.seq_len, m.skipped)
            progress.step(m.step, m.loss, m.tokens_per_s)
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
                summary.evaluated(m.step, eval_loss)
                logger.info("step %4d  eval loss %.4f", m.step, eval_loss)
            stopping = stop.agreed(world_group, device)
            if stopping or m.step % args.save_every == 0 or m.step == args.steps:
                last_saved = save(m.step)
            if stopping:
                stopped_by = stop.reason()
                logger.info("%s: stopped at step %d, saved %s; run the same command again to continue from there",
                            stopped_by, m.step, last_saved)
                break
        progress.close()
        summary.seconds = time.perf_counter() - started

    finished = stopped_by is None       # a stopped run ends at once: its export and samples come when it finishes
    if finished and args.export_hf is not None:
        exported = export_final_checkpoint(last_saved, args.export_hf, world_group=world_group,
                                           verify_checksums=args.verify_checksums)
        logger.info("exported %s (step %d) to %s: %d tensors, %s", last_saved, trainer.step, exported["out_dir"],
                    exported["tensors"], ", ".join(exported["side_files"]) or "no side files")
        summary.exported_to = os.fspath(exported["out_dir"])
    if finished and args.export_peft is not None:
        exported = export_final_checkpoint(last_saved, args.export_peft, world_group=world_group,
                                           verify_checksums=args.verify_checksums, peft=True)
        logger.info("exported the adapters of %s (step %d) for peft to %s: %d tensors", last_saved, trainer.step,
                    exported["out_dir"], exported["tensors"])
    if finished and args.sample_tokens and state.cp.size > 1:
        logger.info("no samples: generation cannot split the sequence over --cp %d; the checkpoints in %s "
                    "generate under any layout with cp 1", state.cp.size, args.save_dir)
    elif finished and args.sample_tokens:
        print_samples(model, state, tokenizer, args, rank, chat=data.chat)
    if rank == 0 and records:
        plot(records, args.work_dir / "loss.png")
    if save_dir_lock is not None:
        save_dir_lock.release()
    if dist.is_initialized():
        destroy_model_parallel()
    if rank == 0:
        logger.info("%s", "\n".join(summary.lines()))
    return summary


def log_config_changes(checkpoint: str, config_text: bytes) -> None:
    """Log the fields of this run's config that differ from those the resumed ``checkpoint`` was saved
    with (its ``run_config.toml``; checkpoints written before configs were recorded have none)."""
    saved = read_side_file(checkpoint, RUN_CONFIG_FILE)
    if saved is None:
        logger.info("%s records no run config (saved before configs were recorded)", checkpoint)
        return
    differences = run_config_differences(read_run_config(saved.decode()), read_run_config(config_text.decode()))
    logger.info("config changes vs %s: %s", checkpoint, "; ".join(differences) if differences else "none")
