"""``host_malloc.keep_freed_host_memory``: set under glibc, left alone where the user chose allocator settings."""

from __future__ import annotations

import ctypes.util
import sys

import pytest

from hybridkv.engine import host_malloc

apply = host_malloc.keep_freed_host_memory.__wrapped__  # the uncached function: each case decides afresh


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc")
def test_the_thresholds_are_set_under_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in host_malloc.os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LD_PRELOAD", "")
    assert apply() is True


@pytest.mark.parametrize(
    "variable, value", [("MALLOC_ARENA_MAX", "2"), ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")]
)
def test_a_user_allocator_setting_is_left_alone(variable: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, value)
    called = []
    monkeypatch.setattr(host_malloc.ctypes, "CDLL", lambda *a: called.append(a))
    assert apply() is False
    assert not called  # the C library was not even opened
