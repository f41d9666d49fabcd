"""The engine-neutral half of the SGLang backend, in the project's venv (no SGLang): the id map onto the
shadow memory, and the package boundary (nothing outside ``hybridkv.integrations.sglang`` imports it or
SGLang)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import hybridkv

ROOT = Path(hybridkv.__file__).parent
CHECKOUT = Path(__file__).resolve().parents[2] / "src" / "hybridkv"
if ROOT.resolve() != CHECKOUT:  # a venv whose editable install points at another checkout
    pytest.fail(f"hybridkv is imported from {ROOT}, not from {CHECKOUT}: run with PYTHONPATH=src", pytrace=False)

from hybridkv.cache import HybridRadixCache  # noqa: E402
from hybridkv.integrations.sglang.idmap import IdMap, SGLangIdError, shadow_memory  # noqa: E402


def test_pages_bind_once_and_come_back_unbound() -> None:
    mem = shadow_memory(4, 64, window=8, slots=None)
    ids = IdMap(mem, 64)
    hk, fresh = ids.bind_pages(np.array([3, 9, 5]))
    assert fresh.all() and ids.sg_pages_of(hk).tolist() == [3, 9, 5]
    again, fresh2 = ids.bind_pages(np.array([9, 7]))  # 9 is bound: its shadow page is reused
    assert again[0] == hk[1] and fresh2.tolist() == [False, True]
    live = mem.pages.live.copy()
    ids.release_pages(again[1:])
    assert not mem.pages.live[again[1]] and live[again[1]]
    assert ids.unbind_pages(hk).tolist() == [3, 9, 5]
    assert (ids.hk_of_page == -1).all() and (ids.sg_of_page == -1).all()


def test_the_shadow_memory_never_runs_out_first() -> None:
    """Every SGLang page and slot at once fits the shadow memory (with a window pool and a state pool)."""
    mem = shadow_memory(1, 4096, window=16, slots=64)
    ids = IdMap(mem, 4096, 64)
    hk, fresh = ids.bind_pages(np.arange(1, 4097))
    assert fresh.all() and np.unique(hk).size == 4096 and mem.pages.live[hk].all()
    assert ids.sg_pages_of(hk).tolist() == list(range(1, 4097))
    slots = [ids.bind_slot(s) for s in range(65)]
    assert all(new for _, new in slots) and len({hk for hk, _ in slots}) == 65
    assert HybridRadixCache(mem).cached_tokens == 0  # and a cache can be built over it


def test_ids_outside_the_pool_are_refused_with_the_range() -> None:
    ids = IdMap(shadow_memory(1, 16, window=None, slots=4), 16, 4)
    with pytest.raises(SGLangIdError, match=r"page 17 is outside its allocator's pages 1\.\.16"):
        ids.bind_pages(np.array([2, 17]))
    with pytest.raises(SGLangIdError, match="page 0 is outside"):
        ids.bind_pages(np.array([0]))
    with pytest.raises(SGLangIdError, match=r"Mamba slot 5 is outside .* slots 0\.\.4"):
        ids.bind_slot(5)
    assert (ids.hk_of_page == -1).all()  # a refused call bound nothing


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_nothing_imports_the_integration_and_sglang_stays_inside_it() -> None:
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        names = _imports(path)
        if not rel.startswith("integrations/sglang/"):
            assert not any(n.startswith("hybridkv.integrations.sglang") for n in names), rel
            assert not any(n == "sglang" or n.startswith("sglang.") for n in names), rel
    assert not any(n.startswith("sglang") for n in _imports(ROOT / "integrations" / "sglang" / "idmap.py"))


def test_the_package_and_its_id_map_import_no_sglang() -> None:
    import sys

    import hybridkv.integrations.sglang as pkg

    assert "sglang" not in sys.modules  # the package and idmap.py were imported above: SGLang was not
    assert pkg.__all__ == ["HybridKVRadixCache", "HybridKVSGLangError", "build_tree_cache", "register"]
    with pytest.raises(AttributeError, match="no_such_name"):
        pkg.no_such_name  # noqa: B018
