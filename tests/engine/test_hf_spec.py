"""The engine's spec (``hybridkv.spec.from_hf_config`` at the serving dtype) keeps what the layers really keep,
checked against the cache transformers builds."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.engine import Engine
from hybridkv.engine.forward.batch import ForwardBatch
from hybridkv.engine.random_models import tiny_names
from hybridkv.engine.registry import engine_spec
from hybridkv.engine.sched.kv import Admission, Budget, RequestKV
from hybridkv.engine.sched.request import Request, SamplingParams
from hybridkv.spec import MLA, RECURRENT_POOL, FullAttention, Linear, NoCache, SlidingWindow, from_hf_config
from tests.engine.harness import hf_model, make_runner, prompt


def _hf_cache(name: str, length: int = 20):
    with torch.no_grad():
        return hf_model(name)(torch.tensor([prompt(1, length)]), use_cache=True).past_key_values


@pytest.mark.parametrize("name", tiny_names())
def test_spec_matches_the_cache_transformers_builds(name: str) -> None:
    spec = engine_spec(hf_model(name).config)
    assert spec == from_hf_config(hf_model(name).config)  # the tiny models are fp32: no dtype override
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
            *windows, matrix = (s.shape for s in kind.states)  # conv windows per component: q, k, v
            # transformers keeps `kernel` inputs over the concatenation, the first of which no later token reads
            assert sum(w[0] for w in windows) == conv.shape[1] and {w[1] for w in windows} == {conv.shape[2] - 1}
            assert matrix == tuple(state.shape[1:])
        elif isinstance(kind, NoCache):
            assert not getattr(hf_layer, "is_initialized", False) or getattr(hf_layer, "keys", None) is None


def test_gdn_state_slots_hold_the_states_transformers_keeps() -> None:
    """After a chunked prefill, the state pool holds HF's conv window (last K-1 inputs) and recurrent matrix."""
    runner = make_runner("tiny-qwen3-next", 4)
    ids = prompt(1, 20)
    kv = RequestKV(runner.mem, prefix_cache=False)
    req = Request(0, list(ids), SamplingParams())
    assert kv.admit(req, Budget(7, alone=True)) is Admission.ADMITTED
    for start in range(0, 20, 7):
        chunk = ids[start : start + 7]
        prefix = req.computed
        kv.allocate([req], [len(chunk)])
        runner.forward(ForwardBatch.build([chunk], [prefix], [req.kv.token_locs()], [req.kv.state_slot], [req.fresh]))
        kv.computed([req])
        req.computed += len(chunk)
    cache = _hf_cache("tiny-qwen3-next")
    cell = runner.mem.page_cells([req.kv.state_slot], RECURRENT_POOL)
    for layer_id, hf_layer in enumerate(cache.layers):
        if not hasattr(hf_layer, "conv_states"):
            continue
        conv = torch.cat([runner.mem.view(layer_id, part)[cell][0] for part in ("conv_q", "conv_k", "conv_v")])
        state = runner.mem.view(layer_id, "recurrent_state")[cell][0]
        torch.testing.assert_close(conv, hf_layer.conv_states[0][0, :, 1:], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state, hf_layer.recurrent_states[0][0], atol=1e-6, rtol=1e-4)
    kv.free(req, cache=False)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-kimi-linear"])
def test_served_in_bf16_kv_and_conv_windows_follow_and_recurrent_matrices_stay_fp32(name: str) -> None:
    spec = engine_spec(hf_model(name).config, torch.bfloat16)
    assert spec.kv_dtype == torch.bfloat16
    linear = [layer.kind for layer in spec.layers if isinstance(layer.kind, Linear)]
    assert linear and all([s.dtype for s in k.states] == [torch.bfloat16] * 3 + [torch.float32] for k in linear)


def test_an_architecture_without_a_model_is_refused_naming_the_served_ones() -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    assert from_hf_config(config).num_layers == 1  # the spec exists; the engine has no llama model
    with pytest.raises(ValueError, match=r"no model for model_type 'llama'; it serves \['gemma3_text'"):
        Engine(config, {})
