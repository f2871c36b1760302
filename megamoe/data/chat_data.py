"""Conversations -> token ids and the assistant mask (the tokens the loss is taken on), by one of two rules.

- ``generation`` (the template marks the assistant's text with ``{% generation %}``): the conversation is
  rendered once, tokenized, and every token overlapping a marked span is the assistant's: exactly what
  transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)`` returns
  (``tests/unit/test_chat_data.py`` compares them).
- ``prefix`` (no markers): the conversation is rendered prefix by prefix. For each assistant turn ``i``, the
  prompt is ``messages[:i]`` rendered with ``add_generation_prompt=True`` and the turn is ``messages[:i + 1]``
  rendered without: the text the turn adds to its prompt (its content and its end-of-turn marker, e.g.
  ``<|im_end|>\\n``; not the generation prompt, which the prompt holds) is trained. The turns whose
  renderings extend one another share one document. A template that renders earlier turns otherwise than
  the last one (e.g. Qwen3's, which drops the reasoning of earlier assistant turns and shows the last with
  a ``<think>`` block) gives one document per turn that breaks the chain: each turn is trained on the text
  the model sees when it generates that turn. A rendering of a turn that does not start with its prompt's
  is an error (the assistant's text cannot be told).

Rendered text is tokenized with the tokenizer's ``encode`` (no special tokens added: the template writes
them) and its character offsets map spans to tokens, as transformers does. Which rule applies is logged
once per file; :func:`encode_chat_file` returns the file's documents (:class:`ChatDocuments`) and
:func:`tokenized_chat_path` caches them.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from megamoe.data.chat_documents import ChatDocuments, bounds_of, load_chat_documents, save_chat_documents
from megamoe.data.chat_records import chat_records
from megamoe.data.chat_template import ChatTemplate
from megamoe.data.tokenizer import Tokenizer

__all__ = ["GENERATION_RULE", "PREFIX_RULE", "ChatEncoder", "encode_chat_file", "tokenized_chat_path"]

logger = logging.getLogger(__name__)

GENERATION_RULE, PREFIX_RULE = "generation", "prefix"


def spans_to_token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """[num tokens] bool: the tokens (``[start, end)`` character offsets, in order) overlapping any of the
    ordered character ``spans`` (transformers' rule for ``return_assistant_tokens_mask``)."""
    mask = np.zeros(len(offsets), dtype=bool)
    span = 0
    for token, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[token] = True
    return mask


class ChatEncoder:
    """Conversations -> documents (token ids [n] int64, assistant mask [n] bool) with ``tokenizer`` and
    ``template``; ``rule`` is ``generation`` or ``prefix`` (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate):
        self.tokenizer, self.template = tokenizer, template
        self.rule = GENERATION_RULE if template.has_generation_markers else PREFIX_RULE

    def _render(self, messages: list[dict], where: str, tools, add_generation_prompt: bool = False):
        import jinja2

        try:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"{where}: the chat template ({self.template.origin}) fails to render this "
                             f"conversation: {type(e).__name__}: {e}") from None

    def _tokens(self, text: str, spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        return np.asarray(ids, dtype=np.int64), spans_to_token_mask(offsets, spans)

    def encode(self, messages: list[dict], where: str = "conversation",
               tools: list[dict] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
        """The documents of one conversation (offered ``tools``): (ids, assistant mask) each; ValueError naming
        ``where`` when the template fails or nothing is left to train."""
        if self.rule == GENERATION_RULE:
            rendered = self._render(messages, where, tools)
            texts = [(rendered.text, rendered.generation_spans)]
        else:
            texts = self._prefix_documents(messages, where, tools)
        documents = [self._tokens(text, spans) for text, spans in texts]
        if not any(mask.any() for _, mask in documents):
            raise ValueError(f"{where}: the chat template ({self.template.origin}) leaves no assistant token to "
                             f"train on ({self.rule} rule)")
        return documents

    def generation_prompt(self, messages: list[dict], where: str = "prompt") -> tuple[str, list[int]]:
        """``messages`` rendered with the generation prompt (what a chat model answers), and its token ids."""
        text = self._render(messages, where, None, add_generation_prompt=True).text
        return text, self.tokenizer.encode_with_offsets(text)[0]

    def _prefix_documents(self, messages: list[dict], where: str, tools) -> list[tuple[str, list[tuple[int, int]]]]:
        documents: list[tuple[str, list[tuple[int, int]]]] = []
        text, spans = None, []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], where, tools, add_generation_prompt=True).text
            turn = self._render(messages[:i + 1], where, tools).text
            if not turn.startswith(prompt):
                raise ValueError(f"{where}: the chat template ({self.template.origin}) renders assistant turn {i} "
                                 "in a way that does not start with its prompt (the conversation before it, with "
                                 "the generation prompt): the assistant's text cannot be told; add {% generation %} "
                                 "markers to the template")
            if text is not None and not turn.startswith(text):
                documents.append((text, spans))
                spans = []
            text = turn
            if len(turn) > len(prompt):
                spans.append((len(prompt), len(turn)))
        documents.append((text, spans))
        return documents


def encode_chat_file(path: str | os.PathLike, encoder: ChatEncoder) -> ChatDocuments:
    """Every conversation of the chat JSON Lines file ``path`` (:mod:`megamoe.data.chat_records`) encoded;
    logs the rule and the counts. ValueError naming ``file:line`` for a bad record or a failing template."""
    path = Path(path)
    logger.info("chat data %s: %s rule (%s)", path, encoder.rule,
                "the template's {% generation %} blocks are trained" if encoder.rule == GENERATION_RULE else
                "no {% generation %} in the template: the text each assistant turn adds to its prompt, rendered "
                "prefix by prefix, is trained, its end-of-turn marker included")
    ids, masks, lengths, per_conversation = [], [], [], []
    for where, conversation in tqdm(chat_records(path), desc="chat data", unit="conversation", disable=None):
        documents = encoder.encode(conversation.messages, where, conversation.tools)
        for document_ids, mask in documents:
            ids.append(document_ids)
            masks.append(mask)
            lengths.append(document_ids.size)
        per_conversation.append(len(documents))
    conversations = len(per_conversation)
    if not conversations:
        raise ValueError(f"{path} holds no conversation")
    documents = ChatDocuments(np.concatenate(ids), np.concatenate(masks), bounds_of(lengths),
                              bounds_of(per_conversation), {"rule": encoder.rule})
    trained = int(documents.assistant.sum())
    logger.info("chat data %s: %d conversations -> %d documents (%d split by the prefix rule), %d tokens, %d of "
                "them assistant tokens (%.1f%%)", path, conversations, documents.num_documents,
                documents.num_documents - conversations, documents.ids.size, trained,
                100 * trained / max(1, documents.ids.size))
    return documents


def _cache_key(path: Path, encoder: ChatEncoder) -> str:
    """What the documents of ``path`` depend on: the file (path, size, mtime), the tokenizer's digest, the
    template and its special tokens, and the format."""
    stat = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{encoder.tokenizer.sha256}\0"
                            f"{encoder.template.source}\0{sorted(encoder.template.special_tokens.items())}\0"
                            f"{encoder.rule}".encode())
    return digest.hexdigest()[:16]


def tokenized_chat_path(path: str | os.PathLike, encoder: ChatEncoder, cache_dir: str | os.PathLike) -> Path:
    """The documents file (:mod:`megamoe.data.chat_documents`) of the chat file ``path`` in ``cache_dir``:
    the one an earlier call made of the same file, tokenizer and template, else made now. Call it on one
    rank, then let the others read the returned path."""
    path = Path(path)
    out = Path(cache_dir) / f"{path.stem}_{_cache_key(path, encoder)}.chat.safetensors"
    try:
        documents = load_chat_documents(out, vocab_size=encoder.tokenizer.vocab_size)
        logger.info("chat data %s: reusing %s (%s rule, %d conversations)", path, out, documents.info.get("rule"),
                    documents.num_conversations)
    except ValueError:
        save_chat_documents(encode_chat_file(path, encoder), out)
    return out
