"""Text in and out of the server: an optional tokenizer from a local directory, and streamed text deltas.

Without a tokenizer the server speaks token ids only: text prompts are refused (a 400 naming the
field) and every ``text`` in an answer is ``""``. With one (``--tokenizer DIR``, a ``transformers``
tokenizer saved there; nothing is downloaded) text prompts are encoded without special tokens
added and outputs decoded.

Invariant (``TextStream``): the deltas it hands out, joined, equal the decoding of every token so
far, except that a trailing replacement character (an incomplete UTF-8 sequence) is held back until
the next token completes it or the request ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise ValueError(f"--tokenizer {str(path)!r} is not a directory holding a saved tokenizer")
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))


class TextStream:
    """Incremental text of one request's tokens (``""`` throughout without a tokenizer)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters handed out
        self._decoded = (0, "")  # (how many ids, their text): ``push`` and ``text`` decode once per change

    def push(self, tokens: list[int], final: bool) -> str:
        """Add ``tokens``; the new text (all that is left when ``final``)."""
        self.ids += tokens
        if self.tokenizer is None:
            return ""
        text = self._decode()
        if not final and text.endswith("\ufffd"):
            return ""
        delta = text[self.sent :]
        self.sent = len(text)
        return delta

    @property
    def text(self) -> str:
        return "" if self.tokenizer is None else self._decode()

    def _decode(self) -> str:
        assert self.tokenizer is not None
        if self._decoded[0] != len(self.ids):
            self._decoded = (len(self.ids), self.tokenizer.decode(self.ids))
        return self._decoded[1]
