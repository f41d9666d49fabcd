"""PDConfig: what a disaggregated server runs (model, layouts, transport, memory, timeouts, faults).

``check_layout`` proves, in the calling process and before any process starts, that every
prefill rank (PP x TP) and decode rank (TP) can be built and that every decode rank pairs
with every prefill rank for the transfer (same model, dtype, page size, pool ids, shapes:
``pair_entries``); a mismatch raises ``LayoutMismatch`` naming both sides and what to change.
It also checks the model directory as every rank will load it, from the checkpoint files'
headers only (``check_checkpoint``: a missing, truncated or foreign ``*.safetensors`` file, a
missing, unexpected or misshapen weight of any stage or TP part): a ``WeightError`` here, not a
worker's traceback after every process started. (Values, e.g. NaN weights, are read only by
the workers: one line, ``PDStartError``.)

``Fault`` entries are deliberate faults for tests and demos, applied by the router and the
workers with real signals and real timeouts (never simulated outcomes): each drill, what it
does and the ranks its ``rank`` names are in ``faults.py`` (``FAULTS``); ``check_faults`` asks
a fault which ranks it targets and never names a kind. ``check_transport`` refuses a
transport whose class cannot carry KV between processes (``Transport.cross_process``): each
rank is a process of its own.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.disagg.faults import Fault, Target
from hybridkv.engine.registry import engine_spec, text_config
from hybridkv.engine.tensor_parallel import SINGLE, TensorParallel
from hybridkv.engine.weights import check_safetensors, empty_model, read_config
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import Parallel, ShardSpec
from hybridkv.tiers import MooncakeMaster, StorageTier
from hybridkv.transfer import buffer_set_from_memory, pair_entries
from hybridkv.transfer.pairing import check_coverage, check_prefill_group
from hybridkv.transfer.transport import TRANSPORTS, transport_class

PD_ENGINE = EngineConfig(gpu_memory=8_000_000, max_context=256, store_memory=32 << 20)
"""A disaggregated server's engine defaults: 8 MB per process, a 256-token context (every rank sizes its
memory for it), a 32 MiB store segment per prefill rank; ``dataclasses.replace(PD_ENGINE, ...)`` changes some."""


@dataclass(frozen=True)
class PDConfig:
    model_dir: str  # config.json + *.safetensors
    prompts: tuple[tuple[int, ...], ...] = ()  # what run_pd serves; PDServer takes requests by submit
    max_new: int = 16
    prefill_pp: int = 2
    decode_tp: int = 2
    prefill_tp: int = 1
    transport: str = "shm"  # a name in transfer.transport.TRANSPORTS whose class is cross_process
    decode_page_size: int | None = None  # None: engine.page_size (another value is a layout mismatch: a fault test)
    timeout_s: float = 60.0  # per collective, per start-up, per prefill-side transfer
    transfer_timeout_s: float = 30.0  # decode side: reservation -> every stage's KV landed
    restarts: int = 1  # how often the router restarts a dead engine before reporting it lost
    faults: tuple[Fault, ...] = ()
    engine: EngineConfig = PD_ENGINE
    """Every rank's engine options: ``gpu_memory`` per process, ``max_context`` (required: every rank sizes its
    memory for it), the batch and step sizes (prefill and decode alike), ``dtype``; the prefix cache,
    ``checkpoints`` and the tiers (``host_memory`` and ``store_memory`` per rank; one ``store_master`` for
    all, started by the router when the store is mooncake and none is named) are the prefill side's."""

    @property
    def decode_page(self) -> int:
        return self.engine.page_size if self.decode_page_size is None else self.decode_page_size

    @property
    def max_context(self) -> int:
        """Every rank's context (``check_layout`` refuses an engine config without one)."""
        assert self.engine.max_context is not None
        return self.engine.max_context


@dataclass(frozen=True)
class WorkerArgs:
    """What every worker process of one engine epoch starts from: the server's config and this
    epoch's bootstrap name, bootstrap address and cluster key."""

    config: PDConfig
    engine: str  # this epoch's bootstrap name
    bootstrap: str
    key_hex: str
    shm_tokens: tuple[str, ...] = ()  # decode ranks over shm: each rank's arena token (the router unlinks them)


def check_layout(config: PDConfig) -> None:
    """Raise ``ValueError`` (a size to change) or ``LayoutMismatch`` (both sides named) unless every
    prefill and decode rank can be built and every decode rank pairs with every prefill rank."""
    if min(config.prefill_pp, config.prefill_tp, config.decode_tp, config.max_new) < 1:
        raise ValueError(
            f"a disaggregated server needs prefill_pp, prefill_tp, decode_tp and max_new >= 1, got "
            f"PP {config.prefill_pp} x TP {config.prefill_tp} -> TP {config.decode_tp}, max_new {config.max_new}"
        )
    if config.engine.max_context is None:
        raise ValueError("a disaggregated server needs engine.max_context: every rank sizes its memory for it")
    if isinstance(config.engine.store, StorageTier):
        raise ValueError("a disaggregated server's store is a name (none or mooncake): each rank builds its own client")
    check_transport(config)
    check_faults(config)
    hf_config = read_config(config.model_dir)
    spec = engine_spec(text_config(hf_config), config.engine.dtype)
    prefill_layout = Parallel(pp_size=config.prefill_pp, tp_size=config.prefill_tp)
    prefills = [
        buffer_set_from_memory(_memory(ShardSpec(spec, prefill_layout, stage, tp), config.engine.page_size, config))
        for stage in range(config.prefill_pp)
        for tp in range(config.prefill_tp)
    ]
    check_prefill_group(prefills)
    for rank in range(config.decode_tp):
        shard = ShardSpec(spec, Parallel(tp_size=config.decode_tp), 0, rank)
        decode = buffer_set_from_memory(_memory(shard, config.decode_page, config))
        check_coverage(decode, prefills)
        for prefill in prefills:
            pair_entries(prefill, decode)
    check_checkpoint(config, hf_config)


def check_checkpoint(config: PDConfig, hf_config: Any) -> None:
    """``WeightError`` (naming the file or weights) unless every prefill rank (PP stage x TP rank) and
    every decode rank (TP rank) finds its part of the checkpoint, from the files' headers alone: the
    engine's model of each shard is built on the meta device and matched against what the files
    declare (``check_safetensors``); no tensor data is read, nothing the size of the model allocated."""
    spec = engine_spec(text_config(hf_config), config.engine.dtype)
    layout = Parallel(pp_size=config.prefill_pp, tp_size=config.prefill_tp)
    shards: set[tuple[tuple[int, int] | None, int, int]] = {
        (ShardSpec(spec, layout, s, t).bounds, config.prefill_tp, t)
        for s in range(config.prefill_pp)
        for t in range(config.prefill_tp)
    }
    shards |= {(None, config.decode_tp, t) for t in range(config.decode_tp)}
    for layers, tp_size, tp_rank in sorted(shards, key=str):
        tp = TensorParallel(tp_size, tp_rank, _never_reduce) if tp_size > 1 else SINGLE
        check_safetensors(config.model_dir, empty_model(hf_config, layers, tp))


def _never_reduce(partial: torch.Tensor) -> torch.Tensor:
    raise AssertionError("a model built to check a checkpoint never runs")


def check_transport(config: PDConfig) -> None:
    """Raise ``ValueError`` naming the transport unless the registry knows it (``UnknownName`` names the known
    ones) and its class carries KV between processes, as the ranks of a disaggregated server are."""
    if not transport_class(config.transport).cross_process:
        crossing = [name for name, kind in TRANSPORTS.items() if kind.cross_process]
        raise ValueError(
            f"transport {config.transport!r} moves KV only inside one process, and each rank of a disaggregated "
            f"server is a process of its own; use one of {', '.join(crossing)}"
        )


def check_faults(config: PDConfig) -> None:
    """Raise ``ValueError`` naming the fault and the allowed range unless every fault's rank exists among the ranks
    its drill targets (a PP stage < ``prefill_pp``, a decode TP rank < ``decode_tp``, or none) and no two faults
    hit the same request (the router applies one fault per request)."""
    counts = {Target.PREFILL_STAGE: config.prefill_pp, Target.DECODE_RANK: config.decode_tp}
    seen: set[int] = set()
    for f in config.faults:
        size = counts.get(f.target)
        if size is not None and f.rank >= size:
            what = f.target.value
            raise ValueError(
                f"fault '{f.kind}' on request {f.request}: rank {f.rank} does not exist with {what} {size}; "
                f"use a rank in 0..{size - 1} or raise {what}"
            )
        if f.request in seen:
            raise ValueError(f"two faults hit request {f.request}; give each request at most one fault")
        seen.add(f.request)


def with_store_master(config: PDConfig) -> tuple[PDConfig, MooncakeMaster | None]:
    """``config`` with its store's master named: one started on 127.0.0.1 (the caller stops it)
    when the config asks for the Mooncake Store and names none. Every prefill rank of every epoch
    is a client of this one master."""
    engine = config.engine
    if engine.store_master is not None:
        host, _, port = engine.store_master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5.0).close()
        except (OSError, ValueError) as exc:
            why = f"no mooncake_master answers at {engine.store_master} ({exc})"
            raise ValueError(f"{why}: start one there, or drop store_master to have the router start one") from None
    if engine.store != "mooncake" or engine.store_master is not None:
        return config, None
    master = MooncakeMaster().start()
    return dataclasses.replace(config, engine=dataclasses.replace(engine, store_master=master.address)), master


def _memory(shard: ShardSpec, page_size: int, config: PDConfig) -> UnifiedMemory:
    e = config.engine
    return UnifiedMemory.create(
        shard, e.memory_bytes, page_size=page_size, max_context=config.max_context, chunk_tokens=e.chunk_size
    )
