"""``megamoe train --config run.toml`` and ``--section.field VALUE``: a TOML run config turned into the
flags it stands for, so that a file, a dotted override and a flag are checked and converted by the one
parser (:func:`megamoe.cli.train.build_parser`). Precedence: the file, then the dotted overrides, then the
plain flags (the command line wins over the file). The sections and fields are
:data:`megamoe.training.run_config_file.SECTIONS`; an unknown section or field is a
:class:`~megamoe.errors.UsageError` naming it and the closest known one.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib

from megamoe.errors import UsageError
from megamoe.training.run_config_file import SECTION_OF_FIELD, SECTIONS

__all__ = ["read_config_file", "split_dotted_overrides", "config_flags"]


def _close_match(name: str) -> str:
    """`` (did you mean X?)`` for the known section or ``section.field`` closest to ``name``, or ``""``."""
    known = [*SECTIONS, *(f"{section}.{field}" for field, section in SECTION_OF_FIELD.items())]
    field = name.rsplit(".", 1)[-1]
    if field in SECTION_OF_FIELD:        # a known field in the wrong section
        return f" (did you mean {SECTION_OF_FIELD[field]}.{field}?)"
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _check_name(section: str, field: str | None, where: str) -> None:
    if section not in SECTIONS:
        raise UsageError(f"{where}: unknown section [{section}]{_close_match(section)}; the sections are "
                         f"{', '.join(SECTIONS)}")
    if field is not None and SECTION_OF_FIELD.get(field) != section:
        name = f"{section}.{field}"
        raise UsageError(f"{where}: unknown key {name}{_close_match(name)}; megamoe train --print-config "
                         "lists every key")


def read_config_file(path: str | os.PathLike) -> dict[str, dict]:
    """The sections of the TOML file ``path``, every name checked (UsageError naming the file and the key)."""
    try:
        with open(path, "rb") as f:
            tables = tomllib.load(f)
    except OSError as e:
        raise UsageError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not a valid TOML file: {e}") from None
    for section, table in tables.items():
        if not isinstance(table, dict):
            home = SECTION_OF_FIELD.get(section)
            raise UsageError(f"--config {path}: {section} = ... is outside any section; "
                             + (f"put it under [{home}]" if home else f"the sections are {', '.join(SECTIONS)}"))
        _check_name(section, None, f"--config {path}")
        for field in table:
            _check_name(section, field, f"--config {path}")
    return tables


def split_dotted_overrides(argv: list[str]) -> tuple[dict[str, dict], list[str]]:
    """``--section.field VALUE`` (or ``--section.field=VALUE``) overrides out of ``argv``, as sections
    (VALUE read as a TOML value where it is one, e.g. ``3e-4``, ``true``, ``[1, 2]``; else as a string), and
    the rest of ``argv``."""
    overrides: dict[str, dict] = {}
    rest, i = [], 0
    while i < len(argv):
        token = argv[i]
        name = token[2:].split("=", 1)[0] if token.startswith("--") else ""
        if "." not in name or token == "--":
            rest.append(token)
            i += 1
            continue
        section, _, field = name.partition(".")
        _check_name(section, field, f"--{name}")
        if "=" in token:
            text = token.split("=", 1)[1]
            i += 1
        elif i + 1 < len(argv):
            text = argv[i + 1]
            i += 2
        else:
            raise UsageError(f"--{name} needs a value, e.g. --{name} VALUE")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        overrides.setdefault(section, {})[field] = value
    return overrides, rest


def config_flags(parser: argparse.ArgumentParser, tables: dict[str, dict], where: str) -> list[str]:
    """The command-line tokens that set the fields of ``tables`` (checked names) through ``parser``'s
    actions; UsageError naming the key for a value of the wrong kind (a bool for an on/off flag, a list
    for a flag taking several values)."""
    actions = {action.dest: action for action in parser._actions}
    tokens = []
    for section, table in tables.items():
        for field, value in table.items():
            action, key = actions[field], f"{section}.{field}"
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                if not isinstance(value, bool):
                    raise UsageError(f"{where}: {key} must be true or false, got {value!r}")
                if value != action.default:         # the flag turns it from its default to this
                    tokens.append(action.option_strings[0])
                continue
            many = action.nargs in ("+", "*")
            if isinstance(value, dict) or (isinstance(value, list) and not many):
                raise UsageError(f"{where}: {key} takes one value, got {value!r}")
            values = value if isinstance(value, list) else [value]
            if many and not values:
                raise UsageError(f"{where}: {key} is an empty list; leave the key out instead")
            if any(isinstance(v, bool) for v in values):
                raise UsageError(f"{where}: {key} takes {'values' if many else 'a value'}, not true/false")
            flag = action.option_strings[0]
            # flag=value: a value that starts with "-" (a prompt, a negative number) is not read as a flag
            tokens += [flag, *map(_text, values)] if many else [f"{flag}={_text(value)}"]
    return tokens


def _text(value) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)
