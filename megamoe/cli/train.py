"""``megamoe train``: pretrain or fine-tune a MoE language model with tensor, pipeline, data, context and
expert parallelism.

Runs anywhere with no download: by default it trains a sentencepiece tokenizer and a small model on the
Python standard library's own source files. One process, torchrun, or its own launcher::

    megamoe train --config configs/demo.toml --nproc-per-node 4
    torchrun --nproc-per-node 4 -m megamoe train --config configs/demo.toml
    torchrun --nproc-per-node 4 -m megamoe train --pp 2 --ep 2 --dispatcher alltoall
    torchrun --nproc-per-node 4 -m megamoe train --pp 2 --virtual-pipeline-stages 2 --layers 4
    torchrun --nproc-per-node 4 -m megamoe train --tp 2 --etp 1 --ep 4 --dispatcher alltoall
    torchrun --nproc-per-node 4 -m megamoe train --cp 2 --ep 2 --dispatcher alltoall

Config files: --config run.toml holds the same settings in sections (model, moe, parallel, data,
optimizer, schedule, checkpoint, logging; each key a flag's name with '_'); flags, or --section.key VALUE
(e.g. --optimizer.lr 3e-4), override it; --print-config prints the effective config, which --config reads
back. Every checkpoint and the --work-dir keep it as run_config.toml; a resumed run logs what changed.

Real runs: --data (text, JSON Lines, Parquet, token files, Megatron datasets; blended by --data-weights),
--hf-model (start from a HuggingFace model) or --model-config (a model of that shape from scratch),
--lr-schedule, --eval-fraction / --eval-data, --export-hf (end as a HuggingFace model), --export-peft (a LoRA
run's adapters for peft).

It logs loss, LR, grad norm, tokens/s, model TFLOP/s and MFU, aux loss and expert-load balancedness per
step (to --log-json, and --tensorboard / --wandb-project), shows a progress line on a terminal
(--no-progress: none), skips non-finite steps, saves checkpoints, prints a greedy sample and a few
temperature samples, and ends with a summary (steps, tokens, time, eval losses, the checkpoints). With
matplotlib installed it also plots the run.

Rerunning in the same directories continues the run: a --save-dir that holds checkpoints is resumed
from its newest one (with --steps reached, nothing is trained). --overwrite starts afresh instead,
after moving the old checkpoints aside. Each run appends a "run_start" record to the JSON log.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from megamoe.after_torchrun import wait_for_lines_after
from megamoe.cli.launch import (HelpFormatter, ScriptArgumentParser, add_device_argument, add_launch_arguments,
                                add_no_verify_checksums_argument, run_script)
from megamoe.cli.run_config import config_flags, read_config_file, split_dotted_overrides
from megamoe.data.data_arguments import add_data_arguments
from megamoe.data.packing import add_packing_arguments
from megamoe.errors import UsageError
from megamoe.moe.placement.eplb_arguments import add_eplb_arguments
from megamoe.moe.token_dispatcher import DEFAULT_DISPATCHER, dispatcher_names
from megamoe.process_group import launch_rank, resolve_device
from megamoe.training.metrics_arguments import add_metrics_arguments
from megamoe.training.lora_run import add_lora_arguments
from megamoe.training.optim_arguments import add_optim_arguments
from megamoe.training.pretrain import pretrain
from megamoe.training.pretrain_checks import HEADS, check_arguments, check_model_shape_flags
from megamoe.training.run_config_file import SECTIONS, render_run_config
from megamoe.transformer.recompute_arguments import add_recompute_arguments

__all__ = ["PROG", "build_parser", "parse_args", "main"]

PROG = "megamoe train"
# The flags that say how to read or launch the run, not what it is: not part of the run config.
_NOT_CONFIG = {"help", "config", "print_config", "nproc_per_node"}


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = ScriptArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    c = p.add_argument_group("run config and launch")
    c.add_argument("--config", type=Path, default=None, metavar="FILE",
                   help="a TOML run config (sections: " + ", ".join(SECTIONS) + "; each key a flag's name "
                        "with '_', e.g. [optimizer] lr = 3e-4); flags and --section.key VALUE overrides on the "
                        "command line win over it")
    c.add_argument("--print-config", action="store_true",
                   help="print the effective run config (file, overrides and flags) as TOML that --config reads, "
                        "and exit")
    c.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="start N ranks on this machine (torch.distributed.run) after checking the config for "
                        "that world size; without it, launch with torchrun or run as one process")
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
    g.add_argument("--dispatcher", choices=dispatcher_names(), default=DEFAULT_DISPATCHER,
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
    add_lora_arguments(p)
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
                   help="per-layer expert loads (megamoe.moe.placement.expert_slots.save_expert_load): balanced expert "
                        "placements over the slots, as megamoe-convert import-hf applies them")
    d.add_argument("--tokenizer", type=Path, default=None, metavar="PATH",
                   help="tokenizer file or directory (sentencepiece .model or HF tokenizer.json); default: the "
                        "--hf-model directory's own; with --data token files, the tokenizer their sidecars record "
                        "(when it is still there, unchanged); without --data, a sentencepiece model trained on the "
                        "corpus")
    d.add_argument("--export-hf", type=Path, default=None, metavar="OUT",
                   help="at the end, write the final checkpoint as a HuggingFace model directory (with the "
                        "tokenizer and side files) that transformers loads; OUT must not exist (a LoRA run: the "
                        "merged weights)")
    d.add_argument("--export-peft", type=Path, default=None, metavar="OUT",
                   help="a LoRA run: at the end, write its adapters as a PEFT adapter directory (adapter_config.json, "
                        "adapter_model.safetensors) that peft loads onto the transformers model; OUT must not exist")
    d.add_argument("--log-json", type=Path, default=None,
                   help="append one JSON object per step here, after a run_start record; default: "
                        "<work-dir>/log.jsonl")
    d.add_argument("--sample-tokens", type=int, default=32,
                   help="tokens of each sample printed at the end (0: no samples)")
    d.add_argument("--sample-prompt", default="def ", help="the prompt of the samples")
    d.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress line (rank 0 draws one on stderr when it is a terminal); the log lines stay")
    return p


def parse_args(argv=None, *, prog: str = PROG) -> argparse.Namespace:
    """The run config from the command line: ``--config FILE`` (if given), then the ``--section.key VALUE``
    overrides, then the flags, each later one winning. UsageError for an unknown key, a value of the wrong
    kind, or a model-shape flag (or key) given next to what already decides it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    overrides, rest = split_dotted_overrides(argv)
    args = parser.parse_args(rest)           # --help, flag errors; finds --config
    tables: dict[str, dict] = {}
    if args.config is not None:
        tables = read_config_file(args.config)
    for section, table in overrides.items():
        tables.setdefault(section, {}).update(table)
    where = f"--config {args.config}" if args.config is not None else "the --section.key overrides"
    from_file = config_flags(parser, tables, where)
    _check_values(parser, from_file, where)
    args = parser.parse_args(from_file + rest)
    # What the user chose (a file's key counts where it is not the default): the model-shape checks.
    given = {dest for dest, value in vars(_set_only(parser, from_file)).items()
             if value != parser.get_default(dest)} | set(vars(_set_only(parser, rest)))
    check_model_shape_flags(args, given)
    if args.save_dir is None:       # each --work-dir its own checkpoints: another run never resumes the demo's
        args.save_dir = args.work_dir / "checkpoints"
    return args


def _check_values(parser: argparse.ArgumentParser, tokens: list[str], where: str) -> None:
    """UsageError (one line, naming the file or the overrides and the flag) for a value the flag's type or
    choices refuse, where argparse itself would print its usage and exit 2."""
    def refuse(message):
        raise UsageError(f"{where}: {message}")

    parser.error = refuse
    try:
        parser.parse_args(tokens)
    finally:
        del parser.error


def _set_only(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The fields ``argv`` sets (a default value given explicitly included), nothing else."""
    defaults = {action.dest: action.default for action in parser._actions}
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        return parser.parse_args(argv)
    finally:
        for action in parser._actions:
            action.default = defaults[action.dest]


def config_fields(parser: argparse.ArgumentParser) -> set[str]:
    """The destinations of the parser that belong to the run config."""
    return {action.dest for action in parser._actions} - _NOT_CONFIG


def launch_ranks(args, argv: list[str]) -> int:
    """``--nproc-per-node N``: check the config for N ranks here (a mistake is one error line, before any
    rank starts), then run torch.distributed.run with this command, less the flag, on N local ranks."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise UsageError(f"--nproc-per-node {args.nproc_per_node} under torchrun: torchrun started the ranks "
                         "already; drop --nproc-per-node (or launch without torchrun)")
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    check_arguments(args, args.nproc_per_node, resolve_device(args.device))
    rest, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--nproc-per-node":
            skip = True
        elif not token.startswith("--nproc-per-node="):
            rest.append(token)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc_per_node),
               "-m", "megamoe", "train", *rest]
    torchrun = subprocess.Popen(command)
    code = torchrun.wait()
    if code:
        wait_for_lines_after(torchrun.pid)      # a rank's error line, repeated after torchrun's report
    return code


def main(argv=None, *, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv, prog=prog)
    if args.print_config:
        if launch_rank() == 0:
            sys.stdout.write(render_run_config(args))
        return 0
    if args.nproc_per_node is not None:
        return launch_ranks(args, argv)
    logging.basicConfig(level=logging.INFO if launch_rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    pretrain(args)
    return 0


def cli(argv=None) -> int:
    """``megamoe train``: :func:`main` with one-line errors (:func:`megamoe.cli.launch.run_script`)."""
    return run_script(main, argv, prog=PROG)
