"""What a tier hierarchy counts: bytes and objects written per tier, refusals, write-around, loads, misses and
hit tokens per component and source tier. Plain counters: the hierarchy writes them, restores add to them,
``/metrics`` and the engines' figures read them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TierCounters:
    written_bytes: Counter[str] = field(default_factory=Counter)
    """Bytes written per tier name."""
    written_objects: Counter[str] = field(default_factory=Counter)
    write_refused: Counter[str] = field(default_factory=Counter)
    """Objects a tier refused (full, down, error, larger than its budget), per tier name."""
    write_around: Counter[str] = field(default_factory=Counter)
    """Objects larger than host memory's budget written straight to the store, per component label."""
    loaded_bytes: Counter[str] = field(default_factory=Counter)
    """Bytes restored to the device per source (``device`` is a device-to-device copy), for
    the hits recorded (``record``)."""
    load_seconds: float = 0.0
    """Load-back time of the recorded hits at the stated bandwidths (host and store)."""
    misses: Counter[str] = field(default_factory=Counter)
    """Objects a planned load did not get, by ``MissReason``."""
    fallbacks: int = 0
    """Restores that fell back to the device hit because an object was missing."""
    hit_tokens: dict[str, Counter[str]] = field(default_factory=dict)
    """Per component label: hit tokens by the tier each needed piece came from."""
    restored_tokens: int = 0
    """Tokens of hits beyond the device's own hit (restored from the tiers)."""
    restored_requests: int = 0
