"""Text in and out of the server: an optional tokenizer from a local directory, and streamed text deltas.

Without a tokenizer the server speaks token ids only: text prompts are refused (a 400 naming the
field) and every ``text`` in an answer is ``""``. With one (``--tokenizer DIR``, a ``transformers``
tokenizer saved there; nothing is downloaded) text prompts are encoded without special tokens
added and outputs decoded.

Invariant (``TextStream``): the deltas it hands out, joined, equal the decoding of every token so
far, except that a trailing replacement character (an incomplete UTF-8 sequence) is held back until
the next token completes it or the request ends; after the last push they equal it whole.
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
    """Incremental text of one request's tokens (``""`` throughout without a tokenizer).

    Each push decodes a window, not every token so far (which made a stream's text O(n^2)): the tokens since
    the last text handed out, after the ones before it as context (``_prefix:_read``), so that a tokenizer
    that spells a token differently at the start of a text (a leading space) gives the same delta as a decode
    of everything would. The last push decodes everything once and hands out what is left of it.
    """

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the context the next delta follows
        self._read = 0  # ids before it are in the text handed out
        self._text = ""  # the deltas so far, joined

    def push(self, tokens: list[int], final: bool) -> str:
        """Add ``tokens``; the new text (all that is left when ``final``)."""
        self.ids += tokens
        if self.tokenizer is None:
            return ""
        if final:
            whole, sent = self.tokenizer.decode(self.ids), self._text
            same = len(sent)  # (the window's deltas are a prefix of the whole for every tokenizer tested)
            if not whole.startswith(sent):
                same = next((i for i, (a, b) in enumerate(zip(whole, sent, strict=False)) if a != b), len(whole))
            self._text = whole
            return whole[same:]
        context = self.tokenizer.decode(self.ids[self._prefix : self._read])
        text = self.tokenizer.decode(self.ids[self._prefix :])
        if len(text) <= len(context) or text.endswith("\ufffd"):  # nothing new, or an incomplete UTF-8 sequence
            return ""
        delta = text[len(context) :]
        self._prefix, self._read = self._read, len(self.ids)
        self._text += delta
        return delta

    @property
    def text(self) -> str:
        """Every delta so far, joined (after the last push: the decoding of every token)."""
        return self._text
