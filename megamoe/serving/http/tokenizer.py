"""The server's tokenizer: prompts to ids, ids to text (special tokens skipped), the stop tokens, and chats to
prompts through the checkpoint's chat template.

A directory of HF tokenizer files (``tokenizer.json`` / ``tokenizer_config.json``, as ``megamoe convert
import-hf`` and training runs keep them in ``CKPT/hf_files/``) is loaded with transformers'
``AutoTokenizer``: its chat template (``tokenizer_config.json``'s ``chat_template`` or ``chat_template.jinja``)
renders chats exactly as transformers does, and prompts are encoded as transformers encodes them (with the
special tokens its post-processor adds, e.g. a BOS). Anything else (a sentencepiece ``.model``, as the demo
trains) is loaded with :class:`megamoe.data.tokenizer.Tokenizer`; it has no chat template, so only
``/v1/completions`` serves it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from megamoe.data.tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "ServingTokenizer"]

_HF_FILES = ("tokenizer.json", "tokenizer_config.json")


class ChatTemplateError(ValueError):
    """A chat that the tokenizer's template cannot render (or no template at all): the client's request is wrong."""


class ServingTokenizer:
    """Use :meth:`from_path`. ``eos_token_ids``: the default stop tokens (the tokenizer's EOS, and those of a
    ``generation_config.json`` beside it)."""

    def __init__(self, path: Path, vocab_size: int, eos_token_ids: tuple[int, ...], *, hf=None, plain=None):
        self.path = path
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._hf = hf
        self._plain = plain

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> ServingTokenizer:
        """ValueError / OSError naming the path when nothing loads."""
        path = Path(path)
        directory = path.parent if path.is_file() and path.name in _HF_FILES else path
        if directory.is_dir() and any((directory / name).is_file() for name in _HF_FILES):
            import transformers
            try:
                hf = transformers.AutoTokenizer.from_pretrained(os.fspath(directory))
            except Exception as error:         # transformers raises many kinds for bad files
                raise ValueError(f"cannot load the tokenizer in {directory} with transformers: {error}") from None
            eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
            eos += _generation_config_eos(directory)
            return cls(directory, len(hf), tuple(dict.fromkeys(eos)), hf=hf)
        plain = Tokenizer.from_path(path)
        return cls(plain.path, plain.vocab_size, () if plain.eos_id is None else (plain.eos_id,), plain=plain)

    @property
    def has_chat_template(self) -> bool:
        return self._hf is not None and bool(self._hf.chat_template)

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text))
        return self._plain.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens skipped unless told)."""
        if self._hf is not None:
            return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        special = {self._plain.bos_id, self._plain.eos_id, self._plain.pad_id} if skip_special_tokens else set()
        return self._plain.decode([t for t in ids if t not in special])

    def token_text(self, token_id: int) -> str:
        """One token as text (logprobs' ``token``): its decode, special tokens included."""
        return self.decode([token_id], skip_special_tokens=False)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """The prompt ids of a chat, rendered by the chat template (its text encoded without adding special
        tokens: the template writes them). ChatTemplateError when there is no template or it fails."""
        if not self.has_chat_template:
            raise ChatTemplateError(f"the tokenizer {self.path} has no chat template: use /v1/completions, or "
                                    "serve with a --tokenizer whose tokenizer_config.json has a chat_template")
        try:
            text = self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                **template_kwargs)
        except Exception as error:       # jinja2's TemplateError (raise_exception in the template), TypeError, ...
            raise ChatTemplateError(f"the chat template cannot render these messages: {error}") from None
        return list(self._hf.encode(text, add_special_tokens=False))


def _generation_config_eos(directory: Path) -> list[int]:
    """The ``eos_token_id`` (an int or a list) of ``generation_config.json`` in ``directory``, if any."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from None
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
