"""A request: what a client asks of the engine (token ids and ``SamplingParams``, validated at the edge), the
engine's ``Request`` that carries it (its status and its KV) and how it ended.

``SamplingParams`` is the one description of how a request's tokens are chosen and when it
ends, used alike by ``Engine``, ``generate``, ``serve-pd``, ``PDServer`` and the HTTP server:
``max_new_tokens``, ``temperature`` (0, or below ``GREEDY_BELOW``: greedy), ``top_p``,
``top_k`` (0: off), ``seed``, ``stop_token_ids``, ``ignore_eos`` and ``logprobs`` (None: off; n: each
new token's log-probability and the n most likely tokens', ``engine.logprobs``) and ``prompt_logprobs``
(the same for every prompt token after the first: the prompt is then computed whole, no cache hit).
``check_request`` is the
one validation every entry point runs before a request is queued; its ``RequestError`` names
the offending field, its ``CheckedPrompt`` is what the engines queue. Inside an engine a ``Request`` carries its
tokens, its ``RequestStatus`` and its KV (``Request.kv``, held through ``engine.sched.kv.RequestKV``: the
scheduler changes memory through it alone). ``Outcome`` is the one report of a request's end, from the engine
through a server's backend to its HTTP answer.

Invariants:
- A ``SamplingParams`` holds only values the engine can serve: ``check`` raises
  ``RequestError`` (field named) for anything else, at construction.
- A prompt is checked once: a ``CheckedPrompt`` exists only as ``check_request``'s answer, and an
  engine given one checks only that it was checked for its own vocabulary and context.
- A ``Request``'s state is its ``status``; it holds KV exactly while ``kv`` is set (``HELD`` statuses hold it
  outside the running batch), and its cache namespace is its ``cache_salt`` alone.
- A request ends for exactly one ``FinishReason``, reported once as its ``Outcome``: ``length``
  (max_new_tokens reached), ``eos`` (the model's end-of-sequence id, unless ``ignore_eos``), ``stop`` (one of
  ``stop_token_ids``; the stop token is part of the output, as EOS is), ``abort`` (a client
  gave up) or ``error`` (it could not be served; ``error`` says why).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hybridkv.cache import KVHandle, MatchResult
    from hybridkv.engine.disagg.path import PDPath
    from hybridkv.engine.logprobs import TokenLogprob
    from hybridkv.tiers import Fetched

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
"""The most likely tokens a request may ask to see at each position (OpenAI's ``top_logprobs`` bound)."""
GREEDY_BELOW = 1e-5
"""Temperatures below this choose greedily (vLLM's convention): dividing logits by a tinier one overflows fp32 to
infinities, and the draw would no longer be the softmax's most likely token."""


class RequestError(ValueError):
    """A request the engine refuses as given; ``field`` names the part to change."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class RequestStatus(Enum):
    """Where a request is in its life: the one field that says it (the scheduler moves it, forward only, except
    a retraction's RUNNING -> WAITING)."""

    WAITING = "waiting"
    """Queued; holds no KV (a planned restore's pins at most)."""
    RUNNING = "running"
    """In the batch: holds its KV and computes."""
    HANDED_OFF = "handed_off"
    """Prefill role: its prompt is computed; its KV stays held while its sender reads it."""
    RECEIVING = "receiving"
    """Decode role: its KV is reserved while it arrives by transfer."""
    ABANDONED = "abandoned"
    """Decode role: received or reserved, but it will not run (its transfer failed, or it was given up); its KV is
    held until no writer can touch it."""
    FINISHED = "finished"
    """Ended (its ``finish_reason`` says why, or it was handed off and sent); holds no KV."""


HELD = frozenset({RequestStatus.HANDED_OFF, RequestStatus.RECEIVING, RequestStatus.ABANDONED})
"""Statuses of a request that holds KV outside the running batch."""


class FinishReason(StrEnum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class Outcome:
    """How one request ended: what ``Engine.step`` and ``Engine.generate`` report and every server ``Sink`` gets."""

    output_ids: list[int]  # every output token ([] when it failed)
    finish_reason: FinishReason
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at the first admission (not computed; PD: the prefill side's)."""
    _: KW_ONLY
    cached_tokens_details: dict[str, int] | None = None
    """``cached_tokens`` by where they came from {device, host, storage} (None: whoever ended it does not say)."""
    hit: CacheHit | None = None
    """A single engine's first admission's match per component (full / window / checkpoint lengths)."""
    retractions: int = 0
    """Times the engine (PD: the decode engine) retracted it and computed it again."""
    rid: Hashable = None
    """The engine's id of the request (PD: its submission index; None where it never had one)."""
    logprobs: list[TokenLogprob] | None = None
    """One per output token when the request asked (``SamplingParams.logprobs``), else None."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """One per prompt token after the first when the request asked (``SamplingParams.prompt_logprobs``)."""
    pd: PDPath | None = None
    """A disaggregated request's path (attempts, bytes moved, timing); None from a single engine or where the
    PD server never ended it (a backend's own refusal)."""
    stop_string: str | None = None
    """The stop string its text matched, ending it with ``stop`` (set by the HTTP ``Generation``, never by an
    engine or a backend)."""


def _int(value: object, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise RequestError(name, f"must be an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RequestError(name, f"must be {bound}, got {v}")
    return v


def _float(value: object, name: str, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise RequestError(name, f"must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise RequestError(name, f"must be a finite number in {bound}, got {value!r}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    """None: the engine picks one per request (``Engine.generate``: its ``seed`` + the index)."""
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no log-probabilities; n: each new token's and the n most likely tokens' (``engine.logprobs``)."""
    prompt_logprobs: int | None = None
    """None: none; n: each prompt token's after the first, and the n most likely tokens' at its position.
    Such a request computes its whole prompt (no prefix-cache hit: a hit's positions have no logits)."""

    def __post_init__(self) -> None:
        _int(self.max_new_tokens, "max_new_tokens", 1)
        _float(self.temperature, "temperature", 0.0, 100.0)
        _float(self.top_p, "top_p", 0.0, 1.0, lo_open=True)
        _int(self.top_k, "top_k", 0)
        if self.seed is not None:
            _int(self.seed, "seed", 0, MAX_SEED)
        if not isinstance(self.ignore_eos, bool):
            raise RequestError("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(self.stop_token_ids, Iterable):
            raise RequestError("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        stops = tuple(_int(t, "stop_token_ids", 0) for t in self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stops)
        if self.logprobs is not None:
            _int(self.logprobs, "logprobs", 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int(self.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def stops(self, eos: frozenset[int]) -> frozenset[int]:
        """The token ids that end the request: the model's EOS ids (unless ``ignore_eos``) and the stop ids."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else eos)

    def with_seed(self, seed: int) -> SamplingParams:
        """The same parameters with ``seed`` where none was given."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=seed % (MAX_SEED + 1))


@dataclass(frozen=True)
class CheckedPrompt:
    """A prompt ``check_request`` passed with ``params`` for a model of ``vocab_size`` ids and ``max_context``
    tokens: what ``Engine.submit`` and ``PDServer.submit`` take without checking it again."""

    ids: list[int]
    params: SamplingParams
    vocab_size: int
    max_context: int

    def served_by(self, vocab_size: int, max_context: int) -> CheckedPrompt:
        """Itself, once it is known to have been checked for a model of these bounds (else ``ValueError``: a
        caller's bug, not the client's)."""
        if (self.vocab_size, self.max_context) != (vocab_size, max_context):
            raise ValueError(
                f"a prompt checked for {self.vocab_size} ids and {self.max_context} tokens of context went to "
                f"a model of {vocab_size} ids and {max_context} tokens"
            )
        return self


def check_request(prompt: Sequence[int], params: SamplingParams, vocab_size: int, max_context: int) -> CheckedPrompt:
    """The prompt as a list of ints, checked with ``params``, or ``RequestError`` naming what makes it
    unservable: not a list of ints, empty, ids outside ``[0, vocab_size)`` (stop ids too), or prompt +
    max new tokens beyond ``max_context``."""
    if not isinstance(params, SamplingParams):
        raise RequestError("sampling_params", f"expected SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str | bytes | bytearray) or not isinstance(prompt, Sequence | np.ndarray):
        raise RequestError("input_ids", f"must be a list of token ids, got {type(prompt).__name__}")
    listed = True  # its items are checked one by one: a list, or an object array (checked like a list)
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or (prompt.size and prompt.dtype != object and prompt.dtype.kind not in "iu"):
            raise RequestError(
                "input_ids", f"must be a flat list of integer token ids, got an array {prompt.shape} {prompt.dtype}"
            )
        listed = prompt.dtype == object
    if listed and not all(type(t) is int for t in prompt):  # plain ints (the common case) pass in one sweep
        odd = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int | np.integer)]
        if odd:
            raise RequestError("input_ids", f"must be a flat list of integer token ids, got {odd[:3]!r}")
    if len(prompt) == 0:
        raise RequestError("input_ids", "empty prompt: give at least one token")
    try:
        ids = np.asarray(prompt, dtype=np.int64)  # a uint64 array beyond int64 wraps below 0: outside too
        inside = int(ids.min()) >= 0 and int(ids.max()) < vocab_size
    except OverflowError:  # a Python int beyond int64: outside any vocabulary
        inside = False
    if not inside:
        outside = [int(t) for t in prompt if not 0 <= t < vocab_size]
        raise RequestError("input_ids", f"token ids {outside[:5]} outside the vocabulary [0, {vocab_size})")
    stops = [t for t in params.stop_token_ids if t >= vocab_size]
    if stops:
        raise RequestError("stop_token_ids", f"ids {stops[:5]} outside the vocabulary [0, {vocab_size})")
    if ids.size + params.max_new_tokens > max_context:
        raise RequestError(
            "max_new_tokens",
            f"prompt of {ids.size} tokens + {params.max_new_tokens} new exceeds the context of {max_context} "
            "tokens; shorten the prompt or lower max_new_tokens",
        )
    return CheckedPrompt(ids.tolist(), params, vocab_size, max_context)


@dataclass(frozen=True)
class CacheHit:
    """What a request's first admission found in the cache (tokens of the match per component)."""

    cached_tokens: int
    """Tokens valid for every component: prefill started there."""
    full: int
    """Page-aligned full-KV match."""
    window: int
    """Longest match valid for full KV and every window pool."""
    checkpoint: int
    """Deepest state checkpoint on the full-KV match (0 without recurrent layers)."""
    host: int = 0
    """Tokens of ``cached_tokens`` whose full KV came back from host memory (restored at admission)."""
    storage: int = 0
    """Tokens of ``cached_tokens`` whose full KV came back from the store (the Mooncake Store)."""

    @classmethod
    def of(cls, m: MatchResult, details: dict[str, int] | None = None) -> CacheHit:
        """The device ``m``'s hit; with ``details`` (``EngineTiers.details``) a hit restored
        beyond it from the tiers below."""
        if details is None:
            return cls(m.length, m.full_length, m.window_length, m.checkpoint_length)
        total = sum(details.values())
        return cls(total, m.full_length, m.window_length, m.checkpoint_length, details["host"], details["storage"])

    @property
    def details(self) -> dict[str, int]:
        """``cached_tokens`` by where their full KV came from (the server's ``cached_tokens_details``)."""
        return {"device": self.cached_tokens - self.host - self.storage, "host": self.host, "storage": self.storage}


_NO_TOKENS = np.empty(0, dtype=np.int64)


@dataclass(eq=False)
class Request:
    """One request inside an engine: its tokens, its ``status``, and its KV (``kv``, held through ``RequestKV``)."""

    rid: Hashable
    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int] = frozenset()
    cache_salt: Hashable = None
    """Its prefix-cache namespace."""
    status: RequestStatus = RequestStatus.WAITING
    kv: KVHandle | None = None
    """Its pages, state slot and checkpoints (the one owner is ``KVManager``); None while it holds nothing."""
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    """Tokens whose K/V and state are in memory (``kv.seq_len`` after each forward)."""
    fresh: bool = True
    """Its state slot holds nothing yet: the next forward zeroes it."""
    wanted: tuple[int, ...] = ()
    """Page-aligned positions where a prefill chunk must end: the placement wants a checkpoint there."""
    hit: CacheHit | None = None
    """The first admission's hit (kept across retractions)."""
    cached_tokens: int = 0
    """Tokens taken from the cache over every admission."""
    fetched: Fetched | None = None
    """With tiers: the cross-tier hit planned while it waits (store reads under way)."""
    first: int | None = None
    """Decode role: its first token, chosen by the prefill engine, known before its KV arrived."""
    writers_gone: bool = False
    """Decode role: the receiver says no transfer can write its reserved KV any more (it may be freed)."""
    finish_reason: FinishReason | None = None
    error: str | None = None
    retractions: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token when params.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (params.prompt_logprobs)
    _ids: np.ndarray = field(default_factory=lambda: _NO_TOKENS, repr=False)
    _known: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def reuse(self) -> bool:
        """It may start from a prefix-cache hit (False: it computes its whole prompt, for the prompt's
        log-probabilities; what it computes is still cached for others)."""
        return self.params.prompt_logprobs is None

    def ids(self, end: int) -> np.ndarray:
        """``tokens[:end]`` as int64 ids: a view of a copy kept with the request, to which only
        tokens not seen before are converted (a request's tokens only grow, by appending).
        Never written below ``_known``: views handed out stay valid."""
        known = self._known
        if end > known:
            if end > self._ids.size:
                grown = np.empty(max(end, 2 * self._ids.size, 64), dtype=np.int64)
                grown[:known] = self._ids[:known]
                self._ids = grown
            self._ids[known:end] = self.tokens[known:end]
            self._known = end
        return self._ids[:end]
