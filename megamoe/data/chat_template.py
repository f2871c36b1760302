"""A model's chat template (the ``chat_template`` of its HF tokenizer files), rendered with jinja2 as
transformers renders it, with the character spans of its ``{% generation %}`` blocks.

As transformers' ``utils/chat_template_utils.py`` (read in transformers 5.24): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension and a ``generation`` tag, the ``tojson`` filter that does not escape HTML (``ensure_ascii=False``,
``indent``, ``separators``, ``sort_keys``), the globals ``raise_exception`` (a template error),
``strftime_now``, ``dict`` and ``namespace``; the template sees ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...), as
``apply_chat_template`` passes ``tokenizer.special_tokens_map``. Messages are passed as transformers
passes them: ``None`` values dropped (a template then sees a missing key, not the text "None"), and a
reasoning given as ``reasoning_content``, ``thinking`` or ``reasoning`` under the first two names too.

Where the template is read from (as transformers' ``from_pretrained``): ``chat_template.jinja`` beside the
tokenizer, else the ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates
of which ``default`` is used).
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from megamoe.data.tokenizer import read_json_object

__all__ = ["ChatTemplate", "RenderedChat", "load_chat_template", "chat_template_dir"]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation and the ``[start, end)`` character spans of its ``{% generation %}`` blocks."""

    text: str
    generation_spans: tuple[tuple[int, int], ...]


def _environment():
    """The jinja2 environment transformers renders chat templates in (see the module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body and, while :meth:`track` is active,
        records the body's character span in the output."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self._tracking: ContextVar = ContextVar("megamoe_generation_tracker", default=None)
            environment.extend(track_generations=self.track)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            text = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore attributes (no way to CPython's internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    environment.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    environment.globals["namespace"] = Namespace
    return environment


# The names a message's reasoning comes under; templates read the first (transformers' aliasing).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _as_transformers_passes(messages: list[dict]) -> list[dict]:
    """``messages`` as transformers hands them to a template: keys whose value is None dropped, and the
    reasoning, under any of its names, also as ``reasoning_content`` and ``thinking``."""
    passed = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        passed.append(message)
    return passed


class ChatTemplate:
    """A chat template's ``source`` (jinja text), compiled once; ``special_tokens`` are the template
    variables ``bos_token``, ``eos_token``, ... (strings). ValueError for a template jinja2 cannot compile."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, *, origin: str = "chat template"):
        import jinja2

        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{origin}: the chat template is empty")
        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"{origin}: the chat template does not compile: {e}") from None

    @property
    def has_generation_markers(self) -> bool:
        """Whether the template marks the assistant's text with ``{% generation %}`` (transformers' test)."""
        return _GENERATION_TAG.search(self.source) is not None

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False,
               tools: list[dict] | None = None) -> RenderedChat:
        """``messages`` (and the ``tools`` offered, JSON schemas) rendered; jinja2's errors (``raise_exception`` included) propagate as
        ``jinja2.TemplateError``, other failures of the template's code as their own types."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        with self._template.environment.track_generations(blocks, spans):
            for block in self._template.generate(messages=_as_transformers_passes(messages), tools=tools, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **self.special_tokens):
                blocks.append(block)
        return RenderedChat("".join(blocks), tuple(spans))


def chat_template_dir(tokenizer_path: str | Path) -> Path:
    """The directory of a tokenizer's files: ``tokenizer_path`` itself, or the directory of a file."""
    path = Path(tokenizer_path)
    return path if path.is_dir() else path.parent


def _special_tokens(directory: Path, config: dict) -> dict[str, str]:
    """The special tokens' strings (``special_tokens_map.json``, then ``tokenizer_config.json`` winning)."""
    tokens: dict[str, str] = {}
    sources = [config]
    if (directory / "special_tokens_map.json").is_file():
        sources.insert(0, read_json_object(directory / "special_tokens_map.json"))
    for source in sources:
        for name in _SPECIAL_TOKEN_NAMES:
            value = source.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                tokens[name] = value
    return tokens


def load_chat_template(tokenizer_path: str | Path) -> ChatTemplate | None:
    """The chat template of the tokenizer at ``tokenizer_path`` (a tokenizer file or its directory; see
    the module docstring), with its special tokens; None when its files hold none. ValueError for
    unreadable files or a template that does not compile."""
    directory = chat_template_dir(tokenizer_path)
    config_path = directory / "tokenizer_config.json"
    config = read_json_object(config_path) if config_path.is_file() else {}
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            source, origin = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {jinja_path}: {e}") from None
    else:
        source, origin = config.get("chat_template"), f"{config_path} (chat_template)"
        if isinstance(source, list):            # named templates: [{"name": ..., "template": ...}]
            named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{origin}: expected the template's text, got {type(source).__name__}")
    return ChatTemplate(source, _special_tokens(directory, config), origin=origin)
