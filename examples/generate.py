"""Generate text with a megamoe checkpoint under any parallel layout, with a KV cache.

The checkpoint may have been saved under any layout (training, or ``megamoe-convert import-hf``): each
rank reads the slices its layout needs. Launch with torchrun, or plain python for one process::

    torchrun --nproc-per-node 4 examples/generate.py CKPT --tp 2 --ep 2 --dispatcher allgather \\
        --prompt "def fibonacci(n):" --max-new-tokens 64
    torchrun --nproc-per-node 4 examples/generate.py CKPT --ep 4 --data-parallel-attention \\
        --prompt-file prompts.txt --record-expert-load load.json
    python examples/generate.py CKPT --prompt-ids 1,15,27 --temperature 0.8 --top-p 0.95 --seed 1

Prompts are tokenized with the checkpoint's tokenizer: ``--tokenizer``, by default the files a
conversion keeps in ``CKPT/hf_files/``, else ``CKPT`` itself (``tokenizer.json`` or a sentencepiece
``.model``). ``--prompt-ids`` needs no tokenizer. Rank 0 prints every generation; ``--output-json``
also saves prompts, ids, texts and timings, and ``--record-expert-load`` the per-layer router token
counts (the file ``megamoe-convert import-hf / reshard --expert-load`` reads to balance placements).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint_tools.format import read_manifest
from checkpoint_tools.manifest_fields import HF_FILES_DIR, model_config_from_manifest
from checkpoint_tools.model_loading import build_model_from_checkpoint, config_for_engine
from megamoe import comms
from megamoe.data.tokenizer import Tokenizer
from megamoe.inference.expert_load import gather_expert_load, reset_expert_load
from megamoe.inference.generation import GenerationConfig, generate
from megamoe.inference.sampling import SamplingConfig
from megamoe.models import GPTMoEModel
from megamoe.moe.expert_slots import ExpertPlacement, save_expert_load
from parallel_state import ParallelState, destroy_model_parallel, initialize_model_parallel

logger = logging.getLogger("generate")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="megamoe checkpoint directory (holding manifest.json)")
    g = p.add_argument_group("parallel layout (world size = tp * pp * dp; dp is what is left)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (attention heads, MLPs, vocab)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size (expert slots are split over it)")
    g.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size; default: tp for alltoall, 1 for allgather")
    g.add_argument("--order", default="tp-cp-ep-dp-pp",
                   help="rank order, smallest stride first (see parallel_state); e.g. tp-cp-dp-ep-pp puts EP over "
                        "data-parallel ranks when tp > 1")
    g.add_argument("--dispatcher", choices=("alltoall", "allgather"), default=None,
                   help="MoE token dispatcher (default: the checkpoint's). alltoall: needs etp == tp; allgather: "
                        "EP inside the TP group, or over data-parallel ranks with --data-parallel-attention")
    g.add_argument("--num-expert-slots", type=int, default=None,
                   help="expert slots per MoE layer (>= experts, multiple of ep; default: the checkpoint's); extra "
                        "slots replicate experts. The saved placement is used when it fits, else the default one")
    g.add_argument("--expert-backend", choices=("auto", "torch", "loop", "te"), default=None,
                   help="grouped-GEMM experts implementation (default: the checkpoint's)")
    g.add_argument("--data-parallel-attention", action="store_true",
                   help="each data-parallel rank serves its own share of the prompts (round robin); MoE layers are "
                        "expert-parallel across them (allgather: input-sharded gather + reduce-scatter)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank (LOCAL_RANK), NCCL")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter and activation dtype")
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
    s.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    s.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    s.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens of this total mass")
    s.add_argument("--compile", action="store_true",
                   help="decode steps through torch.compile (the first step compiles, tens of seconds on a CPU; "
                        "worth it for long generations)")
    s.add_argument("--seed", type=int, default=0,
                   help="sampling seed; each prompt draws from its own generator, so results do not depend on "
                        "the layout or on the batch")
    o = p.add_argument_group("outputs")
    o.add_argument("--output-json", type=Path, default=None,
                   help="write prompts, prompt ids, generated ids and text, finish reasons and timings here")
    o.add_argument("--record-expert-load", type=Path, default=None,
                   help="write the per-layer router token counts per expert of this run here (expert-load JSON)")
    return p.parse_args(argv)


def init_distributed(args, dispatcher: str | None) -> ParallelState:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        if (args.tp, args.pp, args.ep, args.etp or 1) != (1, 1, 1, 1):
            raise SystemExit("a single process runs tp = pp = ep = etp = 1; launch with torchrun for a layout")
        return ParallelState.single_process()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    etp = args.etp if args.etp is not None else (args.tp if dispatcher == "alltoall" else 1)
    return initialize_model_parallel(tp=args.tp, pp=args.pp, ep=args.ep, etp=etp, order=args.order)


def engine_choices(args, manifest: dict) -> dict:
    """This run's MoE engine choices (dispatcher, slots, backend, sharded input), None where the saved
    ones stay."""
    saved = model_config_from_manifest(manifest)
    if saved.moe is None:
        return {}
    dispatcher = args.dispatcher or saved.moe.dispatcher
    return {"dispatcher": args.dispatcher, "num_expert_slots": args.num_expert_slots,
            "expert_backend": args.expert_backend,
            "input_sharded": args.data_parallel_attention and dispatcher == "allgather"}


def load_model(args, engine: dict, state) -> tuple[GPTMoEModel, dict]:
    """This rank's stage, resharded from the checkpoint, and the placement of every MoE layer (the
    saved one where it fits this layout, else the default)."""
    device = torch.device("cuda") if args.device == "cuda" else None
    model = build_model_from_checkpoint(args.checkpoint, state, device=device, dtype=DTYPES[args.dtype], **engine)
    return model.eval(), {layer_id: layer.placement for layer_id, layer in model.moe_layers().items()}


def load_tokenizer(args) -> Tokenizer | None:
    if not (args.prompt or args.prompt_file) and args.tokenizer is None:
        return None
    path = args.tokenizer
    if path is None:
        side_files = args.checkpoint / HF_FILES_DIR
        path = side_files if side_files.is_dir() else args.checkpoint
    return Tokenizer.from_path(path)


def read_prompts(args, tokenizer: Tokenizer | None) -> tuple[list[str | None], list[list[int]]]:
    texts = list(args.prompt)
    if args.prompt_file is not None:
        texts += [line for line in args.prompt_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if texts and tokenizer is None:
        raise SystemExit("text prompts need a tokenizer: pass --tokenizer, or --prompt-ids instead")
    bos = [tokenizer.bos_id] if args.add_bos and tokenizer is not None and tokenizer.bos_id is not None else []
    ids = [bos + tokenizer.encode(text) for text in texts]
    ids += [[int(t) for t in spec.split(",") if t.strip()] for spec in args.prompt_ids]
    if not ids:
        raise SystemExit("no prompt: give --prompt, --prompt-file or --prompt-ids")
    return texts + [None] * len(args.prompt_ids), ids


def record_expert_load(args, model: GPTMoEModel, placements: dict, state, num_requests: int) -> None:
    """Gather this run's expert load, log each layer's balancedness under this run's placement and
    under a balanced one, and write the expert-load file (rank 0)."""
    loads = gather_expert_load(model, state, data_parallel_attention=args.data_parallel_attention)
    if state.rank != 0:
        return
    moe = model.config.moe
    for layer_id, load in loads.items():
        balanced = ExpertPlacement.balanced(load, moe.num_expert_slots, state.ep.size)
        logger.info("layer %d: %d routed pairs; balancedness %.3f with this run's placement, %.3f balanced "
                    "(EP %d, %d slots)", layer_id, int(load.sum()), placements[layer_id].balancedness(load),
                    balanced.balancedness(load), state.ep.size, moe.num_expert_slots)
    save_expert_load(args.record_expert_load, loads, num_experts=moe.num_experts, metadata={
        "checkpoint": str(args.checkpoint), "requests": num_requests, "max_new_tokens": args.max_new_tokens})
    logger.info("wrote %s", args.record_expert_load)


def report(args, state, config: GenerationConfig, tokenizer: Tokenizer | None, texts, prompt_ids,
           shares) -> None:
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
    timings = {   # data-parallel ranks run concurrently: tokens add up, the slowest rank sets the time
        "prompt_tokens": sum(o.prompt_tokens for o in outs),
        "decode_tokens": sum(o.decode_tokens for o in outs),
        "decode_steps": outs[0].decode_steps,
        "prefill_seconds": max(o.prefill_seconds for o in outs),
        "decode_seconds": max(o.decode_seconds for o in outs),
        "compile_seconds": max(o.compile_seconds for o in outs),   # part of decode_seconds (--compile)
    }
    timings["prefill_tokens_per_second"] = timings["prompt_tokens"] / max(timings["prefill_seconds"], 1e-9)
    timings["decode_tokens_per_second"] = timings["decode_tokens"] / max(timings["decode_seconds"], 1e-9)
    logger.info("prefill %d tokens in %.3f s (%.1f tok/s); decode %d tokens in %.3f s (%.1f tok/s)%s",
                timings["prompt_tokens"], timings["prefill_seconds"], timings["prefill_tokens_per_second"],
                timings["decode_tokens"], timings["decode_seconds"], timings["decode_tokens_per_second"],
                f", of which {timings['compile_seconds']:.1f} s compiling" if timings["compile_seconds"] else "")
    if args.output_json is not None:
        layout = {"world_size": state.world_size, "tp": state.tp.size, "pp": state.pp.size, "dp": state.dp.size,
                  "ep": state.ep.size, "etp": state.etp.size, "order": state.order,
                  "data_parallel_attention": args.data_parallel_attention}
        document = {"checkpoint": str(args.checkpoint), "layout": layout,
                    "generation": dataclasses.asdict(config), "requests": requests, "timings": timings}
        args.output_json.write_text(json.dumps(document, indent=1) + "\n")
        logger.info("wrote %s", args.output_json)


def main(argv=None) -> int:
    args = parse_args(argv)
    manifest = read_manifest(args.checkpoint)
    engine = engine_choices(args, manifest)
    model_config = config_for_engine(model_config_from_manifest(manifest), **engine)
    state = init_distributed(args, model_config.moe.dispatcher if model_config.moe is not None else None)
    logging.basicConfig(level=logging.INFO if state.rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    tokenizer = load_tokenizer(args)
    texts, prompt_ids = read_prompts(args, tokenizer)
    stop_ids = args.stop_token_id
    if stop_ids is None:
        stop_ids = [tokenizer.eos_id] if tokenizer is not None and tokenizer.eos_id is not None else []
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(stop_ids),
                              sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed))
    model, placements = load_model(args, engine, state)
    logger.info("world %d: tp %d pp %d dp %d ep %d etp %d, dispatcher %s%s", state.world_size, state.tp.size,
                state.pp.size, state.dp.size, state.ep.size, state.etp.size,
                model_config.moe.dispatcher if model_config.moe is not None else "-",
                ", data-parallel attention" if args.data_parallel_attention else "")
    if args.record_expert_load is not None and model_config.moe is None:
        raise SystemExit("--record-expert-load: the model has no MoE layer")

    mine = list(range(len(prompt_ids)))
    if args.data_parallel_attention:
        mine = mine[state.dp.rank::state.dp.size]
    if args.record_expert_load is not None:
        reset_expert_load(model)
    output = generate(model, state, [prompt_ids[i] for i in mine], config, request_ids=mine, compiled=args.compile)
    if args.record_expert_load is not None:
        record_expert_load(args, model, placements, state, len(prompt_ids))

    # Every request's result (and the timings) onto rank 0.
    shares = comms.all_gather_object((mine, output), state.dp.group) if args.data_parallel_attention else [
        (mine, output)]
    if state.rank == 0:
        report(args, state, config, tokenizer, texts, prompt_ids, shares)
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
