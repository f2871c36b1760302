"""megamoe.data.documents: the text, JSON Lines and Parquet readers, directory expansion, and their errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megamoe.data.documents import (
    format_of, list_document_files, read_documents, read_jsonl_file, read_parquet_file, read_text_file,
)

DOCS = ["first document\nwith two lines\n", "", "ünïcödé ✓ and tabs\t", "{\"looks\": \"like json\"}"]


def _write_jsonl(path: Path, records, blank_lines: bool = False) -> Path:
    lines = [json.dumps(record) for record in records]
    if blank_lines:
        lines = ["", *lines[:1], "   ", *lines[1:]]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _write_parquet(path: Path, columns: dict) -> Path:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table(columns), path, row_group_size=2)  # several row groups
    return path


def test_text_file_is_one_document(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(DOCS[0], encoding="utf-8")
    assert list(read_text_file(path)) == [(DOCS[0], str(path))]
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt: not UTF-8"):
        list(read_text_file(tmp_path / "latin1.txt"))


def test_jsonl_lines_are_documents_with_line_numbers(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS)], blank_lines=True)
    documents = list(read_jsonl_file(path))
    assert [text for text, _ in documents] == DOCS
    # Blank lines are skipped but still counted: line numbers are the file's own.
    assert [where for _, where in documents] == [f"{path}:{n}" for n in (2, 4, 5, 6)]
    other = _write_jsonl(tmp_path / "o.jsonl", [{"body": d} for d in DOCS])
    assert [text for text, _ in read_jsonl_file(other, text_field="body")] == DOCS


@pytest.mark.parametrize("line, message", [
    ("{not json", r"bad\.jsonl:2: not valid JSON"),
    ("[1, 2]", r"bad\.jsonl:2: expected a JSON object with a 'text' field, got a JSON list"),
    ('{"body": "x", "id": 3}', r"bad\.jsonl:2: no field 'text' \(fields: 'body', 'id'\)"),
    ('{"text": 7}', r"bad\.jsonl:2: field 'text' must be a string, got int"),
    pytest.param('{"text": "x", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 r"bad\.jsonl:2: JSON nested too deeply", id="nested 100k deep"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n" + json.dumps({"text": "never read"}) + "\n")
    reader = read_jsonl_file(path)
    assert next(reader) == ("fine", f"{path}:1")
    with pytest.raises(ValueError, match=message):
        next(reader)


def test_jsonl_bad_utf8_names_the_line(tmp_path):
    path = tmp_path / "enc.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"enc\.jsonl:2: not UTF-8"):
        list(read_jsonl_file(path))


def test_parquet_rows_are_documents(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", {"id": list(range(len(DOCS))), "text": DOCS})
    assert list(read_parquet_file(path)) == [(d, f"{path} row {i}") for i, d in enumerate(DOCS)]

    pyarrow = pytest.importorskip("pyarrow")
    categorical = _write_parquet(tmp_path / "c.parquet", {"text": pyarrow.array(DOCS).dictionary_encode()})
    assert [text for text, _ in read_parquet_file(categorical)] == DOCS  # as pandas writes a category column
    with pytest.raises(ValueError, match=r"d\.parquet: no column 'body' \(columns: id, text\)"):
        list(read_parquet_file(path, text_field="body"))
    with pytest.raises(ValueError, match=r"d\.parquet: column 'id' must hold strings"):
        list(read_parquet_file(path, text_field="id"))
    nulls = _write_parquet(tmp_path / "n.parquet", {"text": ["a", "b", None, "d"]})
    with pytest.raises(ValueError, match=r"n\.parquet row 2: column 'text' is null"):
        list(read_parquet_file(nulls))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"junk\.parquet: cannot read as Parquet"):
        list(read_parquet_file(tmp_path / "junk.parquet"))


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` raise ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install megamoe\[data\]"):
        list(read_parquet_file(tmp_path / "any.parquet"))


def test_directories_expand_recursively_sorted_by_suffix(tmp_path):
    root = tmp_path / "corpus"
    for name in ("b.txt", "a/z.md", "a/b/c.txt", "a/notes.jsonl", "image.png", ".hidden.txt", ".git/x.txt"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f'{{"text": "{name}"}}' if name.endswith(".jsonl") else name)
    single = tmp_path / "single.log"
    single.write_text("a file named directly counts whatever its suffix")

    files = list_document_files([root, single])
    assert files == [(root / "a/b/c.txt", "text"), (root / "a/notes.jsonl", "jsonl"), (root / "a/z.md", "text"),
                     (root / "b.txt", "text"), (single, "text")]
    assert [text for text, _ in read_documents([root])] == ["a/b/c.txt", "a/notes.jsonl", "a/z.md", "b.txt"]
    # An explicit format keeps only that format's files of a directory, and applies to named files.
    assert list_document_files([root], format="jsonl") == [(root / "a/notes.jsonl", "jsonl")]
    assert [f for f, _ in list_document_files([root], text_suffixes=["PNG"])][-1] == root / "image.png"
    assert list_document_files([single], format="jsonl") == [(single, "jsonl")]
    assert (format_of("x.JSONL"), format_of("x.json"), format_of("x.parquet"), format_of("x")) == (
        "jsonl", "jsonl", "parquet", "text")


def test_missing_input_empty_directory_and_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"input .*absent\.txt does not exist"):
        list_document_files([tmp_path / "absent.txt"])
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "sub" / "data.csv").write_text("x")
    with pytest.raises(ValueError, match=r"input directory .*empty holds no file ending in \.jsonl"):
        list_document_files([tmp_path / "empty"])
    with pytest.raises(ValueError, match="format must be one of"):
        list_document_files([tmp_path], format="csv")
    with pytest.raises(ValueError, match="text_field must be a non-empty string"):
        list(read_documents([tmp_path], text_field=""))
    with pytest.raises(TypeError, match="wrap it in a list"):
        list_document_files(str(tmp_path))
