"""The tiny random models, and their widened forms (``random_models.widened``): every width times a factor, nothing
else changed, and the engine still serves each token-exact against transformers."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.bench.hf_baselines import one_by_one
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import TINY_CONFIGS, WIDTHS, build_random, tiny_names, widened
from tests.engine.harness import prompt


@pytest.mark.parametrize("name", tiny_names())
def test_widening_multiplies_every_width_and_nothing_else(name: str) -> None:
    _, base = TINY_CONFIGS[name]
    wide = widened(base, 3)
    assert set(wide) == set(base) and widened(base, 1) == base
    assert "hidden_size" in base and any(key.endswith("head_dim") for key in base)  # a model's widths are named
    for key, value in base.items():
        if key in WIDTHS:
            assert wide[key] == 3 * value, key
        elif key == "linear_attn_config":  # Kimi-Linear's KDA heads: their dim widens, the rest stays
            assert wide[key] == {**value, "head_dim": 3 * value["head_dim"]}
        else:
            assert wide[key] == value, key  # head counts, layers, experts, windows, chunks


@pytest.mark.parametrize("bad", [0, 65, -2, 1.5, True, "2"])
def test_a_widen_that_is_not_a_small_positive_integer_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"widen must be an integer in \[1, 64\]"):
        widened(TINY_CONFIGS["tiny-gemma3"][1], bad)


@pytest.mark.parametrize("name", tiny_names())
def test_a_widened_model_is_served_token_exact(name: str) -> None:
    model, config = build_random(name, 2)
    assert config.hidden_size == 2 * TINY_CONFIGS[name][1]["hidden_size"]
    prompts = [prompt(7, 5), prompt(8, 23), prompt(8, 23)[:17] + prompt(9, 6)]  # the third shares a prefix
    engine = Engine(config, model, EngineConfig(gpu_memory="64MiB", page_size=4, chunk_size=8, max_context=48))
    got = [r.output_ids for r in engine.generate(prompts, 6, stop_at_eos=False)]
    want, _, _ = one_by_one(model, prompts, 6)
    assert got == want
