"""Tiers below the prefill ranks of a disaggregated server: host memory and the Mooncake Store, token-exact.

One server ((PP 2, TP 1) -> (TP 1), Qwen3-Next: full attention on one stage's layers, GDN state on
both) with host memory and the Mooncake Store below every prefill rank, on a master its router
starts: a prompt served, the prefill caches emptied (written back to host memory), the same prefix
comes back from host memory; host memory emptied too (into the store), it comes back from the
store; every time the tokens are transformers'. Shard keys across processes, on that master: a
server of another layout ((PP 1, TP 2) -> (TP 1)) reads nothing of the first's prefix (hit 0,
exact) and stores its own; a second server of the TP 2 layout (``serve-pd``) serves that prefix
from the store (hit > 0, exact); the first server (PP 2) and a single-process engine (TP 1, PP 1)
read nothing of the TP 2 objects (hit 0, no miss: their keys never name the TP 2 shards'
objects, exact). Stage 1's stored objects damaged through the store's API: stage 1 misses, stage
0 falls back with it, the request recomputes (exact). The router's master SIGKILLed with a prefix
in the store: every rank's store tier goes down, requests go on from device and host memory
(exact, in bounded time), write-backs to the store are refused; the master restarted on its ports,
every rank's store comes back and serves a prefix again; the same once more over HTTP (``PDBackend``
under ``HttpServer``, as ``serve --disaggregated`` runs it), with ``/metrics`` saying down, then up.
Bad tier options of ``serve-pd``: one error line. The router's master, the workers: nothing outlives
the servers.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

from hybridkv.cli import main
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.disagg import FINISHED, PD_ENGINE, PDConfig, PDServer
from hybridkv.engine.engine import Engine
from hybridkv.engine.registry import engine_spec, text_config
from hybridkv.engine.sched.request import Outcome, SamplingParams
from hybridkv.engine.weights import read_config
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import Parallel, ShardSpec
from hybridkv.tiers import KeySpace, MooncakeStoreTier
from hybridkv.tiers.framing import HEADER
from tests.engine.disagg.test_disagg import gone
from tests.engine.harness import hf_model, hf_reference, prompt

NAME = "tiny-qwen3-next"
PAGE, CHUNK, NEW = 4, 8, 5
A = prompt(700, 41)
B = prompt(701, 41)  # the TP 2 servers' prefix


def turn(seed: int, keep: int = 40, base: list[int] = A) -> tuple[int, ...]:
    """A prompt sharing ``base``'s first ``keep`` tokens (10 pages), then leaving it."""
    tail = prompt(seed, 5)
    tail[0] = 3 if base[keep] != 3 else 4
    return tuple(base[:keep] + tail)


def config(path: Path, pp: int = 2, tp: int = 1, **tiers: object) -> PDConfig:
    return PDConfig(
        str(path),
        prefill_pp=pp,
        prefill_tp=tp,
        decode_tp=1,
        engine=replace(
            PD_ENGINE,
            page_size=PAGE,
            chunk_size=CHUNK,
            gpu_memory=3_000_000,
            max_context=96,
            store="mooncake",
            store_memory=32 << 20,
            **tiers,
        ),
    )


def served(server: PDServer, ids: tuple[int, ...], salt: str | None) -> Outcome:
    r = server.result(server.submit(ids, SamplingParams(NEW, ignore_eos=True), cache_salt=salt), timeout_s=120)
    assert r.pd is not None and r.pd.status == FINISHED, r.error
    assert r.output_ids == hf_reference(NAME, ids, NEW)[0], "tokens differ from transformers"
    assert r.cached_tokens_details is not None and sum(r.cached_tokens_details.values()) == r.cached_tokens
    return r


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(NAME)
    hf_model(NAME).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def first(model_dir: Path) -> Iterator[tuple[PDServer, str]]:
    """The first server (host memory and the store; its router starts the master) and its cache salt."""
    server = PDServer(config(model_dir, host_memory=8 << 20))
    try:
        yield server, uuid.uuid4().hex
    finally:
        server.close()
    assert server.master is not None and not server.master.running
    assert all(gone(pid) for pid in server.pids())


def test_an_evicted_prefix_comes_back_from_host_memory_then_from_the_store(first):
    server, salt = first
    assert server.master is not None and server.config.engine.store_master == server.master.address
    assert served(server, tuple(A), salt).cached_tokens == 0
    server.clear_cache()  # every prefill rank: device -> host memory
    host = served(server, turn(1), salt)
    assert host.cached_tokens_details == {"device": 0, "host": 40, "storage": 0}
    server.clear_cache(host=True)  # device -> host memory -> the Mooncake Store
    stored = served(server, turn(2), salt)
    assert stored.cached_tokens_details == {"device": 0, "host": 0, "storage": 40}
    again = served(server, turn(3), salt)  # restored pages and states are the devices' own again
    assert again.cached_tokens_details == {"device": 40, "host": 0, "storage": 0}
    m = server.metrics()
    assert (m["cached_tokens_host"], m["cached_tokens_storage"]) == (40, 40)
    ranks = m["prefill_tiers"]  # every prefill rank's own tier counters, as it last sent them
    assert sorted(ranks) == [f"prefill stage {s} TP rank 0 (epoch 0)" for s in (0, 1)]
    for f in ranks.values():  # each restored both hits: from its host memory, then from its store objects
        assert f["restored_requests"] == 2 and f["loaded_bytes"]["host"] > 0 and f["loaded_bytes"]["store"] > 0
        assert f["written_bytes"]["host"] > 0 and f["written_bytes"]["mooncake"] > 0 and f["store"]["up"]
    assert m["tier_written_bytes"] == dict(sum((Counter(f["written_bytes"]) for f in ranks.values()), Counter()))
    assert m["tier_loaded_bytes"]["store"] == sum(f["loaded_bytes"]["store"] for f in ranks.values())
    assert (m["tier_misses"], m["tier_fallbacks"], m["tier_store_ranks_down"]) == ({}, 0, 0)


def test_the_same_layout_shares_the_store_another_layout_reads_nothing(first, model_dir, tmp_path, capsys):
    """PP 2 stores A's prefix; a TP 2 server on the same master reads none of it and stores its own;
    a second TP 2 server (``serve-pd``) serves it from the store; PP 2 and a TP 1 engine read nothing of it."""
    server, _ = first
    salt = None  # serve-pd's prompts carry no cache salt (the first test's salt keeps its objects apart)
    assert served(server, tuple(A), salt).cached_tokens == 0
    server.clear_cache(host=True)  # A's pages and states of the PP 2 shards: in the store only
    master = server.master
    assert master is not None
    # the TP 2 server stays up while the others read: Mooncake keeps an object in its writer's mounted segment
    with PDServer(config(model_dir, pp=1, tp=2, store_master=master.address)) as tp2:
        assert served(tp2, turn(4), salt).cached_tokens == 0  # the PP 2 shards' objects of A: not its keys
        assert served(tp2, turn(5, base=B), salt).cached_tokens == 0
        tp2.clear_cache()  # no host tier: device -> the store, under the TP 2 shards' keys
        tp2.probe(timeout_s=60)  # answered after the clear (one inbox, one leader): the objects are written
        assert served(server, turn(6, base=B), salt).cached_tokens == 0  # PP 2: none of the TP 2 shards' B
        assert server.metrics()["tier_misses"] == {} == tp2.metrics()["tier_misses"]  # not looked up: no miss
        prompts = tmp_path / "p.jsonl"
        prompts.write_text(json.dumps({"prompt_ids": list(turn(7, base=B))}) + "\n")
        args = ["serve-pd", "--model", str(model_dir), "--prompts", str(prompts), "--prefill-pp", "1"]
        args += ["--prefill-tp", "2", "--decode-tp", "1", "--page-size", str(PAGE), "--chunk-size", str(CHUNK)]
        args += ["--max-new-tokens", str(NEW), "--ignore-eos", "--store", "mooncake", "--store-master", master.address]
        args += ["--store-memory", "32MiB", "--json"]
        # the second server of the TP 2 layout (serve-pd: a PDServer, a client of the same master)
        assert main(args) == 0, capsys.readouterr().err
        (shared,) = json.loads(capsys.readouterr().out)["requests"]
        assert shared["output_ids"] == hf_reference(NAME, turn(7, base=B), NEW)[0]
        assert shared["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 40}, shared
        pids = tp2.pids()
    assert all(gone(pid) for pid in pids)
    other = Engine(
        model_dir,
        config=EngineConfig(
            gpu_memory=400_000,
            page_size=PAGE,
            chunk_size=CHUNK,
            max_context=96,
            store="mooncake",
            store_master=master.address,
            store_memory="32MiB",
        ),
    )
    try:
        for ids in (turn(8), turn(8, base=B)):  # A's prefix of the PP 2 shards, B's of the TP 2 shards
            out = other.generate([list(ids)], [SamplingParams(NEW, ignore_eos=True)], cache_salts=[salt])[0]
            assert out.output_ids == hf_reference(NAME, ids, NEW)[0]
            assert out.cached_tokens == 0  # TP 1, PP 1: neither layout's objects
        assert other.tiers is not None and not other.tiers.hierarchy.counters.misses
    finally:
        other.close()


def test_a_damaged_object_of_one_stage_makes_every_stage_recompute(first, model_dir):
    """Stage 1's objects of a stored prefix damaged through the store's own API (read, flip a byte,
    upsert): stage 1 misses at the copy, stage 0 (whose objects are intact) falls back with it, the
    request computes the whole prompt, tokens exact; then both store it again."""
    server, _ = first
    salt = uuid.uuid4().hex
    assert served(server, tuple(A), salt).cached_tokens == 0
    server.clear_cache(host=True)  # into the store
    server.probe()  # answered after the clear (each rank takes its commands in order)
    spec = engine_spec(text_config(read_config(str(model_dir))))
    shard = ShardSpec(spec, Parallel(pp_size=2), 1, 0)
    keys = KeySpace.of(UnifiedMemory.create(shard, 400_000, page_size=PAGE, max_context=96, chunk_tokens=CHUNK))
    names = keys.page_names(np.asarray(A[:40]), salt)
    assert server.master is not None
    client = MooncakeStoreTier(server.master.address, segment_bytes=16 << 20)
    try:
        raw = client._store  # the Mooncake client itself
        damaged = 0
        deadline = time.monotonic() + 30  # clear_cache is asynchronous: the ranks' writes land soon after
        while not damaged and time.monotonic() < deadline:
            for pool in keys.prefixes:
                for key in keys.keys(pool, names):
                    blob = raw.get(key)
                    if blob:
                        blob = bytearray(blob)
                        blob[HEADER + 1] ^= 0x40
                        assert raw.upsert(key, bytes(blob)) == 0
                        damaged += 1
            if not damaged:
                time.sleep(0.1)
        # stage 1's pages (and the state after 40 tokens) were in the store
        assert damaged > 0, server.metrics()
        out = served(server, turn(9), salt)
        assert out.cached_tokens == 0  # no stage restored, though stage 0's objects were intact
        m = server.metrics()
        stage0, stage1 = (m["prefill_tiers"][f"prefill stage {s} TP rank 0 (epoch 0)"] for s in (0, 1))
        assert set(stage1["misses"]) == {"checksum"} and not stage0["misses"]  # the damaged stage's objects only
        assert m["tier_misses"] == stage1["misses"] and stage0["fallbacks"] == stage1["fallbacks"] == 1
        assert served(server, turn(10), salt).cached_tokens_details == {"device": 40, "host": 0, "storage": 0}
    finally:
        client.close()


def test_a_killed_master_marks_every_ranks_store_down_requests_go_on_and_a_restart_resumes_it(first):
    """The router's master SIGKILLed with a prefix in the store (the last test on it: its objects are
    lost): every prefill rank's store answers down at once, the request recomputes (exact, bounded
    time); host memory goes on serving hits; a write-back to the store is refused, not waited on; the
    master restarted on its ports, the ranks' store clients come back and a prefix is served from the
    store again."""
    server, _ = first
    salt = uuid.uuid4().hex
    master = server.master
    assert master is not None
    assert served(server, tuple(A), salt).cached_tokens == 0
    server.clear_cache(host=True)  # into the store
    master.kill()
    started = time.monotonic()
    assert served(server, turn(11), salt).cached_tokens == 0  # the store held it: down, recomputed
    assert server.metrics()["tier_store_ranks_down"] == 2  # every rank's client saw it, on its own
    server.clear_cache()  # host memory still works
    assert served(server, turn(12), salt).cached_tokens_details == {"device": 0, "host": 40, "storage": 0}
    server.clear_cache(host=True)  # written back to a store that is down: refused at once
    assert served(server, turn(13), salt).cached_tokens == 0
    assert time.monotonic() - started < 60  # nothing waited on the dead master for long
    down = server.metrics()
    assert down["tier_write_refused"]["mooncake"] > 0 and down["tier_store_down_events"] >= 2
    master.start()  # the same ports, no objects
    deadline, seed = time.monotonic() + 60, 14
    while time.monotonic() < deadline:  # each rank's tier probes while down; its client remounts its segment
        server.clear_cache(host=True)
        got = served(server, turn(seed), salt)
        seed += 1
        if got.cached_tokens_details["storage"]:
            break
        time.sleep(0.5)
    assert got.cached_tokens_details == {"device": 0, "host": 0, "storage": 40}
    assert server.metrics()["tier_store_ranks_down"] == 0


@pytest.mark.parametrize(
    ("tiers", "message"),
    [
        (["--store", "disk"], "--store takes none or mooncake"),
        (["--store-master", "127.0.0.1:5"], "it needs --store mooncake"),
        (["--store", "mooncake", "--store-memory", "1MiB"], "at least 16MiB"),
        (["--store", "mooncake", "--store-master", "127.0.0.1:9"], "no mooncake_master answers at 127.0.0.1:9"),
    ],
)
def test_bad_tier_options_of_serve_pd_are_one_error_line(tiers, message, model_dir, tmp_path, capsys) -> None:
    """Refused before any worker starts (nothing to reap): one ``error:`` line, exit 2."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": A}) + "\n")
    assert main(["serve-pd", "--model", str(model_dir), "--prompts", str(prompts), *tiers]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("hybridkv serve-pd:")]
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err  # (the sizing line aside)


def test_a_killed_master_over_http_on_the_disaggregated_server(first):
    """The same over HTTP (``serve --disaggregated``'s front: ``PDBackend`` under ``HttpServer``), after the test
    above restarted the master: it is SIGKILLed again; requests go on exact, ``/metrics`` says the store is down;
    restarted, the store serves a prefix again and ``/metrics`` says it is up. Closing the front closes the server."""
    from prometheus_client.parser import text_string_to_metric_families

    from hybridkv.server import HttpServer, PDBackend, ServerConfig, bind

    server, _ = first
    master = server.master
    assert master is not None
    front = HttpServer(PDBackend(server, NAME, "3MB"), ServerConfig(), bind("127.0.0.1", 0), 10.0)
    front.start()
    key = uuid.uuid4().hex
    try:

        def generate(ids: tuple[int, ...]) -> dict[str, int]:
            body = {"input_ids": list(ids), "extra_key": key, "sampling_params": {"max_new_tokens": NEW}}
            body["sampling_params"] |= {"temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{front.url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == hf_reference(NAME, ids, NEW)[0], "tokens differ from transformers"
            details: dict[str, int] = r.json()["meta_info"]["cached_tokens_details"]
            return details

        def store_up() -> float:
            text = httpx.get(f"{front.url}/metrics", timeout=30).text
            samples = (s for f in text_string_to_metric_families(text) for s in f.samples)
            return next(s.value for s in samples if s.name == "hybridkv_tier_store_up")

        def flush_into_the_store() -> None:
            assert httpx.post(f"{front.url}/flush_cache?host=true", timeout=60).status_code == 200

        generate(turn(31))
        assert store_up() == 1
        flush_into_the_store()
        master.kill()
        started = time.monotonic()
        assert generate(turn(32))["storage"] == 0  # the store's objects are gone with it
        assert store_up() == 0
        flush_into_the_store()  # written back to a store that is down: refused at once
        assert time.monotonic() - started < 60
        master.start()
        deadline, seed = time.monotonic() + 60, 33
        while time.monotonic() < deadline:
            flush_into_the_store()
            if generate(turn(seed))["storage"]:
                break
            seed += 1
            time.sleep(0.5)
        else:
            raise AssertionError("the store did not come back over HTTP within 60 s of the master's restart")
        assert store_up() == 1
    finally:
        front.stop()
    assert all(gone(pid) for pid in server.pids())
