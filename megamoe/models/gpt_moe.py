"""A decoder-only MoE language model, built as ONE pipeline stage of a parallel layout.

Every module is named by its global position (``layers.<global index>``), so seeded initialisation
(:func:`megamoe.tensor_parallel.initialize_parameters`) and checkpoints are independent of the
pipeline split, the TP size and the expert placement.

Parallel layout of the MoE layers (the rules each dispatcher class declares, applied once by the layout plan
:mod:`megamoe.parallel_plan`, which the model builds and every layer reads): the all-gather dispatcher runs inside
the TP group (``ep * etp`` divides ``tp``): tokens are replicated over TP after attention, so one
all-reduce per MoE layer replaces the dense MLP's (with ``ep * etp < tp`` the expert group's work is
replicated over the rest of the TP group). The all-to-all dispatcher takes any ``etp`` dividing
``tp``: with ``etp == tp`` ETP ranks share their tokens, and EP then spans data-parallel ranks, which
hold different tokens; with ``etp < tp`` (MoE parallel folding, :mod:`megamoe.models.moe_folding`)
each TP rank dispatches a disjoint share of the replicated tokens (split on entry to the MoE layer,
all-gathered on exit), so no token is computed twice. The all-gather
dispatcher with ``input_sharded`` gathers the tokens of the whole EP x ETP group, which must then
span data-parallel ranks only (no two of its ranks in one TP group): data-parallel attention, each
DP rank running attention on its own tokens, in any number. Under sequence parallelism
(:mod:`megamoe.models.sequence_parallel`) every rank holds its own tokens: both dispatchers take
them sharded, in any layout the groups allow.

Padding (inference): ``attention_mask`` [B, S_past + S] (True where a position holds a real token)
hides padding keys from attention, and this call's padding tokens skip the MLP / MoE layers: they are
neither computed by the experts nor counted in the expert load.

Packed documents (training): ``document_ids`` [B, S] (:mod:`megamoe.data.packing`) makes every layer's
attention document-causal; with per-document ``position_ids`` each document's logits are those of the
document run alone. Every pipeline stage needs both (they are not sent with the hidden states).

Activation recomputation (``config.recompute``, :mod:`megamoe.transformer.recompute`), chosen at
construction: ``full`` checkpoints each decoder layer whole (:meth:`GPTMoEModel._decoder_layers`);
selective ``layernorm``, ``moe`` and ``mlp`` wrap the decoder layer's calls of its norms and MLP;
``core_attn``, ``mla_up_proj`` and ``moe_act`` are flags of the attention and experts modules.
Calls with a KV cache are never recomputed.

Kept block-FP8 weights (``config.weight_quantization``, :mod:`megamoe.quantization.kept_weights`): each
decoder layer's quantized weights become e4m3 parameters with their block scales right after the layer is
built; dense linears dequantize them per call, routed experts run the ``block`` FP8 recipe (or dequantize
without one). Inference only (the weights are frozen).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from megamoe import comms
from megamoe.host_values import host_ints
from megamoe.models.block_fp8_layers import keep_block_fp8_weights
from megamoe.models.config import GPTMoEConfig
from megamoe.models.decoder_layer import DecoderLayer
from megamoe.models.layer_spec import LayerSpec
from megamoe.models.mtp import MTPLayer, mtp_targets, shift_left
from megamoe.models.sequence_parallel import check_sequence_length
from megamoe.moe.moe_layer import MoELayer
from megamoe.moe.placement.expert_slots import ExpertPlacement
from megamoe.parallel_plan import build_moe_layout, build_parallel_plan, check_moe_layout
from megamoe.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy
from megamoe.tensor_parallel.main_grad_linear import linear
from megamoe.tensor_parallel.init import normal_init
from megamoe.tensor_parallel.vocab_padding import gather_vocab_parallel_logits  # noqa: F401 (doc)
from megamoe.tensor_parallel.vocab_padding import mask_padded_logits_, padded_vocab_size
from megamoe.transformer import RMSNorm
from megamoe.transformer.attention import check_no_cache_with_documents
from megamoe.transformer.context_parallel import (check_context_parallel_length, cp_token_index,  # noqa: F401 (doc)
                                                  slice_for_context_parallel)
from megamoe.transformer.recompute import checkpointed
from megamoe.tensor_parallel.sequence import SEQUENCE_DIM
from megamoe.transformer.rope import RotaryEmbedding

__all__ = ["DecoderLayer", "GPTMoEModel", "LayerSpec", "check_moe_layout_on_grid", "expert_token_replicas"]

_FEW_ROWS = 16  # logits of at most this many rows (decoding) take the weight-major GEMM on CPU


def check_moe_layout_on_grid(config: GPTMoEConfig, grid) -> None:
    """:func:`check_moe_layout` for every rank of ``grid`` (a :class:`parallel_state.RankGroups` from
    ``compute_rank_groups``): the same rules, checked before any process group exists (a launcher
    validating its flags). Raises the first rank's ValueError."""
    for rank in range(grid.world_size):
        groups = grid.groups_of(rank)
        view = SimpleNamespace(rank=rank, **{kind: SimpleNamespace(size=len(groups[kind]), ranks=groups[kind])
                                             for kind in ("tp", "ep", "etp", "ep_etp")})
        check_moe_layout(config, view)


def expert_token_replicas(config: GPTMoEConfig, state) -> int:
    """How many ranks of an expert-DP group compute the SAME tokens with the same expert shards (the expert
    gradient reduction divides by it): the plan's ``moe.expert_token_replicas`` (1 without MoE layers)."""
    moe = build_moe_layout(config, state)
    return 1 if moe is None else moe.expert_token_replicas


class GPTMoEModel(nn.Module):
    """One pipeline stage of the model for the layout ``state`` (a ParallelState).

    First stage: ``embed_tokens``; last stage: ``norm`` and the vocab-parallel ``lm_head`` (tied to
    ``embed_tokens`` when ``tie_word_embeddings``: the last stage then holds its own copy of the
    embedding, kept identical by summing both copies' gradients over the embedding group).

    ``forward(inputs, position_ids=None, labels=None, kv_caches=None, attention_mask=None,
    document_ids=None) -> (output, aux_loss)``: ``inputs`` are token ids [B, S] on the first stage and
    hidden states [B, S, H] elsewhere; the output is the hidden states for the next stage, or on the
    last stage the mean token loss (with ``labels``; -100 ignored) or this rank's vocab shard of the
    logits [B, S, Vp / tp] (``Vp = padded_vocab_size``: the vocabulary padded to a multiple of tp, the
    padding columns -inf; see :meth:`logits`). Under sequence parallelism (``config.sequence_parallel``, tp > 1; see
    :mod:`megamoe.models.sequence_parallel`) the hidden states in and out of a stage are this TP rank's
    chunk [B, S / tp, H], while ids, labels, ``position_ids`` and ``document_ids`` stay [B, S].
    Under context parallelism (cp > 1, :mod:`megamoe.transformer.context_parallel`) every CP rank gets
    the same full ids, labels, ``position_ids`` and ``document_ids`` [B, S]; the first stage keeps this
    rank's load-balanced chunks of the ids (S / cp tokens) and the positions are sliced alike for RoPE,
    so the hidden states between layers and stages are [B, S / cp, H] ([B, S / (cp tp), H] with
    sequence parallelism); ``document_ids`` reach attention whole. Logits without labels are this rank's
    tokens' [B, S / cp, V / tp], in its chunk order (:func:`cp_token_index`). With labels (sliced on the
    last stage) the loss is ``cp * (sum of this rank's token losses) / (non-ignored tokens of the WHOLE
    micro-batch)``: the mean over the CP ranks, which the trainer's average over dp x cp takes, is the
    micro-batch's mean token loss, and so is its gradient (every dense and expert gradient is averaged
    over CP by the gradient sync). ``kv_caches`` maps this stage's layer ids to their caches; ``attention_mask``
    [B, S_past + S] marks real tokens; ``document_ids`` [B, S] packs documents (see the module
    docstring). :meth:`run_layers` stops before the final norm, so that generation computes logits
    for the last position only.

    Multi-token prediction (``config.mtp_num_layers``, :mod:`megamoe.models.mtp`): the last stage also holds
    the MTP layers ``layers.<num_layers + k>`` (in ``layers``, so ``moe_layers()`` lists their MoE layers)
    and a copy of the input embedding (shared with them, tied like tied embeddings). They never change the
    main logits; in training mode a forward with labels adds their loss, and needs the token ids:
    ``inputs`` on a single stage, ``input_ids`` [B, S] on a last stage of several.

    ``layer_spec`` (:class:`~megamoe.models.layer_spec.LayerSpec`) chooses the classes of every decoder
    layer's attention, dense MLP and MoE layer, e.g. ``LayerSpec(moe=MyMoELayer)`` for a MoELayer
    subclass with its own router; the default builds the shipped ones. The model meets
    :class:`megamoe.training.TrainableModel` whatever the spec.
    """

    def __init__(self, config: GPTMoEConfig, state, *, pp_split=None,
                 placements: dict[int, ExpertPlacement] | None = None, layer_spec: LayerSpec | None = None,
                 device=None, dtype=None, virtual_pipeline_stages: int = 1):
        super().__init__()
        # The layout rules, computed once: every layer reads them from here (megamoe.parallel_plan).
        self.plan = build_parallel_plan(config, state, pp_split=pp_split,
                                        virtual_pipeline_stages=virtual_pipeline_stages)
        self.config, self.state, self.pp_split = config, state, pp_split
        self.virtual_pipeline_stages = virtual_pipeline_stages
        self.layer_spec = layer_spec or LayerSpec()
        factory = {"device": device, "dtype": dtype}
        tp = state.tp.group
        self.sequence_group = self.plan.group(self.plan.dense.sequence_group)   # None: no sequence parallelism
        self.cp_group = self.plan.group(self.plan.dense.context_group)         # None: no context parallelism
        sp = {"sequence_parallel": True, "sequence_dim": SEQUENCE_DIM} if self.sequence_group is not None else {}
        # One layer range per model chunk of this rank (virtual stage chunk * pp + pp_rank).
        self.chunk_layer_ids = list(self.plan.stages.chunk_layer_ids)
        self.layer_ids = (self.chunk_layer_ids[0] if virtual_pipeline_stages == 1
                          else self.plan.stages.layer_ids)
        self.is_first_stage, self.is_last_stage = state.is_first_pp_stage, state.is_last_pp_stage
        # DeepSeek-V3's multi-token-prediction layers (megamoe.models.mtp) run on the last stage, after its chunk.
        self.mtp_layer_ids = list(self.plan.stages.mtp_layer_ids)
        init = dict(init_method=normal_init(config.init_std))
        # Any vocabulary under any TP: the vocabulary rows are padded (megamoe.tensor_parallel.vocab_padding).
        self.padded_vocab_size = padded_vocab_size(config.vocab_size, state.tp.size,
                                                   config.make_vocab_size_divisible_by)
        self.vocab_start = state.tp.rank * (self.padded_vocab_size // state.tp.size)
        # The last stage embeds too with tied embeddings (the output layer) and with MTP layers (their input).
        if self.is_first_stage or (self.is_last_stage and (config.tie_word_embeddings or config.mtp_num_layers)):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_group=tp,
                                                       padded_num_embeddings=self.padded_vocab_size,
                                                       **sp, **init, **factory)
        # The rotary angles of a forward's positions, computed once and shared by every layer.
        self.rotary = RotaryEmbedding(config.attention.rope, device=device)
        placements = placements or {}
        self.layers = nn.ModuleDict()
        for i in self.layer_ids:
            layer = DecoderLayer(config, i, state, placement=placements.get(i), layer_spec=self.layer_spec,
                                 plan=self.plan, **factory)
            if config.weight_quantization is not None:    # one layer at a time: bounded extra memory
                keep_block_fp8_weights(layer, f"layers.{i}.", config.weight_quantization)
            self.layers[str(i)] = layer
        if self.mtp_layer_ids:
            for i in self.mtp_layer_ids:
                layer = MTPLayer(config, i, state, placement=placements.get(i), layer_spec=self.layer_spec,
                                 plan=self.plan, **factory)
                if config.weight_quantization is not None:
                    keep_block_fp8_weights(layer, f"layers.{i}.", config.weight_quantization)
                self.layers[str(i)] = layer
        if self.is_last_stage:
            self.norm = RMSNorm(config.hidden_size, config.norm_eps, **factory)
            if self.sequence_group is not None:
                self.norm.weight.sequence_parallel = True
            if not config.tie_word_embeddings:
                self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, tp_group=tp, bias=False,
                                                    padded_out_features=self.padded_vocab_size, **init, **factory)

    def without_sequence_parallel(self) -> GPTMoEModel:
        """This model, or under sequence parallelism a copy built without it holding the same weights
        (SP changes no parameter's shape, only the communication): the model generation needs, as the
        KV cache and single-token decoding cannot split the sequence. Every TP rank must call it."""
        if self.sequence_group is None:
            return self
        placements = {i: layer.placement for i, layer in self.moe_layers().items()}
        param = next(self.parameters())
        plain = GPTMoEModel(dataclasses.replace(self.config, sequence_parallel=False), self.state,
                            pp_split=self.pp_split, placements=placements, layer_spec=self.layer_spec,
                            device=param.device, dtype=param.dtype,
                            virtual_pipeline_stages=self.virtual_pipeline_stages)
        plain.load_state_dict(self.state_dict())
        return plain.train(self.training)

    def tied_parameters(self) -> tuple[nn.Parameter, ...]:
        """Parameters whose copies on the first and last stage must stay identical."""
        shared = self.config.tie_word_embeddings or self.config.mtp_num_layers     # the last stage's copy
        if shared and self.state.pp.size > 1 and hasattr(self, "embed_tokens"):
            return (self.embed_tokens.weight,)
        return ()

    def chunk_is_first(self, chunk: int) -> bool:
        """Whether model chunk ``chunk`` is the first virtual stage (it embeds the token ids)."""
        self._check_chunk(chunk)
        return self.is_first_stage and chunk == 0

    def chunk_is_last(self, chunk: int) -> bool:
        """Whether model chunk ``chunk`` is the last virtual stage (it returns the loss or logits)."""
        self._check_chunk(chunk)
        return self.is_last_stage and chunk == self.virtual_pipeline_stages - 1

    def _check_chunk(self, chunk: int) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk < self.virtual_pipeline_stages:
            raise ValueError(f"chunk must be an int in [0, virtual_pipeline_stages={self.virtual_pipeline_stages}), "
                             f"got {chunk!r}")

    def chunk_parameters(self) -> list[list[nn.Parameter]]:
        """This rank's trainable parameters by model chunk (every one in exactly one list, in
        ``parameters()`` order): a chunk's layers; the embedding with chunk 0 on the first rank; the final
        norm, output layer and the tied embedding copy with the last chunk on the last rank. A parameter
        of no chunk's module (a custom subclass's) goes with chunk 0, whose last backward is the step's
        last. ``[list(parameters)]`` for V = 1."""
        owner: dict[int, int] = {}
        for chunk, layer_ids in enumerate(self.chunk_layer_ids):
            for i in layer_ids:
                for p in self.layers[str(i)].parameters():
                    owner[id(p)] = chunk
        last = self.virtual_pipeline_stages - 1
        for i in self.mtp_layer_ids:
            for p in self.layers[str(i)].parameters():
                owner[id(p)] = last
        for name in ("norm", "lm_head"):
            if hasattr(self, name):
                for p in getattr(self, name).parameters():
                    owner[id(p)] = last
        if hasattr(self, "embed_tokens"):
            for p in self.embed_tokens.parameters():
                owner[id(p)] = 0 if self.is_first_stage else last
        chunks: list[list[nn.Parameter]] = [[] for _ in range(self.virtual_pipeline_stages)]
        for p in self.parameters():
            if p.requires_grad:
                chunks[owner.get(id(p), 0)].append(p)
        return chunks

    def moe_layers(self) -> dict[int, MoELayer]:
        """This stage's MoE layers (subclasses included) by global layer id."""
        return {i: layer.mlp for i, layer in ((int(k), v) for k, v in self.layers.items())
                if isinstance(layer.mlp, MoELayer)}

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, kv_caches=None, attention_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, chunk: int = 0, input_ids: torch.Tensor | None = None):
        hidden, aux_loss = self.run_layers(inputs, position_ids, kv_caches, attention_mask, document_ids, chunk=chunk)
        if not self.chunk_is_last(chunk):
            return hidden, aux_loss
        logits_local = self.logits(hidden)
        if labels is None:
            return logits_local, aux_loss
        loss = self._mean_token_loss(logits_local, labels)
        if self.mtp_layer_ids and self.training:
            ids = inputs if self.chunk_is_first(chunk) else input_ids
            if ids is None:
                raise ValueError("the MTP layers on the last pipeline stage embed the token ids: pass "
                                 "input_ids=[batch, seq] to its forward (the Trainer does)")
            mtp_loss, mtp_aux = self.mtp_loss(hidden, ids, labels, position_ids, document_ids)
            loss = loss + self.config.mtp_loss_coeff * mtp_loss
            aux_loss = aux_loss + mtp_aux
        return loss, aux_loss

    def _mean_token_loss(self, logits_local: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        token_loss = vocab_parallel_cross_entropy(logits_local, slice_for_context_parallel(labels, self.cp_group),
                                                  self.state.tp.group, vocab_size=self.config.vocab_size)
        num_tokens = (labels != -100).sum().clamp(min=1)     # of the WHOLE micro-batch (the full labels)
        # Context parallelism: cp x this rank's share of the micro-batch's mean token loss; the mean over
        # the CP ranks (the trainer's average over dp x cp) is the mean token loss (see the class docstring).
        return token_loss.sum() * self.state.cp.size / num_tokens

    def mtp_hidden_states(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids=None, document_ids=None,
                          kv_caches=None, attention_mask=None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The MTP depths' normed hidden states ``[h^1, ...]`` (each [B, S, H], this rank's chunk like
        ``hidden``) from the main model's last hidden states ``hidden`` (before the final norm, which they
        then go through: h^0 is its output) and the whole token ids [B, S]; with their aux losses. Last
        stage only (:mod:`megamoe.models.mtp`)."""
        batch, seq = self._full_shape(hidden)
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device).expand(batch, seq)
        positions = slice_for_context_parallel(position_ids, self.cp_group)
        position_embeddings = self.rotary(positions)
        aux_loss = hidden.new_zeros((), dtype=torch.float32)
        states, previous = [], self.norm(hidden)
        for k, layer_id in enumerate(self.mtp_layer_ids, start=1):
            embeds = self.embed_tokens(slice_for_context_parallel(shift_left(input_ids, k, 0), self.cp_group))
            cache = None if kv_caches is None else kv_caches[layer_id]
            layer = self.layers[str(layer_id)]
            previous, layer_aux = checkpointed(layer.forward_mtp, embeds, previous, positions, cache, attention_mask,
                                               None, position_embeddings, None, document_ids,
                                               enabled=self.config.recompute.full and cache is None)
            aux_loss = aux_loss + layer_aux
            states.append(previous)
        return states, aux_loss

    def mtp_loss(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, position_ids=None,
                 document_ids=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean over depths of each depth's mean token loss, the MTP layers' aux losses); see
        :mod:`megamoe.models.mtp` for the targets and the normalisation."""
        states, aux_loss = self.mtp_hidden_states(hidden, input_ids, position_ids, document_ids)
        losses = [self._mean_token_loss(self.logits(state, norm=False), mtp_targets(labels, k, document_ids))
                  for k, state in enumerate(states, start=1)]
        return torch.stack(losses).mean(), aux_loss

    def run_layers(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None, kv_caches=None,
                   attention_mask: torch.Tensor | None = None,
                   document_ids: torch.Tensor | None = None, *, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding (first stage) and this stage's decoder layers: ``(hidden [B, S, H], aux_loss)``
        (under sequence parallelism this rank's chunk [B, S / tp, H]; see
        :mod:`megamoe.models.sequence_parallel`). With virtual pipeline stages, those of model chunk
        ``chunk`` only."""
        self._check_chunk(chunk)
        self._check_sequence_parallel_call(inputs, kv_caches, attention_mask, chunk)
        hidden, position_ids = self._embed(inputs, position_ids, chunk)
        check_no_cache_with_documents(kv_caches, document_ids)
        if document_ids is not None and document_ids.shape != self._full_shape(hidden):
            raise ValueError(f"document_ids must be [batch, seq] = {list(self._full_shape(hidden))} like the inputs, "
                             f"got {list(document_ids.shape)}")
        seq = hidden.shape[1]
        mlp_token_index = None
        if attention_mask is not None:               # host syncs once per call, not per layer
            real = attention_mask[:, -seq:].reshape(-1).bool()
            # One read of both flags; a meta dry run has no padding (see megamoe.host_values).
            all_real, no_padding = host_ints(torch.stack([real.all(), attention_mask.bool().all()]), on_meta=[1, 1])
            if not all_real:
                mlp_token_index = real.nonzero().squeeze(1)
            elif no_padding:
                attention_mask = None                # no padding at all: the plain causal mask
        return self._decoder_layers(hidden, position_ids, kv_caches, attention_mask, mlp_token_index=mlp_token_index,
                                    document_ids=document_ids, chunk=chunk)

    def run_layers_static(self, inputs: torch.Tensor, position_ids: torch.Tensor, kv_caches,
                          attention_mask: torch.Tensor, token_mask: torch.Tensor, *,
                          chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`run_layers` without host syncs or data-dependent shapes (compiled decoding). The caches
        are written at their ``write_index`` (:class:`~megamoe.inference.kv_cache.StaticKVCache`);
        ``attention_mask`` [B, S_past + S] spans the filled positions; ``token_mask`` [B * S] marks
        this call's real tokens: padding tokens go through every layer (their outputs are unused)
        but reach no expert and are not counted in the expert load."""
        self._check_sequence_parallel_call(inputs, kv_caches, attention_mask, chunk)
        hidden, position_ids = self._embed(inputs, position_ids, chunk)
        return self._decoder_layers(hidden, position_ids, kv_caches, attention_mask, mlp_token_mask=token_mask,
                                    chunk=chunk)

    def _embed(self, inputs: torch.Tensor, position_ids: torch.Tensor | None, chunk: int = 0):
        """(hidden [B, S, H], position_ids [B, S]): the embedding on the first virtual stage, the received
        hidden states elsewhere."""
        if self.chunk_is_first(chunk):
            hidden = self.embed_tokens(slice_for_context_parallel(inputs, self.cp_group))
        else:
            hidden = inputs
        if position_ids is None:
            batch, seq = self._full_shape(hidden)
            position_ids = torch.arange(seq, device=hidden.device).expand(batch, seq)
        # RoPE rotates this CP rank's tokens by their own positions.
        return hidden, slice_for_context_parallel(position_ids, self.cp_group)

    def _full_shape(self, hidden: torch.Tensor) -> tuple[int, int]:
        """(batch, the whole sequence length) of ``hidden`` (a sequence chunk under sequence parallelism)."""
        chunks = 1 if self.sequence_group is None else self.state.tp.size
        return hidden.shape[0], hidden.shape[1] * chunks * self.state.cp.size

    def _check_sequence_parallel_call(self, inputs: torch.Tensor, kv_caches, attention_mask, chunk: int = 0) -> None:
        """Sequence / context parallelism: the ids split into equal chunks; no generation (KV cache, padding)."""
        if self.cp_group is not None:
            if kv_caches is not None or attention_mask is not None:
                raise ValueError("context parallelism is a training feature: a forward with a KV cache or an "
                                 "attention_mask (generation) cannot split the sequence over the CP group; generate "
                                 "with a layout of cp=1 (the same checkpoint loads into it)")
            if self.chunk_is_first(chunk):
                check_context_parallel_length(inputs.shape[1], self.state.cp.size)
                if self.sequence_group is not None:
                    check_sequence_length(inputs.shape[1] // self.state.cp.size, self.state.tp.size)
            return
        if self.sequence_group is None:
            return
        if kv_caches is not None or attention_mask is not None:
            raise ValueError("sequence parallelism is a training feature: a forward with a KV cache or an "
                             "attention_mask (generation) cannot split the sequence; generate with "
                             "model.without_sequence_parallel(), or build the model with sequence_parallel=False "
                             "(it computes the same function)")
        if self.chunk_is_first(chunk):
            check_sequence_length(inputs.shape[1], self.state.tp.size)

    def _decoder_layers(self, hidden, position_ids, kv_caches, attention_mask, *, mlp_token_index=None,
                        mlp_token_mask=None, document_ids=None, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        aux_loss = hidden.new_zeros((), dtype=torch.float32)
        position_embeddings = self.rotary(position_ids)
        full = self.config.recompute.full
        for layer_id in self.chunk_layer_ids[chunk]:
            layer = self.layers[str(layer_id)]
            cache = None if kv_caches is None else kv_caches[layer_id]
            # Full recomputation keeps only each layer's inputs (never with a cache: it updates once).
            hidden, layer_aux = checkpointed(layer, hidden, position_ids, cache, attention_mask, mlp_token_index,
                                             position_embeddings, mlp_token_mask, document_ids,
                                             enabled=full and cache is None)
            aux_loss = aux_loss + layer_aux
        return hidden, aux_loss

    def logits(self, hidden: torch.Tensor, norm: bool = True) -> torch.Tensor:
        """Final norm (unless ``norm=False``: an MTP depth's output, normed already) + output layer: this
        rank's vocab shard of the logits [..., Vp / tp] (fp32 for the loss). Columns of a padded vocabulary's
        padding rows are -inf (they never win, take no probability and pass no gradient);
        :func:`gather_vocab_parallel_logits` strips them."""
        return mask_padded_logits_(self._output_layer(hidden, norm), self.vocab_start, self.config.vocab_size)

    def _output_layer(self, hidden: torch.Tensor, norm: bool = True) -> torch.Tensor:
        normed = self.norm(hidden) if norm else hidden
        if self.sequence_group is not None:
            # The final norm ran on this rank's chunk; the output layer needs the whole sequence (the
            # backward reduce-scatter sums the vocab shards' partial gradients of every position).
            hidden = comms.gather_from_sequence_parallel_region(normed, self.sequence_group, dim=SEQUENCE_DIM)
        else:
            hidden = comms.copy_to_tensor_parallel_region(normed, self.state.tp.group)
        weight = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if hidden.device.type == "cpu" and hidden.dim() == 2 and 2 <= hidden.shape[0] <= _FEW_ROWS:
            # Decoding a batch: a few rows against the whole vocabulary shard. MKL runs the GEMM with
            # the vocabulary as the long side (weight @ hidden^T) 1.2x to 3x faster than F.linear for
            # 2 to 16 rows (measured for vocabularies of 8k to 50k, 1 and 2 threads; decode steps of
            # benchmarks/decode.py at batch 8: 0.3 to 2.3 ms less); one row is a GEMV either way.
            return torch.mm(weight, hidden.t()).t().contiguous()
        if self.config.tie_word_embeddings or self.config.mtp_num_layers:
            return F.linear(hidden, weight)     # a weight with other uses: their gradients sum in autograd, as ever
        return linear(hidden, weight)           # the weight gradient straight into an fp32 main_grad
