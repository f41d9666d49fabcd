"""``fast_paths(state_cells=...)``: a step that gathers no whole state cell (the recurrent states updated in the pool
by cell, other state tensors gathered alone) generates what the whole-cell gather does, checkpoints and prefix hits
included, on every model with recurrent state (GatedDeltaNet, Mamba2, KDA)."""

from __future__ import annotations

import pytest

from hybridkv.engine.fast_paths import fast_paths
from tests.engine.test_prefix_cache import FIRST, LATER, _engine


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-nemotron-h", "tiny-kimi-linear"])
def test_in_pool_states_generate_what_whole_cells_do(name: str) -> None:
    engine = _engine(name, 2_000_000, 4)
    runs = {}
    for on in (False, True):
        with fast_paths(state_cells=on):
            first = engine.generate([FIRST], 6)  # writes checkpoints the later requests hit
            later = engine.generate(LATER, 6)  # decodes of several requests, some fresh in the step
        assert all(o.hit is not None and o.hit.checkpoint > 0 for o in later[1:]), [o.hit for o in later]
        runs[on] = [o.output_ids for o in first + later]
        engine.clear_cache()
    assert runs[True] == runs[False]
