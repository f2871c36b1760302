"""Packed sequences: several documents in one training row, separated by their EOS (EOD) tokens.

As Megatron-LM's ``--reset-position-ids`` / ``--reset-attention-mask`` / ``--eod-mask-loss``: a
document ends at its EOS token, which belongs to the document it ends; the next token starts a new
document.

- ``reset_position_ids``: positions restart at 0 at each document's first token (RoPE then sees every
  document as if it began the row). Otherwise positions run 0 .. S-1 over the row.
- ``reset_attention_mask``: a token attends only to earlier tokens of its OWN document (document-causal),
  through the ``document_ids`` the model's attention compares. Otherwise (None) attention is plain
  causal over the whole row: a document sees the documents packed before it.
- ``mask_eod_loss``: no loss on the labels of EOS inputs (the first token of the next document,
  which a document-causal model predicts from the previous document alone).

With both resets, each document's logits are those of the document run alone (up to rounding). The
first token of a row may continue a document cut by the previous row: it is a document of its own
here, as in Megatron.

:class:`MicroBatch` is what :meth:`megamoe.training.Trainer.train_step` accepts besides plain
``(inputs, labels)`` tuples; :func:`packed_micro_batch` builds one. A script takes Megatron's flags with
:func:`add_packing_arguments` and turns them into a config with :func:`packing_config_from_args`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["MicroBatch", "PackingConfig", "add_packing_arguments", "document_ids_of", "document_position_ids",
           "micro_batches_on", "packed_micro_batch", "packing_config_from_args", "packing_inputs"]


class MicroBatch(NamedTuple):
    """One micro-batch of training: ``inputs`` / ``labels`` [B, S] and, for packed documents,
    ``position_ids`` [B, S] (None: 0 .. S-1) and ``document_ids`` [B, S] (None: plain causal
    attention). A tuple, so ``(inputs, labels)`` and ``MicroBatch(*pair)`` mean the same."""

    inputs: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        """The micro-batch on ``device`` (each tensor copied without blocking; a no-op where it is)."""
        return MicroBatch(*(t.to(device, non_blocking=True) if t is not None else None for t in self))

    def packing_keywords(self) -> dict[str, torch.Tensor]:
        """The model keywords of the packed fields that are set: a model of one's own that knows
        nothing of packing is never passed them for a plain micro-batch."""
        return {name: value for name, value in (("position_ids", self.position_ids),
                                                ("document_ids", self.document_ids)) if value is not None}


def micro_batches_on(micro_batches, device: torch.device | str) -> list[MicroBatch]:
    """``micro_batches`` ((inputs, labels) pairs or :class:`MicroBatch` tuples, on any device) as MicroBatch
    on ``device``: what the Trainer and evaluate_loss feed a model whose parameters are there."""
    return [MicroBatch(*batch).to(device) for batch in micro_batches]


@dataclass(frozen=True)
class PackingConfig:
    """How packed rows are read: ``eos_id`` ends a document (see the module docstring)."""

    eos_id: int
    reset_position_ids: bool = True
    reset_attention_mask: bool = True
    mask_eod_loss: bool = False

    def __post_init__(self):
        if isinstance(self.eos_id, bool) or not isinstance(self.eos_id, int) or self.eos_id < 0:
            raise ValueError(f"PackingConfig.eos_id must be a token id (an int >= 0), got {self.eos_id!r}; "
                             "pass the tokenizer's EOS id")


def _check_input_ids(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must be integer token ids [batch, seq], got {input_ids.dtype} of shape "
                         f"{tuple(input_ids.shape)}")


def document_ids_of(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, S] -> [B, S] int64: the index of each token's document within its row (0, 1, ...): the
    number of EOS tokens strictly before it (an EOS belongs to the document it ends)."""
    _check_input_ids(input_ids)
    eos = (input_ids == eos_id).long()
    return eos.cumsum(1) - eos


def document_position_ids(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, S] -> [B, S] int64: each token's position within its own document (0 at the token after
    each EOS, and at the row's first token)."""
    _check_input_ids(input_ids)
    seq = input_ids.shape[1]
    index = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    # Where a document starts after each EOS (0 elsewhere); the running max, shifted by one token,
    # is the start of the document each token belongs to.
    next_start = torch.where(input_ids == eos_id, index + 1, 0)
    start = torch.cummax(next_start, dim=1).values
    start = torch.cat([torch.zeros_like(start[:, :1]), start[:, :-1]], dim=1)
    return index - start


def packing_inputs(input_ids: torch.Tensor, config: PackingConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(position_ids [B, S], document_ids [B, S] or None)`` of a micro-batch's input ids, on their
    device: reset or plain (0 .. S-1) positions; document ids with ``reset_attention_mask``, else None."""
    _check_input_ids(input_ids)
    if config.reset_position_ids:
        position_ids = document_position_ids(input_ids, config.eos_id)
    else:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    document_ids = document_ids_of(input_ids, config.eos_id) if config.reset_attention_mask else None
    return position_ids, document_ids


def packed_micro_batch(inputs: torch.Tensor, labels: torch.Tensor, config: PackingConfig) -> MicroBatch:
    """The :class:`MicroBatch` of packed ``inputs`` / next-token ``labels`` [B, S] under ``config``
    (``mask_eod_loss``: labels of EOS inputs become -100, ignored by the loss)."""
    if labels.shape != inputs.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of inputs {tuple(inputs.shape)}")
    position_ids, document_ids = packing_inputs(inputs, config)
    if config.mask_eod_loss:
        labels = labels.masked_fill(inputs == config.eos_id, -100)
    return MicroBatch(inputs, labels, position_ids, document_ids)


def add_packing_arguments(parser) -> None:
    """Megatron's flags: ``--reset-position-ids``, ``--reset-attention-mask``, ``--eod-mask-loss``."""
    parser.add_argument("--reset-position-ids", action="store_true",
                        help="packed documents: restart the position ids at 0 after each EOS token")
    parser.add_argument("--reset-attention-mask", action="store_true",
                        help="packed documents: a token attends only to earlier tokens of its own document "
                             "(documents end at EOS tokens)")
    parser.add_argument("--eod-mask-loss", action="store_true",
                        help="no loss on the tokens that follow an EOS (a document's first token)")


def packing_config_from_args(args, eos_id: int | None) -> PackingConfig | None:
    """The :class:`PackingConfig` of :func:`add_packing_arguments`' flags (None when none is set), with
    the tokenizer's ``eos_id``; ValueError when a flag is set and the tokenizer has no EOS token."""
    flags = {"reset_position_ids": args.reset_position_ids, "reset_attention_mask": args.reset_attention_mask,
             "mask_eod_loss": args.eod_mask_loss}
    if not any(flags.values()):
        return None
    if eos_id is None:
        raise ValueError("--reset-position-ids / --reset-attention-mask / --eod-mask-loss find documents by "
                         "their EOS token, but the tokenizer has none; use a tokenizer with an EOS token (and "
                         "a token file built with append_eos) or drop these flags")
    return PackingConfig(eos_id, **flags)
