"""``megamoe generate``: generate text with a megamoe checkpoint under any parallel layout, with a KV cache.

The checkpoint may have been saved under any layout (training, or ``megamoe-convert import-hf``): each
rank reads the slices its layout needs (and checks their files' checksums, unless
--no-verify-checksums). Launch with torchrun, or plain python for one process::

    torchrun --nproc-per-node 4 -m megamoe generate CKPT --tp 2 --ep 2 --dispatcher allgather \\
        --prompt "def fibonacci(n):" --max-new-tokens 64
    torchrun --nproc-per-node 4 -m megamoe generate CKPT --ep 4 --data-parallel-attention \\
        --prompt-file prompts.txt --record-expert-load load.json
    megamoe generate CKPT --prompt-ids 1,15,27 --temperature 0.8 --top-p 0.95 --seed 1

Without --dispatcher the MoE layers run the checkpoint's dispatcher if it fits the layout, else the
one that does (e.g. alltoall with etp = tp for EP over data-parallel ranks), and the log says so.

Prompts are tokenized with the checkpoint's tokenizer: ``--tokenizer``, by default the files a
conversion or a training run keeps in ``CKPT/hf_files/``, else ``CKPT`` itself (``tokenizer.json`` or a sentencepiece
``.model``). ``--prompt-ids`` needs no tokenizer. Rank 0 prints every generation; ``--output-json``
also saves prompts, ids, texts and timings (decode tokens/s leave out the time --compile spends
compiling, which is reported apart), and ``--record-expert-load`` the per-layer router token
counts (the file ``megamoe-convert import-hf / reshard --expert-load`` reads to balance placements).

Arguments, paths and the layout are checked before anything is loaded: a mistake is one ``error:``
line (from rank 0) and exit code 1 (MEGAMOE_TRACEBACK=1 shows the traceback). So are the requests
(every prompt plus --max-new-tokens within the model's max_position_embeddings, stop tokens in its
vocabulary) and the memory: the parameters (expert slots included) and KV caches a rank needs at
least, against what the machine has free (the ranks on one host share its memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

from megamoe.checkpoint.format import read_manifest
from megamoe.checkpoint.manifest_fields import HF_FILES_DIR
from megamoe.checkpoint.model_loading import build_model_from_checkpoint, config_for_engine
from megamoe.checkpoint.model_manifest import check_model_manifest
from megamoe import comms
from megamoe.atomic_file import AtomicWriteError, atomic_write, check_output_target
from megamoe.data.tokenizer import Tokenizer
from megamoe.inference.expert_load import gather_expert_load, reset_expert_load
from megamoe.inference.generation import GenerationConfig, check_generation_request, generate
from megamoe.inference.generation_memory import estimate_generation_memory
from megamoe.inference.sampling import SamplingConfig
from megamoe.errors import UsageError
from megamoe.cli.launch import (HelpFormatter, ScriptArgumentParser, add_launch_arguments,
                                add_no_verify_checksums_argument, run_script)
from megamoe.machine_memory import available_memory_bytes, format_bytes
from megamoe.process_group import init_distributed, launch_rank, launch_world_size, resolve_device
from megamoe.models import GPTMoEConfig, GPTMoEModel
from megamoe.models.gpt_moe import check_moe_layout_on_grid
from megamoe.moe.placement.eplb_arguments import add_eplb_arguments, eplb_config_from_args
from megamoe.moe.placement.expert_slots import ExpertPlacement, save_expert_load
from megamoe.moe.token_dispatcher import dispatcher_class, dispatcher_names
from megamoe.parallel_plan import default_etp
from parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel
from parallel_state.rank_grid import compute_rank_groups

logger = logging.getLogger(__name__)

PROG = "megamoe generate"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The flag that sets each GenerationConfig / SamplingConfig field: their ValueErrors name the field.
FLAG_OF_FIELD = {"max_new_tokens": "--max-new-tokens", "stop_token_ids": "--stop-token-id",
                 "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"}


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = ScriptArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("checkpoint", type=Path, help="megamoe checkpoint directory (holding manifest.json)")
    add_layout_arguments(p)
    _add_request_arguments(p)
    return p


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """The layout, device and loading flags (``megamoe generate`` and ``megamoe serve``)."""
    g = p.add_argument_group("parallel layout (world size = tp * pp * dp; dp is what is left)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (attention heads, MLPs, vocab)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size (expert slots are split over it)")
    g.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size (default: tp for alltoall, 1 for allgather)")
    g.add_argument("--order", default="tp-cp-ep-dp-pp",
                   help="rank order, smallest stride first (see parallel_state); e.g. tp-cp-dp-ep-pp puts EP over "
                        "data-parallel ranks when tp > 1")
    g.add_argument("--dispatcher", choices=dispatcher_names(), default=None,
                   help="MoE token dispatcher (default: the checkpoint's if it fits the layout, else the one that "
                        "does). alltoall: etp dividing tp (etp < tp: MoE parallel folding); allgather: EP "
                        "inside the TP group, or over data-parallel ranks with --data-parallel-attention")
    g.add_argument("--num-expert-slots", type=int, default=None,
                   help="expert slots per MoE layer (>= experts, multiple of ep; default: the checkpoint's); extra "
                        "slots replicate experts. The saved placement is used when it fits, else the default one")
    g.add_argument("--expert-backend", choices=("auto", "torch", "loop", "te"), default=None,
                   help="grouped-GEMM experts implementation (default: the checkpoint's)")
    g.add_argument("--data-parallel-attention", action="store_true",
                   help="each data-parallel rank serves its own requests (generate: a round-robin share of the "
                        "prompts; serve: those rank 0 assigns it, least loaded first); MoE layers are "
                        "expert-parallel across them (allgather: input-sharded gather + reduce-scatter)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank (LOCAL_RANK), NCCL")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter and activation dtype")
    add_launch_arguments(g)
    add_no_verify_checksums_argument(g)
    g.add_argument("--allow-non-finite", action="store_true",
                   help="generate from weights holding NaN or Inf (a warning names each) instead of refusing them")


def _add_request_arguments(p: argparse.ArgumentParser) -> None:
    q = p.add_argument_group("prompts (at least one)")
    q.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a text prompt (repeatable)")
    q.add_argument("--prompt-file", type=Path, default=None, help="a text file, one prompt per non-empty line")
    q.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids, e.g. 1,15,27 (repeatable; no tokenizer needed)")
    q.add_argument("--tokenizer", type=Path, default=None,
                   help=f"tokenizer file or directory (default: CKPT/{HF_FILES_DIR} if present, else CKPT)")
    q.add_argument("--add-bos", action="store_true", help="prepend the tokenizer's BOS id to every text prompt")
    s = p.add_argument_group("generation")
    s.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt at most")
    s.add_argument("--stop-token-id", type=int, action="append", default=None, metavar="ID",
                   help="stop a sequence at this token (repeatable; default: the tokenizer's EOS, if any)")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    s.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (default: all)")
    s.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens of this total mass")
    s.add_argument("--compile", action="store_true",
                   help="decode steps through torch.compile (the first step compiles, tens of seconds on a CPU; "
                        "worth it for long generations; tokens/s are reported without the compile time)")
    s.add_argument("--seed", type=int, default=0,
                   help="sampling seed; each prompt draws from its own generator, so results do not depend on "
                        "the layout or on the batch")
    add_eplb_arguments(p, unit="forward passes (the prefill is the first)")
    o = p.add_argument_group("outputs (their folders must exist)")
    o.add_argument("--output-json", type=Path, default=None,
                   help="write prompts, prompt ids, generated ids and text, finish reasons and timings here")
    o.add_argument("--record-expert-load", type=Path, default=None,
                   help="write the per-layer router token counts per expert of this run here (expert-load JSON)")


def parse_args(argv=None, *, prog: str = PROG) -> argparse.Namespace:
    return build_parser(prog).parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Checks before any process group, weight or tokenizer is loaded (all ranks run them alike)
# ----------------------------------------------------------------------------------------------
def parse_prompt_ids(specs: list[str]) -> list[list[int]]:
    prompts = []
    for spec in specs:
        try:
            prompts.append([int(t) for t in spec.split(",") if t.strip()])
        except ValueError:
            raise UsageError(f"--prompt-ids {spec!r}: expected integer token ids separated by commas, "
                             "e.g. --prompt-ids 1,15,27") from None
        if not prompts[-1]:
            raise UsageError(f"--prompt-ids {spec!r} holds no token id; e.g. --prompt-ids 1,15,27")
    return prompts


def check_paths(args) -> None:
    """Inputs that must exist and output folders that must exist, so that no run fails at its end."""
    if args.prompt_file is not None and not args.prompt_file.is_file():
        raise UsageError(f"--prompt-file {args.prompt_file}: no such file")
    for flag, path in (("--output-json", args.output_json), ("--record-expert-load", args.record_expert_load)):
        if path is None:
            continue
        if path.is_dir():
            raise UsageError(f"{flag} {path} is a directory; name a file in it, e.g. {path / 'out.json'}")
        try:
            check_output_target(path)          # a FIFO or a device would be replaced by a regular file
        except AtomicWriteError as e:
            raise UsageError(f"{flag} {e}") from None
        folder = path.parent
        if not folder.is_dir():
            raise UsageError(f"{flag} {path}: the folder {folder} does not exist; create it first "
                             f"(mkdir -p {folder})")
    if not (args.prompt or args.prompt_file or args.prompt_ids):
        raise UsageError("no prompt: give --prompt, --prompt-file or --prompt-ids")


def flag_error(error: ValueError) -> UsageError:
    """A GenerationConfig / SamplingConfig error as the user knows it: each field named by its flag."""
    return UsageError(re.sub(r"\b(?:GenerationConfig|SamplingConfig)\.(\w+)",
                             lambda m: FLAG_OF_FIELD.get(m.group(1), m.group(0)), str(error)))


def generation_config(args) -> GenerationConfig:
    """The generation flags, checked (the stop tokens: --stop-token-id's; main adds the tokenizer's EOS)."""
    try:
        return GenerationConfig(max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(args.stop_token_id or ()),
                                sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed))
    except ValueError as e:
        raise flag_error(e) from None


def dispatcher_problem(args, config: GPTMoEConfig, dispatcher: str, world: int) -> str | None:
    """Why ``dispatcher`` cannot run ``config``'s MoE layers under this layout (None: it can)."""
    try:
        grid = compute_rank_groups(world, tp=args.tp, pp=args.pp, ep=args.ep,
                                   etp=default_etp(args.tp, dispatcher, args.etp), order=args.order)
    except ValueError as e:
        return str(e)
    engine = config_for_engine(config, dispatcher=dispatcher,
                               input_sharded=_input_sharded(args, dispatcher))
    try:
        check_moe_layout_on_grid(engine, grid)
    except ValueError as e:
        return str(e)
    return None


def check_layout(args, saved: GPTMoEConfig, world: int) -> str | None:
    """The layout fits the world size and the model; returns the dispatcher to run (None for a dense
    model): --dispatcher, else the checkpoint's when it fits the layout, else the other one."""
    try:
        compute_rank_groups(world, tp=args.tp, pp=args.pp, ep=args.ep, order=args.order)
    except ValueError as e:
        launch = ("launch with torchrun --nproc-per-node N" if world == 1 else
                  "launch a world size that fits (torchrun --nproc-per-node N)")
        raise UsageError(f"--tp {args.tp} --pp {args.pp} --ep {args.ep} do not fit {world} rank(s): {e}; {launch}, "
                         "or change --tp / --pp / --ep / --order") from None
    if saved.moe is None:
        return None
    if args.dispatcher is not None:
        problem = dispatcher_problem(args, saved, args.dispatcher, world)
        if problem is None:
            return args.dispatcher
        fitting = [d for d in dispatcher_names() if d != args.dispatcher
                   and dispatcher_problem(args, saved, d, world) is None]
        fix = (f"pass --dispatcher {fitting[0]} (or leave --dispatcher out: a dispatcher that fits is chosen)"
               if fitting else "change --tp / --ep / --etp / --order")
        raise UsageError(f"--dispatcher {args.dispatcher} does not fit this layout: {problem}; {fix}")
    problems = {}
    for dispatcher in (saved.moe.dispatcher, *(d for d in dispatcher_names() if d != saved.moe.dispatcher)):
        problems[dispatcher] = dispatcher_problem(args, saved, dispatcher, world)
        if problems[dispatcher] is None:
            if dispatcher != saved.moe.dispatcher:
                logger.info("the checkpoint's dispatcher %s does not fit this layout (%s): running %s "
                            "(etp %d)", saved.moe.dispatcher, problems[saved.moe.dispatcher], dispatcher,
                            default_etp(args.tp, dispatcher, args.etp))
            return dispatcher
    raise UsageError("no MoE dispatcher fits this layout: " + "; ".join(f"{d}: {p}" for d, p in problems.items())
                     + "; change --tp / --ep / --etp / --order")


def tokenizer_path(args) -> Path:
    if args.tokenizer is not None:
        return args.tokenizer
    side_files = args.checkpoint / HF_FILES_DIR
    return side_files if side_files.is_dir() else args.checkpoint


def load_tokenizer(args) -> Tokenizer | None:
    """The tokenizer text prompts and outputs need (None when neither does); an error names where it
    was looked for and which flag to pass."""
    if not (args.prompt or args.prompt_file) and args.tokenizer is None:
        return None
    path = tokenizer_path(args)
    try:
        return Tokenizer.from_path(path)
    except (OSError, ValueError, ImportError) as e:
        if args.tokenizer is not None:
            raise UsageError(f"--tokenizer {path}: {e}") from None
        raise UsageError(f"text prompts need a tokenizer: {e}; pass --tokenizer FILE_OR_DIR (a tokenizer.json, a "
                         "sentencepiece .model or a directory holding one), or give the prompts as --prompt-ids"
                         ) from None


def read_prompts(args, tokenizer: Tokenizer | None, prompt_ids: list[list[int]],
                 vocab_size: int) -> tuple[list[str | None], list[list[int]]]:
    """Every prompt's text (None for --prompt-ids) and token ids, checked against the vocabulary."""
    texts = list(args.prompt)
    if args.prompt_file is not None:
        texts += [line for line in args.prompt_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts and not prompt_ids:
        raise UsageError(f"--prompt-file {args.prompt_file} holds no prompt (no non-empty line)")
    bos = [tokenizer.bos_id] if args.add_bos and tokenizer is not None and tokenizer.bos_id is not None else []
    ids = [bos + tokenizer.encode(text) for text in texts] + prompt_ids
    for shown, prompt in zip(texts + args.prompt_ids, ids):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise UsageError(f"prompt {shown!r} holds token ids {bad[:4]} outside the model's vocabulary "
                             f"[0, {vocab_size})")
    return texts + [None] * len(prompt_ids), ids


def with_default_stop_token(args, config: GenerationConfig, tokenizer: Tokenizer | None,
                            vocab_size: int) -> GenerationConfig:
    """Without --stop-token-id: stop at the tokenizer's EOS, if any (which must be a token of the model)."""
    if args.stop_token_id is not None or tokenizer is None or tokenizer.eos_id is None:
        return config
    if not tokenizer.eos_id < vocab_size:
        raise UsageError(f"the tokenizer's EOS id {tokenizer.eos_id} (the default stop token) is outside the "
                         f"model's vocabulary [0, {vocab_size}): is {tokenizer.path} this model's tokenizer? Pass "
                         "its --tokenizer, or choose the stop token with --stop-token-id")
    return dataclasses.replace(config, stop_token_ids=(tokenizer.eos_id,))


def check_memory(args, model_config: GPTMoEConfig, dispatcher: str | None, world: int, prompt_ids: list[list[int]],
                 config: GenerationConfig, device: torch.device) -> None:
    """Refuse, before anything is allocated, a run whose parameters (expert slots included) and KV caches
    cannot fit in the memory free now: on the CPU the ranks of this host share it (LOCAL_WORLD_SIZE), on
    a GPU each rank has its own. The estimate is a lower bound (no activations), so nothing that fits
    is refused."""
    available, what = available_memory_bytes(device)
    if available is None:
        return
    rows = len(prompt_ids)
    if args.data_parallel_attention:            # each data-parallel rank serves its share of the prompts
        dp = world // (args.tp * args.pp)
        rows = -(-rows // dp)
    positions = max(len(p) for p in prompt_ids) + config.max_new_tokens
    estimate = estimate_generation_memory(model_config, batch=rows, sequence_length=positions, tp=args.tp, pp=args.pp,
                                          ep=args.ep, etp=default_etp(args.tp, dispatcher, args.etp),
                                          dtype=DTYPES[args.dtype])
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    if estimate.total * sharing <= available:
        return
    slots = model_config.moe.num_expert_slots if model_config.moe is not None else 0
    ranks = f" x {sharing} ranks on this host" if sharing > 1 else ""
    raise UsageError(
        f"generating needs at least {format_bytes(estimate.total * sharing)}: {format_bytes(estimate.param_bytes)} "
        f"of parameters (of which {format_bytes(estimate.expert_param_bytes)} are expert slots, {slots} per MoE "
        f"layer) and {format_bytes(estimate.kv_cache_bytes)} of KV cache ({rows} prompt(s) x {positions} positions: "
        f"the longest prompt + --max-new-tokens {config.max_new_tokens}){ranks}, against {format_bytes(available)} "
        f"of {what}: lower --max-new-tokens or --num-expert-slots, or spread the model over more ranks "
        "(--tp / --pp / --ep)")


def engine_choices(args, saved: GPTMoEConfig, dispatcher: str | None) -> dict:
    """This run's MoE engine choices (dispatcher, slots, backend, sharded input), None where the saved
    ones stay."""
    if saved.moe is None:
        return {}
    return {"dispatcher": dispatcher, "num_expert_slots": args.num_expert_slots,
            "expert_backend": args.expert_backend,
            "input_sharded": _input_sharded(args, dispatcher)}


def _input_sharded(args, dispatcher: str) -> bool:
    """--data-parallel-attention: each rank's own requests, taken sharded by dispatchers that accept it."""
    return args.data_parallel_attention and dispatcher_class(dispatcher).accepts_input_sharded


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------
def join_layout(args, dispatcher: str | None, world: int, device: torch.device) -> ParallelState:
    """Join the process group (torchrun) and create the layout's groups."""
    if world == 1:
        return ParallelState.single_process()
    init_distributed(comm_timeout_s=args.comm_timeout, device=device)   # on CUDA: this rank's GPU, NCCL
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return initialize_model_parallel(tp=args.tp, pp=args.pp, ep=args.ep,
                                     etp=default_etp(args.tp, dispatcher, args.etp),
                                     order=args.order)   # the world's timeout (see init_distributed)


def load_model(args, engine: dict, state, device: torch.device) -> GPTMoEModel:
    """This rank's stage, resharded from the checkpoint (each MoE layer with the saved placement where it
    fits this layout, else the default), without sequence parallelism (decoding cannot split the sequence;
    a run trained with it computes the same function without it)."""
    model = build_model_from_checkpoint(args.checkpoint, state, device=device, dtype=DTYPES[args.dtype],
                                        sequence_parallel=False,
                                        verify_checksums=args.verify_checksums,
                                        world_group=dist.group.WORLD if dist.is_initialized() else None,
                                        allow_non_finite=args.allow_non_finite, **engine)
    return model.eval()


def record_expert_load(args, model: GPTMoEModel, state, num_requests: int) -> None:
    """Gather this run's expert load, log each layer's balancedness under the placement the run ended with
    (the checkpoint's, or the last one --eplb-interval reached) and under a balanced one, and write the
    expert-load file (rank 0). Collective over the pipeline (and data-parallel) groups."""
    loads = gather_expert_load(model, state, data_parallel_attention=args.data_parallel_attention)
    placements = {}                    # every stage's layers: each stage knows only its own
    for stage in comms.all_gather_object({i: layer.placement.to_dict() for i, layer in model.moe_layers().items()},
                                         state.pp.group):
        placements.update({layer_id: ExpertPlacement.from_dict(d) for layer_id, d in stage.items()})
    if state.rank != 0:
        return
    moe = model.config.moe
    for layer_id, load in loads.items():
        balanced = ExpertPlacement.balanced(load, moe.num_expert_slots, state.ep.size)
        logger.info("layer %d: %d routed pairs; balancedness %.3f with this run's (final) placement, %.3f balanced "
                    "(EP %d, %d slots)", layer_id, int(load.sum()), placements[layer_id].balancedness(load),
                    balanced.balancedness(load), state.ep.size, moe.num_expert_slots)
    save_expert_load(args.record_expert_load, loads, num_experts=moe.num_experts, metadata={
        "checkpoint": str(args.checkpoint), "requests": num_requests, "max_new_tokens": args.max_new_tokens})
    logger.info("wrote %s", args.record_expert_load)


def report(args, state, dispatcher: str | None, config: GenerationConfig, tokenizer: Tokenizer | None,
           texts, prompt_ids, shares) -> None:
    """Print every generation; log (and with --output-json write) them with the timings. ``shares``:
    (request ids, GenerationOutput) of each data-parallel rank (one share without DP attention)."""
    results = {}
    for ids, out in shares:
        for request, new, reason in zip(ids, out.token_ids, out.finish_reasons):
            results[request] = (new, reason)
    requests = []
    for index, (text, ids) in enumerate(zip(texts, prompt_ids)):
        new, reason = results[index]
        completion = tokenizer.decode(new) if tokenizer is not None else None
        requests.append({"prompt": text, "prompt_ids": ids, "ids": new, "text": completion, "finish_reason": reason})
        shown = completion if completion is not None else " ".join(map(str, new))
        print(f"--- request {index} ({reason}, {len(new)} tokens) ---\n{text if text is not None else ids}"
              f"{shown}", flush=True)
    outs = [out for _, out in shares]
    timings = timings_of(outs)
    compiling = f" ({timings['compile_seconds']:.1f} s compiling apart)" if timings["compile_seconds"] else ""
    logger.info("prefill %d tokens in %.3f s (%.1f tok/s); decode %d tokens in %.3f s (%.1f tok/s)%s",
                timings["prompt_tokens"], timings["prefill_seconds"], timings["prefill_tokens_per_second"],
                timings["decode_tokens"], timings["decode_seconds_excluding_compile"],
                timings["decode_tokens_per_second"], compiling)
    if args.output_json is not None:
        layout = {"world_size": state.world_size, "tp": state.tp.size, "pp": state.pp.size, "dp": state.dp.size,
                  "ep": state.ep.size, "etp": state.etp.size, "order": state.order,
                  "data_parallel_attention": args.data_parallel_attention,
                  "dispatcher": dispatcher}
        document = {"checkpoint": str(args.checkpoint), "layout": layout,
                    "generation": dataclasses.asdict(config), "requests": requests, "timings": timings,
                    "eplb": [dataclasses.asdict(r) for r in outs[0].eplb_reports]}   # the same on every rank
        with atomic_write(args.output_json, "w") as f:
            f.write(json.dumps(document, indent=1) + "\n")
        logger.info("wrote %s", args.output_json)


def timings_of(outs) -> dict:
    """The run's timings from every data-parallel rank's GenerationOutput (one without DP attention).
    The ranks run concurrently: tokens add up, the slowest rank sets the time. ``decode_seconds`` is
    every decode step's time, compiling included (as GenerationOutput has it); the decode tokens/s
    leave out the steps that compiled, their time (``compile_seconds``, 0 without --compile) and their
    tokens."""
    timings = {
        "prompt_tokens": sum(o.prompt_tokens for o in outs),
        "decode_tokens": sum(o.decode_tokens for o in outs),
        "decode_steps": outs[0].decode_steps,
        "prefill_seconds": max(o.prefill_seconds for o in outs),
        "decode_seconds": max(o.decode_seconds for o in outs),
        "compile_seconds": max(o.compile_seconds for o in outs),
        "decode_seconds_excluding_compile": max(o.decode_seconds - o.compile_seconds for o in outs),
        "decode_tokens_excluding_compile": sum(o.decode_tokens - o.compile_tokens for o in outs),
    }
    timings["prefill_tokens_per_second"] = timings["prompt_tokens"] / max(timings["prefill_seconds"], 1e-9)
    timings["decode_tokens_per_second"] = (timings["decode_tokens_excluding_compile"]
                                           / max(timings["decode_seconds_excluding_compile"], 1e-9))
    return timings


def main(argv=None, *, prog: str = PROG) -> int:
    args = parse_args(argv, prog=prog)
    logging.basicConfig(level=logging.INFO if launch_rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    # Every check that needs no process group nor weights first: a mistake costs seconds, not a load.
    check_paths(args)
    config = generation_config(args)
    eplb = eplb_config_from_args(args)
    if eplb is not None and args.compile:
        raise UsageError("--eplb-interval with --compile: the compiled decode step keeps the placement it was "
                         "compiled with; drop one of them")
    device = resolve_device(args.device)            # UsageError for --device cuda without a GPU
    prompt_ids = parse_prompt_ids(args.prompt_ids)
    saved = check_model_manifest(read_manifest(args.checkpoint), args.checkpoint)
    world = launch_world_size()
    dispatcher = check_layout(args, saved, world)
    if args.record_expert_load is not None and saved.moe is None:
        raise UsageError("--record-expert-load: the checkpoint's model has no MoE layer")
    if eplb is not None and saved.moe is None:
        raise UsageError("--eplb-interval: the checkpoint's model has no MoE layer, so there is no expert to rebalance")
    tokenizer = load_tokenizer(args)
    texts, prompt_ids = read_prompts(args, tokenizer, prompt_ids, saved.vocab_size)
    config = with_default_stop_token(args, config, tokenizer, saved.vocab_size)
    try:
        check_generation_request(saved, prompt_ids, config)     # positions and stop tokens; generate() checks again
    except ValueError as e:
        raise flag_error(e) from None
    engine = engine_choices(args, saved, dispatcher)
    check_memory(args, config_for_engine(saved, **engine), dispatcher, world, prompt_ids, config, device)

    state = join_layout(args, dispatcher, world, device)
    model = load_model(args, engine, state, device)
    logger.info("world %d: tp %d pp %d dp %d ep %d etp %d, dispatcher %s%s", state.world_size, state.tp.size,
                state.pp.size, state.dp.size, state.ep.size, state.etp.size, dispatcher or "-",
                ", data-parallel attention" if args.data_parallel_attention else "")
    mine = list(range(len(prompt_ids)))
    if args.data_parallel_attention:
        mine = mine[state.dp.rank::state.dp.size]
    if args.record_expert_load is not None:
        reset_expert_load(model)
    output = generate(model, state, [prompt_ids[i] for i in mine], config, request_ids=mine, compiled=args.compile,
                      eplb=eplb, data_parallel_attention=args.data_parallel_attention)
    if args.record_expert_load is not None:
        record_expert_load(args, model, state, len(prompt_ids))

    # Every request's result (and the timings) onto rank 0.
    shares = comms.all_gather_object((mine, output), state.dp.group) if args.data_parallel_attention else [
        (mine, output)]
    if state.rank == 0:
        report(args, state, dispatcher, config, tokenizer, texts, prompt_ids, shares)
    destroy_model_parallel()
    return 0



def cli(argv=None) -> int:
    """``megamoe generate``: :func:`main` with one-line errors (:func:`megamoe.cli.launch.run_script`)."""
    return run_script(main, argv, prog=PROG)
