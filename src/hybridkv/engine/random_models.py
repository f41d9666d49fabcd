"""Tiny random ``transformers`` models of every architecture the engine serves.

Invariants:
- One table (``TINY_CONFIGS``): name -> ``model_type`` and config overrides. Every model is
  fp32, hidden size <= 128, 2-6 layers, with windows of 8-32 tokens so windows matter.
- ``widen`` (``random_config``, ``build_random``) multiplies every width of a model (``WIDTHS``:
  hidden size, MLP and expert sizes, head and state dims) and nothing else: head counts,
  layers, experts, windows and scan chunks stay the tiny model's, so its layer kinds and
  window effects are the same, at a width where arithmetic rather than op dispatch dominates.
- ``build_random(name)`` seeds torch's global generator with a fixed seed before building, so
  the weights are identical in every process (CPU; the same torch build).
- Special token ids lie inside the vocabulary (Kimi-Linear's defaults do not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from hybridkv.registry import Registry

SEED = 1234
VOCAB = 256
CONTEXT = 512  # max_position_embeddings of every tiny model

_GEMMA3: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=8,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
)
"""The tiny Gemma 3 both Gemma entries share; each adds its layer pattern."""

_TINY_TABLE: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-qwen3-next": (
        "qwen3_next",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            full_attention_interval=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
    ),
    "tiny-gemma3": ("gemma3_text", {**_GEMMA3, "sliding_window_pattern": 3}),
    # Gemma 3 with every layer full attention: the dense control (bench serve --peer)
    "tiny-gemma3-dense": ("gemma3_text", {**_GEMMA3, "layer_types": ["full_attention"] * 6}),
    "tiny-gpt-oss": (
        "gpt_oss",
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=12,
            num_local_experts=8,
            num_experts_per_tok=2,
            pad_token_id=0,
            eos_token_id=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "tiny-nemotron-h": (
        "nemotron_h",
        dict(
            hidden_size=64,
            intermediate_size=128,
            hybrid_override_pattern="M-M*-M",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            ssm_state_size=16,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            conv_kernel=4,
            expand=2,
            chunk_size=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "tiny-kimi-linear": (
        "kimi_linear",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            linear_attn_config={
                "head_dim": 16,
                "num_heads": 4,
                "short_conv_kernel_size": 4,
                "full_attn_layers": [2, 4],
                "kda_layers": [1, 3],
            },
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}

TINY_CONFIGS = Registry("tiny random model", _TINY_TABLE)

WIDTHS = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "head_dim",
        "query_pre_attn_scalar",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "mamba_head_dim",
        "ssm_state_size",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
    }
)
"""The overrides ``widen`` multiplies (and ``linear_attn_config``'s ``head_dim``, Kimi-Linear's KDA heads)."""
MAX_WIDEN = 64


def tiny_names() -> list[str]:
    return list(TINY_CONFIGS)


def widened(overrides: dict[str, Any], widen: int) -> dict[str, Any]:
    """``overrides`` with every width (``WIDTHS``) multiplied by ``widen``."""
    if isinstance(widen, bool) or not isinstance(widen, int) or not 1 <= widen <= MAX_WIDEN:
        raise ValueError(f"widen must be an integer in [1, {MAX_WIDEN}], got {widen!r}")
    out = {key: value * widen if key in WIDTHS else value for key, value in overrides.items()}
    if "linear_attn_config" in out:
        linear = out["linear_attn_config"]
        out["linear_attn_config"] = {**linear, "head_dim": linear["head_dim"] * widen}
    return out


def random_config(name: str, widen: int = 1) -> Any:
    """The ``transformers`` config of the tiny random model ``name`` (no weights built), its widths times ``widen``."""
    from transformers import AutoConfig

    model_type, overrides = TINY_CONFIGS[name]  # UnknownName (a KeyError) names the known ones
    overrides = widened(overrides, widen)
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, max_position_embeddings=CONTEXT, **overrides)
    config._attn_implementation = "eager"
    return config


def build_random(name: str, widen: int = 1) -> tuple[Any, Any]:
    """``(hf_model, hf_config)`` of a tiny random model (its widths times ``widen``), identical in every process."""
    import torch  # here, not at the top: the CLI lists these names without importing torch
    from transformers import AutoModelForCausalLM

    config = random_config(name, widen)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model, config


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' notes (e.g. "falling back to the reference PyTorch implementation", which
    is the computation the engine is compared with) inside the block; its verbosity is restored after."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def save_random(name: str, directory: str) -> Any:
    """Build the tiny random model ``name`` and save it to ``directory`` (``config.json`` + safetensors, what the
    engine and its processes load), quietly; returns the ``transformers`` model (the reference)."""
    from transformers.utils import logging as hf_logging

    with quiet_transformers():
        model, _ = build_random(name)
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(directory)
        finally:
            hf_logging.enable_progress_bar()
    return model
