"""``hybridkv.server.stops``: the released text of any deltas equals the reference cut of the whole text, never holds
a stop string, and holds back less than the longest stop string; ``StopText`` over the byte tokenizer (characters
over several tokens) and a saved one (stops across and inside tokens); the 400s of ``stop_strings``."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.server.schemas import ApiError
from hybridkv.server.stops import MAX_STOPS, Stops, StopScanner, StopText, stop_strings
from hybridkv.server.text import ByteTokenizer, Tokenizer
from tests.server.test_chat import word_tokenizer

TEXT = "héllo ✓ 日本 🙂"


def reference(text: str, stops: Stops) -> tuple[str, str | None]:
    """The text cut at the occurrence ending first (of several ending there, the longest), by brute force."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops.strings if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[: end if stops.keep else end - len(stop)], stop
    return text, None


def run(deltas: list[str], stops: Stops) -> tuple[str, str | None]:
    scanner = StopScanner(stops)
    longest = max(len(s) for s in stops.strings)
    released = fed = ""
    for delta in deltas:
        fed += delta
        released += scanner.feed(delta)
        if scanner.matched is None:
            body = released
            assert fed.startswith(released) and len(fed) - len(released) < longest
        else:
            body = released[: -len(scanner.matched)] if stops.keep else released
        assert not any(s in body for s in stops.strings), (released, stops)
    if scanner.matched is None:
        released += scanner.flush()
    return released, scanner.matched


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)] or [""]


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab\nxé", max_size=40),
    stops=st.lists(st.text(alphabet="ab\nxé", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 1000), max_size=12),
    keep=st.booleans(),
)
def test_released_text_is_the_reference_cut_for_any_deltas(
    text: str, stops: list[str], cuts: list[int], keep: bool
) -> None:
    spec = Stops(tuple(stops), keep)
    assert run(split(text, cuts), spec) == reference(text, spec)


def test_a_tail_that_may_begin_a_stop_is_held_then_flushed_or_cut() -> None:
    scanner = StopScanner(Stops(("abc", "bd")))
    assert scanner.feed("xxab") == "xx"  # "ab" may begin "abc", "b" may begin "bd"
    assert scanner.feed("x") == "abx"  # neither any more
    assert scanner.feed("ab") == ""
    assert scanner.feed("d") == "a" and scanner.matched == "bd"  # "bd" ends before "abc" could
    assert scanner.feed("more") == "" and scanner.flush() == ""
    ends = StopScanner(Stops(("ab",)))
    assert ends.feed("xa") == "x" and ends.flush() == "a"  # the end: a held tail cannot match any more


def test_the_longest_of_stops_ending_together_and_keep() -> None:
    scanner = StopScanner(Stops(("c", "abc"), keep=True))
    assert scanner.feed("zabcd") == "zabc" and scanner.matched == "abc"
    cut = StopScanner(Stops(("c", "abc")))
    assert cut.feed("zab") == "z" and cut.feed("cd") == "" and cut.matched == "abc"


@pytest.mark.parametrize(("stop", "want"), [("✓", "héllo "), ("日本", "héllo ✓ "), ("🙂", "héllo ✓ 日本 "), ("é", "h")])
def test_byte_tokens_stop_at_whole_characters(stop: str, want: str) -> None:
    text = StopText(ByteTokenizer(256), Stops((stop,)))
    released = ""
    for byte in TEXT.encode():  # one token per byte: a character comes over several pushes
        released += text.push([byte], final=False)
        if text.matched is not None:
            break
    assert released == want and text.matched == stop
    assert text.push([ord("z")], final=True) == ""


def test_no_match_releases_everything_at_the_end() -> None:
    text = StopText(ByteTokenizer(256), Stops(("🙂!",)))
    released = "".join(text.push([b], final=False) for b in TEXT.encode())
    assert released == TEXT[:-1]  # the smiley may begin the stop: held
    assert text.push([], final=True) == "🙂" and text.matched is None


def test_stop_strings_from_a_body() -> None:
    tok = ByteTokenizer(256)
    assert stop_strings(None, False, "stop", tok) is None
    assert stop_strings("", False, "stop", tok) is None
    assert stop_strings([], False, "stop", tok) is None
    assert stop_strings("\n", True, "stop", tok) == Stops(("\n",), True)
    assert stop_strings(["a", "b", "a"], False, "stop", tok) == Stops(("a", "b"))
    refusals = [
        (["a", ""], tok, "stop[1]"),
        (["x"] * (MAX_STOPS + 1), tok, "stop"),
        ("x", None, "stop"),
    ]
    for value, tokenizer, field in refusals:
        with pytest.raises(ApiError) as err:
            stop_strings(value, False, "stop", tokenizer)
        assert err.value.status == 400 and err.value.param == field and err.value.message.startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("stop", "keep", "want"),
    [("is a", False, "Answer briefly. what "), ("a pre", True, "Answer briefly. what is a pre")],
)
def test_a_saved_tokenizer_stops_across_tokens(tmp_path: Path, stop: str, keep: bool, want: str) -> None:
    tok = Tokenizer(word_tokenizer(tmp_path, None))
    ids = tok.encode("Answer briefly. what is a prefix cache?")
    text = StopText(tok, Stops((stop,), keep))
    released = "".join(text.push([t], final=False) for t in ids) + text.push([], final=True)
    assert released == want and text.matched == stop
