"""Reading training data into tokenized documents: text, JSONL (text or chat), folders, saved
Hugging Face datasets and parquet. Every error names the file and the line or row at fault.

[Note: data formats]
`--data PATH` is, by what it is:
  * a `.txt` (or any non-JSON) file: the whole file is one document;
  * a `.jsonl` / `.json` file of one JSON object per line (or a JSON array of them): a row with `"messages"` is a chat
    (see [Note: chat masking]); any other row must have the text field (`--text-field`,
    default "text") holding a string: one document per row;
  * a `.parquet` file, or a folder written by `datasets.Dataset.save_to_disk` (it has
    `dataset_info.json` or `state.json`): rows as in JSONL (needs the `datasets` extra);
  * any other folder: every `.txt` / `.text` / `.md` / `.jsonl` / `.json` / `.parquet` file and
    saved dataset below it, sorted by path, each read as above (hidden entries skipped). A folder
    with none is an error.
Every document is tokenized without special tokens and ends with the EOS id (the tokenizer's,
else the model config's `eos_token_id`; with neither, documents are joined as they are and the
data summary says so).

[Note: chat masking]
A chat row is rendered with the tokenizer's chat template (transformers' `apply_chat_template`,
no generation prompt) and tokenized as one string. The loss is taken on assistant turns only,
as TRL's `assistant_only_loss`: a token is trained iff its first character lies in an assistant
span, which runs from the end of `render(messages[:i], add_generation_prompt=True)` (the prompt
including the assistant header) to the end of `render(messages[:i + 1])` (the reply and the
template's end-of-turn marker). Every other token (system, user, tool turns, the headers) gets
label -100. The EOS appended after the chat is trained (it closes the last reply). Roles
allowed: system, user, assistant, tool; a template whose prefix renders are not prefixes of the
whole render cannot be masked this way and is an error naming the row.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiered.config.user_files import open_regular_file
from tiered.errors import ConfigError, TieredError

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""The label Hugging Face causal LMs (and torch's cross_entropy) leave out of the loss."""
CHAT_ROLES = ("system", "user", "assistant", "tool")
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
FOLDER_SUFFIXES = (*TEXT_SUFFIXES, *JSON_SUFFIXES, ".parquet")
DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Document:
    """One tokenized document: ids and labels of equal length (-100 where not trained)."""

    ids: tuple[int, ...]
    labels: tuple[int, ...]
    where: str
    """File and line or row, for messages."""


@dataclass(frozen=True)
class Record:
    """One raw row before tokenization: text or chat messages, and where it came from."""

    where: str
    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None


# ---- reading --------------------------------------------------------------------------------
def _read_text_file(path: Path) -> Iterator[Record]:
    # a regular file only: a FIFO would block the read, a device never end ([Note: files a user names])
    fd, _ = open_regular_file(path, "--data", hint=_DATA_HINT)
    try:
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ConfigError(f"--data {path}: cannot be read ({exc.strerror or exc})") from None
    nul = raw.find(b"\0")
    if nul >= 0:
        line = raw.count(b"\n", 0, nul) + 1
        raise ConfigError(f"--data {path}:{line}: binary data (a NUL byte at byte {nul}); pass UTF-8 text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"--data {path}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start}); pass UTF-8 text"
        ) from None
    if not text.strip():
        raise ConfigError(f"--data {path}: the file is empty (no text to train on)")
    yield Record(where=str(path), text=text)


def _row_record(row: Any, where: str, text_field: str) -> Record:
    if not isinstance(row, dict):
        raise ConfigError(f"--data {where}: a row must be a JSON object, got {type(row).__name__}")
    if "messages" in row and text_field not in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ConfigError(f'--data {where}: "messages" must be a non-empty list of {{role, content}}')
        for j, m in enumerate(msgs):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise ConfigError(
                    f'--data {where}: message {j} must be an object with string "role" and "content"'
                )
            if m["role"] not in CHAT_ROLES:
                raise ConfigError(
                    f"--data {where}: message {j} has unknown role {m['role']!r}; roles are {', '.join(CHAT_ROLES)}"
                )
        return Record(where=where, messages=tuple(msgs))
    if text_field not in row:
        keys = ", ".join(sorted(map(str, row))) or "none"
        raise ConfigError(
            f"--data {where}: row has no {text_field!r} field (its keys: {keys}); pass --text-field NAME "
            'or a "messages" list for chat'
        )
    text = row[text_field]
    if not isinstance(text, str):
        raise ConfigError(f"--data {where}: field {text_field!r} must be a string, got {type(text).__name__}")
    return Record(where=where, text=text)


def _too_deep(path: Path, lineno: int) -> ConfigError:
    return ConfigError(
        f"--data {path}:{lineno}: JSON nested too deeply to parse (thousands of levels of [ or {{); "
        'a row is an object such as {"text": "..."} or {"messages": [...]}: fix or drop that row'
    )


def _deepest_line(text: str) -> int:
    """The line where a JSON array file nests deepest (brackets outside strings)."""
    depth = best = 0
    line = best_line = 1
    in_str = escaped = False
    for ch in text:
        if ch == "\n":
            line += 1
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > best:
                best, best_line = depth, line
        elif ch in "]}":
            depth -= 1
    return best_line


def _read_jsonl_file(path: Path, text_field: str) -> Iterator[Record]:
    for recs in _read_text_file(path):  # the same empty / binary / UTF-8 checks
        assert recs.text is not None
        if path.suffix.lower() == ".json" and recs.text.lstrip().startswith("["):  # an array, not lines
            try:
                rows = json.loads(recs.text)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"--data {path}:{exc.lineno}: malformed JSON ({exc.msg} at column {exc.colno})"
                ) from None
            except RecursionError:
                raise _too_deep(path, _deepest_line(recs.text)) from None
            for i, row in enumerate(rows):
                yield _row_record(row, f"{path} row {i}", text_field)
            if not rows:
                raise ConfigError(f"--data {path}: the JSON array has no rows")
            return
        n = 0
        for lineno, line in enumerate(recs.text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"--data {path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})"
                ) from None
            except RecursionError:  # json's parser recurses per nesting level
                raise _too_deep(path, lineno) from None
            n += 1
            yield _row_record(row, f"{path}:{lineno}", text_field)
        if n == 0:
            raise ConfigError(f"--data {path}: the file has no JSON rows")


def _datasets_module(path: Path) -> Any:
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError as exc:
        raise TieredError(
            f"--data {path}: reading parquet and saved datasets needs the `datasets` package; "
            "pip install 'tiered[hf]'"
        ) from exc
    return datasets


def _read_rows_table(path: Path, text_field: str) -> Iterator[Record]:
    datasets = _datasets_module(path)
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            import pyarrow.parquet as pq  # type: ignore[import-untyped]  # a dependency of datasets

            ds = datasets.Dataset(pq.read_table(str(path)))
    except Exception as exc:  # noqa: BLE001 - whatever the library says is the file's fault
        raise ConfigError(f"--data {path}: cannot be read as a dataset: {exc}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ConfigError(f'--data {path}: a DatasetDict without a "train" split (has {", ".join(ds)})')
        ds = ds["train"]
    if len(ds) == 0:
        raise ConfigError(f"--data {path}: the dataset has no rows")
    for i, row in enumerate(ds):
        yield _row_record(row, f"{path} row {i}", text_field)


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in DATASET_MARKERS)


def _read_file(path: Path, text_field: str) -> Iterator[Record]:
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return _read_jsonl_file(path, text_field)
    if suffix == ".parquet":
        return _read_rows_table(path, text_field)
    return _read_text_file(path)


def folder_files(path: Path) -> list[Path]:
    """The usable sources below a data folder, sorted by path ([Note: data formats]): files by
    suffix, and saved datasets (folders) as one source each, their own files not descended into."""
    found: list[Path] = []

    def walk(d: Path) -> None:
        for p in sorted(d.iterdir()):
            if p.name.startswith("."):
                continue
            if p.is_dir():
                if _is_saved_dataset(p):
                    found.append(p)
                else:
                    walk(p)
            elif p.is_file() and p.suffix.lower() in FOLDER_SUFFIXES:
                found.append(p)

    walk(path)
    if not found:
        raise ConfigError(
            f"--data {path}: the folder has no usable files ({', '.join(FOLDER_SUFFIXES)}); "
            "put text or JSONL files in it"
        )
    return found


_DATA_HINT = "pass a text/JSONL/parquet file, a folder of them or a saved Hugging Face dataset"


def read_records(path: str | Path, *, text_field: str = "text") -> Iterator[Record]:
    """Every raw record of `path`, in a fixed order ([Note: data formats])."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            f"--data {path}: no such file or folder; pass a text/JSONL/parquet file, a folder of them "
            "or a saved Hugging Face dataset"
        )
    if _is_saved_dataset(p):
        yield from _read_rows_table(p, text_field)
    elif not p.is_dir():
        os.close(open_regular_file(p, "--data", hint=_DATA_HINT)[0])  # before any reader opens it
        yield from _read_file(p, text_field)
    else:
        for f in folder_files(p):
            yield from (_read_rows_table(f, text_field) if f.is_dir() else _read_file(f, text_field))


# ---- tokenizing -----------------------------------------------------------------------------
def _chat_spans(tok: Any, rec: Record) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans of its assistant turns ([Note: chat masking])."""
    msgs = [dict(m) for m in rec.messages or ()]

    def render(part: list[dict[str, Any]], gen: bool) -> str:
        if not part:
            return ""
        return str(tok.apply_chat_template(part, tokenize=False, add_generation_prompt=gen))

    try:
        full = render(msgs, False)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start, end = len(render(msgs[:i], True)), len(render(msgs[: i + 1], False))
            if not (full.startswith(render(msgs[: i + 1], False)) and start <= end):
                raise ConfigError(
                    f"--data {rec.where}: the tokenizer's chat template does not render a conversation's "
                    "beginning as a prefix of the whole, so prompt tokens cannot be masked"
                )
            spans.append((start, end))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template error is the row's or the template's
        raise ConfigError(f"--data {rec.where}: the chat template failed on this row: {exc}") from None
    return full, spans


def tokenize_record(rec: Record, tokenizer: Any, eos_id: int | None) -> Document:
    """`rec` as ids and labels ([Note: data formats], [Note: chat masking])."""
    tail = [eos_id] if eos_id is not None else []
    if rec.messages is None:
        ids = list(tokenizer.encode(rec.text or "")) + tail
        return Document(tuple(ids), tuple(ids), rec.where)
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise ConfigError(
            f'--data {rec.where}: a chat row ("messages"), but the tokenizer ({tokenizer.name}) has no chat '
            "template; put a tokenizer with a chat_template (tokenizer_config.json) in the model folder, "
            "or use text rows"
        )
    if not getattr(hf, "is_fast", False):
        raise ConfigError(f"--data {rec.where}: chat masking needs a fast tokenizer (tokenizer.json)")
    full, spans = _chat_spans(hf, rec)
    enc = hf(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [
        t if any(a <= start < b for a, b in spans) else IGNORE_INDEX
        for t, (start, _) in zip(ids, enc["offset_mapping"], strict=True)
    ]
    return Document(tuple(ids + tail), tuple(labels + tail), rec.where)


def load_documents(
    path: str | Path, tokenizer: Any, *, vocab_size: int, eos_id: int | None, text_field: str = "text"
) -> list[Document]:
    """Every document of `path`, tokenized; an id beyond the model's vocabulary is an error."""
    docs = []
    for rec in read_records(path, text_field=text_field):
        doc = tokenize_record(rec, tokenizer, eos_id)
        top = max(doc.ids, default=0)
        if top >= vocab_size:
            raise ConfigError(
                f"--data {doc.where}: tokenizer {tokenizer.name} produced id {top} >= the model's vocab_size "
                f"{vocab_size}; the tokenizer does not belong to this model"
            )
        docs.append(doc)
    if not docs:
        raise ConfigError(f"--data {path}: no documents")
    return docs
