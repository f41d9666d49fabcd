"""Token-exactness against transformers: Nemotron-H (Mamba2) and Kimi-Linear (KDA + MLA) over UnifiedMemory.

Every run prefills in chunks (5 and 7) that align with neither pages nor the recurrent ops'
chunks (SSD 16, KDA 64), then decodes greedily; the tokens must equal
``generate(do_sample=False)`` and every last-position logit row must be within ``ATOL`` of
the HF forward on the same sequence (measured max difference on this machine: 1.2e-6 for
Nemotron-H, 2.4e-7 for Kimi-Linear, logits of magnitude ~0.5-1.5). Prompts run below, at and
well above those chunk sizes. Recurrent state lives only in state slots, KV only in the
token pools (MLA: one latent per token); memory is verified at the end and holds nothing
once the requests are freed.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hybridkv.engine.errors import WeightError
from hybridkv.engine.forward.batch import ForwardBatch
from hybridkv.engine.random_models import SEED, TINY_CONFIGS, VOCAB
from hybridkv.engine.registry import engine_spec, model_class
from hybridkv.engine.runner import ShardRunner
from hybridkv.engine.sched.kv import Admission, Budget, RequestKV
from hybridkv.engine.sched.request import Request, SamplingParams
from hybridkv.engine.weights import from_directory, from_hf_model, load_weights, read_safetensors
from hybridkv.memory import UnifiedMemory
from hybridkv.spec import RECURRENT_POOL, ShardSpec
from tests.engine.harness import live_counts, prompt, serve

ATOL = 1e-4
# Test models: the tiny random models with, for Nemotron-H, 2.5x the init scale. At the default
# (0.02) its Mamba2 layers add so little to the logits that serving with a corrupted SSM state
# (padded positions fed into it) moved logits by only 5e-6, under ATOL; at 0.05 the same bug
# moves them by 4e-4 while correct serving stays within 2e-6.
MODELS: dict[str, tuple[tuple[str, Any], ...]] = {
    "tiny-nemotron-h": (("initializer_range", 0.05),),
    "tiny-kimi-linear": (),
}


@cache
def _model(name: str, changes: tuple[tuple[str, Any], ...] = ()) -> Any:
    """A tiny model of ``name``'s architecture with some config fields changed (same seed)."""
    model_type, overrides = TINY_CONFIGS[name]
    fields = {**overrides, **dict(changes)}
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, max_position_embeddings=512, **fields)
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@cache
def _reference(model: Any, ids: tuple[int, ...], max_new: int) -> tuple[list[int], torch.Tensor]:
    """``generate``'s greedy tokens and the HF forward's logits along them.

    ``eos_token_id=None``: the harness decodes ``max_new`` tokens regardless of EOS, so
    ``generate`` must neither stop at EOS nor ban it (``min_new_tokens`` would bend the tokens).
    """
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=None)
        full = model(out).logits[0]
    return out[0, len(ids) :].tolist(), full[len(ids) - 1 :]


def _check(model: Any, prompts: list[list[int]], served: list, max_new: int, what: str) -> None:
    for ids, got in zip(prompts, served, strict=True):
        tokens, logits = _reference(model, tuple(ids), max_new)
        assert got.tokens == tokens, f"{what}: prompt of {len(ids)} tokens"
        assert len(got.logits) == max_new
        diff = max(float((a - b).abs().max()) for a, b in zip(got.logits, logits[:max_new], strict=True))
        assert diff < ATOL, f"{what}: logits differ by {diff}"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("length", [3, 16, 70])
def test_single_request_chunked_prefill_then_decode(name: str, page_size: int, length: int) -> None:
    model = _model(name, MODELS[name])
    runner = _runner(model, page_size)
    empty = live_counts(runner.mem)
    ids = prompt(length, length)
    for chunk in (5, 7):
        _check(model, [ids], serve(runner, [ids], chunk, max_new=6), 6, name)
        assert live_counts(runner.mem) == empty


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MODELS)
def test_many_requests_batched_in_each_forward(name: str, page_size: int) -> None:
    model = _model(name, MODELS[name])
    runner = _runner(model, page_size)
    empty = live_counts(runner.mem)
    prompts = [prompt(100 + n, n) for n in (1, 4, 9, 13, 22, 41)]
    _check(model, prompts, serve(runner, prompts, 7, max_new=5), 5, name)
    assert live_counts(runner.mem) == empty


def _runner(model: Any, page_size: int) -> ShardRunner:
    spec = engine_spec(model.config, torch.float32)
    mem = UnifiedMemory.create(ShardSpec.whole(spec), 4_000_000, page_size=page_size, max_context=256, chunk_tokens=64)
    return ShardRunner(from_hf_model(model), mem)


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        # Nemotron-H with MoE layers (group-limited sigmoid router, plain relu2 experts, shared expert).
        (
            "tiny-nemotron-h",
            dict(
                hybrid_override_pattern="ME*EM",
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_group=2,
                topk_group=1,
                moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=48,
            ),
        ),
        # Kimi-Linear / DeepSeek-style MLA with a low-rank query.
        ("tiny-kimi-linear", dict(q_lora_rank=24)),
    ],
)
def test_variants_are_exact(name: str, changes: dict[str, Any], tmp_path: Path) -> None:
    model = _model(name, MODELS[name] + tuple(changes.items()))
    runner = _runner(model, page_size=4)
    empty = live_counts(runner.mem)
    prompts = [prompt(200 + n, n) for n in (2, 11, 30)]
    _check(model, prompts, serve(runner, prompts, 5, max_new=5), 5, f"{name} {changes}")
    assert live_counts(runner.mem) == empty
    _assert_directory_matches_state_dict(model, tmp_path)


def _assert_directory_matches_state_dict(hf: Any, tmp_path: Path) -> None:
    """``save_pretrained`` writes the checkpoint layout (per-expert MoE weights, Nemotron-H's ``backbone.``,
    Kimi's ``block_sparse_moe`` and split q/k/v convs); loading it must give the ``state_dict``'s weights."""
    hf.save_pretrained(tmp_path)
    a, b = from_hf_model(hf), from_directory(tmp_path)
    assert type(a) is type(b) is model_class(hf.config.model_type)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("name", MODELS)
def test_directory_and_state_dict_give_the_same_weights(name: str, tmp_path: Path) -> None:
    _assert_directory_matches_state_dict(_model(name, MODELS[name]), tmp_path)


def test_kimi_checkpoint_missing_a_split_conv_is_named() -> None:
    hf = _model("tiny-kimi-linear")
    tensors = dict(hf.state_dict())
    conv = tensors.pop("model.layers.0.self_attn.conv1d.weight")
    tensors["model.layers.0.self_attn.q_conv1d.weight"] = conv[:64]
    tensors["model.layers.0.self_attn.v_conv1d.weight"] = conv[128:]
    model = model_class("kimi_linear")(hf.config)
    with pytest.raises(WeightError, match=r"missing conv weights model\.layers\.0\.self_attn\.k_conv1d\.weight"):
        load_weights(model, tensors)


def test_nemotron_checkpoint_missing_an_expert_is_named(tmp_path: Path) -> None:
    hf = _model("tiny-nemotron-h", (("hybrid_override_pattern", "ME"), ("n_routed_experts", 4), ("n_group", 1)))
    hf.save_pretrained(tmp_path)
    tensors = read_safetensors(tmp_path)
    del tensors["backbone.layers.1.mixer.experts.2.up_proj.weight"]
    model = model_class("nemotron_h")(hf.config)
    with pytest.raises(WeightError, match=r"missing expert weights backbone\.layers\.1\.mixer\.experts\.2\.up_proj"):
        load_weights(model, tensors)


def test_state_and_latents_live_in_memory() -> None:
    """The recurrent layers keep nothing between steps but their state slots; MLA keeps one latent a token."""
    kimi = _runner(_model("tiny-kimi-linear"), 16)
    mla_layers = [i for i, t in enumerate(_model("tiny-kimi-linear").config.layer_types) if t == "full_attention"]
    latent = kimi.mem.view(mla_layers[0], "latent")
    assert latent.shape[2:] == (1, 16 + 8)  # kv_lora_rank + qk_rope_head_dim
    nemotron = _runner(_model("tiny-nemotron-h"), 16)
    assert nemotron.mem.view(0, "ssm_state").shape[1:] == (8, 16, 16)
    convs = [nemotron.mem.view(0, name).shape[1:] for name in ("conv_x", "conv_B", "conv_C")]
    assert convs == [(8 * 16, 3), (2 * 16, 3), (2 * 16, 3)]
    for runner in (kimi, nemotron):
        assert not [name for name, _ in runner.model.named_buffers()], "a layer keeps tensors outside the memory"


def test_logits_are_not_trivially_small() -> None:
    """The tolerance means something: logits of the tiny models are far larger than ATOL."""
    for name in MODELS:
        _, logits = _reference(_model(name, MODELS[name]), tuple(prompt(1, 10)), 2)
        assert float(logits.abs().max()) > 1000 * ATOL
        assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("name", "conv", "state"),
    [
        ("tiny-nemotron-h", ("conv_x", "conv_B", "conv_C"), "ssm_state"),
        ("tiny-kimi-linear", ("conv_q", "conv_k", "conv_v"), "recurrent_state"),
    ],
)
def test_state_slots_hold_the_states_transformers_keeps(name: str, conv: tuple[str, ...], state: str) -> None:
    """After a chunked prefill (chunks of 7), the state pool holds HF's conv window (its last K-1 inputs;
    ours one tensor per component, concatenated in HF's order) and recurrent state after one pass over
    the same 40 tokens."""
    model = _model(name, MODELS[name])
    runner = _runner(model, page_size=4)
    ids = prompt(3, 40)
    kv = RequestKV(runner.mem, prefix_cache=False)
    req = Request(0, list(ids), SamplingParams())
    assert kv.admit(req, Budget(7, alone=True)) is Admission.ADMITTED
    for start in range(0, len(ids), 7):
        chunk = ids[start : start + 7]
        prefix = req.computed
        kv.allocate([req], [len(chunk)])
        runner.forward(ForwardBatch.build([chunk], [prefix], [req.kv.token_locs()], [req.kv.state_slot], [req.fresh]))
        kv.computed([req])
        req.computed += len(chunk)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    cell = runner.mem.page_cells([req.kv.state_slot], RECURRENT_POOL)
    checked = 0
    for layer_id, hf_layer in enumerate(cache.layers):
        if not getattr(hf_layer, "is_conv_states_initialized", [False])[0]:
            continue
        window = torch.cat([runner.mem.view(layer_id, part)[cell][0] for part in conv])
        torch.testing.assert_close(window, hf_layer.conv_states[0][0, :, 1:], atol=1e-6, rtol=1e-5)
        ours = runner.mem.view(layer_id, state)[cell][0]
        torch.testing.assert_close(ours, hf_layer.recurrent_states[0][0], atol=1e-5, rtol=1e-4)
        checked += 1
    assert checked == sum(t == "linear_attention" for t in model.config.layer_types)
    kv.free(req, cache=False)
    runner.mem.verify()
