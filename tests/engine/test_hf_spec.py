"""The engine's spec from HF configs keeps what the layers really keep (checked against transformers' cache)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.allocator import RequestAllocator
from hybridkv.engine.batch import ForwardBatch
from hybridkv.engine.hf_spec import HFSpecError, spec_from_hf_config
from hybridkv.engine.random_models import tiny_names
from hybridkv.spec import MLA, RECURRENT_POOL, FullAttention, Linear, NoCache, SlidingWindow
from tests.engine.harness import hf_model, make_runner, prompt


def _hf_cache(name: str, length: int = 20):
    with torch.no_grad():
        return hf_model(name)(torch.tensor([prompt(1, length)]), use_cache=True).past_key_values


@pytest.mark.parametrize("name", tiny_names())
def test_spec_matches_the_cache_transformers_builds(name: str) -> None:
    spec = spec_from_hf_config(hf_model(name).config)
    cache = _hf_cache(name)
    assert spec.num_layers == len(cache.layers)
    for layer, hf_layer in zip(spec.layers, cache.layers, strict=True):
        kind = layer.kind
        if isinstance(kind, FullAttention | SlidingWindow):
            _, heads, kept, dim = hf_layer.keys.shape
            assert (heads, dim, hf_layer.values.shape[-1]) == (kind.num_kv_heads, kind.head_dim, kind.v_head_dim)
            # transformers keeps window - 1 past tokens for a sliding layer: the same window
            assert kept == (kind.window - 1 if isinstance(kind, SlidingWindow) else 20)
        elif isinstance(kind, MLA):  # transformers caches the latent as keys and the rope part as values
            assert (hf_layer.keys.shape[-1], hf_layer.values.shape[-1]) == (kind.kv_lora_rank, kind.qk_rope_head_dim)
        elif isinstance(kind, Linear):
            conv = hf_layer.conv_states[0]
            state = hf_layer.recurrent_states[0]
            ours = {s.name: s.shape for s in kind.states}
            # transformers keeps `kernel` inputs, the first of which no later token reads
            assert ours["conv_state"] == (conv.shape[1], conv.shape[2] - 1)
            assert next(v for k, v in ours.items() if k != "conv_state") == tuple(state.shape[1:])
        elif isinstance(kind, NoCache):
            assert not getattr(hf_layer, "is_initialized", False) or getattr(hf_layer, "keys", None) is None


def test_gdn_state_slots_hold_the_states_transformers_keeps() -> None:
    """After a chunked prefill, the state pool holds HF's conv window (last K-1 inputs) and recurrent matrix."""
    runner = make_runner("tiny-qwen3-next", 4)
    ids = prompt(1, 20)
    alloc = RequestAllocator(runner.mem)
    req = alloc.new()
    for start in range(0, 20, 7):
        chunk = ids[start : start + 7]
        prefix = req.length
        alloc.extend([req], [len(chunk)])
        runner.forward(ForwardBatch.build([chunk], [prefix], [req.token_locs], [req.slot], [req.fresh]))
        alloc.mark_computed([req])
    cache = _hf_cache("tiny-qwen3-next")
    cell = runner.mem.page_cells([req.slot], RECURRENT_POOL)
    for layer_id, hf_layer in enumerate(cache.layers):
        if not hasattr(hf_layer, "conv_states"):
            continue
        conv = runner.mem.view(layer_id, "conv_state")[cell][0]
        state = runner.mem.view(layer_id, "recurrent_state")[cell][0]
        torch.testing.assert_close(conv, hf_layer.conv_states[0][0, :, 1:], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state, hf_layer.recurrent_states[0][0], atol=1e-6, rtol=1e-4)
    alloc.free(req)


def test_unknown_architecture_is_named() -> None:
    class Config:
        model_type = "llama"

    with pytest.raises(HFSpecError, match="model_type 'llama' is not served"):
        spec_from_hf_config(Config())
