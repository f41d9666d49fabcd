"""``Registry[T]``: one generic type for every registry of the package (issue 19, item 14)."""

from __future__ import annotations

import re

import pytest

from hybridkv.registry import Registry, UnknownName


def test_a_registry_maps_names_and_refuses_what_it_does_not_know() -> None:
    reg = Registry[int]("colour", {"red": 1, "green": 2})
    reg.add("blue", 3)
    assert list(reg) == ["red", "green", "blue"] and reg.names() == ["blue", "green", "red"]
    assert reg["green"] == 2 and "blue" in reg and "pink" not in reg and reg.get("pink") is None and len(reg) == 3
    for bad in ("pink", ["red"]):  # unknown, and unhashable
        with pytest.raises(UnknownName) as err:
            reg[bad]  # type: ignore[index]
        assert str(err.value) == f"unknown colour {bad!r}; known: red, green, blue"
        assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    with pytest.raises(ValueError, match="colour 'red' is registered already"):
        reg.add("red", 9)
    with pytest.raises(ValueError, match="non-empty string name"):
        reg.add("", 9)
    assert dict(reg) == {"red": 1, "green": 2, "blue": 3}, "a refused add changes nothing"


def test_every_registry_of_the_package_is_one() -> None:
    from hybridkv.cache.placement import PLACEMENTS
    from hybridkv.cache.policies import POLICIES
    from hybridkv.engine import random_models, registry
    from hybridkv.spec import hf_config, layers, presets
    from hybridkv.traces import TRACES
    from hybridkv.transfer.transport import TRANSPORTS

    registries = {
        "transport": TRANSPORTS,
        "eviction policy": POLICIES,
        "checkpoint placement": PLACEMENTS,
        "Hugging Face architecture (model_type)": hf_config._ARCHITECTURES,
        "layer kind": presets._KINDS,
        "dtype": layers._DTYPES,
        "engine architecture (model_type)": registry._MODELS,
        "tiny random model": random_models.TINY_CONFIGS,
        "built-in trace": TRACES,
    }
    for kind, reg in registries.items():
        assert isinstance(reg, Registry) and reg.kind == kind and len(reg) > 0
        with pytest.raises(UnknownName, match=re.escape(f"unknown {kind} 'no-such-name'; known: ")):
            reg["no-such-name"]
