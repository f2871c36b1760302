"""Documents of a user's corpus, read from plain text, JSON Lines or Parquet files behind one interface.

Every reader yields ``(text, where)`` pairs, one per document, in a fixed order; ``where`` names the
document's place for error messages: ``path`` for a text file, ``path:LINE`` (1-based, as editors
count) for JSON Lines, ``path row ROW`` (0-based, as pandas and pyarrow count) for Parquet.

Formats (:data:`FORMATS`), chosen per file by suffix unless given explicitly:

- ``jsonl`` (``.jsonl``, ``.json``): one JSON object per line, one line = one document, its text in
  the field ``text_field`` (default ``"text"``). Blank lines are skipped; any other line that is not
  JSON, not an object, lacks the field or holds a non-string there is an error naming file and line.
- ``parquet`` (``.parquet``): one row = one document, its text in the string column ``text_field``;
  needs the optional ``pyarrow`` package (``pip install megamoe[data]``).
- ``text`` (any other suffix): the whole UTF-8 file is one document.

A directory stands for the files under it (recursively; hidden files and directories skipped), in
sorted order of their relative paths, keeping only the suffixes of the chosen format: with automatic
format detection, ``.jsonl``/``.json``, ``.parquet`` and :data:`DEFAULT_TEXT_SUFFIXES` (or the
``text_suffixes`` given; case-insensitive, the dot optional), since a directory also holds files that
are not documents.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterable, Iterator, Sequence

__all__ = [
    "FORMATS", "DEFAULT_TEXT_SUFFIXES", "Document", "format_of", "list_document_files", "read_text_file",
    "json_lines", "read_jsonl_file", "import_pyarrow", "read_parquet_file", "read_documents", "read_document_files",
]

FORMATS = ("text", "jsonl", "parquet")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
# Suffixes of the text files a directory contributes; a text file named directly may have any suffix.
DEFAULT_TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
# Rows a Parquet reader decodes at a time: bounds memory for files of any size.
_PARQUET_BATCH_ROWS = 1024

Document = tuple[str, str]  # (text, where)


def format_of(path: str | os.PathLike) -> str:
    """The format a file's suffix implies: ``jsonl``, ``parquet``, else ``text``."""
    suffix = Path(path).suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


def _check_format(format: str | None) -> None:
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS} or None (by suffix), got {format!r}")


def _directory_suffixes(format: str | None, text_suffixes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(text_suffixes, str):
        raise TypeError("text_suffixes must be a collection of suffixes, not one str: wrap it in a list")
    text_suffixes = tuple(s.lower() if s.startswith(".") else f".{s.lower()}" for s in text_suffixes)
    by_format = {"text": text_suffixes, "jsonl": JSONL_SUFFIXES, "parquet": PARQUET_SUFFIXES}
    if format is not None:
        return by_format[format]
    return JSONL_SUFFIXES + PARQUET_SUFFIXES + text_suffixes


def list_document_files(
    inputs: Iterable[str | os.PathLike],
    *,
    format: str | None = None,
    text_suffixes: Sequence[str] = DEFAULT_TEXT_SUFFIXES,
) -> list[tuple[Path, str]]:
    """The files ``inputs`` name, each with the format it is read in, in reading order (inputs in
    the order given, a directory's files sorted). Raises FileNotFoundError for an input that does not
    exist and ValueError for a directory holding no file of the formats read."""
    _check_format(format)
    if isinstance(inputs, (str, os.PathLike)):
        raise TypeError("inputs must be a collection of paths, not one str or path: wrap it in a list")
    suffixes = _directory_suffixes(format, text_suffixes)
    files: list[tuple[Path, str]] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append((path, format or format_of(path)))
        elif path.is_dir():
            found = _files_under(path, suffixes)
            if not found:
                raise ValueError(
                    f"input directory {path} holds no file ending in {', '.join(suffixes)} (hidden files "
                    "skipped): name the files directly, or choose the text suffixes"
                )
            files += [(file, format or format_of(file)) for file in found]
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    return files


def _files_under(directory: Path, suffixes: tuple[str, ...]) -> list[Path]:
    found = []
    for parent, subdirectories, filenames in os.walk(directory):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".")]
        found += [
            Path(parent, name) for name in filenames
            if not name.startswith(".") and Path(name).suffix.lower() in suffixes
        ]
    return sorted(found, key=lambda file: file.relative_to(directory).parts)


def read_text_file(path: str | os.PathLike) -> Iterator[Document]:
    """The whole file as one document (UTF-8, newlines normalised to ``\\n``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error})") from None
    yield text, str(path)


def json_lines(path: str | os.PathLike) -> Iterator[tuple[str, object]]:
    """``(where, value)`` of every non-blank line of the JSON Lines file ``path``, ``where`` its ``file:line``;
    ValueError naming it for a line that is not UTF-8 or not JSON."""
    path = Path(path)
    with open(path, "rb") as file:  # bytes, so that a bad UTF-8 sequence is reported with its line
        for line_number, raw_line in enumerate(file, start=1):
            where = f"{path}:{line_number}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: not UTF-8 text ({error})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{where}: not valid JSON ({error.msg} at column {error.colno}); a JSON Lines file "
                    "holds one JSON object per line"
                ) from None
            except RecursionError:  # json's parser recurses once per level of nesting
                raise ValueError(
                    f"{where}: JSON nested too deeply to read (over about {sys.getrecursionlimit()} levels); a "
                    "JSON Lines file holds one JSON object per line"
                ) from None
            yield where, value


def read_jsonl_file(path: str | os.PathLike, text_field: str = "text") -> Iterator[Document]:
    """One document per non-blank line: the string ``text_field`` of the line's JSON object."""
    for where, record in json_lines(path):
        if not isinstance(record, dict):
            raise ValueError(
                f"{where}: expected a JSON object with a {text_field!r} field, got a JSON "
                f"{type(record).__name__}"
            )
        if text_field not in record:
            fields = ", ".join(repr(name) for name in list(record)[:10]) or "none"
            raise ValueError(
                f"{where}: no field {text_field!r} (fields: {fields}); choose the field holding the "
                "text (text_field, --text-field)"
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(
                f"{where}: field {text_field!r} must be a string, got {type(text).__name__}"
            )
        yield text, where


def import_pyarrow():
    """``(pyarrow, pyarrow.parquet)``; ImportError saying how to install them when absent."""
    try:
        import pyarrow.parquet
    except ImportError:
        raise ImportError(
            "reading Parquet files needs the optional 'pyarrow' package: pip install megamoe[data]"
        ) from None
    return pyarrow, pyarrow.parquet


def _is_string_type(pyarrow, column_type) -> bool:
    """Whether a Parquet column decodes to Python strings: (large) string, string view, or a
    dictionary-encoded one (what pandas writes for a categorical column)."""
    if pyarrow.types.is_dictionary(column_type):
        column_type = column_type.value_type
    is_string_view = getattr(pyarrow.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    return (pyarrow.types.is_string(column_type) or pyarrow.types.is_large_string(column_type)
            or is_string_view(column_type))


def read_parquet_file(path: str | os.PathLike, text_field: str = "text") -> Iterator[Document]:
    """One document per row: the string column ``text_field``; a null is an error naming the row."""
    path = Path(path)
    pyarrow, parquet = import_pyarrow()
    try:
        parquet_file = parquet.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as error:
        raise ValueError(f"{path}: cannot read as Parquet ({error})") from None
    schema = parquet_file.schema_arrow
    if text_field not in schema.names:
        raise ValueError(
            f"{path}: no column {text_field!r} (columns: {', '.join(schema.names) or 'none'}); choose the "
            "column holding the text (text_field, --text-field)"
        )
    column_type = schema.field(text_field).type
    if not _is_string_type(pyarrow, column_type):
        raise ValueError(f"{path}: column {text_field!r} must hold strings, its type is {column_type}")
    row = 0
    for batch in parquet_file.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is None:
                raise ValueError(f"{path} row {row}: column {text_field!r} is null")
            yield text, f"{path} row {row}"
            row += 1


def read_documents(
    inputs: Iterable[str | os.PathLike],
    *,
    format: str | None = None,
    text_field: str = "text",
    text_suffixes: Sequence[str] = DEFAULT_TEXT_SUFFIXES,
) -> Iterator[Document]:
    """Every document of ``inputs`` (files or directories, see the module docstring) as ``(text,
    where)``, in order. ``format`` (one of :data:`FORMATS`) overrides the suffix of every file."""
    _check_text_field(text_field)
    return _read_document_files(list_document_files(inputs, format=format, text_suffixes=text_suffixes), text_field)


def read_document_files(files: Iterable[tuple[Path, str]], *, text_field: str = "text") -> Iterator[Document]:
    """The documents of ``files``, ``(path, format)`` pairs as :func:`list_document_files` returns them."""
    _check_text_field(text_field)
    return _read_document_files(files, text_field)


def _check_text_field(text_field: str) -> None:
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")


def _read_document_files(files: Iterable[tuple[Path, str]], text_field: str) -> Iterator[Document]:
    for path, file_format in files:
        if file_format == "jsonl":
            yield from read_jsonl_file(path, text_field)
        elif file_format == "parquet":
            yield from read_parquet_file(path, text_field)
        else:
            yield from read_text_file(path)
