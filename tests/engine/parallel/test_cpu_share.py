"""Each worker's intra-op threads: an explicit OMP_NUM_THREADS, else an equal share of the CPUs."""

from __future__ import annotations

import os

import pytest

from hybridkv.engine.parallel.cpu_share import usable_cpus, worker_threads


def test_usable_cpus_is_the_affinity_mask() -> None:
    assert usable_cpus() == len(os.sched_getaffinity(0)) >= 1


@pytest.mark.parametrize("processes", [1, 2, 3, 4, 64])
def test_without_omp_num_threads_workers_share_the_cpus(monkeypatch, processes: int) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = worker_threads(processes)
    assert threads == max(1, usable_cpus() // processes)
    assert threads * processes <= usable_cpus() or threads == 1  # never more threads than CPUs, unless 1 each


@pytest.mark.parametrize("value", ["1", "3", " 8 "])
def test_an_explicit_omp_num_threads_wins(monkeypatch, value: str) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert worker_threads(4) == int(value)


@pytest.mark.parametrize("value", ["0", "-2", "two", ""])
def test_an_unusable_omp_num_threads_is_ignored(monkeypatch, value: str) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert worker_threads(2) == max(1, usable_cpus() // 2)


def test_no_worker_process_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one worker process, got 0"):
        worker_threads(0)
