"""The names the command line checks before it imports the library: model presets (and which preset a
name means) and transports, without importing torch.

The command line checks a ``--model`` or a ``--transport`` against these first (torch alone takes
seconds to import on a cold, busy machine), so a wrong name is answered at once. ``spec.presets``
builds the ``ModelSpec`` of each preset listed here; ``transfer.transport.TRANSPORTS`` holds the
class of each ``TransportName``.

So a new transport adds one line here besides its module under ``transfer/`` (the redesign's "a new
transport touches ``transfer/`` only" does not hold, by choice): names that each transport's module
registered in a ``transfer/transport/names.py`` would be read through the ``hybridkv.transfer``
package, which imports torch. Measured (``python -X importtime``, 2-core host under load):
``hybridkv --help`` imports ``hybridkv.cli`` in 0.34-0.50 s without torch; ``import hybridkv.transfer``
alone takes 1.66 s.

Invariants:
- ``preset_names()``: the published presets, in the order of ``spec/data/model_presets.json``,
  then ``TINY_PRESETS``; no name appears twice.
- ``resolve_preset(name)``: ``name`` itself when it is a preset, else the one preset that contains
  it case-insensitively; no match or several raise ``PresetError`` naming the candidates.
- ``TINY_PRESETS`` lists exactly the tiny presets ``spec.presets`` builds (it refuses to build
  any other set).
- ``TransportName`` names exactly the transports ``transfer.transport.TRANSPORTS`` registers (its
  test checks both ways).
"""

from __future__ import annotations

import json
from enum import StrEnum
from functools import cache
from importlib import resources
from typing import Any

PRESETS_FILE = "spec/data/model_presets.json"  # inside the hybridkv package

TINY_PRESETS = (
    "tiny-dense",
    "tiny-mla",
    "tiny-swa",
    "tiny-swa2-state",
    "tiny-gdn",
    "tiny-gdn-bf16",
    "tiny-kda-mla",
    "tiny-mamba-mlp",
    "tiny-lightning",
)


class TransportName(StrEnum):
    """The transports ``hybridkv.transfer.transport.TRANSPORTS`` knows, as named on the wire."""

    SHM = "shm"
    MOONCAKE = "mooncake"


class PresetError(ValueError):
    """A preset file or name that cannot describe a model."""


@cache
def published_records() -> dict[str, dict[str, Any]]:
    """The published preset records by name (the file's order)."""
    text = resources.files("hybridkv").joinpath(PRESETS_FILE).read_text()
    return {record["name"]: record for record in json.loads(text)}


def real_preset_names() -> list[str]:
    return list(published_records())


def tiny_preset_names() -> list[str]:
    return list(TINY_PRESETS)


def preset_names() -> list[str]:
    return real_preset_names() + tiny_preset_names()


def resolve_preset(name: str) -> str:
    """The preset ``name`` means: itself, or the unique preset containing it (case-insensitive)."""
    names = preset_names()
    if name in names:
        return name
    hits = [n for n in names if name.lower() in n.lower()]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise PresetError(f"no preset named {name!r}; known: {', '.join(names)}")
    raise PresetError(f"preset name {name!r} is ambiguous: {', '.join(hits)}")
