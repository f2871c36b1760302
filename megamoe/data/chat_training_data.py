"""The training and eval datasets of a chat SFT run: ``--data`` chat JSON Lines files (what
:func:`~megamoe.data.chat_records.is_chat_file` recognises) rendered with the tokenizer's chat template,
tokenized once into the run's cache (:func:`~megamoe.data.chat_data.tokenized_chat_path`), packed into
rows with labels on the assistant tokens only (:class:`~megamoe.data.chat_samples.ChatSamples`).

Several ``--data`` chat files are packed together as one dataset (their conversations side by side, no
weights); held-out data is a seeded random fraction of the conversations (``eval_fraction``) or separate
chat files (``eval_paths``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

from megamoe.data.chat_data import ChatEncoder, tokenized_chat_path
from megamoe.data.chat_documents import ChatDocuments, load_chat_documents
from megamoe.data.chat_samples import ChatSamples, split_chat_documents
from megamoe.data.chat_template import load_chat_template
from megamoe.data.tokenizer import Tokenizer
from megamoe.data.training_data import TrainEvalData

__all__ = ["chat_encoder", "tokenized_chat_paths", "build_chat_train_eval_data"]

logger = logging.getLogger(__name__)


def chat_encoder(tokenizer: Tokenizer) -> ChatEncoder:
    """The encoder of ``tokenizer``'s chat template (beside its files); ValueError when it has none."""
    template = load_chat_template(tokenizer.path)
    if template is None:
        raise ValueError(f"chat data needs the tokenizer's chat template, and {tokenizer.path.parent} has none (no "
                         "chat_template.jinja, no chat_template in tokenizer_config.json): give the tokenizer of a "
                         "chat model (--tokenizer or --hf-model) or add its template there")
    return ChatEncoder(tokenizer, template)


def tokenized_chat_paths(paths: Sequence[str | os.PathLike], tokenizer: Tokenizer,
                         cache_dir: str | os.PathLike) -> list[Path]:
    """Each chat file's documents file in ``cache_dir`` (made now or reused). Call it on one rank."""
    encoder = chat_encoder(tokenizer)
    return [tokenized_chat_path(path, encoder, cache_dir) for path in paths]


def _documents(paths: Sequence[Path], vocab_size: int | None) -> ChatDocuments:
    return ChatDocuments.concatenate([load_chat_documents(path, vocab_size=vocab_size) for path in paths])


def build_chat_train_eval_data(documents_paths: Sequence[str | os.PathLike], *, seq_len: int, vocab_size: int | None,
                               overlong: str = "truncate", pad_id: int = 0, eval_fraction: float | None = None,
                               eval_paths: Sequence[str | os.PathLike] = (), seed: int = 0) -> TrainEvalData:
    """The packed chat samples of the documents files ``documents_paths`` (:func:`tokenized_chat_paths`), and
    the held-out ones (a fraction of the conversations, or the documents files ``eval_paths``)."""
    if eval_fraction is not None and eval_paths:
        raise ValueError("give eval_fraction (--eval-fraction) or eval_paths (--eval-data), not both")
    documents = _documents([Path(path) for path in documents_paths], vocab_size)
    held_out = _documents([Path(path) for path in eval_paths], vocab_size) if eval_paths else None
    if eval_fraction is not None:
        documents, held_out = split_chat_documents(documents, eval_fraction, seed=seed)
    train = ChatSamples(documents, seq_len, overlong=overlong, pad_id=pad_id, source="chat training data")
    evaluation = None if held_out is None else ChatSamples(held_out, seq_len, overlong=overlong, pad_id=pad_id,
                                                           source="chat eval data")
    return TrainEvalData(train=train, eval=evaluation, sources=(), chat=True)
