"""``megamoe convert`` (alias ``megamoe-convert``): HuggingFace <-> megamoe checkpoints.

Subcommands: ``import-hf``, ``export-hf``, ``export-peft``, ``reshard``, ``inspect``, ``verify``, ``edit-config``;
``--help`` on each.
Bad input ends with a one-line ``error:`` message and exit code 1 (2 for a malformed command line);
``verify`` exits 1 when the logits differ by more than ``--atol``, ``inspect`` when a file is damaged or a
tensor holds NaN/Inf, and with an error line when the manifest is refused. Every command that reads a
megamoe checkpoint checks each file against its manifest (checksums included) before using it;
``--no-verify-checksums`` skips the hashing (sizes are still checked). Every ``--help`` shows the defaults.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import re
import sys

from megamoe.hf.adapters import AdapterError
from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.finite_values import ALLOW_FLAG
from megamoe.checkpoint.format import CheckpointError
from megamoe.hf.target_dtype import TARGET_DTYPES
from megamoe.cli.launch import HelpFormatter, add_no_verify_checksums_argument
from megamoe.moe.token_dispatcher import DEFAULT_DISPATCHER, dispatcher_names

__all__ = ["main", "build_parser"]

_PROG = "megamoe-convert"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _size(text: str) -> int:
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size like 5GB, 500MB or a number of bytes, got {text!r}")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"the size must be positive, got {text!r}")
    return size


def _assignment(text: str):
    from checkpoint_tools.edit_config import parse_assignment
    try:
        return parse_assignment(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _layout_options(parser: argparse.ArgumentParser, dispatcher_default: str | None) -> None:
    group = parser.add_argument_group("target layout and expert slots")
    group.add_argument("--tp", type=_positive_int, required=True, help="tensor-parallel size")
    group.add_argument("--pp", type=_positive_int, required=True, help="pipeline-parallel size")
    group.add_argument("--ep", type=_positive_int, required=True, help="expert-parallel size")
    group.add_argument("--etp", type=_positive_int,
                       help="expert-tensor-parallel size (default: tp with the alltoall dispatcher, 1 with allgather)")
    group.add_argument("--num-expert-slots", type=_positive_int,
                       help="expert slots per MoE layer, a multiple of --ep and >= the number of experts (extra "
                            "slots hold replicas); default: " + ("one per expert" if dispatcher_default else
                                                                 "the checkpoint's number"))
    group.add_argument("--expert-load", metavar="FILE",
                       help="per-layer expert loads (megamoe-expert-load JSON) for balanced placements")
    saved = "the checkpoint's"
    group.add_argument("--dispatcher", choices=dispatcher_names(), default=dispatcher_default,
                       help=f"token dispatcher recorded in the model config (default: {dispatcher_default or saved})")


def _allow_non_finite_option(parser: argparse.ArgumentParser, doing: str) -> None:
    parser.add_argument(ALLOW_FLAG, action="store_true",
                        help=f"{doing} weights holding NaN or Inf (a warning names each) instead of refusing them")


def build_parser(prog: str = _PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Convert checkpoints between HuggingFace and megamoe, "
                                     "reshard them, inspect and verify them.", formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: debug)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add = functools.partial(commands.add_parser, formatter_class=HelpFormatter)

    p = add("import-hf", help="HF model directory -> megamoe checkpoint for a layout",
            description="Convert a HuggingFace model directory (config.json + safetensors) into a "
                        "megamoe checkpoint laid out for the given parallel layout.")
    p.add_argument("hf_dir", metavar="HF_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    _layout_options(p, DEFAULT_DISPATCHER)
    p.add_argument("--dtype", choices=tuple(TARGET_DTYPES), default="keep",
                   help="cast floating tensors; of a block-FP8 release (quant_method fp8), keep stores the e4m3 "
                        "weights and their block scales as they are, the others dequantize them")
    p.add_argument("--overwrite", action="store_true", help="replace an existing megamoe checkpoint at OUT_DIR")
    _allow_non_finite_option(p, "import")

    p = add("export-hf", help="megamoe checkpoint -> HF model directory",
            description="Write a HuggingFace model directory (config.json, safetensors shards + "
                        "index, tokenizer files) that transformers' from_pretrained loads.")
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--dtype", choices=tuple(TARGET_DTYPES), default="keep",
                   help="cast floating tensors; of a checkpoint kept in block FP8, keep writes the FP8 release "
                        "back as it was imported, the others a dequantized directory without quantization_config")
    p.add_argument("--max-shard-size", type=_size, default="50GB",
                   help="largest safetensors shard, e.g. 5GB (default: 50GB, as save_pretrained)")
    p.add_argument("--hf-config", metavar="HF_DIR",
                   help="take config.json and tokenizer files from this HF directory (for checkpoints saved by "
                        "training, which do not keep them)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing HF model directory at OUT_DIR")
    p.add_argument("--merge-lora", action="store_true",
                   help="a LoRA run's checkpoint: write each adapted weight merged, W + alpha / r * B @ A")
    _allow_non_finite_option(p, "export")
    add_no_verify_checksums_argument(p)

    p = add("export-peft", help="LoRA run's checkpoint -> PEFT adapter directory",
            description="Write the adapters of a LoRA run's checkpoint as a PEFT adapter directory "
                        "(adapter_config.json, adapter_model.safetensors) that peft's PeftModel.from_pretrained "
                        "loads onto the transformers model of its base, expert adapters included.")
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--overwrite", action="store_true", help="replace an existing PEFT adapter directory at OUT_DIR")
    add_no_verify_checksums_argument(p)

    p = add("reshard", help="megamoe checkpoint -> another layout / slots / placement",
            description="Rewrite a megamoe checkpoint (optimizer state included) for another "
                        "parallel layout, number of expert slots or placement.")
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.add_argument("out_dir", metavar="OUT_DIR")
    _layout_options(p, None)
    p.add_argument("--overwrite", action="store_true", help="replace an existing megamoe checkpoint at OUT_DIR")
    add_no_verify_checksums_argument(p)

    p = add("inspect", help="layout, placements, parameter counts, FP8 weights, checksums, NaN/Inf",
            description="Describe a megamoe checkpoint, verify every file's checksum and, if they "
                        "pass, scan every tensor for NaN and infinite values (one tensor in memory "
                        "at a time). Exits 1 when a file is damaged or a tensor holds NaN/Inf. Given a "
                        "HuggingFace model directory, describe its weights (dtypes, block-FP8 weights "
                        "and block size) from the file headers.")
    p.add_argument("checkpoint", metavar="CKPT_DIR|HF_DIR")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = add("verify", help="compare the checkpoint's logits with transformers'",
            description="Run the checkpoint on spawned CPU ranks (its layout) and the HF model with "
                        "transformers on the same tokens; exit 1 if the logits differ by more than "
                        "--atol.")
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.add_argument("--hf", required=True, metavar="HF_DIR", help="the HuggingFace model directory to compare with")
    p.add_argument("--nproc", type=_positive_int, help="ranks to spawn (default: the checkpoint's world size)")
    p.add_argument("--atol", type=float, default=1e-4, help="largest accepted absolute logit difference")
    add_no_verify_checksums_argument(p)

    p = add("edit-config", help="change fields of a checkpoint's model config (hand edits are refused)",
            description="Set fields of a megamoe checkpoint's model_config and rewrite its manifest atomically "
                        "with a new digest (a manifest edited by hand is refused on load). The new config is "
                        "checked as every load path checks it: valid, and matching the stored tensors.")
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.add_argument("--set", dest="assignments", metavar="KEY=VALUE", action="append", required=True,
                   type=_assignment,
                   help="a dotted model_config field and its new value as JSON (else a string), e.g. "
                        "moe.router.top_k=3 or attention.rope.theta=1e6; repeat for several")
    return parser


def _layout(args, dispatcher: str):
    from megamoe.checkpoint.layout import ParallelLayout
    from megamoe.parallel_plan import default_etp
    return ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=default_etp(args.tp, dispatcher, args.etp))


def _run(args) -> int:
    if args.command == "import-hf":
        from megamoe.hf.import_hf import import_hf
        summary = import_hf(args.hf_dir, args.out_dir, _layout(args, args.dispatcher),
                            num_expert_slots=args.num_expert_slots, expert_load=args.expert_load, dtype=args.dtype,
                            dispatcher=args.dispatcher, overwrite=args.overwrite,
                            allow_non_finite=args.allow_non_finite)
        print(f"wrote {summary['out_dir']}: {summary['family']}, {summary['logical_tensors']} logical tensors, "
              f"{summary['files']} files, {summary['bytes'] / 2**20:.1f} MiB, layout "
              + " ".join(f"{k}={v}" for k, v in summary["layout"].items()))
        return 0
    if args.command == "export-hf":
        from megamoe.hf.export_hf import export_hf
        summary = export_hf(args.checkpoint, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                            max_shard_bytes=args.max_shard_size, hf_config_dir=args.hf_config,
                            verify_checksums=args.verify_checksums, allow_non_finite=args.allow_non_finite,
                            merge_lora=args.merge_lora)
        print(f"wrote {summary['out_dir']}: {summary['family']}, {summary['tensors']} tensors in {summary['shards']} "
              f"shards, {summary['bytes'] / 2**20:.1f} MiB")
        return 0
    if args.command == "export-peft":
        from megamoe.hf.peft_export import export_peft_checkpoint
        summary = export_peft_checkpoint(args.checkpoint, args.out_dir, overwrite=args.overwrite,
                                         verify_checksums=args.verify_checksums)
        print(f"wrote {summary['out_dir']}: {summary['family']}, {summary['tensors']} adapter tensors of rank "
              f"{summary['rank']}")
        return 0
    if args.command == "reshard":
        from megamoe.checkpoint.format import read_manifest
        from megamoe.checkpoint.model_manifest import check_model_manifest
        from checkpoint_tools.reshard import reshard
        saved = check_model_manifest(read_manifest(args.checkpoint), args.checkpoint)
        dispatcher = args.dispatcher or (saved.moe.dispatcher if saved.moe is not None else DEFAULT_DISPATCHER)
        summary = reshard(args.checkpoint, args.out_dir, _layout(args, dispatcher),
                          num_expert_slots=args.num_expert_slots, expert_load=args.expert_load,
                          dispatcher=args.dispatcher, overwrite=args.overwrite,
                          verify_checksums=args.verify_checksums)
        print(f"wrote {summary['out_dir']}: {summary['logical_tensors']} logical tensors "
              f"({summary['optimizer_tensors']} optimizer state), {summary['files']} files, layout "
              + " ".join(f"{k}={v}" for k, v in summary["layout"].items()))
        return 0
    if args.command == "inspect":
        from checkpoint_tools.fp8_inspection import format_hf_inspection, inspect_hf_directory, is_hf_directory
        if is_hf_directory(args.checkpoint):
            info = inspect_hf_directory(args.checkpoint)
            print(json.dumps(info, indent=1) if args.json else format_hf_inspection(info))
            return 0
        from checkpoint_tools.inspection import format_inspection, inspect_checkpoint
        info = inspect_checkpoint(args.checkpoint)
        print(json.dumps(info, indent=1) if args.json else format_inspection(info))
        return 0 if info["verification"]["ok"] and not info["non_finite"]["count"] else 1
    if args.command == "edit-config":
        from checkpoint_tools.edit_config import edit_config
        changes = edit_config(args.checkpoint, args.assignments)
        print(f"edited {args.checkpoint}: " + ", ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}"
                                                       for key, old, new in changes))
        return 0
    from checkpoint_tools.verify import verify_against_hf
    result = verify_against_hf(args.checkpoint, args.hf, nproc=args.nproc, atol=args.atol,
                               verify_checksums=args.verify_checksums)
    print(f"{'OK' if result.ok else 'FAILED'}: max abs logit difference {result.max_abs_diff:.3e} (atol "
          f"{result.atol:.1e}), max relative {result.max_rel_diff:.3e}; {result.nproc} ranks, {result.layout}")
    return 0 if result.ok else 1


def main(argv: list[str] | None = None, *, prog: str = _PROG) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) as ``prog`` (``megamoe-convert``, or ``megamoe
    convert`` / ``megamoe inspect``); returns the exit code."""
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:            # --help (0) or a malformed command line (2)
        return int(e.code or 0)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    import torch
    threads = torch.get_num_threads()
    # The conversions only copy memory: one thread is as fast, and intra-op threads waiting on each other
    # make every copy up to a hundred times slower when the cores are busy (measured: 65 MB/s instead of
    # 2-8 GB/s on two loaded cores). Restored afterwards for callers that run main() in process.
    torch.set_num_threads(1)
    # The objects made by importing torch and transformers (about a million) live as long as the process:
    # without this, every full collection triggered during a conversion walks them all again (~0.15 s).
    gc.freeze()
    try:
        return _run(args)
    except (ConversionError, CheckpointError, AdapterError, OSError) as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
