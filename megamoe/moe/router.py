"""Top-k MoE routing that reproduces HuggingFace transformers' routers, plus the balancing losses.

Family -> RouterConfig fields, checked against transformers 5.24's modeling code (HF config names in
quotes; fields not listed keep their defaults). Every family: hidden_size = "hidden_size",
top_k = "num_experts_per_tok", init_std = "initializer_range".

- mixtral:     num_experts = "num_local_experts", score_func = softmax,
               norm_topk_prob = True (HF always renormalises).
- qwen2_moe, qwen3_moe, olmoe:
               num_experts = "num_experts", score_func = softmax, norm_topk_prob = "norm_topk_prob".
- deepseek_v2: num_experts = "n_routed_experts", score_func = softmax,
               norm_topk_prob = False (HF ignores "norm_topk_prob"),
               routed_scaling_factor = "routed_scaling_factor";
               "topk_method" == "group_limited_greedy": n_group = "n_group", topk_group = "topk_group",
               group_score = max; "greedy": n_group = topk_group = 1.
- deepseek_v3: num_experts = "n_routed_experts", score_func = sigmoid, norm_topk_prob = "norm_topk_prob",
               routed_scaling_factor = "routed_scaling_factor", n_group = "n_group",
               topk_group = "topk_group", group_score = top2_sum, use_expert_bias = True
               (buffer expert_bias <- "e_score_correction_bias").
- glm4_moe:    DeepSeek-V3's router (transformers' Glm4MoeTopkRouter is the same computation), with
               num_experts = "n_routed_experts".
- minimax_m2:  num_experts = "num_local_experts", score_func = sigmoid, norm_topk_prob = True (HF always
               renormalises), use_expert_bias = True (its MoE block's "e_score_correction_bias"); no
               groups, no scaling. HF computes these logits in the gate weight's dtype, here in fp32 as
               for every family (the same in fp32; in bf16 the routing here is the more precise).
- gpt_oss:     num_experts = "num_local_experts", score_func = softmax, norm_topk_prob = True (HF's
               softmax over the top-k logits), bias = True (the gate's ``router.bias``).

Every family applies the score function over all experts before top-k; renormalising the top-k softmax
probabilities equals a softmax over the top-k logits, so no "softmax after top-k" option is needed.

Balancing losses. HF's ``load_balancing_loss_func`` (mixtral, qwen2_moe, qwen3_moe, olmoe) divides the
expert counts by the number of *tokens*, so its value is ``top_k`` times the switch loss defined here
(counts divided by token-*slots*, as in Megatron-Core and the DeepSeek papers, which makes a perfectly
balanced router score 1 for any top_k). Reproducing an HF training loss therefore needs
``aux_loss_coeff = router_aux_loss_coef * top_k``; HF also pools the counts of all layers before the
product, whereas each Router here reports its own layer's loss.

Sequence parallelism: ``Router.sequence_group`` (set by the MoE layer; None by default) is the group
whose ranks hold the other chunks of the same sequences (the TP group). The losses are then those of
the whole sequences: the selection counts (per expert, and per sequence and expert) are summed over
the group (one all-reduce, no gradient), the probability and z-loss sums are divided by the whole
token count, and each rank's loss is its own tokens' share of the sum. Its gradient is that share's
(the router weight, tagged ``sequence_parallel``, gets its gradient summed over the group), while its
VALUE is the whole loss (the shares summed, one all-reduce of a scalar), identical on every rank as
without sequence parallelism.

Context parallelism: the CP ranks hold other tokens of the same sequences too, so ``sequence_group`` is
the CP group (tp x cp under sequence parallelism or MoE folding). The gradient sync AVERAGES the
router's gradient over CP (a dense parameter, averaged over dp x cp) where it sums it over TP, so
``Router.averaged_shards`` (= cp) multiplies each share's gradient: the average over the CP ranks is
then the gradient of the whole loss, as on one rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megamoe import comms
from megamoe.precision import compute_dtype, hold_in_compute_dtype_
from megamoe.quantization.kept_weights import linear_weight

__all__ = ["RouterConfig", "RouterOutput", "Router"]

_SCORE_FUNCS = ("softmax", "sigmoid")
_GROUP_SCORES = ("max", "top2_sum")
# Guards the renormalisation and the sigmoid-score normalisation against an all-zero row; it is below
# fp32 resolution for any sum that is not itself vanishing, so results match HF's un-guarded division.
_NORM_EPS = 1e-20


@dataclass
class RouterConfig:
    """Shape and behaviour of one MoE router; see the module docstring for the HF family mapping.

    Selection uses ``scores + expert_bias`` (when ``use_expert_bias``), restricted to the
    ``topk_group`` best of ``n_group`` equal expert groups (when ``n_group > 1``); the combine weights
    are the unbiased scores of the selected experts, optionally renormalised to sum to 1, times
    ``routed_scaling_factor``.
    """

    hidden_size: int
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    use_expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    aux_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    init_std: float = 0.02  # std of the normal init of the gate weight (HF: initializer_range)
    bias: bool = False      # a learned [E] logit bias (gpt-oss's router.bias); trained, unlike expert_bias

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_experts", "top_k", "n_group", "topk_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"RouterConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts}); "
                "lower top_k or add experts"
            )
        if self.score_func not in _SCORE_FUNCS:
            raise ValueError(
                f"RouterConfig.score_func must be one of {_SCORE_FUNCS}, got {self.score_func!r}"
            )
        if self.group_score not in _GROUP_SCORES:
            raise ValueError(
                f"RouterConfig.group_score must be one of {_GROUP_SCORES}, got {self.group_score!r}"
            )
        if self.num_experts % self.n_group != 0:
            raise ValueError(
                f"RouterConfig.n_group ({self.n_group}) must divide num_experts ({self.num_experts})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(
                f"RouterConfig.topk_group ({self.topk_group}) must be <= n_group ({self.n_group})"
            )
        experts_per_group = self.num_experts // self.n_group
        if self.top_k > self.topk_group * experts_per_group:
            raise ValueError(
                f"RouterConfig.top_k ({self.top_k}) must be <= topk_group * experts per group "
                f"({self.topk_group} * {experts_per_group}); raise topk_group or lower top_k"
            )
        if self.n_group > 1 and self.group_score == "top2_sum" and experts_per_group < 2:
            raise ValueError(
                "RouterConfig.group_score 'top2_sum' needs >= 2 experts per group; "
                f"lower n_group ({self.n_group}) or use group_score='max'"
            )
        if not (math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            raise ValueError(
                "RouterConfig.routed_scaling_factor must be a finite number > 0, "
                f"got {self.routed_scaling_factor}"
            )
        for name in ("expert_bias_update_rate", "init_std", "aux_loss_coeff", "seq_aux_loss_coeff",
                     "z_loss_coeff"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"RouterConfig.{name} must be a finite number >= 0, got {value}")


@dataclass
class RouterOutput:
    """What one routing call produces for ``T`` tokens, ``K = top_k`` and ``E = num_experts``."""

    expert_ids: torch.Tensor  # [T, K] int64, in descending order of selection score
    weights: torch.Tensor  # [T, K] fp32 combine weights (renormalisation and scaling applied)
    aux_loss: torch.Tensor  # [] fp32 sum of the enabled losses, each times its coeff
    tokens_per_expert: torch.Tensor  # [E] int64 selection counts of this call, detached
    logits: torch.Tensor  # [T, E] fp32 router logits


class Router(nn.Module):
    """Linear gate + top-k selection, matching HF's routers (see the module docstring).

    ``weight`` is ``[E, H]`` like HF's ``gate.weight``. With ``use_expert_bias`` the persistent fp32
    buffer ``expert_bias`` ``[E]`` (HF's ``e_score_correction_bias``) shifts the scores used for
    selection only; it is adjusted by :meth:`update_expert_bias`, never by the optimizer.
    All router arithmetic runs in fp32 whatever the dtype of the input (in fp64 when either is fp64, see
    :mod:`megamoe.precision`), and ``weight`` and ``bias`` are HELD in that dtype: a bf16 / fp16 model
    (``dtype=``, ``model.to(torch.bfloat16)``) keeps its routers' parameters in fp32 (:meth:`_apply`), so
    the fp32 gate GEMM casts no weight per call and its weight gradient reaches the optimizer in fp32.
    """

    # The group holding the other sequence chunks of this router's tokens (see the module docstring).
    sequence_group: ProcessGroup | None = None
    # How many of those ranks' router gradients the gradient sync AVERAGES instead of summing (the CP
    # ranks: dense gradients are averaged over dp x cp); each share's gradient is multiplied by it.
    averaged_shards: int = 1

    def __init__(self, config: RouterConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        dtype = compute_dtype(dtype if dtype is not None else torch.get_default_dtype())   # fp32 at least
        self.weight = nn.Parameter(
            torch.empty(config.num_experts, config.hidden_size, device=device, dtype=dtype)
        )  # [E, H]
        if config.bias:
            self.bias = nn.Parameter(torch.empty(config.num_experts, device=device, dtype=dtype))  # [E]
        else:
            self.register_parameter("bias", None)
        if config.use_expert_bias:
            bias = torch.zeros(config.num_experts, device=device, dtype=torch.float32)  # [E]
            self.register_buffer("expert_bias", bias)
        else:
            self.register_buffer("expert_bias", None)
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        """As nn.Module's, then the gate's parameters back to at least fp32 (see the class docstring)."""
        super()._apply(fn, recurse)
        hold_in_compute_dtype_(self.weight, self.bias)
        return self

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) gate weight, zero gate bias and expert bias.

        The values are drawn in fp32 on the generator's device (CPU without one) and then copied, so a
        given generator state yields the same weight on every device and in every parameter dtype.
        """
        draw_device = generator.device if generator is not None else torch.device("cpu")
        init = torch.empty(self.weight.shape, dtype=torch.float32, device=draw_device)
        init.normal_(0.0, self.config.init_std, generator=generator)
        self.weight.copy_(init)
        if self.bias is not None:
            self.bias.zero_()
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def gate_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, E] router logits, in fp32 at least (fp64 for an fp64 model); score function,
        selection, weights and losses follow.

        The hook for a custom router: a subclass overriding it (e.g. adding a learned per-expert offset)
        keeps everything else, the expert-bias update included."""
        dtype = compute_dtype(hidden.dtype, self.weight.dtype)
        # autocast would run the GEMM in bf16/fp16 whatever its inputs' dtype: routing decisions and the
        # router's gradient (which overflows fp16 under loss scaling) need the full precision.
        bias = None if self.bias is None else self.bias.to(dtype)
        if not torch.amp.is_autocast_available(hidden.device.type):      # e.g. meta: no autocast to leave
            return F.linear(hidden.to(dtype), linear_weight(self, "weight", dtype).to(dtype), bias)
        with torch.autocast(hidden.device.type, enabled=False):
            return F.linear(hidden.to(dtype), linear_weight(self, "weight", dtype).to(dtype), bias)

    def forward(self, hidden: torch.Tensor, num_sequences: int = 1) -> RouterOutput:
        """Route ``hidden`` [T, H]: T = num_sequences * seq_len tokens, sequence-major.

        ``num_sequences`` only matters for the sequence-level aux loss.
        """
        cfg = self.config
        if hidden.dim() != 2 or hidden.shape[1] != cfg.hidden_size:
            raise ValueError(f"hidden must be [tokens, {cfg.hidden_size}], got {tuple(hidden.shape)}")
        num_tokens = hidden.shape[0]
        if num_sequences < 1 or num_tokens % num_sequences != 0:
            raise ValueError(
                f"num_sequences ({num_sequences}) must be >= 1 and divide the token count ({num_tokens})"
            )

        logits = self.gate_logits(hidden)  # [T, E]
        scores = logits.softmax(dim=-1) if cfg.score_func == "softmax" else logits.sigmoid()  # [T, E]

        # Selection never needs gradients: the weights are gathered from `scores` afterwards.
        selection_scores = scores.detach()
        if self.expert_bias is not None:
            selection_scores = selection_scores + self.expert_bias.to(logits.dtype)
        if cfg.n_group > 1:
            selection_scores = self._mask_to_best_groups(selection_scores)
        expert_ids = torch.topk(selection_scores, cfg.top_k, dim=-1).indices  # [T, K]

        weights = scores.gather(1, expert_ids)  # [T, K]
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor

        # index_add_ rather than bincount: a static output shape (torch.compile) and no device sync.
        flat_ids = expert_ids.flatten()
        tokens_per_expert = torch.zeros(cfg.num_experts, dtype=torch.int64, device=flat_ids.device).index_add_(
            0, flat_ids, torch.ones_like(flat_ids))  # [E]
        aux_loss = self._losses(logits, scores, expert_ids, tokens_per_expert, num_sequences)
        return RouterOutput(
            expert_ids=expert_ids,
            weights=weights,
            aux_loss=aux_loss,
            tokens_per_expert=tokens_per_expert,
            logits=logits,
        )

    def _mask_to_best_groups(self, selection_scores: torch.Tensor) -> torch.Tensor:
        """Set to -inf the scores of experts outside each token's ``topk_group`` best groups."""
        cfg = self.config
        grouped = selection_scores.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)  # [T, G, E/G]
        if cfg.group_score == "max":
            group_scores = grouped.amax(dim=-1)  # [T, G]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept_groups = torch.topk(group_scores, cfg.topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)  # [T, G]
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(selection_scores)

    def _losses(
        self,
        logits: torch.Tensor,
        scores: torch.Tensor,
        expert_ids: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        num_sequences: int,
    ) -> torch.Tensor:
        """Sum of the enabled losses, each times its coefficient; a zero scalar when none is enabled.

        Means divide by max(count, 1) so a rank that received no tokens contributes a finite zero.
        """
        cfg = self.config
        shards = comms.group_size(self.sequence_group)
        if shards > 1 and (cfg.aux_loss_coeff > 0 or cfg.seq_aux_loss_coeff > 0 or cfg.z_loss_coeff > 0):
            return self._sequence_parallel_losses(logits, scores, expert_ids, tokens_per_expert, num_sequences, shards)
        # P_e needs per-token distributions: sigmoid scores are normalised to sum to 1 per token
        # (DeepSeek-V3's s'), softmax probabilities already do.
        if cfg.score_func == "sigmoid":
            probs = scores / (scores.sum(dim=-1, keepdim=True) + _NORM_EPS)  # [T, E]
        else:
            probs = scores
        return self._loss_terms(logits, probs, expert_ids, tokens_per_expert, num_sequences, logits.shape[0], None)

    def _sequence_parallel_losses(self, logits, scores, expert_ids, tokens_per_expert, num_sequences: int,
                                  shards: int) -> torch.Tensor:
        """The losses of the whole sequences, split over ``sequence_group`` (see the module docstring)."""
        cfg = self.config
        probs = scores / (scores.sum(dim=-1, keepdim=True) + _NORM_EPS) if cfg.score_func == "sigmoid" else scores
        counts = [tokens_per_expert.to(logits.dtype)]
        if cfg.seq_aux_loss_coeff > 0:
            counts.append(self._sequence_counts(logits, expert_ids, num_sequences))
        counts = comms.all_reduce_(torch.cat(counts), self.sequence_group)      # no grad: selection counts
        seq_counts = counts[cfg.num_experts:] if cfg.seq_aux_loss_coeff > 0 else None
        share = self._loss_terms(logits, probs, expert_ids, counts[:cfg.num_experts], num_sequences,
                                 logits.shape[0] * shards, seq_counts)
        whole = comms.all_reduce_(share.detach().clone(), self.sequence_group)
        if self.averaged_shards > 1:     # CP ranks' router gradients are averaged, not summed: scale up
            share = share * self.averaged_shards
        return share + (whole - share.detach())     # value: the whole loss; gradient: this rank's share

    def _sequence_counts(self, logits, expert_ids, num_sequences: int) -> torch.Tensor:
        """[num_sequences * E] selections per (sequence, expert) of these tokens (sequence-major)."""
        cfg = self.config
        num_tokens = logits.shape[0]
        seq_len = num_tokens // num_sequences
        # One scatter over the flattened [S * E] grid; the [T, K] slots are sequence-major like the tokens.
        seq_of_slot = torch.arange(num_sequences, device=logits.device).repeat_interleave(seq_len * cfg.top_k)
        seq_counts = logits.new_zeros(num_sequences * cfg.num_experts)  # [S * E]
        seq_counts.index_add_(0, seq_of_slot * cfg.num_experts + expert_ids.flatten(),
                              logits.new_ones(num_tokens * cfg.top_k))
        return seq_counts

    def _loss_terms(self, logits, probs, expert_ids, tokens_per_expert, num_sequences: int, total_tokens: int,
                    seq_counts: torch.Tensor | None) -> torch.Tensor:
        """The enabled losses over ``total_tokens`` tokens of which these are ``logits.shape[0]`` (all of
        them, or this rank's chunk of every sequence): the counts are the whole tokens' (``seq_counts``
        None: counted here), the probability and logsumexp sums these tokens'."""
        cfg = self.config
        num_tokens = total_tokens
        total = logits.new_zeros(())
        if cfg.aux_loss_coeff > 0:
            slot_fraction = tokens_per_expert.to(logits.dtype) / max(num_tokens * cfg.top_k, 1)  # [E]
            mean_prob = probs.sum(dim=0) / max(num_tokens, 1)  # [E]
            total = total + cfg.aux_loss_coeff * cfg.num_experts * (slot_fraction * mean_prob).sum()
        if cfg.seq_aux_loss_coeff > 0:
            seq_len = num_tokens // num_sequences                    # of the whole sequences
            if seq_counts is None:
                seq_counts = self._sequence_counts(logits, expert_ids, num_sequences)
            seq_slot_fraction = seq_counts.view(num_sequences, cfg.num_experts) / max(seq_len * cfg.top_k, 1)
            seq_mean_prob = probs.view(num_sequences, -1, cfg.num_experts).sum(dim=1) / max(seq_len, 1)
            per_sequence = cfg.num_experts * (seq_slot_fraction * seq_mean_prob).sum(dim=-1)  # [S]
            total = total + cfg.seq_aux_loss_coeff * per_sequence.mean()
        if cfg.z_loss_coeff > 0:
            z_loss = torch.logsumexp(logits, dim=-1).square().sum() / max(num_tokens, 1)
            total = total + cfg.z_loss_coeff * z_loss
        return total

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3 aux-loss-free balancing: ``bias += rate * sign(mean_load - load)``.

        ``tokens_per_expert`` [E] must already be reduced over every rank that shares this router, so
        that all of them apply the same update.
        """
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs RouterConfig.use_expert_bias=True")
        if tokens_per_expert.shape != (self.config.num_experts,):
            raise ValueError(
                f"tokens_per_expert must be [{self.config.num_experts}], got {tuple(tokens_per_expert.shape)}"
            )
        load = tokens_per_expert.to(device=self.expert_bias.device, dtype=torch.float32)
        self.expert_bias.add_(torch.sign(load.mean() - load), alpha=self.config.expert_bias_update_rate)
