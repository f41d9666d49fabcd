"""Stop strings: a request's text ends right before (or, asked, right after) the first stop string it contains.

``Stops`` is what a request asked (``stop_strings`` reads it from a body: ``stop`` of OpenAI's bodies,
``sampling_params.stop`` of SGLang's, a string or a list of up to ``MAX_STOPS`` non-empty strings; they need
a tokenizer, text to match). ``StopScanner`` matches text deltas as they come; ``StopText`` is one prompt's
``TextStream`` through a scanner: tokens in, text out (``Generation`` runs it in the backend's thread, so a
match stops the request in the engine at the token that completed it).

The match is the occurrence of any stop string that ends first in the text; of several ending at the same
place, the longest. The text released up to it is ``text[:start]`` (``keep``: ``text[:end]``); nothing after it
is ever released.

Invariants (``StopScanner``, whatever the deltas):
- The text released so far, joined, never contains a stop string (``keep``: only as its end, once matched).
- Until a match, released + held back == every delta fed, joined; the held-back tail is the longest suffix of
  it that is a proper prefix of a stop string, so shorter than the longest stop string.
- After ``flush`` (the end, no match) the released text is every delta joined; once matched, it is the
  reference ``text[:start]`` (or ``text[:end]``) of the text fed up to the match, and feeding more releases
  nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.server.schemas import ApiError
from hybridkv.server.text import TextStream, TextTokenizer

MAX_STOPS = 16
"""Stop strings per request, at most (OpenAI allows 4, vLLM any number)."""


@dataclass(frozen=True)
class Stops:
    strings: tuple[str, ...]
    keep: bool = False  # the matched stop string stays at the end of the text (``include_stop_str_in_output``)


def stop_strings(
    value: str | list[str] | None, keep: bool, field: str, tokenizer: TextTokenizer | None
) -> Stops | None:
    """The stop strings a body gave in ``field`` (None or ``""`` or ``[]``: none); a 400 naming the field for an
    empty string in a list, more than ``MAX_STOPS``, or a server without a tokenizer."""
    strings = ([value] if value else []) if isinstance(value, str) else list(value or ())
    if not strings:
        return None
    if tokenizer is None:
        raise ApiError(
            400,
            f"{field}: stop strings match the generated text and this server has no tokenizer (start it with "
            "--tokenizer DIR); give stop_token_ids",
            field,
        )
    if len(strings) > MAX_STOPS:
        raise ApiError(400, f"{field}: {len(strings)} stop strings; give at most {MAX_STOPS}", field)
    for i, s in enumerate(strings):
        if not s:
            where = f"{field}[{i}]"
            raise ApiError(400, f"{where}: an empty stop string matches everywhere; give one character or more", where)
    return Stops(tuple(dict.fromkeys(strings)), keep)


class StopScanner:
    """Text deltas in, the text that can be released out (see the module's invariants)."""

    def __init__(self, stops: Stops):
        self.stops = stops
        self.matched: str | None = None  # the stop string found (then nothing more is released)
        self._held = ""  # the tail that may begin a stop string

    def feed(self, delta: str) -> str:
        """The text ``delta`` lets out: all of it but a tail that may begin a stop string, or the text up to a match."""
        if self.matched is not None:
            return ""
        text = self._held + delta
        found = self._first_match(text)
        if found is not None:
            start, stop = found
            self.matched, self._held = stop, ""
            return text[: start + len(stop)] if self.stops.keep else text[:start]
        held = self._held_tail(text)
        self._held = text[len(text) - held :] if held else ""
        return text[: len(text) - held]

    def flush(self) -> str:
        """At the end of the text: the held-back tail (no stop string can complete any more)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """The occurrence ending first (then the longest): its start and stop string."""
        best: tuple[int, int, str] | None = None  # end, -length, stop
        for stop in self.stops.strings:
            at = text.find(stop)
            if at >= 0 and (best is None or (at + len(stop), -len(stop)) < best[:2]):
                best = (at + len(stop), -len(stop), stop)
        return None if best is None else (best[0] + best[1], best[2])

    def _held_tail(self, text: str) -> int:
        """The length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops.strings:
            first, end = stop[0], len(text) - longest  # only a suffix longer than ``longest`` counts
            at = text.find(first, max(len(text) - len(stop) + 1, 0), end)
            while at >= 0:  # candidates by the stop's first character, longest first
                if stop.startswith(text[at:]):
                    longest = len(text) - at
                    break
                at = text.find(first, at + 1, end)
        return longest


class StopText:
    """One prompt's text (``TextStream``) through its stop strings: ``push`` as ``TextStream.push``, but no text
    past a match (``matched``) and a tail that may begin a stop string held back until it cannot."""

    def __init__(self, tokenizer: TextTokenizer, stops: Stops):
        self._stream = TextStream(tokenizer)
        self._scanner = StopScanner(stops)

    def push(self, tokens: list[int], final: bool) -> str:
        """Add ``tokens``; the text released by them (``final``: all that is left, up to a match)."""
        out = self._scanner.feed(self._stream.push(tokens, final))
        return out + self._scanner.flush() if final and self.matched is None else out

    @property
    def matched(self) -> str | None:
        return self._scanner.matched
