"""Run by a vLLM venv's python (not by pytest): HybridKVConnector end to end on a tiny model.

    python tests/integrations/vllm_connector_driver.py --model llama|gemma3|qwen3next --out result.json

1. builds a tiny random model (seeded) with ``save_pretrained`` in a temporary directory: fp32, but
   Qwen3-Next in bf16 (vLLM's CPU GDN kernel takes only bf16 and linear head dims of 128);
2. serves it with ``vllm.LLM`` (prefix caching, greedy) *without* a connector: the reference tokens;
3. serves it again with ``HybridKVConnector``: a shared-prefix workload, ``reset_prefix_cache()``, the
   workload again (hits come from the connector), then every stored object damaged,
   ``reset_prefix_cache()`` and the workload a third time (loads fail, vLLM recomputes, the damaged
   objects leave, the recomputed blocks are saved anew), and a fourth (hits again, no new errors);
   with a recurrent group, a fifth, the control: every stored state replaced by well-formed zeros
   (what a connector that skips the state restores), so the tokens must differ;
4. writes the tokens, timings and the connector's counters as JSON for the test to judge.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the driver can read
the scheduler's and the worker's connector objects; they still talk only through vLLM's metadata.
With ``--mp`` it runs in vLLM's own child process (the default layout): passes 1 and 2 only, judged by
tokens and by the first request's cached tokens after the reset (external hits only). With
``--store-master`` a host tier too small for the prefix over the Mooncake Store: passes 1 and 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any

# --mp: vLLM's default process layout (the engine core in a child process); no introspection then
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if "--mp" in sys.argv else "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
BLOCKS = {"qwen3next": 64}
"""vLLM raises a hybrid model's block size until an attention page holds a recurrent state: 64 for
this tiny Qwen3-Next (its state fits 64 tokens of its 4 KV heads of 128)."""
DTYPES = {"qwen3next": "bfloat16"}
VOCAB = 512
WINDOW = 64
MAX_LEN = 4096


def build_model(kind: str, directory: str, hidden: int = 64, layers: int = 2) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        config: Any = Gemma3TextConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            max_position_embeddings=MAX_LEN,
        )
    elif kind == "qwen3next":
        from transformers import Qwen3NextConfig

        config = Qwen3NextConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=128,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,  # vLLM's CPU GDN kernel: 128 only
            linear_value_head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            full_attention_interval=2,  # GDN, full, GDN, full
            max_position_embeddings=MAX_LEN,
        )
    else:
        from transformers import LlamaConfig

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=MAX_LEN,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a random model's logits are flat; sharpen them so greedy ties cannot flip
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(directory)


def workload(prefix_blocks: int, seed: int = 7, block: int = BLOCK, tail: int = 0) -> list[list[int]]:
    """Four prompts sharing ``prefix_blocks`` blocks and ``tail + 3`` tokens."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(prefix_blocks * block + tail + 3)]
    return [prefix + [rng.randrange(1, VOCAB) for _ in range(5 + 3 * i)] for i in range(4)]


def make_llm(
    model_dir: str,
    connector: bool,
    chunk: int,
    host_bytes: int | str = "256MiB",
    block: int = BLOCK,
    dtype: str = "float32",
    extra: dict[str, Any] | None = None,
    unit: int | None = None,
) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": model_dir,
        "dtype": dtype,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "block_size": block,
        "max_model_len": MAX_LEN,
        "max_num_seqs": 8,
        "max_num_batched_tokens": chunk,  # small: prompts are prefilled in chunks, blocks saved across steps
        "skip_tokenizer_init": True,
        "seed": 0,
    }
    if unit is not None:  # vLLM's sub-block hits: a prefix-cache key every `unit` tokens
        kwargs["prefix_match_unit"] = unit
    if connector:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "HybridKVConnector",
            "kv_connector_module_path": "hybridkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"host_bytes": host_bytes, **(extra or {})},
        }
    return LLM(**kwargs)


def generate(llm: Any, prompts: list[list[int]]) -> tuple[list[list[int]], list[int], float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    took = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    cached = [int(o.num_cached_tokens or 0) for o in outs]
    return tokens, cached, took


def connectors(llm: Any) -> tuple[Any, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return scheduler, get_kv_transfer_group()


def spec_check() -> dict[str, Any]:
    """vLLM's own spec classes through the connector's group rule: full + window + Mamba groups, every
    block of the full and window groups held. A Mamba group without block-aligned checkpoints
    (``mamba_cache_mode="none"``) refuses every hit; in "align" mode the hit ends at the last block
    whose state checkpoint is held."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

    from hybridkv.integrations.vllm.connector import group_layouts
    from hybridkv.integrations.vllm.layout import BlockIndex

    f32 = torch.float32
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=f32)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=f32, sliding_window=WINDOW)
    out: dict[str, Any] = {}
    names = list(range(1, 9))
    for mode in ("none", "align"):
        state = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(f32,), mamba_cache_mode=mode)
        specs = [("full.0", full), ("swa.1", swa), ("mamba.2", state)]
        groups = group_layouts(SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([n], sp) for n, sp in specs]))
        index = BlockIndex(groups)
        index.add((g, n) for g in (0, 1) for n in names)
        index.add([(2, names[2]), (2, names[5])])  # states after 3 and after 6 blocks
        out[mode] = {
            "kinds": [g.kind.value for g in groups],
            "why": index.supported,
            "hit_blocks": index.hit_blocks(names),
            "hit_blocks_without_state_group": BlockIndex(groups[:2], set(index.held)).hit_blocks(names),
        }
    return out


def zero_states(sched: Any, worker: Any) -> int:
    """Replace every stored recurrent state by a well-formed frame of zeros (checksums pass): what a
    connector that restores attention KV but skips the state (LMCache on hybrid models) leaves."""
    import torch

    from hybridkv.integrations.vllm.layout import GroupKind, block_key
    from hybridkv.tiers.framing import frame

    count = 0
    for g in (g for g in sched.groups if g.kind is GroupKind.STATE):
        keys = [block_key(worker.prefixes[g.index], name) for gi, name in sched.index.held if gi == g.index]
        zeros = torch.zeros(worker._payload_bytes[g.index], dtype=torch.uint8)
        worker.tier.evict(keys)
        worker.tier.put(keys, [frame(k, zeros) for k in keys], label=f"g{g.index}")
        count += len(keys)
    return count


def evict_check(model_dir: str, args: Any) -> dict[str, Any]:
    """A host tier that holds one shared prefix of two: A then B fill it (B evicts most of A); after a
    reset, B hits (its blocks are held) and A misses (the scheduler heard of A's evictions), with no
    load error and the reference tokens."""
    a, b = workload(args.prefix_blocks, 7, args.block), workload(args.prefix_blocks, 8, args.block)
    result: dict[str, Any] = {}
    llm = make_llm(model_dir, False, args.chunk, block=args.block, dtype=args.dtype)
    result["ref_a"], _, _ = generate(llm, a)
    result["ref_b"], _, _ = generate(llm, b)
    del llm
    gc.collect()
    llm = make_llm(model_dir, True, args.chunk, args.host_bytes, args.block, args.dtype)
    sched, worker = connectors(llm)
    result["a1"], _, _ = generate(llm, a)
    result["b1"], _, _ = generate(llm, b)
    llm.reset_prefix_cache()
    result["b2"], result["b2_cached"], _ = generate(llm, b)  # B first: A's recompute would evict it
    result["a2"], result["a2_cached"], _ = generate(llm, a)
    result["report"] = {"scheduler": sched.scheduler_report(), "worker": worker.worker_report()}
    del llm
    gc.collect()
    return result


def store_check(model_dir: str, args: Any) -> dict[str, Any]:
    """A host tier of two objects over the Mooncake Store at ``args.store_master``: the host's evictions
    are written back, and after a reset the prefix is loaded mostly from the store, tokens unchanged."""
    prompts = workload(args.prefix_blocks, 7, args.block)
    result: dict[str, Any] = {}
    llm = make_llm(model_dir, False, args.chunk, block=args.block, dtype=args.dtype)
    result["reference"], _, _ = generate(llm, prompts)
    del llm
    gc.collect()
    store = {"store_master": args.store_master, "store_segment_bytes": "64MiB"}
    llm = make_llm(model_dir, True, args.chunk, args.host_bytes, args.block, args.dtype, store)
    sched, worker = connectors(llm)
    result["pass1"], _, _ = generate(llm, prompts)
    llm.reset_prefix_cache()
    result["pass2"], result["pass2_cached"], _ = generate(llm, prompts)
    result["report"] = {"scheduler": sched.scheduler_report(), "worker": worker.worker_report()}
    del llm
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["llama", "gemma3", "qwen3next"], default="llama")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix-blocks", type=int, default=5, help="whole blocks of the shared prefix")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--chunk", type=int, help="vLLM's max_num_batched_tokens (chunked prefill; default 3 blocks)")
    ap.add_argument("--mp", action="store_true", help="engine core in its own process: tokens and hits only")
    ap.add_argument("--spec-check", action="store_true", help="the group rule on vLLM's spec classes only")
    ap.add_argument("--evict-check", action="store_true", help="a host tier too small for two prefixes")
    ap.add_argument("--host-bytes", default="256MiB", help="the host tier's budget (kv_connector_extra_config)")
    ap.add_argument("--store-master", help="--store-check: host:port of a running mooncake_master")
    ap.add_argument("--prefix-match-unit", type=int, help="vLLM's prefix_match_unit (sub-block hits), both runs")
    ap.add_argument("--tail-tokens", type=int, default=0, help="shared prefix tokens past its whole blocks (+3)")
    args = ap.parse_args()
    args.block, args.dtype = BLOCKS.get(args.model, BLOCK), DTYPES.get(args.model, "float32")
    args.chunk = args.chunk or 3 * args.block
    if args.spec_check:
        with open(args.out, "w") as f:
            json.dump(spec_check(), f, indent=1)
        return
    result: dict[str, Any] = {"model": args.model, "prefix_blocks": args.prefix_blocks, "hidden": args.hidden}
    result["layers"], result["chunk"], result["block"] = args.layers, args.chunk, args.block
    result["tail_tokens"] = args.tail_tokens
    prompts = workload(args.prefix_blocks, block=args.block, tail=args.tail_tokens)
    with tempfile.TemporaryDirectory() as model_dir:
        build_model(args.model, model_dir, args.hidden, args.layers)
        if args.evict_check or args.store_master:
            check = evict_check if args.evict_check else store_check
            with open(args.out, "w") as f:
                json.dump({**result, **check(model_dir, args)}, f, indent=1)
            return
        unit = args.prefix_match_unit
        llm = make_llm(model_dir, False, args.chunk, block=args.block, dtype=args.dtype, unit=unit)
        result["reference"], _, result["reference_s"] = generate(llm, prompts)
        llm.reset_prefix_cache()
        _, _, result["reference_cold_s"] = generate(llm, prompts)  # the same work, warmed up
        del llm
        gc.collect()

        llm = make_llm(model_dir, True, args.chunk, block=args.block, dtype=args.dtype, unit=unit)
        if args.mp:
            result["pass1"], result["pass1_cached"], result["pass1_s"] = generate(llm, prompts)
            llm.reset_prefix_cache()
            result["pass2"], result["pass2_cached"], result["pass2_s"] = generate(llm, prompts)
            del llm
            gc.collect()
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            return
        sched, worker = connectors(llm)
        result["groups"] = [g.kind.value for g in sched.groups]
        result["pass1"], result["pass1_cached"], result["pass1_s"] = generate(llm, prompts)
        result["after_pass1"] = {"scheduler": sched.scheduler_report(), "worker": worker.worker_report()}
        # a window group needs only its window: drop every window-group block before the last window
        # of the shared prefix; the hit must stay whole
        from hybridkv.integrations.vllm.layout import GroupKind, block_names

        names = block_names(prompts[0][: args.prefix_blocks * args.block], args.block, ("vllm", None, None))
        first_needed = max(0, len(names) * args.block - WINDOW) // args.block
        drop = [(g.index, n) for g in sched.groups if g.kind is GroupKind.WINDOW for n in names[:first_needed]]
        result["window_dropped"] = worker.evict_blocks(drop)
        llm.generate([{"prompt_token_ids": [1]}], use_tqdm=False)  # one step carries the report to the scheduler
        llm.reset_prefix_cache()
        result["pass2"], result["pass2_cached"], result["pass2_s"] = generate(llm, prompts)
        result["after_pass2"] = {"scheduler": sched.scheduler_report(), "worker": worker.worker_report()}
        result["damaged"] = worker.damage_stored()
        llm.reset_prefix_cache()
        result["pass3"], result["pass3_cached"], result["pass3_s"] = generate(llm, prompts)
        result["after_pass3"] = {"scheduler": sched.scheduler_report(), "worker": worker.worker_report()}
        llm.reset_prefix_cache()  # the recomputed blocks were saved anew: hits again, no new errors
        result["pass4"], result["pass4_cached"], result["pass4_s"] = generate(llm, prompts)
        result["after_pass4"] = {"scheduler": sched.scheduler_report(), "worker": worker.worker_report()}
        if "state" in result["groups"]:  # the control: a well-formed zero state, as a connector skipping it gives
            result["zeroed_states"] = zero_states(sched, worker)
            llm.reset_prefix_cache()
            result["pass5"], result["pass5_cached"], _ = generate(llm, prompts)
            result["after_pass5"] = {"scheduler": sched.scheduler_report(), "worker": worker.worker_report()}
        del llm
        gc.collect()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
