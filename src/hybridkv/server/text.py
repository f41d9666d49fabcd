"""Text in and out of the server: a tokenizer (a saved one, or bytes), and streamed text deltas.

Without a tokenizer the server speaks token ids only: text prompts are refused (a 400 naming the
field) and every ``text`` in an answer is ``""``. With one, text prompts are encoded without
special tokens added and outputs decoded: ``Tokenizer(DIR)`` is a ``transformers`` tokenizer saved
there (``--tokenizer DIR``, or the model directory's own; nothing is downloaded);
``ByteTokenizer(vocab_size, special_ids)`` is the built-in one of the random models: token id
``b`` < 256 is the byte ``b`` of the UTF-8 text, a special id (bos, eos) decodes to nothing, any
other id to U+FFFD, and invalid UTF-8 decodes with replacement characters (never an error).

A chat (``render_chat``) becomes token ids through the tokenizer's chat template: a saved tokenizer's
own (``apply_chat_template``, with the generation prompt), or for ``ByteTokenizer`` a built-in one
(``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``). ``ChatTemplateMissing`` says which
tokenizer has none and what to add.

Invariant (``TextStream``): the deltas it hands out, joined, equal the decoding of every token so
far, except that a trailing replacement character (an incomplete UTF-8 sequence) is held back until
the next token completes it or the request ends; after the last push they equal it whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a directory holding one has a saved tokenizer
BYTES = 256


class ChatTemplateMissing(ValueError):
    """The tokenizer has no chat template to render a conversation with."""


class TextTokenizer(Protocol):
    source: str  # where it came from (``/get_model_info``'s ``tokenizer_path``)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt of a conversation (``{"role", "content"}`` messages), ready for the assistant's turn."""
        ...


def has_tokenizer(path: str | Path) -> bool:
    """Whether the directory ``path`` holds a saved tokenizer."""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


class ByteTokenizer:
    """Text as its UTF-8 bytes, one token id per byte, for a model whose vocabulary has at least the 256 byte ids
    (a text with a byte at or above ``vocab_size`` encodes to an id the engine refuses, named)."""

    def __init__(self, vocab_size: int, special_ids: Iterable[int] = ()):
        self.vocab_size = vocab_size
        self.special = frozenset(special_ids)
        self.source = f"builtin:bytes (vocabulary {vocab_size})"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogatepass"))

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return self.encode(text + "<|assistant|>\n")

    def decode(self, ids: list[int]) -> str:
        out, run = [], bytearray()
        for t in ids:
            if t in self.special:
                continue
            if 0 <= t < BYTES:
                run.append(t)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append("\ufffd")  # an id past the bytes: no text of its own
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class Tokenizer:
    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.source = str(path)
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

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise ChatTemplateMissing(
                f"the tokenizer at {self.source!r} has no chat template; add one (tokenizer_config.json's "
                "chat_template, or a chat_template.jinja file beside it), or send prompts to /v1/completions"
            )
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding (transformers' dict answer)
            ids = ids["input_ids"]
        return [int(t) for t in ids]


class TextStream:
    """Incremental text of one request's tokens (``""`` throughout without a tokenizer).

    Each push decodes a window, not every token so far (which made a stream's text O(n^2)): the tokens since
    the last text handed out, after the ones before it as context (``_prefix:_read``), so that a tokenizer
    that spells a token differently at the start of a text (a leading space) gives the same delta as a decode
    of everything would. The last push decodes everything once and hands out what is left of it.
    """

    def __init__(self, tokenizer: TextTokenizer | None):
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
