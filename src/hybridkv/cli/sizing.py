"""One sizing story for every command that builds an engine (``generate``, ``serve-pd``, ``serve``,
``bench engine|pd|serve``): the same options with the same defaults, and one rule.

Options: ``--gpu-memory`` (per process), ``--max-context``, ``--page-size``, ``--chunk-size``
(``GPU_MEMORY``, ``MAX_CONTEXT``, ``PAGE_SIZE``, ``CHUNK_SIZE``); the batching options of the same
commands (``--max-running``, ``--max-step-tokens``) are ``cli.params``'.

The rule (``size``):
- the max context is ``--max-context`` when given (at most the model's maximum:
  ``max_position_embeddings``, Kimi's ``model_max_length``); else the work's when the command
  knows it (its longest prompt + ``--max-new-tokens``), else ``DEFAULT_CONTEXT``, either capped by
  the model's maximum (a prompt too long for it is then refused by the command, naming it);
- the budget is ``--gpu-memory`` when given; else ``DEFAULT_GPU_MEMORY``, doubled until one
  request of the max context fits on every rank (the memory plan's feasibility floor), so the
  default always fits the context it is sized for;
- the device must hold the budget of one process (``memory.host.check_fits``; ``device``: the
  host's memory for the CPU engines every command but ``bench engine --device cuda`` runs).
Every command prints the outcome once, at start, as one line on stderr (``Sizing.line``), e.g.
``hybridkv generate: max context 1,234 tokens (longest prompt 1,218 + 16 new); --gpu-memory 256.00 MiB
per process (one 1,234-token request needs 2.25 MiB)``.

The library (memory plans, shards) is imported inside the functions: the commands declare these
options before any torch import.

Refused with ``typer.BadParameter`` (one ``error:`` line, exit 2): a ``--max-context`` above the
model's maximum, a ``--gpu-memory`` below what one request of the max context needs (the memory
plan's message: the numbers and what to change), a budget the host cannot hold (checked before
anything is allocated).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import typer

from hybridkv.cli.params import MAX_DEVICE_BYTES, byte_size
from hybridkv.units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from hybridkv.engine.config import EngineConfig
    from hybridkv.memory.sizing import MemoryPlan
    from hybridkv.spec import ModelSpec, ShardSpec

DEFAULT_GPU_MEMORY = 256 * 2**20
DEFAULT_CONTEXT = 4096

GPU_MEMORY = typer.Option(
    None,
    "--gpu-memory",
    callback=byte_size,
    help=f"K/V + state memory per process (default: {format_bytes(DEFAULT_GPU_MEMORY)}, more if one request of "
    "the max context needs it); a step's gathered keys take up to a quarter more.",
)
MAX_CONTEXT = typer.Option(
    None,
    "--max-context",
    min=2,
    help=f"Prompt + new tokens, at most (default: the longest prompt + --max-new-tokens when known, else "
    f"{DEFAULT_CONTEXT}; never above the model's maximum).",
)
PAGE = 16
PAGE_SIZE = typer.Option(PAGE, "--page-size", min=1, help="Tokens per KV page.")
CHUNK = 64
CHUNK_SIZE = typer.Option(CHUNK, "--chunk-size", min=1, help="Prefill chunk, in tokens.")
SERVE_STEP_TOKENS = 2048
"""``hybridkv serve``'s step budget for one engine, vLLM's CPU server's (``max_num_batched_tokens`` 2048); a
request's prefill chunk is bounded by it alone. Measured (64 prompts of 144 tokens at once, 16 new each,
widened tiny models, bf16, one thread; chunk 64 / 1024-token steps -> 2048 / 2048): Gemma 3 wall 1.12x, TTFT
p50 1.37x; Qwen3-Next 1.35x, 1.77x (fewer, fuller steps; a state checkpoint every chunk, not every 64 tokens)."""
SERVE_CHUNK_SIZE = typer.Option(
    None,
    "--chunk-size",
    min=1,
    help=f"Prefill chunk, in tokens (default: {SERVE_STEP_TOKENS}, the step budget; {CHUNK} with --disaggregated).",
)


@dataclass(frozen=True)
class Layout:
    """The processes an engine runs as: ``Layout()`` one process; a disaggregated server prefill PP x TP
    (page size ``page_size``) and decode TP (``decode_page_size``)."""

    prefill_pp: int = 1
    prefill_tp: int = 1
    decode_tp: int = 0  # 0: no separate decode engine
    decode_page_size: int | None = None

    def shards(self, spec: ModelSpec, page_size: int) -> list[tuple[ShardSpec, int]]:
        """Every process's shard and page size."""
        from hybridkv.spec import Parallel, ShardSpec

        prefill = Parallel(pp_size=self.prefill_pp, tp_size=self.prefill_tp)
        out = [
            (ShardSpec(spec, prefill, s, t), page_size) for s in range(self.prefill_pp) for t in range(self.prefill_tp)
        ]
        decode = Parallel(tp_size=max(1, self.decode_tp))
        out += [(ShardSpec(spec, decode, 0, t), self.decode_page_size or page_size) for t in range(self.decode_tp)]
        return out


@dataclass(frozen=True)
class Sizing:
    max_context: int
    gpu_memory: int  # bytes per process
    line: str  # what the command prints at start
    page_size: int
    chunk_size: int

    def announce(self) -> None:
        print(self.line, file=sys.stderr, flush=True)

    def engine(self, **fields: Any) -> EngineConfig:
        """The ``EngineConfig`` of this sizing (budget, context, page and chunk) with the command's other
        ``fields`` (batching, dtype, cache, tiers)."""
        from hybridkv.engine.config import EngineConfig

        return EngineConfig(
            gpu_memory=self.gpu_memory,
            max_context=self.max_context,
            page_size=self.page_size,
            chunk_size=self.chunk_size,
            **fields,
        )


def size(
    command: str,
    spec: ModelSpec,
    *,
    prompt_lengths: Sequence[int] | None = None,
    max_new_tokens: int = 0,
    max_context: int | None = None,
    gpu_memory: str | None = None,
    page_size: int = 16,
    chunk_size: int = 64,
    layout: Layout | None = None,
    device: str = "cpu",
) -> Sizing:
    """The max context and per-process budget of ``command`` serving ``spec`` on ``device`` (the module's
    rule); ``prompt_lengths``: the work's prompts when the command knows them."""
    from hybridkv.memory import LayoutError

    model_max = spec.max_context
    if max_context is not None:
        if max_context > model_max:
            raise typer.BadParameter(
                f"{max_context} is above the model's maximum context of {model_max:,} tokens; give at most {model_max}",
                param_hint="--max-context",
            )
        context, why = max_context, "--max-context"
    elif prompt_lengths:
        longest = max(prompt_lengths)
        context = min(longest + max_new_tokens, model_max)  # a longer prompt is refused by name (its line)
        why = f"longest prompt {longest:,} + {max_new_tokens:,} new" + (", capped" if context == model_max else "")
    else:
        context = min(DEFAULT_CONTEXT, model_max)
        why = f"the default, {DEFAULT_CONTEXT:,}" if context == DEFAULT_CONTEXT else "the model's maximum"
    shards = (layout or Layout()).shards(spec, page_size)
    plans: list[MemoryPlan] | None
    if gpu_memory is not None:
        budget = parse_bytes(gpu_memory)
        _check_fits(budget, f"--gpu-memory {gpu_memory}", device)
        try:
            plans = [_plan(shard, budget, page, context, chunk_size) for shard, page in shards]
        except LayoutError as exc:
            raise typer.BadParameter(str(exc), param_hint="--gpu-memory") from None
        given = "--gpu-memory"
    else:
        budget = DEFAULT_GPU_MEMORY
        while (plans := _feasible(shards, budget, context, chunk_size)) is None:
            budget *= 2
            if budget > MAX_DEVICE_BYTES:
                raise typer.BadParameter(
                    f"one request of {context:,} tokens needs more than {format_bytes(MAX_DEVICE_BYTES)} per process; "
                    "lower --max-context",
                    param_hint="--max-context",
                )
        given = "--gpu-memory (default)" if budget == DEFAULT_GPU_MEMORY else "--gpu-memory (sized)"
        _check_fits(budget, f"{given} {format_bytes(budget)}", device)
    assert plans is not None
    need = max(_need(plan) for plan in plans)
    per = " per process" if len(shards) > 1 else ""
    line = (
        f"hybridkv {command}: max context {context:,} tokens ({why}, page {page_size}, chunk {chunk_size}); "
        f"{given} {format_bytes(budget)}{per} (one {context:,}-token request needs {format_bytes(need)})"
    )
    return Sizing(context, budget, line, page_size, chunk_size)


def _check_fits(budget: int, what: str, device: str) -> None:
    from hybridkv.memory import LayoutError
    from hybridkv.memory.host import check_fits

    try:
        check_fits(budget, device, what, "give a smaller --gpu-memory or --max-context")
    except LayoutError as exc:
        raise typer.BadParameter(str(exc), param_hint="--gpu-memory") from None


def _plan(shard: ShardSpec, budget: int, page_size: int, context: int, chunk: int) -> MemoryPlan:
    from hybridkv.memory import MemoryHints, plan_memory

    return plan_memory(shard, budget, MemoryHints(page_size=page_size, max_context=context, chunk_tokens=chunk))


def _feasible(shards: list[tuple[ShardSpec, int]], budget: int, context: int, chunk: int) -> list[MemoryPlan] | None:
    from hybridkv.memory import LayoutError

    try:
        return [_plan(shard, budget, page, context, chunk) for shard, page in shards]
    except LayoutError:
        return None


def _need(plan: MemoryPlan) -> int:
    """The bytes one worst-case request takes in ``plan`` (its slabs and the sink)."""
    return plan.sink_bytes + sum(plan.worst_case_slabs().values()) * plan.slab_bytes
