"""``/generate`` over an engine with host memory below its device: ``meta_info.cached_tokens_details``
says where the cached tokens came from, and a prefix restored from host memory gives the tokens
``Engine.generate`` gives."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridkv.cli import main
from tests.server.conftest import MODEL, listening_url, shared_prefix_prompts
from tests.server.test_shutdown import children


def test_cached_tokens_details_split_device_and_host(start_server: Any, make_engine: Any) -> None:
    server = start_server(engine={"host_memory": "8MiB"})
    family = shared_prefix_prompts(3, groups=1, prefix=80, seed=5)
    reference = [o.output_ids for o in make_engine().generate(family, 4)]

    def generate(ids: list[int]) -> dict[str, Any]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    first = generate(family[0])
    assert first["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
    second = generate(family[1])
    assert second["meta_info"]["cached_tokens_details"] == {"device": 64, "host": 0, "storage": 0}
    server.backend.call(lambda engine: engine.clear_cache())  # the device's cache goes to host memory
    third = generate(family[2])
    assert third["meta_info"]["cached_tokens"] == 80  # the second one checkpointed the branch point
    assert third["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 80, "storage": 0}
    assert [a["output_ids"] for a in (first, second, third)] == reference
    scraped = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text)
        for sample in family.samples
    }
    tier = "hybridkv_tier_"
    assert scraped[(tier + "loaded_bytes_total", (("tier", "host"),))] > 0
    assert scraped[(tier + "written_bytes_total", (("tier", "host"),))] > 0
    assert scraped[(tier + "restored_requests_total", ())] == 1
    assert scraped[(tier + "restored_tokens_total", ())] == 80
    assert scraped[(tier + "host_used_bytes", ())] > 0
    hit = {labels: v for (name, labels), v in scraped.items() if name == tier + "hit_tokens_total"}
    assert hit and all(dict(labels).keys() == {"component", "tier"} for labels in hit), hit
    assert sum(v for labels, v in hit.items() if dict(labels)["tier"] == "host") > 0, hit


def test_serve_with_a_mooncake_store_starts_and_stops_its_master(tmp_path: Path) -> None:
    out, err = (tmp_path / "out").open("w+"), (tmp_path / "err").open("w+")
    cmd = [sys.executable, "-m", "hybridkv", "serve", "--random", MODEL, "--port", "0", "--gpu-memory", "64MiB"]
    cmd += ["--host-memory", "8MiB", "--store", "mooncake", "--shutdown-timeout", "2"]
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = listening_url(proc, tmp_path, 120)
        assert re.search(r"warmed up with \d+ requests", (tmp_path / "out").read_text())  # before it listened
        body = {"input_ids": list(range(5, 40)), "sampling_params": {"max_new_tokens": 3}}
        answer = httpx.post(f"{url}/generate", json=body, timeout=60).json()
        assert answer["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
        # /flush_cache?host=true: the device's cache through host memory into the store, where the repeat finds it
        assert httpx.post(f"{url}/flush_cache?host=true", timeout=60).status_code == 200
        again = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
        assert again["cached_tokens"] > 0
        assert again["cached_tokens_details"] == {"device": 0, "host": 0, "storage": again["cached_tokens"]}
        # a --random model speaks text through the built-in byte tokenizer; /server_info has the options
        text = httpx.post(
            f"{url}/generate", json={"text": "héllo ✓", "sampling_params": {"max_new_tokens": 3}}, timeout=60
        )
        assert text.json()["meta_info"]["prompt_tokens"] == len("héllo ✓".encode())
        info = httpx.get(f"{url}/server_info", timeout=10).json()
        assert info["host_memory"] == "8MiB" and info["store"] == "mooncake" and info["tiers"] is True
        assert info["model_path"] == f"random:{MODEL}" and info["tokenizer_path"].startswith("builtin:bytes")
        masters = children(proc.pid)
        assert len(masters) == 1 and Path(f"/proc/{masters[0]}/comm").read_text().strip() == "mooncake_master"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, (tmp_path / "err").read_text()
        stat = Path(f"/proc/{masters[0]}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z"  # gone (or a zombie awaiting its reaper)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--store-master", "127.0.0.1:9"], "it needs --store mooncake"),
        (["--store", "s3"], "--store takes none or mooncake"),
        (["--host-memory", "1MiB", "--no-prefix-cache"], "drop --no-prefix-cache"),
    ],
)
def test_bad_tier_options_are_one_error_line(args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--random", MODEL, "--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and says in err


def test_a_killed_master_over_http_requests_go_on_the_store_shows_down_then_resumes(
    start_server: Any, make_engine: Any
) -> None:
    """``serve`` with host memory and the Mooncake Store: its master is SIGKILLed mid-run. Requests go on exact from
    the device and host memory, ``/metrics`` says the store is down; the master restarted on its port, the tier
    comes back (a prefix written to it is hit from storage again)."""
    from hybridkv.tiers import MooncakeMaster

    family = shared_prefix_prompts(6, groups=1, prefix=48, seed=11)
    reference = [o.output_ids for o in make_engine().generate(family, 3)]
    with MooncakeMaster() as master:
        tiers = {"host_memory": "8MiB", "store": "mooncake", "store_master": master.address, "store_memory": "32MiB"}
        server = start_server(engine=tiers)

        def generate(i: int) -> dict[str, Any]:
            body = {"input_ids": family[i], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
            r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == reference[i]
            return r.json()["meta_info"]

        def store_up() -> float:
            text = httpx.get(f"{server.url}/metrics", timeout=10).text
            return next(
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "hybridkv_tier_store_up"
            )

        generate(0)
        assert store_up() == 1
        assert httpx.post(f"{server.url}/flush_cache?host=true", timeout=60).status_code == 200  # into the store
        master.kill()
        started = time.monotonic()
        assert generate(1)["cached_tokens_details"]["storage"] == 0  # the store's objects are gone with it
        assert httpx.post(f"{server.url}/flush_cache?host=true", timeout=60).status_code == 200  # refused, counted
        assert generate(2)["cached_tokens"] == 0 and store_up() == 0
        assert time.monotonic() - started < 20  # nothing waits on a dead master for long
        master.start()  # the same port, no objects
        deadline, i = time.monotonic() + 40, 3
        while time.monotonic() < deadline:
            assert httpx.post(f"{server.url}/flush_cache?host=true", timeout=60).status_code == 200
            if generate(i % len(family))["cached_tokens_details"]["storage"]:
                break
            i += 1
            time.sleep(0.3)
        else:
            raise AssertionError("the store did not come back within 40 s of the master's restart")
        assert store_up() == 1
