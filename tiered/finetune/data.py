"""Text in, token batches out: the built-in byte tokenizer and a seeded causal-LM batch stream.

[Note: byte tokenizer]
A model folder without tokenizer files (the usual case for a config-only model built with
from_config) still has to be trained on text. The built-in tokenizer maps each UTF-8 byte to its
value: id = byte, so ids are 0..255 and any text round-trips exactly (decode(encode(s)) == s).
It needs vocab_size >= 256; ids 256 and up are simply never produced. There are no special
tokens: the corpus is one byte stream and training windows are cut from it anywhere.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from tiered.config.user_files import kind_of
from tiered.errors import ConfigError

log = logging.getLogger(__name__)

BYTE_VOCAB = 256
# Files whose presence in a model folder means it brings its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer(Protocol):
    name: str
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """See [Note: byte tokenizer]."""

    name = "bytes"
    eos_token_id: int | None = None  # no special tokens: the model config's EOS id is used

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < BYTE_VOCAB:
            raise ConfigError(
                f"the built-in byte tokenizer needs vocab_size >= {BYTE_VOCAB} (one id per byte value), "
                f"but the model's vocab_size is {vocab_size}; raise vocab_size in config.json or put "
                "tokenizer files (tokenizer.json) in the model folder"
            )
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= i < BYTE_VOCAB]
        if bad:
            raise ValueError(f"ByteTokenizer.decode: ids must be byte values 0..255, got {bad[:5]}")
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer shipped in the model folder, through transformers (local files only)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # any failure is the folder's
            raise ConfigError(
                f"--model {folder}: transformers cannot load its tokenizer files: {exc}"
            ) from exc
        self.name = type(self._tok).__name__
        eos = self._tok.eos_token_id
        self.eos_token_id: int | None = int(eos) if isinstance(eos, int) else None

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer itself (chat templates, offsets)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def tokenizer_for(folder: Path | None, vocab_size: int) -> Tokenizer:
    """The folder's own tokenizer if it has one, else the byte tokenizer ([Note: byte tokenizer])."""
    if folder is not None:
        from tiered.checkpoint.export import TOKENIZER_FILES as READ_BY_TRANSFORMERS

        for f in READ_BY_TRANSFORMERS:  # regular files only: a FIFO would hang the tokenizer's read
            p = folder / f
            if os.path.lexists(p) and not p.is_file():
                kind = kind_of(p.stat().st_mode) if p.exists() else "a symlink to nothing"
                raise ConfigError(
                    f"--model {folder}: its {f} is {kind}, not a regular file; remove or replace it"
                )
    if folder is not None and any((folder / f).is_file() for f in TOKENIZER_FILES):
        return HFTokenizer(folder)
    return ByteTokenizer(vocab_size)


def load_tokens(path: str | Path, tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """The whole text file as one int64 id tensor. Errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--data {path}: no such file; pass a plain UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--data {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"--data {path}: cannot be read ({exc.strerror or exc})") from None
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ConfigError(
            f"--data {path}: tokenizer {tokenizer.name} produced id {int(ids.max())} >= the model's "
            f"vocab_size {vocab_size}; the tokenizer does not belong to this model"
        )
    return ids


def batches(
    ids: torch.Tensor, seq_len: int, batch_size: int, seed: int, source: str = "the data"
) -> Iterator[dict[str, Any]]:
    """An endless, seeded stream of {"input_ids", "labels"} of shape (batch_size, seq_len).

    Each row is a window starting at a uniformly drawn offset, so a few KB of text yields many
    distinct windows; labels == input_ids (Hugging Face causal LMs shift them inside). The same
    (ids, seq_len, batch_size, seed) gives the same stream: that is what lets a run be compared
    with plain PyTorch step for step."""
    if seq_len < 2:
        raise ConfigError(f"--seq-len must be >= 2 (one token predicts the next), got {seq_len}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    n = int(ids.numel())
    if n < seq_len:
        raise ConfigError(
            f"{source} has {n} tokens, fewer than --seq-len {seq_len}; use a longer text or a smaller --seq-len"
        )
    g = torch.Generator().manual_seed(seed)
    span = n - seq_len + 1
    while True:
        starts = torch.randint(0, span, (batch_size,), generator=g)
        x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
        yield {"input_ids": x, "labels": x.clone()}
