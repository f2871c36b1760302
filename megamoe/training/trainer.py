"""One training step over a pipeline stage: forward/backward over micro-batches, gradient sync,
clipping, optimizer step, aux-loss-free expert-bias update, and the step's metrics.

Loss convention (see :mod:`megamoe.training.grad_sync`): each micro-batch's loss is the mean over
its tokens; a rank back-propagates ``loss / num_micro_batches`` (+ its stage's aux losses, also
divided by ``num_micro_batches``), and the reported loss is the mean over micro-batches and DP ranks.
Micro-batches are the same token sets under every layout (see ``ResumableSampler``), so a layout
change leaves the loss curve unchanged.

Devices: every tensor a step creates lives on the device of the model's parameters, and the micro-batches
are moved there; ``tests/test_device_clean.py`` runs whole steps on the ``meta`` device to prove it. The
step's host synchronisations, each a :mod:`megamoe.host_values` read:

- per MoE layer and micro-batch: the number of (token, slot) pairs routed to this rank's experts
  (``permute_by_slot``: it sizes the expert input) and, with the all-to-all dispatcher and EP > 1, the
  split sizes of the exchange (they size the receive buffers); the all-gather dispatcher with sharded
  input also reads every rank's token count; the experts' per-slot GEMMs (CPU, or rows not in bf16)
  read the rows per slot (``torch._grouped_mm`` on accelerators takes them on the device);
- per forward: the attention mask's padding flags when a mask is passed, and with ``dynamic`` RoPE the
  longest position;
- the global gradient norm (``clip_grad_norm_``: the clipping decision, and a metric);
- the reduced expert loads (the placements' balancedness, a metric; the expert-bias update stays on
  the device);
- the step's metrics: loss and aux loss (one read), balancedness (one read).

On the meta device the metrics read as NaN (see :mod:`megamoe.host_values`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import torch

from megamoe import comms
from megamoe.host_values import host_floats
from megamoe.models.gpt_moe import expert_token_replicas
from megamoe.pipeline.schedule import forward_backward
from megamoe.precision import upcast
from megamoe.training.grad_sync import GradientSync, clip_grad_norm_
from megamoe.training.trainable_model import TrainableModel, check_trainable_model

__all__ = ["TrainConfig", "StepMetrics", "Trainer", "build_optimizer"]

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

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("TrainConfig.weight_decay and grad_clip must be >= 0")
        if self.autocast not in _AUTOCAST:
            raise ValueError(f"TrainConfig.autocast must be one of {list(_AUTOCAST)}, got {self.autocast!r}")


@dataclass
class StepMetrics:
    step: int
    loss: float                 # mean token loss over the global batch
    aux_loss: float             # sum over MoE layers of the (coefficient-weighted) aux losses
    grad_norm: float
    tokens_per_s: float
    balancedness: float         # mean over MoE layers of mean/max EP-rank load under the placement


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay only on matrices. NVIDIA apex's FusedAdam when importable on CUDA, else
    torch's fused AdamW kernel where it exists (CPU, CUDA)."""
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
    there is none.
    """

    def __init__(self, model: TrainableModel, state, config: TrainConfig, *, world_group=None,
                 optimizer: torch.optim.Optimizer | None = None):
        check_trainable_model(model)
        self.model, self.state, self.config, self.world_group = model, state, config, world_group
        self._log_balancing()
        self.optimizer = optimizer or build_optimizer(model, config)
        self.grad_sync = GradientSync(model, state, tied_params=model.tied_parameters(),
                                      expert_token_replicas=expert_token_replicas(model.config, state))
        self.step = 0
        self.device = next(model.parameters()).device

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

    def _autocast(self):
        dtype = _AUTOCAST[self.config.autocast]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepMetrics:
        """``micro_batches``: this DP rank's (inputs [mb, S], labels [mb, S]) of one global batch, on any
        device: they are moved to the model's (a no-op for those already there)."""
        start = time.perf_counter()
        model, state = self.model, self.state
        micro_batches = [(inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True))
                         for inputs, labels in micro_batches]
        num_mb = len(micro_batches)
        mb, seq = micro_batches[0][0].shape
        self.optimizer.zero_grad(set_to_none=True)
        for layer in model.moe_layers().values():
            layer.load_counter.reset()
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)

        def forward_step(input_tensor, index):
            nonlocal aux_total
            inputs, labels = micro_batches[index]
            with self._autocast():
                out, aux = model(inputs if model.is_first_stage else input_tensor,
                                 labels=labels if model.is_last_stage else None)
            aux_total += aux.detach().double()
            if model.is_last_stage:
                return upcast(out) / num_mb, aux / num_mb
            return out, aux / num_mb

        hidden_dtype = _AUTOCAST[self.config.autocast] or next(model.parameters()).dtype
        losses = forward_backward(forward_step, num_mb, state, (mb, seq, model.config.hidden_size), hidden_dtype,
                                  device=self.device)
        self.grad_sync.sync()
        grad_norm = clip_grad_norm_(model, self.config.grad_clip, state, self.world_group,
                                    tied_params=model.tied_parameters())
        self.optimizer.step()
        balancedness = self._update_expert_biases()
        self.step += 1

        # Report the global means: the loss lives on the last stage (identical over TP), the aux
        # losses on every stage (identical over TP): sum the TP-rank-0 copies, average over DP.
        reporter = state.tp.rank == 0 and state.cp.rank == 0
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        if reporter:
            if model.is_last_stage:
                totals[0] = torch.stack(losses).double().sum()
            totals[1] = aux_total / num_mb
        comms.all_reduce_(totals, self.world_group)
        loss, aux_loss = host_floats(totals / state.dp_cp.size)
        tokens = mb * seq * num_mb * state.dp_cp.size
        return StepMetrics(step=self.step, loss=loss, aux_loss=aux_loss,
                           grad_norm=grad_norm, tokens_per_s=tokens / (time.perf_counter() - start),
                           balancedness=balancedness)

    @torch.no_grad()
    def _update_expert_biases(self) -> float:
        """Reduce this step's per-layer expert loads over all ranks (one all-reduce), update the
        aux-loss-free expert biases identically everywhere, return the mean balancedness."""
        config = self.model.config
        if config.moe is None:
            return 1.0
        loads = torch.zeros(config.num_layers, config.moe.num_experts, dtype=torch.float64, device=self.device)
        moe_layers = self.model.moe_layers()
        for layer_id, layer in moe_layers.items():
            # Count each DP replica's tokens once (TP ranks route the same tokens).
            if self.state.tp.rank == 0:
                loads[layer_id] = layer.load_counter.per_expert.double()
        comms.all_reduce_(loads, self.world_group)
        host_loads = torch.tensor(host_floats(loads), dtype=torch.float64).view_as(loads)
        balance = []
        for layer_id, layer in moe_layers.items():
            if layer.router.config.use_expert_bias:
                layer.router.update_expert_bias(loads[layer_id])
            # NaN loads (a meta dry run measured nothing) have no balancedness.
            balance.append(layer.placement.balancedness(host_loads[layer_id])
                           if bool(host_loads[layer_id].isfinite().all()) else math.nan)
        # Each stage knows its own layers' placements: one (TP 0, DP 0) rank per stage reports.
        reporter = self.state.tp.rank == 0 and self.state.dp_cp.rank == 0
        stats = torch.tensor([sum(balance), len(balance)] if reporter else [0.0, 0.0], dtype=torch.float64,
                             device=self.device)
        comms.all_reduce_(stats, self.world_group)
        balance_sum, num_layers = host_floats(stats)
        return 1.0 if num_layers == 0 else balance_sum / num_layers
