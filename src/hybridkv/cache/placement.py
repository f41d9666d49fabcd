"""Checkpoint placement: where a request stores its recurrent state for later hits, one policy.

A hit on a model with recurrent layers is valid only where a state checkpoint sits exactly
at its end (``rules.CheckpointRule``), and a running request has its state only between two
forwards: a checkpoint at position ``p`` means prefill ends a chunk at ``p`` and copies the
state there. The cache needs none of them for correctness; every one is an optimisation
whose bytes (one state slot) count against the same memory budget as everything else, and
which the eviction policy weighs like any cached value (``policies.CostAware``: FLOPs to
recompute back to the previous checkpoint per byte held).

A placement is parsed from a spec string: ``none``, or a comma list of parts

- ``interval:N``: every multiple of ``N`` tokens inside the prompt (SGLang / vLLM style);
- ``prompt-aligned[:K]``: the prompt's end rounded down to ``K`` tokens (default: the page);
- ``branch``: where the request's tokens leave the cached full KV (``MatchResult.checkpoint_at``:
  the tree branches, or its cached path ends, at ``p`` with no usable checkpoint there), so
  the next request sharing that prefix hits there (Marconi, MLSys 2025); and where a waiting
  prompt leaves one still in prefill (``branch_off``: the scheduler adds it to that one's positions);
- ``end``: the finished sequence's end rounded down to the page (a later turn that
  continues the conversation hits there).

``N`` and ``K`` must be positive multiples of the page size. ``DEFAULT`` is what the
replay took before placement was a policy of its own: the prompt end (page-aligned), the
branch point and the sequence end. The engine adds its page-aligned chunk ends
(``engine_default``), as it did before.

Invariants: ``prefill`` returns sorted, distinct, page-aligned positions ``p`` with
``computed < p <= prompt_len``; ``at_finish`` a page-aligned position past the cached
part, or None. A placement is immutable and holds no memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.registry import Registry

NONE = "none"
DEFAULT = "prompt-aligned,branch,end"
"""Today's placement: the prompt end and the sequence end (page-aligned), and the branch point."""


def engine_default(chunk_size: int, page_size: int) -> str:
    """``DEFAULT`` plus a checkpoint every chunk (rounded down to whole pages): a request that
    arrives while an earlier one sharing its prefix is still in prefill hits the chunks that one
    finished. Measured (``hybridkv bench engine``, 32 requests, tiny Qwen3-Next, chunk 64): prefix
    hit rate 0.39 with it vs 0.30 with ``DEFAULT`` alone, at the same speed."""
    every = chunk_size // page_size * page_size
    return f"interval:{every},{DEFAULT}" if every else DEFAULT


class PlacementError(ValueError):
    """A placement spec that does not parse; the message names the part and what is accepted."""


@dataclass(frozen=True)
class Interval:
    every: int

    def positions(self, branch_at: int | None, prompt_len: int, computed: int) -> range:
        return range((computed // self.every + 1) * self.every, prompt_len + 1, self.every)


@dataclass(frozen=True)
class PromptAligned:
    unit: int

    def positions(self, branch_at: int | None, prompt_len: int, computed: int) -> tuple[int, ...]:
        return (prompt_len // self.unit * self.unit,)


@dataclass(frozen=True)
class Branch:
    def positions(self, branch_at: int | None, prompt_len: int, computed: int) -> tuple[int, ...]:
        return () if branch_at is None else (branch_at,)


@dataclass(frozen=True)
class End:
    """Taken at finish (``CheckpointPlacement.at_finish``), not during prefill."""

    def positions(self, branch_at: int | None, prompt_len: int, computed: int) -> tuple[int, ...]:
        return ()


Part = Interval | PromptAligned | Branch | End


def _unit(name: str, arg: str | None, page_size: int, default: int | None) -> int:
    if arg is None:
        if default is None:
            raise PlacementError(f"checkpoint placement {name!r} needs a token count: {name}:N")
        return default
    try:
        value = int(arg)
    except ValueError:
        raise PlacementError(f"checkpoint placement {name}:{arg}: {arg!r} is not a token count") from None
    if value <= 0 or value % page_size:
        raise PlacementError(
            f"checkpoint placement {name}:{value}: the token count must be a positive multiple of the "
            f"page size {page_size} (checkpoints sit at page boundaries); e.g. {name}:{page_size * 32}"
        )
    return value


def _no_arg(name: str, part: Part) -> Callable[[str | None, int], Part]:
    def make(arg: str | None, page_size: int) -> Part:
        if arg is not None:
            raise PlacementError(f"checkpoint placement {name!r} takes no argument, got {name}:{arg}")
        return part

    return make


PLACEMENTS = Registry[Callable[[str | None, int], Part]]("checkpoint placement")
"""Each placement part by name: (its argument or None, the page size) -> the part."""
PLACEMENTS.add("interval", lambda arg, ps: Interval(_unit("interval", arg, ps, None)))
PLACEMENTS.add("prompt-aligned", lambda arg, ps: PromptAligned(_unit("prompt-aligned", arg, ps, ps)))
PLACEMENTS.add("branch", _no_arg("branch", Branch()))
PLACEMENTS.add("end", _no_arg("end", End()))


@dataclass(frozen=True)
class CheckpointPlacement:
    spec: str
    """The spec it was parsed from, normalised (``none`` or the parts joined by commas)."""
    parts: tuple[Part, ...]
    page_size: int

    @classmethod
    def parse(cls, spec: str, page_size: int) -> CheckpointPlacement:
        if not isinstance(spec, str):
            raise PlacementError(f"a checkpoint placement is a spec string, got {type(spec).__name__} {spec!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise PlacementError(f"checkpoint placement: page size must be a positive int, got {page_size!r}")
        names = [p.strip() for p in spec.split(",")]
        if names == [NONE]:
            return cls(NONE, (), page_size)
        parts: list[Part] = []
        for text in names:
            name, sep, arg = text.partition(":")
            make = PLACEMENTS.get(name.strip())
            if make is None or (sep and not arg.strip()):
                raise PlacementError(
                    f"unknown checkpoint placement {text!r} in {spec!r}; use 'none' or a comma list of "
                    "interval:N, prompt-aligned[:K], branch, end (N, K multiples of the page size)"
                )
            part = make(arg.strip() if sep else None, page_size)
            if part in parts:
                raise PlacementError(f"checkpoint placement {text!r} is given twice in {spec!r}")
            parts.append(part)
        return cls(",".join(names), tuple(parts), page_size)

    @property
    def at_end(self) -> bool:
        return any(isinstance(p, End) for p in self.parts)

    def branch_off(self, shared: int) -> int | None:
        """Where a prompt sharing its first ``shared`` tokens with another one still in prefill branches off it,
        rounded down to the page, when this placement stores branch points (``branch``): the one in prefill
        stores its state there, so the other hits there instead of computing the prefix again. None without
        ``branch`` or under a page."""
        at = shared - shared % self.page_size
        return at if at and any(isinstance(p, Branch) for p in self.parts) else None

    def prefill(self, branch_at: int | None, prompt_len: int, computed: int) -> tuple[int, ...]:
        """Positions in ``(computed, prompt_len]`` where prefill must end a chunk and store the
        state, for a request whose hit's full KV ends at ``branch_at`` (None: at the hit)."""
        wanted = {p for part in self.parts for p in part.positions(branch_at, prompt_len, computed)}
        return tuple(sorted(p for p in wanted if computed < p <= prompt_len))

    def at_finish(self, seq_len: int, cached: int) -> int | None:
        """The position to checkpoint when a request of ``seq_len`` tokens finishes (its first
        ``cached`` tokens being the cache's), or None."""
        if not self.at_end:
            return None
        end = seq_len - seq_len % self.page_size
        return end if end > cached else None
