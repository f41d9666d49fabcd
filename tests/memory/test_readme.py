"""The README's memory example runs as written (on the CPU, with a budget this machine holds):
``UnifiedMemory.create``, the page API, the token API adapter, state slots, views, translate."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_memory_example_runs() -> None:
    code = re.search(r"```python\n(import numpy as np\n.*?)```", README.read_text(), re.S)
    assert code is not None, "README lost its memory example"
    text = code.group(1)
    assert 'UnifiedMemory.create(shard, "60GiB", device="cuda", page_size=16)' in text
    assert "tokens.alloc_extend(" in text and "tokens.free_segment(" in text
    text = text.replace('"60GiB", device="cuda", page_size=16', '"1GiB", device="cpu", page_size=16, max_context=4096')
    scope: dict[str, object] = {}
    exec(compile(text, str(README), "exec"), scope)
    mem = scope["mem"]
    assert mem.pages.live_count == 3  # type: ignore[attr-defined]  # request 1's 3 pages; request 0's 57 freed
