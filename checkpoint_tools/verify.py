"""``verify``: run a megamoe checkpoint on spawned ranks and transformers on the same tokens; compare logits.

The ranks (gloo, CPU, :func:`megamoe.spawned_ranks.run_on_ranks`) form the checkpoint's parallel layout (or
the same layout over more data-parallel ranks with ``nproc``), build the model from the checkpoint
(:func:`build_model_from_checkpoint`) in fp32 and compute the full logits with
:func:`megamoe.inference.pipeline_forward.pipeline_logits`. The parent loads the HF directory with
``transformers.AutoModelForCausalLM`` in fp32 and runs the same token ids.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from megamoe.checkpoint.errors import ConversionError
from megamoe.checkpoint.format import read_manifest
from megamoe.checkpoint.layout import ParallelLayout
from megamoe.checkpoint.model_manifest import check_model_manifest

__all__ = ["VerifyResult", "verify_against_hf", "rank_logits", "compare_logits"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyResult:
    """Logit differences between the megamoe checkpoint and transformers."""

    max_abs_diff: float
    max_rel_diff: float          # max |diff| / max |reference logit|
    atol: float
    nproc: int
    layout: str

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.atol


def compare_logits(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, max abs difference / max abs reference value)."""
    diff = (logits.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    return diff, diff / scale if scale else diff


def rank_logits(rank: int, world_size: int, checkpoint: str, layout: dict, input_ids: torch.Tensor,
                overrides: dict | None = None, verify_checksums: bool = True):
    """Spawned-rank body: this rank's model from ``checkpoint`` under ``layout`` (tp, pp, ep, etp and
    optionally order): the full fp32 logits as a numpy array (a tensor would travel back to the parent
    as shared memory of a process that has exited) on ONE rank, the last pipeline stage's first TP rank
    of the first data-parallel replica (where they are computed, not broadcast); None elsewhere. ``overrides``: engine
    choices for :func:`build_model_from_checkpoint` (dispatcher, num_expert_slots). The ranks share out
    verifying the checkpoint's files (each is hashed by one rank) unless ``verify_checksums=False``."""
    import torch.distributed as dist

    from megamoe.checkpoint.model_loading import build_model_from_checkpoint
    from megamoe.inference.pipeline_forward import pipeline_logits
    from parallel_state import destroy_model_parallel, initialize_model_parallel

    state = initialize_model_parallel(tp=layout["tp"], pp=layout["pp"], ep=layout["ep"], etp=layout["etp"],
                                      **({"order": layout["order"]} if "order" in layout else {}))
    try:
        model = build_model_from_checkpoint(checkpoint, state, dtype=torch.float32, verify_checksums=verify_checksums,
                                            world_group=dist.group.WORLD, **(overrides or {})).eval()
        logits = pipeline_logits(model, state, input_ids)
        reports = state.is_last_pp_stage and state.tp.rank == 0 and state.dp.rank == 0
        return logits.numpy() if reports else None
    finally:
        destroy_model_parallel()


def _hf_config(hf_dir) -> dict:
    try:
        with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read {os.path.join(hf_dir, 'config.json')}: {e}") from None
    return config if isinstance(config, dict) else {}


def verify_against_hf(checkpoint: str | os.PathLike, hf_dir: str | os.PathLike, *, nproc: int | None = None,
                      atol: float = 1e-4, batch: int = 2, seq_len: int = 16, seed: int = 0,
                      timeout_s: float = 600.0, verify_checksums: bool = True) -> VerifyResult:
    """Logit differences of ``checkpoint`` (on ``nproc`` spawned ranks, default the layout's world size)
    against transformers' model in ``hf_dir`` on ``batch`` random sequences of ``seq_len`` tokens. The
    checkpoint's files are checked against its manifest first (checksums unless ``verify_checksums=False``):
    a damaged file fails the run."""
    from megamoe.spawned_ranks import RankFailure, run_on_ranks
    from parallel_state import compute_rank_groups

    checkpoint, hf_dir = os.fspath(checkpoint), os.fspath(hf_dir)
    manifest = read_manifest(checkpoint)
    config = check_model_manifest(manifest, checkpoint)
    saved = manifest["parallel_layout"]
    layout = ParallelLayout.from_manifest(saved)
    nproc = nproc or saved.get("world_size") or layout.world_size
    try:
        compute_rank_groups(nproc, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
                            **({"order": saved["order"]} if "order" in saved else {}))
    except ValueError as e:
        raise ConversionError(f"--nproc {nproc} cannot hold the checkpoint's layout {layout}: {e}") from None
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir} is not a directory (expected a HuggingFace model directory)")
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))

    logger.info("running the checkpoint on %d ranks (%s)", nproc, layout)
    try:
        per_rank = run_on_ranks(rank_logits, nproc, args=(checkpoint, saved, input_ids),
                                kwargs={"verify_checksums": verify_checksums}, timeout_s=timeout_s)
    except RankFailure as e:     # e.g. a damaged checkpoint: say what the rank said, without its traceback
        lines = [line.strip() for line in str(e).splitlines() if line.strip() and not line.startswith("(ranks")]
        raise ConversionError(f"running the checkpoint on {nproc} ranks failed: {lines[-1]}") from None
    logits = torch.from_numpy(next(r for r in per_rank if r is not None))

    import transformers
    # A block-FP8 release runs dequantized, on the CPU like the ranks (transformers' FP8 kernels need a GPU).
    quantized = (_hf_config(hf_dir).get("quantization_config") or {}).get("quant_method") == "fp8"
    extra = {"quantization_config": transformers.FineGrainedFP8Config(dequantize=True)} if quantized else {}
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                                     attn_implementation="eager", **extra).eval()
    except Exception as e:  # noqa: BLE001 - transformers raises many types for an unusable directory
        raise ConversionError(f"transformers cannot load {hf_dir}: {e}") from None
    with torch.no_grad():
        reference = hf_model(input_ids=input_ids).logits
    if reference.shape != logits.shape:
        raise ConversionError(f"logits of shape {tuple(logits.shape)} from the checkpoint, "
                              f"{tuple(reference.shape)} from {hf_dir}: not the same model")
    abs_diff, rel_diff = compare_logits(logits, reference)
    return VerifyResult(abs_diff, rel_diff, atol, nproc, str(layout))
