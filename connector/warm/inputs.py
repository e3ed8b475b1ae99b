"""Documents to warm: read from files, directories, globs and JSONL, and rendered into the exact
prompt text that later requests will start with."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

# Appended to the user message before rendering a chat template and cut off after: the rendered
# text up to it is what every chat request whose message starts with the document shares.
END_OF_DOCUMENT = "<<connector.warm: end of document>>"


@dataclass
class Document:
    name: str  # the file path, or "<file>#<id>" for a JSONL record
    text: str | None
    error: str | None = None  # why it cannot be warmed (then text is None)

    @property
    def text_hash(self) -> str:
        return xxhash.xxh3_64_hexdigest((self.text or "").encode())


def _failed(name: str, why: str) -> Document:
    return Document(name, None, why)


def read_documents(
    specs: Sequence[str], text_field: str = "text", id_field: str = "id"
) -> list[Document]:
    """Every document named by ``specs`` (files, directories walked recursively, glob patterns,
    ``.jsonl`` files of one JSON object per line), in order. One that cannot be read becomes a
    Document with an ``error``; the others are still read."""
    docs: list[Document] = []
    for spec in specs:
        for path in _paths(spec, docs):
            if path.endswith(".jsonl"):
                docs.extend(_read_jsonl(path, text_field, id_field))
            else:
                docs.append(_read_text(path))
    return docs


def _paths(spec: str, docs: list[Document]) -> Iterator[str]:
    if glob.has_magic(spec):
        matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not matches:
            docs.append(_failed(spec, "no file matches this pattern"))
        yield from matches
    elif os.path.isdir(spec):
        files = sorted(
            str(p)
            for p in Path(spec).rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(spec).parts)
        )
        if not files:
            docs.append(_failed(spec, "the directory holds no files"))
        yield from files
    else:
        yield spec


def _read_text(path: str) -> Document:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        return _failed(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
    except OSError as exc:
        return _failed(path, f"cannot read it: {exc.strerror or exc}")
    if not text.strip():
        return _failed(path, "empty")
    return Document(path, text)


def _read_jsonl(path: str, text_field: str, id_field: str) -> list[Document]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return [_failed(path, f"cannot read it: {exc}")]
    docs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        name = f"{path}:{n}"
        try:
            record: Any = json.loads(line)
        except ValueError as exc:
            docs.append(_failed(name, f"not JSON: {exc}"))
            continue
        if not isinstance(record, dict):
            docs.append(_failed(name, "not a JSON object"))
            continue
        if record.get(id_field) is not None:
            name = f"{path}#{record[id_field]}"
        text = record.get(text_field)
        if not isinstance(text, str) or not text.strip():
            docs.append(_failed(name, f'no text in field "{text_field}" (see --text-field)'))
            continue
        docs.append(Document(name, text))
    if not docs:
        docs.append(_failed(path, "no records"))
    return docs


@dataclass(frozen=True)
class PromptStyle:
    """How a document sits in the requests that will use it."""

    prefix: str = ""  # text before the document (a plain prompt's instructions, ...)
    suffix: str = ""  # text after it, shared by every request on it
    chat: bool = False  # render with a chat template, as /v1/chat/completions does
    chat_template: str | None = None  # a template's text; None: the model's own
    system: str | None = None  # a system message before the user message (chat only)


def render(style: PromptStyle, text: str, tokenizer: Any) -> tuple[str, bool]:
    """The prompt text that requests on this document start with, and whether the tokenizer adds
    its special tokens (as vLLM's completions endpoint does; its chat endpoint leaves them to the
    template)."""
    body = style.prefix + text + style.suffix
    if not style.chat:
        return body, True
    messages = [{"role": "system", "content": style.system}] if style.system else []
    messages.append({"role": "user", "content": body + END_OF_DOCUMENT})
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, chat_template=style.chat_template
    )
    at = rendered.find(END_OF_DOCUMENT)
    if at < 0:
        raise ValueError(
            "the chat template does not copy the user message into the prompt verbatim, so the "
            "prompt that requests share cannot be found; warm without --chat (with --prefix)"
        )
    return rendered[:at], False
