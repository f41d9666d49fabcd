"""Option types shared by the commands: validated at the edge, before any work starts.

Invariants: every callback returns a value the library accepts or raises ``typer.BadParameter``
naming the option, the value and the accepted range (the CLI's error path prints it as one
``error:`` line, exit 2). Integer ranges use typer's own ``min=``/``max=``. Names and sizes are
checked without torch (``hybridkv.catalogue``, ``hybridkv.units``); a callback that needs the
library imports it when it runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import typer

from hybridkv.catalogue import PresetError, TransportName, resolve_preset
from hybridkv.engine.random_models import tiny_names
from hybridkv.units import format_bytes, parse_bytes

MAX_DEVICE_BYTES = 2**50  # 1 PiB: far above any device, low enough that page tables fit in host memory
DTYPES = ("float32", "bfloat16", "float16")


def dtype_option(value: str) -> str:
    """``--dtype``: the weights', activations' and K/V's dtype (recurrent state stays as the config says)."""
    if value not in DTYPES:
        raise typer.BadParameter(f"{value!r} is not a dtype this engine serves; choose one of {', '.join(DTYPES)}")
    return value


DTYPE = typer.Option(
    "float32",
    "--dtype",
    callback=dtype_option,
    help=f"Weights, activations and K/V in this dtype ({', '.join(DTYPES)}); recurrent state as the config says.",
)


def byte_size(value: str | None) -> str | None:
    """A byte budget such as ``80GiB``: positive and at most ``MAX_DEVICE_BYTES``."""
    if value is None:
        return None
    try:
        size = parse_bytes(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if not 0 < size <= MAX_DEVICE_BYTES:
        raise typer.BadParameter(f"{value!r} must be more than 0 B and at most {format_bytes(MAX_DEVICE_BYTES)}")
    return value


def positive_finite(value: float | None) -> float | None:
    """A rate or a duration: a finite number above 0 (``nan`` and ``inf`` are refused)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} must be a finite number above 0")
    return value


TRANSPORT_CHOICES = " or ".join(name.value for name in TransportName)
"""What every ``--transport`` help lists: the registry's names (``TransportName``, torch-free)."""


def transport_option(value: str) -> str:
    """A transport name the registry knows (``typer.BadParameter`` naming the known ones)."""
    known = [name.value for name in TransportName]
    if value not in known:
        raise typer.BadParameter(f"unknown transport {value!r}; known: {', '.join(known)}")
    return value


def device_option(allowed: tuple[str, ...]) -> Callable[[str], str]:
    """A ``--device`` callback: one of ``allowed`` device types (``cuda:N`` for ``cuda``), and
    CUDA only where torch sees it."""

    def check(value: str) -> str:
        kind, colon, index = value.partition(":")
        if kind not in allowed or (colon and not (kind == "cuda" and index.isdigit())):
            raise typer.BadParameter(f"{value!r} is not a device here; use one of {', '.join(allowed)}")
        if kind == "cuda":
            import torch  # only here: every other device is known without loading torch

            if not torch.cuda.is_available():
                raise typer.BadParameter(f"{value!r}: torch sees no CUDA device on this machine")
        return value

    return check


def preset(value: str | None) -> str | None:
    """A model preset's name (``hybridkv presets``; a unique part of one will do), for ``--model``."""
    if value is not None:
        try:
            resolve_preset(value)
        except PresetError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def random_model(value: str | None) -> str | None:
    """A tiny random model's name (``hybridkv.engine.random_models``), for ``--random``."""
    if value is not None and value not in tiny_names():
        raise typer.BadParameter(f"{value!r} is not a tiny random model; choose one of {', '.join(tiny_names())}")
    return value


CHECKPOINTS_HELP = (
    "Where requests store recurrent-state checkpoints: none, or a comma list of interval:N, prompt-aligned[:K], "
    "branch, end (default: interval at the chunk size, prompt-aligned, branch, end)."
)


def engine_checkpoints(value: str | None, chunk_size: int, page_size: int) -> str:
    """``--checkpoints`` for an engine: the given placement, or the engine's default for this chunk and page
    size; ``typer.BadParameter`` naming the bad part."""
    from hybridkv.cache.placement import CheckpointPlacement, PlacementError, engine_default

    placement = value or engine_default(chunk_size, page_size)
    try:
        CheckpointPlacement.parse(placement, page_size)
    except PlacementError as exc:
        raise typer.BadParameter(str(exc), param_hint="--checkpoints") from None
    return placement


# --- sampling: one set of options for every command that serves requests ------------------------


def sampling_value(field: str) -> Callable[[Any], Any]:
    """A callback that checks one sampling option as the engine does (``SamplingParams``: ranges, NaN)."""

    def check(value: Any) -> Any:
        from hybridkv.engine.sched.request import RequestError, SamplingParams  # torch-free

        try:
            SamplingParams(**{field: value})
        except RequestError as exc:
            raise typer.BadParameter(str(exc)) from None
        return value

    return check


MAX_RUNNING = typer.Option(64, "--max-running", min=1, help="Requests in one engine step, at most.")
MAX_STEP_TOKENS = typer.Option(
    None,
    "--max-step-tokens",
    min=1,
    help="Prompt tokens one engine step computes, at most; its decodes ride on top (default: 16 x --chunk-size).",
)
TEMPERATURE = typer.Option(
    0.0, "--temperature", callback=sampling_value("temperature"), help="0 (or below 1e-5) is greedy."
)
TOP_P = typer.Option(
    1.0, "--top-p", callback=sampling_value("top_p"), help="Nucleus sampling: keep the most likely tokens up to p."
)
TOP_K = typer.Option(0, "--top-k", min=0, help="Keep the k most likely tokens (0: all).")
SEED = typer.Option(0, "--seed", min=0, help="Sampling seed (request i draws with seed + i).")
STOP_TOKEN_IDS = typer.Option(
    None, "--stop-token-id", min=0, help="A token id that ends a request (repeatable), besides the model's EOS."
)
IGNORE_EOS = typer.Option(False, "--ignore-eos", help="Do not end requests at the model's EOS token.")


def request_params(
    count: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    stop_token_ids: list[int] | None,
    ignore_eos: bool,
) -> list[Any]:
    """One ``SamplingParams`` per request (request ``i`` seeded ``seed + i``); ``typer.BadParameter`` naming
    the option whose value the engine refuses."""
    from hybridkv.engine.sched.request import RequestError, SamplingParams

    try:
        return [
            SamplingParams(max_new_tokens, temperature, top_p, top_k, seed + i, tuple(stop_token_ids or ()), ignore_eos)
            for i in range(count)
        ]
    except RequestError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"--{exc.field.replace('_', '-')}") from None


# --- tiers below the device: one set of options for every command that runs an engine ------------

HOST_MEMORY = typer.Option(
    None, "--host-memory", callback=byte_size, help="Host memory below the device for evicted KV and state (e.g. 4GiB)."
)
STORE = typer.Option(
    "none",
    "--store",
    help="A store below host memory: none or mooncake (the Mooncake Store; a master is started on 127.0.0.1 unless "
    "--store-master names one).",
)
STORE_MASTER = typer.Option(None, "--store-master", help="host:port of an existing mooncake_master (--store mooncake).")
STORE_MEMORY = typer.Option(
    "256MiB", "--store-memory", callback=byte_size, help="Memory this process mounts into the Mooncake Store."
)


def tier_options(
    host_memory: str | None, store: str, store_master: str | None, store_memory: str, prefix_cache: bool = True
) -> dict[str, Any]:
    """The engine's tier fields (``EngineConfig(host_memory=, store=, ...)``); ``typer.BadParameter``
    naming an option that is malformed or does not fit the others."""
    if not prefix_cache and (host_memory is not None or store != "none"):
        raise typer.BadParameter("--host-memory and --store hold what the prefix cache evicts: drop --no-prefix-cache")
    if store not in ("none", "mooncake"):
        raise typer.BadParameter(f"--store takes none or mooncake, got {store!r}", param_hint="--store")
    if store_master is not None:
        host, _, port = store_master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise typer.BadParameter(
                f"--store-master takes host:port of a mooncake_master, got {store_master!r}",
                param_hint="--store-master",
            )
        if store != "mooncake":
            raise typer.BadParameter("--store-master names a mooncake_master: it needs --store mooncake")
    size = parse_bytes(store_memory)
    if store == "mooncake" and size < 16 << 20:
        raise typer.BadParameter(f"--store-memory must be at least 16MiB (Mooncake's floor), got {store_memory}")
    return {"host_memory": host_memory, "store": store, "store_master": store_master, "store_memory": size}
