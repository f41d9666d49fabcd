"""Byte sizes as people write them (``80GiB``, ``1.5 GB``, ``4096``) and as reports print them.

Pure Python, no torch: the command line checks a size option with it before it imports the library.
Invariants: ``parse_bytes`` accepts a non-negative decimal number and one of the units below
(case-insensitive; none means bytes) and refuses anything else with a ``ValueError`` that shows an
accepted form; ``format_bytes`` prints binary units with two decimals.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """``"80GiB"``, ``"1.5 GB"``, ``"4096"`` -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB, 512MiB or 4096")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
