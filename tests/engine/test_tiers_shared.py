"""Two engine processes share one Mooncake master: the second serves the first's prefix from the
store (exact), but only where their shard keys agree: another page size or dtype never reads
the first's bytes (no hit, still exact)."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.tiers import MooncakeMaster
from tests.engine.harness import hf_model, hf_reference
from tests.engine.test_tiers import NEW, A, engine, run, turn

NAME = "tiny-qwen3-next"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peer(mooncake_master: MooncakeMaster) -> Iterator[tuple[str, dict[str, object]]]:
    """The first engine, in its own process: it served ``A`` and evicted it into the store."""
    salt = uuid.uuid4().hex
    args = [mooncake_master.address, NAME, salt, "4", json.dumps(A)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.tier_peer", *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line, f"the peer engine did not answer (exit code {proc.poll()})"
        yield salt, json.loads(line)
        proc.stdin.close()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_a_second_engine_serves_the_first_ones_prefix_from_the_store(peer, mooncake_master):
    salt, first = peer
    assert first["written"] and first["output_ids"] == hf_reference(NAME, tuple(A), NEW)[0]
    e = engine(NAME, store="mooncake", store_master=mooncake_master.address, store_memory="32MiB")
    try:
        out = run(e, NAME, turn(1), salt)
        assert out.cached_tokens_details == {"device": 0, "host": 0, "storage": 40}
    finally:
        e.close()


def test_another_page_size_never_reads_the_first_engines_bytes(peer, mooncake_master):
    salt, _ = peer
    hf = hf_model(NAME)
    e = Engine(
        hf.config,
        hf,
        EngineConfig(
            gpu_memory=400_000,
            page_size=8,
            chunk_size=8,
            max_context=96,
            store="mooncake",
            store_master=mooncake_master.address,
            store_memory="32MiB",
        ),
    )
    try:
        out = run(e, NAME, turn(1), salt)
        assert out.cached_tokens == 0
        assert e.tiers is not None and not e.tiers.hierarchy.counters.misses
    finally:
        e.close()


def test_another_dtype_never_reads_the_first_engines_bytes(peer, mooncake_master):
    salt, _ = peer
    hf = hf_model(NAME)
    kw: dict[str, Any] = dict(gpu_memory=400_000, page_size=4, chunk_size=8, max_context=96, dtype=torch.bfloat16)
    plain = Engine(hf.config, hf, EngineConfig(**kw))
    e = Engine(
        hf.config, hf, EngineConfig(store="mooncake", store_master=mooncake_master.address, store_memory="32MiB", **kw)
    )
    try:
        ids = turn(1)
        out = e.generate([ids], NEW, cache_salts=[salt])[0]
        assert out.cached_tokens == 0
        assert e.tiers is not None and not e.tiers.hierarchy.counters.misses  # not even a wrong-size object
        assert out.output_ids == plain.generate([ids], NEW, cache_salts=[salt])[0].output_ids
    finally:
        e.close()
