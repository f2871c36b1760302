"""Chat JSON Lines: each line one conversation, checked and turned into a list of messages.

A record holds either ``messages`` (OpenAI's chat format: a list of ``{"role": ..., "content": ...}`` with
the roles ``system``, ``user``, ``assistant`` and ``tool``; an assistant turn may carry ``tool_calls``
instead of content, a tool turn its ``tool_call_id``; other keys pass through to the template), or a
``prompt`` / ``completion`` pair: the prompt (a string: one user turn; or a list of messages) followed by
the completion (a string: the assistant's turn; or a list of assistant messages). Every conversation
needs an assistant turn: it is what is trained. An optional ``tools`` list (the functions offered, as JSON
schemas, OpenAI's request field) is passed to the template as transformers' ``tools``.

Bad records are ValueErrors naming ``file:line``: invalid JSON, a line that is not UTF-8, a record
without ``messages`` or ``prompt`` / ``completion``, a message without a role or with an unknown one, a
message without content, no assistant turn. Blank lines are skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, NamedTuple

from megamoe.data.documents import json_lines

__all__ = ["ROLES", "Conversation", "is_chat_file", "chat_records", "record_conversation"]

ROLES = ("system", "user", "assistant", "tool")


def _first_record(path: Path) -> dict | None:
    """The first non-blank line of ``path`` as a JSON object; None when there is none or it is no object."""
    try:
        _, record = next(json_lines(path), (None, None))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def is_chat_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a JSON Lines file (``.jsonl``) whose first record holds ``messages`` or a
    ``prompt`` / ``completion`` pair: what ``--data`` trains as chat SFT."""
    path = Path(path)
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        return False
    record = _first_record(path)
    return record is not None and ("messages" in record or ("prompt" in record and "completion" in record))


def _messages(value, where: str, what: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {what} must be a non-empty list of messages, got {json.dumps(value)[:80]}")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: message {i} of {what} is not an object: {json.dumps(message)[:80]}")
        if "role" not in message:
            raise ValueError(f"{where}: message {i} of {what} has no role (give it \"role\": one of {', '.join(ROLES)})")
        role = message["role"]
        if role not in ROLES:
            raise ValueError(f"{where}: message {i} of {what} has the unknown role {role!r} (the roles are "
                             f"{', '.join(ROLES)})")
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise ValueError(f"{where}: message {i} of {what} ({role}) has no content"
                             + (" (nor tool_calls)" if role == "assistant" else ""))
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"{where}: message {i} of {what} ({role}): content must be a string or a list of "
                             f"content parts, got {type(content).__name__}")
    return value


class Conversation(NamedTuple):
    """One record's ``messages`` and the ``tools`` offered (None: none)."""

    messages: list[dict]
    tools: list[dict] | None = None


def record_conversation(record, where: str) -> Conversation:
    """The conversation of one record (see the module docstring); ValueError naming ``where`` (``file:line``)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = _messages(record["messages"], where, "messages")
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        prompt = _messages(prompt, where, "prompt")
        completion = _messages(completion, where, "completion")
        if any(message["role"] != "assistant" for message in completion):
            raise ValueError(f"{where}: completion must be a string or assistant messages only")
        messages = prompt + completion
    else:
        raise ValueError(f"{where}: a chat record needs \"messages\", or \"prompt\" and \"completion\"; it has "
                         f"{', '.join(map(repr, record)) or 'no keys'}")
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"{where}: the conversation has no assistant turn (nothing to train on)")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        raise ValueError(f"{where}: tools must be a list of JSON schemas (objects), got {json.dumps(tools)[:80]}")
    return Conversation(messages, tools)


def chat_records(path: str | os.PathLike) -> Iterator[tuple[str, Conversation]]:
    """(``file:line``, conversation) of every non-blank line of the chat JSON Lines file ``path``, checked."""
    for where, record in json_lines(path):
        yield where, record_conversation(record, where)
