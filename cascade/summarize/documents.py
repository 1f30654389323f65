"""Inputs of a summarization job: text files, directories of them, and JSONL files of ``id``/``text``.

A document that cannot be read (missing, unreadable, not UTF-8, empty, a bad JSONL line) becomes a
``Document`` with an ``error`` instead of stopping the job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Document:
    id: str
    text: str | None = None
    error: str | None = None


def read_inputs(paths: list[Path]) -> Iterator[Document]:
    """Documents of every input, in order; directories are walked (sorted), ``*.jsonl`` split by line."""
    for path in paths:
        if path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
                yield from read_file(file)
        else:
            yield from read_file(path)


def read_file(path: Path) -> Iterator[Document]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        yield Document(str(path), error=f"cannot read {path}: {exc.strerror or exc}")
        return
    if path.suffix == ".jsonl":
        yield from jsonl_documents(path, data)
    else:
        yield text_document(str(path), data)


def text_document(doc_id: str, data: bytes) -> Document:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Document(doc_id, error=f"not UTF-8 text: undecodable byte at offset {exc.start}")
    if not text.strip():
        return Document(doc_id, error="the document is empty")
    if "\0" in text:
        return Document(doc_id, error="binary data (NUL bytes), not text")
    return Document(doc_id, text=text.replace("\r\n", "\n"))


def jsonl_documents(path: Path, data: bytes) -> Iterator[Document]:
    """One document per non-blank line: {"id": ..., "text": ...}; a bad line is an error document."""
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            yield Document(where, error=f"not a JSON line: {exc}")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("text"), str) or "id" not in record:
            yield Document(where, error='a JSONL line must be an object with "id" and a string "text"')
            continue
        text = record["text"]
        yield (
            Document(str(record["id"]), text=text)
            if text.strip()
            else Document(str(record["id"]), error="the document is empty")
        )
