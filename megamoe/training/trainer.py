"""One training step over a pipeline stage: forward/backward over micro-batches, gradient sync,
clipping, optimizer step, aux-loss-free expert-bias update, and the step's metrics.

Loss convention (see :mod:`megamoe.training.grad_sync`): each micro-batch's loss is the mean over
its tokens; a rank back-propagates ``loss / num_micro_batches`` (+ its stage's aux losses, also
divided by ``num_micro_batches``), and the reported loss is the mean over micro-batches and DP ranks.
Micro-batches are the same token sets under every layout (see ``ResumableSampler``), so a layout
change leaves the loss curve unchanged. With ``TrainConfig.per_token_loss`` (chat SFT, whose micro-batches
hold very different numbers of labelled tokens) each micro-batch's mean is weighted by its labelled tokens
(labels other than -100) times ``num_micro_batches * dp`` over the global batch's labelled tokens (one
all-reduce of the count over DP; CP, TP and PP ranks hold the same full labels): the loss, and its
gradient, is then the mean over every labelled token of the global batch, under any layout.

Each step's LR is ``TrainConfig.lr_schedule.lr_at(n + 1, TrainConfig.lr)``, set on every param group just
before the optimizer step (:mod:`megamoe.training.lr_schedule`), where ``n`` (``Trainer.lr_schedule_steps``)
counts the optimizer steps taken so far: skipped steps do not advance the schedule.

Non-finite steps. A step whose reduced loss, aux loss or global gradient norm is NaN or Inf (values every
rank holds identically) is skipped on every rank alike: no optimizer step, no expert-bias update (the
step's routing may have run on NaN scores), so parameters, optimizer state and biases stay as they were.
(Megatron updates the expert bias in ``finalize_model_grads``, before its optimizer's inf check, so also
on a skipped step; here a skipped step changes no trained state.) As in Megatron, ``Trainer.step`` (its
iteration) counts a skipped step, but the LR schedule does not advance on it: Megatron's ``train_step``
(megatron/training/training.py) calls ``opt_param_scheduler.step`` only ``if update_successful``, so the
LR of the next update is that of a run without the skipped steps (and Adam's own step count does not
advance either). The warning names what went non-finite (:func:`~megamoe.training.non_finite.locate_non_finite`;
that search runs only on such a step). After ``TrainConfig.max_skipped_steps`` consecutive skips the step
raises :class:`~megamoe.training.non_finite.NonFiniteTrainingError`.

fp16 (``autocast="fp16"``): dynamic loss scaling (:mod:`megamoe.training.loss_scaling`). The backward
starts from the loss times the scale; the synced gradients are unscaled before the norm, clipping and
the optimizer step; an overflow is a non-finite step as above, and backs the scale off. A skip whose
loss was finite and whose overflow lowered the scale (it was above ``LossScaleConfig.min_scale``) is the
scale calibrating, not divergence: it is logged (INFO), counted in ``skipped_steps``, but neither counts
toward ``max_skipped_steps`` nor resets the count (Megatron, whose default initial scale is 2**32, skips
such iterations without stopping). A non-finite loss (the forward does not depend on the scale), or an
overflow at the minimum scale, counts as in bf16 and fp32.

Optimizer. fp32 parameters train with :func:`build_optimizer` (AdamW; the parameters are the master weights)
unless ``TrainConfig.distributed_optimizer``: then :class:`~megamoe.training.distributed_optimizer.DistributedOptimizer`
shards the Adam moments over DP x CP (dense) and expert-DP (experts), the gradient sync leaves the DP
reductions to its reduce-scatter, the norm and clipping run on its gradient shards, and its step all-gathers
the parameters (``zero_stage=2``: the full gradients are freed after the reduce-scatter). Non-fp32 (bf16)
parameters always get that class, unsharded without ``distributed_optimizer``, for its fp32 master weights
and fp32 gradient accumulation over micro-batches (their gradients live in ``p.main_grad``, read through
:func:`megamoe.gradients.main_grad`).

Gradient reduction in buckets (:mod:`megamoe.training.grad_buckets`): the DP all-reduces (or the distributed
optimizer's reduce-scatters) run per bucket of at most ``TrainConfig.grad_bucket_mb`` MB of fp32 gradient. With
``overlap_grad_reduce`` the schedule tells the reducer when each chunk's last micro-batch backward starts
(``on_last_backward``), and buckets launch asynchronously from backward hooks as their gradients become
final; the gradient sync / ``reduce_gradients`` waits for them before the norm and the step. Buckets whose
reduction must follow another sum (sequence-parallel parameters under TP, tied embeddings, and under the
distributed optimizer replicated experts) are reduced after it, not overlapped. Overlap on or off, the same
buckets are reduced on the same buffers: bit-identical steps.

Online expert rebalancing (``TrainConfig.eplb``, :mod:`megamoe.moe.placement.eplb`): after the optimizer step and
the expert-bias update, each finite step's expert loads go into a window on the device (no collective, no
host sync); every ``interval`` steps the window is reduced and experts are re-placed, their weights and
Adam state moved with them, so the next step trains under the new placement (``StepMetrics.eplb``
reports the round). A skipped step records nothing and does not rebalance. The placement is part of the
model's state: the next checkpoint stores it, and a resume under any layout loads by expert. The window
is not checkpointed: a resumed run refills it.

Devices: every tensor a step creates lives on the device of the model's parameters, and the micro-batches
are moved there; ``tests/unit/test_device_clean.py`` runs whole steps on the ``meta`` device to prove it. The
step's host synchronisations, each a :mod:`megamoe.host_values` read:

- per MoE layer and micro-batch, ONE read: the (token, slot) pairs routed to each of this rank's slots
  (they size the expert input and the per-slot GEMMs), read with the all-to-all's split sizes (all-to-all
  dispatcher, EP > 1: one exchange carries both) or with every rank's token count (all-gather dispatcher,
  sharded input); a recomputed layer reuses its forward's read (:mod:`megamoe.moe.token_dispatcher`;
  ``tests/multirank/test_moe_layer.py`` and ``tests/multirank/test_recompute.py`` count them with
  :func:`megamoe.host_values.count_host_reads`);
- per forward: the attention mask's padding flags when a mask is passed, and with ``dynamic`` RoPE the
  longest position;
- the global gradient norm (``clip_grad_norm_``: the clipping decision, and a metric);
- the reduced expert loads (the placements' balancedness, a metric; the expert-bias update stays on
  the device);
- the step's metrics: loss, aux loss and each layer's aux loss (one read), the per-layer balancedness
  (one read);
- on a rebalancing step only (``TrainConfig.eplb``): the reduced window with every layer's placement,
  the placement digests, the migration's split sizes and the round's report (see :mod:`megamoe.moe.placement.eplb`).

On the meta device the metrics read as NaN (see :mod:`megamoe.host_values`), and a step is never taken
for non-finite there: a dry run has no values to judge.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from megamoe import comms
from megamoe.data.eval_split import IGNORE_INDEX
from megamoe.data.packing import MicroBatch, micro_batches_on
from megamoe.gradients import gradients
from megamoe.host_values import host_floats
from megamoe.models.config import GPTMoEConfig
from megamoe.models.sequence_parallel import counts_own_tokens, stage_hidden_shape
from megamoe.moe.placement.eplb import EPLBConfig, EPLBReport, ExpertRebalancer
from megamoe.parallel_plan import moe_layout_of
from megamoe.pipeline.schedule import forward_backward
from megamoe.pipeline.stage_dtype import stage_hidden_dtype
from megamoe.precision import upcast
from megamoe.training.distributed_optimizer import DistributedOptimizer
from megamoe.training.flops import training_flops
from megamoe.training.grad_buckets import grad_bucket_numel
from megamoe.training.grad_sync import GradientSync, clip_grad_norm_
from megamoe.training.loss_scaling import DynamicLossScaler, LossScaleConfig
from megamoe.training.lr_schedule import LRScheduleConfig
from megamoe.training.mfu import model_flops_utilization, model_tflops_per_rank
from megamoe.training.moe_layer_metrics import MoELayerMetrics, PerLayerAuxLoss
from megamoe.training.non_finite import NonFiniteTrainingError, locate_non_finite
from megamoe.training.peak_memory import peak_memory_bytes, reset_peak_memory
from megamoe.training.trainable_model import (TrainableModel, check_trainable_model, model_chunk_is_first,
                                              model_chunk_is_last)

__all__ = ["TrainConfig", "StepMetrics", "MoELayerMetrics", "Trainer", "build_optimizer"]

logger = logging.getLogger(__name__)

_AUTOCAST = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0              # global-norm clipping; 0 disables
    autocast: str | None = None         # None (fp32) | "bf16" | "fp16"; parameters stay fp32 (master weights)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)   # around the peak ``lr``
    max_skipped_steps: int = 10         # consecutive non-finite steps before NonFiniteTrainingError; 0: never
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)      # used with autocast="fp16" only
    eplb: EPLBConfig | None = None      # online expert rebalancing after the optimizer step; None: off
    # ZeRO: shard the Adam moments (and fp32 master weights of non-fp32 parameters) over DP x CP (dense)
    # and expert-DP (experts); gradients are reduce-scattered, parameters all-gathered
    # (megamoe.training.distributed_optimizer). zero_stage 2 also frees the full gradients after the
    # reduce-scatter (needs distributed_optimizer).
    distributed_optimizer: bool = False
    zero_stage: int = 1
    # Gradient reduction in buckets of at most grad_bucket_mb MB of (fp32-reduced) gradient, per (group, dtype,
    # model chunk), in reverse registration order (megamoe.training.grad_buckets). overlap_grad_reduce: each
    # bucket's all-reduce / reduce-scatter starts asynchronously from backward hooks during the last
    # micro-batch's backward, as soon as its gradients are ready, and is waited for before the optimizer step.
    # Off: the same buckets are reduced synchronously after the backward (bit-identical results).
    overlap_grad_reduce: bool = False
    grad_bucket_mb: float = 40.0
    # The loss is the mean over the global batch's labelled tokens, not over micro-batches of their means
    # (see the module docstring): what chat SFT's assistant-only labels need.
    per_token_loss: bool = False

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("TrainConfig.weight_decay and grad_clip must be >= 0")
        if self.autocast not in _AUTOCAST:
            raise ValueError(f"TrainConfig.autocast must be one of {list(_AUTOCAST)}, got {self.autocast!r}")
        if not (isinstance(self.max_skipped_steps, int) and self.max_skipped_steps >= 0):
            raise ValueError(f"TrainConfig.max_skipped_steps must be an int >= 0 (0: never stop), "
                             f"got {self.max_skipped_steps!r}")
        if not isinstance(self.lr_schedule, LRScheduleConfig):
            raise ValueError(f"TrainConfig.lr_schedule must be an LRScheduleConfig, got {type(self.lr_schedule)}")
        if not isinstance(self.distributed_optimizer, bool):
            raise ValueError(f"TrainConfig.distributed_optimizer must be a bool, got {self.distributed_optimizer!r}")
        if self.zero_stage not in (1, 2) or isinstance(self.zero_stage, bool):
            raise ValueError(f"TrainConfig.zero_stage must be 1 or 2, got {self.zero_stage!r}")
        if self.zero_stage == 2 and not self.distributed_optimizer:
            raise ValueError("TrainConfig.zero_stage=2 needs distributed_optimizer=True (ZeRO-2 frees gradients "
                             "outside the shards the distributed optimizer keeps)")
        if not isinstance(self.overlap_grad_reduce, bool):
            raise ValueError(f"TrainConfig.overlap_grad_reduce must be a bool, got {self.overlap_grad_reduce!r}")
        if (isinstance(self.grad_bucket_mb, bool) or not isinstance(self.grad_bucket_mb, (int, float))
                or not 0 < self.grad_bucket_mb < math.inf):
            raise ValueError(f"TrainConfig.grad_bucket_mb must be a number > 0 (MB of gradient per bucket), "
                             f"got {self.grad_bucket_mb!r}")
        if not isinstance(self.per_token_loss, bool):
            raise ValueError(f"TrainConfig.per_token_loss must be a bool, got {self.per_token_loss!r}")
        if self.eplb is not None and not isinstance(self.eplb, EPLBConfig):
            raise ValueError(f"TrainConfig.eplb must be an EPLBConfig or None, got {type(self.eplb).__name__}")


@dataclass
class StepMetrics:
    step: int
    loss: float                 # mean token loss over the global batch
    aux_loss: float             # sum over MoE layers of the (coefficient-weighted) aux losses
    grad_norm: float
    tokens_per_s: float
    balancedness: float         # mean over MoE layers of mean/max EP-rank load under the placement
    lr: float = 0.0             # the LR of this step (set on the optimizer, or that it would have had if skipped)
    skipped: bool = False       # non-finite: the optimizer step was skipped (on every rank)
    consecutive_skips: int = 0  # skipped steps in a row counted toward max_skipped_steps (fp16 calibration: not)
    loss_scale: float | None = None   # fp16: the scale this step's backward used
    # Model TFLOP/s per rank: the whole model's training FLOPs of the global batch / step time / world
    # size (megamoe.training.mfu); None for a model whose config is not a GPTMoEConfig.
    tflops: float | None = None
    mfu: float | None = None    # tflops / the Trainer's peak_tflops; None without one
    moe_layers: dict[int, MoELayerMetrics] = field(default_factory=dict)   # by global layer id, all stages
    peak_memory_bytes: int | None = None   # this rank's; see megamoe.training.peak_memory (CUDA: the step's)
    eplb: EPLBReport | None = None         # the expert rebalancing round run after this step (TrainConfig.eplb)


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay only on matrices. NVIDIA apex's FusedAdam when importable on CUDA, else
    torch's fused AdamW kernel where it exists (CPU, CUDA). The parameters are the master weights, so they
    must be fp32 (others: :class:`~megamoe.training.distributed_optimizer.DistributedOptimizer`, which the
    Trainer builds for them)."""
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype != torch.float32})
    if dtypes:
        raise ValueError(f"build_optimizer: parameters in {', '.join(dtypes)} need fp32 master weights; use "
                         "megamoe.training.distributed_optimizer.DistributedOptimizer (the Trainer builds it for "
                         "non-fp32 parameters, unsharded unless TrainConfig.distributed_optimizer)")
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    on_cuda = any(p.is_cuda for p in model.parameters())
    if on_cuda:
        try:
            from apex.optimizers import FusedAdam  # NVIDIA apex: optional accelerator, never a dependency
            return FusedAdam(groups, lr=config.lr, betas=config.betas, eps=config.eps, adam_w_mode=True)
        except ImportError:
            pass
    # One pass over each parameter instead of ~10 elementwise kernels: on CPU the step of a 61M-parameter
    # model takes ~30 ms instead of ~110 ms (benchmarks/train_step.py). Same update, up to rounding.
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=fused or None)


def _layer_count(config) -> int:
    """Layer ids run from 0 to this: the decoder layers and, after them, any MTP layers (megamoe.models.mtp)."""
    return config.num_layers + getattr(config, "mtp_num_layers", 0)


def _describe_balancing(router_config) -> str | None:
    """The expert load balancing a router config puts in force, in words; None when there is none
    (a z-loss alone keeps the logits small but does not balance the load)."""
    parts = [f"{label} {getattr(router_config, name):g}" for name, label in (
        ("aux_loss_coeff", "aux loss coeff"), ("seq_aux_loss_coeff", "sequence aux loss coeff"))
        if getattr(router_config, name) > 0]
    if router_config.use_expert_bias:
        parts.append(f"aux-loss-free expert bias (update rate {router_config.expert_bias_update_rate:g})")
    if not parts:
        return None
    if router_config.z_loss_coeff > 0:
        parts.append(f"z-loss coeff {router_config.z_loss_coeff:g}")
    return ", ".join(parts)


class Trainer:
    """Owns the optimizer and the gradient sync of one pipeline stage.

    ``model``: anything meeting :class:`~megamoe.training.trainable_model.TrainableModel`, e.g. a
    :class:`~megamoe.models.GPTMoEModel` (TypeError naming what is missing otherwise).
    ``world_group`` is the group of all ranks (``torch.distributed.group.WORLD``, or None for one
    process): metrics and the expert-load statistics are reduced over it. The expert load balancing
    in force (aux-loss coefficients, expert bias) is logged at construction, with a warning when
    there is none. ``peak_tflops``: the per-device peak that ``StepMetrics.mfu`` is measured against
    (:func:`megamoe.training.mfu.resolve_peak_tflops`); None leaves ``mfu`` None.
    """

    def __init__(self, model: TrainableModel, state, config: TrainConfig, *, world_group=None,
                 optimizer: torch.optim.Optimizer | None = None, peak_tflops: float | None = None):
        check_trainable_model(model)
        if getattr(model.config, "weight_quantization", None) is not None:
            raise ValueError("the model holds kept block-FP8 weights (GPTMoEConfig.weight_quantization): frozen e4m3 "
                             "values for inference, which cannot be trained; import the checkpoint with "
                             "`import-hf --dtype bf16` (or fp32) and train that model")
        if config.autocast == "fp16" and any(p.dtype == torch.bfloat16 for p in model.parameters()):
            # fp16 autocast leaves bf16 operands as they are (autocast only narrows wider types), so the experts
            # would meet fp16 activations with bf16 weights and fail at the first step.
            raise ValueError("TrainConfig.autocast='fp16' with bf16 parameters (--param-dtype bf16): the two half "
                             "types cannot mix; use autocast='bf16' (--autocast bf16) with bf16 parameters, or "
                             "fp32 parameters (--param-dtype fp32) with fp16 autocast")
        self.model, self.state, self.config, self.world_group = model, state, config, world_group
        self.peak_tflops = peak_tflops
        self._log_balancing()
        moe_layout = moe_layout_of(model, state)         # the layout plan's rules (megamoe.parallel_plan)
        replicas = 1 if moe_layout is None else moe_layout.expert_token_replicas
        if optimizer is not None and config.distributed_optimizer:
            raise ValueError("Trainer(optimizer=...) with TrainConfig.distributed_optimizer=True: the distributed "
                             "optimizer is built by the Trainer; pass one or the other")
        fp32 = all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        if optimizer is None and (config.distributed_optimizer or not fp32):
            # Non-fp32 parameters need fp32 master weights: the same class, unsharded (groups of one rank).
            optimizer = DistributedOptimizer.from_config(model, state, config, shard=config.distributed_optimizer,
                                                         tied_params=model.tied_parameters(),
                                                         expert_token_replicas=replicas)
        self.optimizer = optimizer or build_optimizer(model, config)
        self.distributed = isinstance(self.optimizer, DistributedOptimizer)
        sharded = self.distributed and self.optimizer.shard
        # Gradient buckets (megamoe.training.grad_buckets): the plain path's all-reduces, or the distributed
        # optimizer's reduce-scatters, start from backward hooks with overlap_grad_reduce.
        self.grad_sync = GradientSync(model, state, tied_params=model.tied_parameters(),
                                      expert_token_replicas=replicas, data_parallel=not sharded,
                                      bucket_numel=grad_bucket_numel(config.grad_bucket_mb),
                                      overlap=config.overlap_grad_reduce and not sharded)
        self._overlapped = ((self.optimizer,) if sharded else (self.grad_sync,)) if config.overlap_grad_reduce else ()
        for reducer in self._overlapped:
            logger.info("overlap_grad_reduce: %d gradient buckets of <= %g MB %s from backward hooks; %d deferred "
                        "(after the TP / tied / replica sums)", reducer.num_buckets, config.grad_bucket_mb,
                        "reduce-scattered" if sharded else "all-reduced", reducer.num_deferred_buckets)
        self.step = 0
        # The optimizer steps taken (skipped steps excluded): the LR schedule's position, like Megatron's
        # OptimizerParamScheduler.num_steps (megatron/core/optimizer_param_scheduler.py; in samples there).
        self.lr_schedule_steps = 0
        self.consecutive_skips = 0      # saved in training checkpoints, so the limit holds across a resume
        self.skipped_steps = 0
        self.loss_scaler = DynamicLossScaler(config.loss_scale) if config.autocast == "fp16" else None
        self.device = next(model.parameters()).device
        self.rebalancer = (ExpertRebalancer(model, state, config.eplb, world_group=world_group,
                                            optimizer=self.optimizer, counts_tokens=counts_own_tokens(model, state))
                           if config.eplb is not None else None)

    def _log_balancing(self) -> None:
        by_description: dict[str | None, list[int]] = {}
        for layer_id, layer in self.model.moe_layers().items():
            by_description.setdefault(_describe_balancing(layer.router.config), []).append(layer_id)
        for description, layer_ids in by_description.items():
            if description is None:
                logger.warning("MoE layers %s train with NO expert load balancing (aux_loss_coeff, "
                               "seq_aux_loss_coeff = 0, use_expert_bias False): their routing may collapse onto "
                               "few experts; set RouterConfig.aux_loss_coeff or use_expert_bias", layer_ids)
            else:
                logger.info("expert load balancing of MoE layers %s: %s", layer_ids, description)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype of ``TrainConfig.autocast`` (None: none): evaluate_loss's ``autocast_dtype`` for an eval
        loss measured as the model trains."""
        return _AUTOCAST[self.config.autocast]

    def _autocast(self):
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor] | MicroBatch]) -> StepMetrics:
        """``micro_batches``: this DP rank's (inputs [mb, S], labels [mb, S]) of one global batch, or
        :class:`~megamoe.data.packing.MicroBatch` tuples that also carry packed documents' position
        ids and document ids (passed to the model on every pipeline stage). On any device: they are
        moved to the model's (a no-op for those already there)."""
        start = time.perf_counter()
        model, state = self.model, self.state
        micro_batches = micro_batches_on(micro_batches, self.device)
        num_mb = len(micro_batches)
        mb, seq = micro_batches[0].inputs.shape
        reset_peak_memory(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        for layer in model.moe_layers().values():
            layer.load_counter.reset()
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)
        lr = self.config.lr_schedule.lr_at(self.lr_schedule_steps + 1, self.config.lr)
        scale = self.loss_scaler.scale if self.loss_scaler is not None else None
        weights = self._token_weights(micro_batches) if self.config.per_token_loss else None

        def chunk_step(chunk: int):
            # The forward step of model chunk ``chunk`` (the whole stage without virtual pipeline stages):
            # token ids on the chunk holding the first virtual stage, labels and the loss on the last.
            first, last = model_chunk_is_first(model, chunk), model_chunk_is_last(model, chunk)
            keywords = {"chunk": chunk} if virtual_stages > 1 else {}
            # MTP layers (megamoe.models.mtp) on a last stage that does not embed: they need the token ids too.
            mtp_ids = last and not first and getattr(model.config, "mtp_num_layers", 0)

            def forward_step(input_tensor, index):
                nonlocal aux_total
                batch = micro_batches[index]
                with self._autocast():
                    out, aux = model(batch.inputs if first else input_tensor, labels=batch.labels if last else None,
                                     **batch.packing_keywords(), **keywords,
                                     **({"input_ids": batch.inputs} if mtp_ids else {}))
                aux_total += aux.detach().double()
                if last:
                    out = upcast(out) / num_mb if weights is None else upcast(out) * (weights[index] / num_mb)
                aux = aux / num_mb
                if scale is not None:
                    out = out * scale if last else out
                    aux = aux * scale
                return out, aux
            return forward_step

        virtual_stages = getattr(model, "virtual_pipeline_stages", 1)
        # One forward step per model chunk: more than one runs the interleaved schedule.
        forward_step = chunk_step(0) if virtual_stages == 1 else [chunk_step(c) for c in range(virtual_stages)]

        for reducer in self._overlapped:      # a previous step that raised mid-backward left nothing armed
            reducer.discard_pending()
        # Between pipeline stages: [mb, S, H], or this rank's sequence chunk [mb, S / tp, H] under sequence
        # parallelism (megamoe.models.sequence_parallel), in the parameters' dtype whatever the autocast
        # (megamoe.pipeline.stage_dtype).
        hidden_dtype = stage_hidden_dtype(model)
        hidden_shape = stage_hidden_shape(model, state, mb, seq)
        with PerLayerAuxLoss(model.moe_layers()) as layer_aux:
            losses = forward_backward(forward_step, num_mb, state, hidden_shape, hidden_dtype, self.device,
                                      on_last_backward=self._on_last_backward if self._overlapped else None)
        self.grad_sync.sync()
        if self.distributed:      # reduce-scatter into the optimizer's shards (ZeRO-2: frees p.grad)
            self.optimizer.reduce_gradients()
        loss, aux_loss, layer_aux_losses = self._global_losses(
            losses, aux_total, layer_aux.totals(_layer_count(model.config), self.device), num_mb, scale or 1.0)
        grads = (self.optimizer.gradient_shards() if self.distributed
                 else gradients(model.parameters()))
        if scale is not None and grads:
            torch._foreach_mul_(grads, 1.0 / scale)     # unscaled before the norm and clipping
        if self.distributed:
            grad_norm = self.optimizer.clip_grad_norm_(self.config.grad_clip, self.world_group)
        else:
            grad_norm = clip_grad_norm_(model, self.config.grad_clip, state, self.world_group,
                                        tied_params=model.tied_parameters())
        # Identical on every rank (global norm, reduced losses): every rank skips, or none does. A dry run
        # on the meta device has no values to judge.
        finite = self.device.type == "meta" or (math.isfinite(loss) and math.isfinite(aux_loss)
                                                and math.isfinite(grad_norm))
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.lr_schedule_steps += 1
        balancedness, layer_balance, loads = self._update_expert_biases(update_biases=finite)
        scale_lowered = self.loss_scaler is not None and self.loss_scaler.update(finite)
        self.step += 1
        if finite:
            self.consecutive_skips = 0
        elif scale_lowered and math.isfinite(loss) and math.isfinite(aux_loss):
            self._skip_calibrating(scale)
        else:
            # The re-run forwards the fewest micro-batches the schedule takes: 1, or pp when interleaved
            # (its micro-batch count is a multiple of pp).
            rerun_micro_batches = 1 if virtual_stages == 1 else state.pp.size
            self._skip(loss, aux_loss, grad_norm, scale, lambda: forward_backward(
                forward_step, rerun_micro_batches, state, hidden_shape, hidden_dtype, self.device))
        eplb_report = self._rebalance_experts(finite)
        tokens = mb * seq * num_mb * state.dp.size      # CP ranks share their sequences: count them once
        elapsed = time.perf_counter() - start
        tflops = mfu = None
        if isinstance(model.config, GPTMoEConfig):
            tflops = model_tflops_per_rank(training_flops(model.config, seq, tokens), step_time_s=elapsed,
                                           world_size=comms.group_size(self.world_group))
            mfu = model_flops_utilization(tflops, self.peak_tflops)
        moe_layers = {i: MoELayerMetrics(aux_loss=layer_aux_losses[i], balancedness=b,
                                         tokens_per_expert=[int(n) for n in loads[i].tolist()]
                                         if bool(loads[i].isfinite().all()) else [])
                      for i, b in layer_balance.items()}
        return StepMetrics(step=self.step, loss=loss, aux_loss=aux_loss, grad_norm=grad_norm,
                           tokens_per_s=tokens / elapsed, balancedness=balancedness, lr=lr, skipped=not finite,
                           consecutive_skips=self.consecutive_skips, loss_scale=scale, tflops=tflops, mfu=mfu,
                           moe_layers=moe_layers, peak_memory_bytes=peak_memory_bytes(self.device), eplb=eplb_report)

    def _token_weights(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """[num_mb] fp32, on the device: each micro-batch's labelled tokens * num_mb * dp / the global batch's
        (TrainConfig.per_token_loss); all ones when every micro-batch holds as many."""
        counts = torch.stack([(batch.labels != IGNORE_INDEX).sum() for batch in micro_batches]).double()
        total = counts.sum()
        comms.all_reduce_(total, self.state.dp.group)
        return (counts * (len(micro_batches) * self.state.dp.size) / total.clamp(min=1)).float()

    def _on_last_backward(self, chunk: int) -> None:
        """The schedule's call before the last backward of ``chunk``: arm the gradient reducer's hooks."""
        for reducer in self._overlapped:
            reducer.on_last_backward(chunk)

    def _rebalance_experts(self, finite: bool) -> EPLBReport | None:
        """TrainConfig.eplb: record the step's expert loads and, every ``interval`` steps, rebalance (after
        the optimizer step and the expert-bias update, so the next step trains under the new placement). A
        skipped step records nothing (its routing may have run on NaN scores) and does not rebalance: its
        weights did not change, and the next due step rebalances from the window as it stands."""
        if self.rebalancer is None or not finite:
            return None
        self.rebalancer.record()
        return self.rebalancer.rebalance(self.step) if self.rebalancer.due(self.step) else None

    def _global_losses(self, losses, aux_total, layer_aux_totals: torch.Tensor, num_mb: int,
                       scale: float) -> tuple[float, float, list[float]]:
        """The global means of the loss, the aux loss and each layer's aux loss [num_layers] (identical on
        every rank), in one all-reduce: the loss lives on the last stage (identical over TP), the aux
        losses on every stage (identical over TP): sum the TP-rank-0 copies, average over DP.
        ``losses`` (what the backward started from) are divided by ``scale``."""
        state = self.state
        # Context parallelism: each CP rank's loss is cp x its share of the micro-batch's mean token loss
        # (megamoe.models.gpt_moe), so every CP rank reports it (the sum over dp x cp, divided by it, is the
        # mean); the aux losses are the whole sequences' on every CP rank (like TP ranks): CP rank 0 reports
        # them cp times over, so that the same division leaves their mean over DP.
        # [loss, aux loss, each layer's aux loss]; the returned losses were already divided by num_mb
        totals = torch.zeros(2 + layer_aux_totals.numel(), dtype=torch.float64, device=self.device)
        if state.tp.rank == 0:
            if self.model.is_last_stage:
                totals[0] = torch.stack(losses).double().sum() / scale
            if state.cp.rank == 0:
                totals[1] = aux_total / num_mb * state.cp.size
                totals[2:] = layer_aux_totals / num_mb * state.cp.size
        comms.all_reduce_(totals, self.world_group)
        values = host_floats(totals / state.dp_cp.size)
        return values[0], values[1], values[2:]

    def _skip_calibrating(self, scale: float) -> None:
        """An fp16 overflow that lowered the loss scale: skipped, not counted toward max_skipped_steps."""
        self.skipped_steps += 1
        logger.info("step %d skipped: the fp16 gradients overflowed at loss scale %g, lowered to %g (calibrating: "
                    "not counted toward max_skipped_steps)", self.step, scale, self.loss_scaler.scale)

    def _skip(self, loss: float, aux_loss: float, grad_norm: float, scale: float | None, rerun_forward) -> None:
        """Count a skipped step, say what went non-finite (collective), raise after too many in a row."""
        self.consecutive_skips += 1
        self.skipped_steps += 1
        culprit = locate_non_finite(self.model, self.state, self.world_group,
                                    loss_finite=math.isfinite(loss) and math.isfinite(aux_loss),
                                    rerun_forward=rerun_forward,
                                    gradients=self.optimizer.named_gradient_shards if self.distributed else None)
        self.optimizer.zero_grad(set_to_none=True)   # the re-run's, if any
        scaling = "" if scale is None else f"; fp16 loss scale {scale:g} -> {self.loss_scaler.scale:g}"
        limit = self.config.max_skipped_steps
        logger.warning("step %d skipped (loss %s, aux loss %s, grad norm %s%s): %s; %d consecutive skipped step(s)%s",
                       self.step, loss, aux_loss, grad_norm, scaling, culprit, self.consecutive_skips,
                       f" of at most {limit}" if limit else "")
        if limit and self.consecutive_skips >= limit:
            raise NonFiniteTrainingError(
                f"training stopped at step {self.step}: {self.consecutive_skips} consecutive steps were non-finite "
                f"and skipped (the limit: max_skipped_steps={limit}, a script's --max-skipped-steps); at the last "
                f"one {culprit}. Resume from an earlier checkpoint, e.g. with a lower learning rate or stronger "
                "gradient clipping")

    def training_state(self) -> dict:
        """What a training checkpoint stores besides the step: the LR schedule with its peak and its
        position (``lr_schedule_steps``), the skip counters and the fp16 loss scale (JSON)."""
        return {"lr_schedule": {"peak_lr": self.config.lr, **self.config.lr_schedule.to_dict()},
                "lr_schedule_steps": self.lr_schedule_steps,
                "consecutive_skips": self.consecutive_skips, "skipped_steps": self.skipped_steps,
                "loss_scale": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_training_state(self, saved: dict) -> None:
        """Restore the counters and the loss scale of :meth:`training_state` (the schedule is this
        trainer's config; :func:`~megamoe.training.checkpoint.load_training_checkpoint` compares them),
        after ``self.step`` was set to the saved step. A loss scale saved by a non-fp16 run leaves an fp16
        trainer at its initial scale. A checkpoint without ``lr_schedule_steps`` was saved when every step
        advanced the schedule: its schedule continues from its step. ValueError naming the field unless
        ``lr_schedule_steps`` is an int in [0, step]."""
        schedule_steps = saved.get("lr_schedule_steps", self.step)
        if isinstance(schedule_steps, bool) or not isinstance(schedule_steps, int) \
                or not 0 <= schedule_steps <= self.step:
            raise ValueError(f"training_state.lr_schedule_steps must be an int in [0, step={self.step}] (the "
                             f"optimizer steps taken), got {schedule_steps!r}")
        self.lr_schedule_steps = schedule_steps
        self.consecutive_skips = int(saved.get("consecutive_skips", 0))
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        if self.loss_scaler is not None and saved.get("loss_scale") is not None:
            self.loss_scaler.load_state_dict(saved["loss_scale"])

    @torch.no_grad()
    def _update_expert_biases(self, update_biases: bool = True) -> tuple[float, dict[int, float], torch.Tensor | None]:
        """Reduce this step's per-layer expert loads over all ranks (one all-reduce), update the
        aux-loss-free expert biases identically everywhere (on the device; not when ``update_biases`` is
        False: a skipped step). Returns the mean balancedness, each MoE layer's (of every stage) and the
        loads [num_layers, num_experts] summed over all ranks, on the host."""
        config = self.model.config
        if config.moe is None:
            return 1.0, {}, None
        loads = torch.zeros(_layer_count(config), config.moe.num_experts, dtype=torch.float64, device=self.device)
        moe_layers = self.model.moe_layers()
        for layer_id, layer in moe_layers.items():
            # Count each token once: TP ranks route the same tokens (TP rank 0 counts them), or under
            # sequence parallelism each its own chunk (every rank counts).
            if counts_own_tokens(self.model, self.state):
                loads[layer_id] = layer.load_counter.per_expert.double()
        comms.all_reduce_(loads, self.world_group)
        host_loads = torch.tensor(host_floats(loads), dtype=torch.float64).view_as(loads)
        # Each stage knows its own layers' placements: one (TP 0, DP 0) rank per stage reports.
        # stats: [balancedness, 1 where reported] per layer.
        reporter = self.state.tp.rank == 0 and self.state.dp_cp.rank == 0
        stats = torch.zeros(2, _layer_count(config), dtype=torch.float64)
        for layer_id, layer in moe_layers.items():
            if update_biases and layer.router.config.use_expert_bias:
                layer.router.update_expert_bias(loads[layer_id])
            if reporter:
                # NaN loads (a meta dry run measured nothing) have no balancedness.
                balance = (layer.placement.balancedness(host_loads[layer_id])
                           if bool(host_loads[layer_id].isfinite().all()) else math.nan)
                stats[:, layer_id] = torch.tensor([balance, 1.0])
        stats = stats.to(self.device)
        comms.all_reduce_(stats, self.world_group)
        stats = torch.tensor(host_floats(stats), dtype=torch.float64).view_as(stats)
        reported = stats[1] > 0
        per_layer = {i: stats[0, i].item() for i in reported.nonzero().flatten().tolist()}
        mean = (stats[0].sum() / stats[1].sum()).item() if reported.any() else 1.0
        return mean, per_layer, host_loads
