"""Recurrent state written by a TP 1 prefill engine, moved by ``hybridkv.transfer`` to TP 2 decode ranks.

The conv window of GatedDeltaNet / KDA runs over ``q|k|v`` (Mamba2: ``x|B|C``); a TP rank's
conv channels are its own part of each component. The spec keeps one state tensor per
component, so the transfer plan's contiguous slice along each tensor's ``tp_dim`` is exactly
that rank's part. Checked: for each TP 2 rank, every state tensor the plan (shm copy,
in-process) delivered into its memory equals what that rank's own engine (2 processes, gloo)
computes for the same prompt, within ``REL`` of each tensor's largest magnitude: the rank's
engine sums its partial products in another order (measured: at most 5.4e-7 of the scale,
Nemotron-H; Qwen3-Next 2.8e-7, Kimi-Linear 2.2e-7). A contiguous slice of the concatenated
window differs by O(1) (checked too, so the test tells the two apart). KV pages travel in the
same plan; the engine's TP tests cover KV.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.engine.parallel import launch
from hybridkv.engine.sched.kv import Budget, RequestKV
from hybridkv.engine.sched.request import Request, SamplingParams
from hybridkv.spec import Parallel, ShardSpec
from hybridkv.transfer import buffer_set_from_memory, build_plan, make_transport, memory_cells, pair_entries
from hybridkv.transfer.shared import shared_memory
from tests.engine.harness import hf_model, make_runner, prompt
from tests.engine.parallel import worker

PAGE, CHUNK = 4, 5
REL = 1e-5  # of the tensor's largest magnitude
CONVS = {
    "tiny-qwen3-next": ("conv_q", "conv_k", "conv_v"),
    "tiny-kimi-linear": ("conv_q", "conv_k", "conv_v"),
    "tiny-nemotron-h": ("conv_x", "conv_B", "conv_C"),
}
IDS = prompt(7, 23)


@pytest.fixture(scope="module")
def tp2_states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, np.ndarray]]]:
    """Per model: each TP 2 rank's own state tensors after prefilling ``IDS`` (one launch of 2 processes)."""
    dirs = {}
    for name in CONVS:
        dirs[name] = tmp_path_factory.mktemp(name)
        hf_model(name).save_pretrained(dirs[name])
    jobs = [(str(dirs[name]), PAGE, CHUNK, IDS) for name in CONVS]
    ranks = launch(worker.tp2_prefill_states, 2, (jobs,), timeout_s=180)
    return {name: [ranks[r][str(dirs[name])] for r in range(2)] for name in CONVS}


def _transferred(name: str) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """Prefill ``IDS`` on a TP 1 engine, send the request to two TP 2 decode memories (plan + shm copy):
    the TP 1 state tensors, and each decode rank's as they landed."""
    runner = make_runner(name, PAGE)
    spec, pre_mem = runner.mem.shard.model, runner.mem
    kv, req = worker.prefill(runner, IDS, CHUNK)
    assert req.kv.state_slot is not None
    pre_bufs = buffer_set_from_memory(pre_mem)
    writer = make_transport("shm")
    writer.register(pre_mem.arena.buffer.data_ptr(), pre_mem.arena.nbytes)
    src = memory_cells(pre_mem, req.kv.token_locs()[::PAGE] // PAGE, req.kv.state_slot)
    out = []
    for tp_rank in range(2):
        dec_mem, shared = shared_memory(
            ShardSpec(spec, Parallel(tp_size=2), 0, tp_rank), 3_000_000, page_size=PAGE, max_context=256
        )
        receiver = make_transport("shm", shared)
        try:
            dec_kv = RequestKV(dec_mem, prefix_cache=False)
            dreq = Request(0, list(IDS), SamplingParams())
            dec_kv.admit(dreq, Budget(len(IDS), alone=True))
            dec_kv.allocate([dreq], [len(IDS)])
            assert dreq.kv.state_slot is not None
            dec_bufs = buffer_set_from_memory(dec_mem)
            dst = memory_cells(dec_mem, dreq.kv.token_locs()[::PAGE] // PAGE, dreq.kv.state_slot)
            plan = build_plan(pre_bufs, dec_bufs, pair_entries(pre_bufs, dec_bufs), len(IDS), src, dst)
            writer.write(receiver.session, *plan.ops(), plan.bounds)
            out.append(worker.slot_states(dec_mem, dreq.kv.state_slot))
            dec_kv.free(dreq, cache=False)
            dec_mem.verify()
        finally:
            receiver.close()
            shared.close()
    writer.close()
    whole = worker.slot_states(pre_mem, req.kv.state_slot)
    kv.free(req, cache=False)
    pre_mem.verify()
    return whole, out


@pytest.mark.parametrize("name", sorted(CONVS))
def test_tp1_state_transferred_to_tp2_ranks_equals_each_rank_own_state(name: str, tp2_states: dict) -> None:
    _whole, got = _transferred(name)
    for tp_rank, (landed, own) in enumerate(zip(got, tp2_states[name], strict=True)):
        assert set(landed) == set(own) and any(key.endswith(CONVS[name][0]) for key in own)
        for key, value in own.items():
            where = f"{name} TP rank {tp_rank} {key}"
            assert landed[key].shape == value.shape, where
            scale = float(np.abs(value).max())  # SSM states are ~1e-6, conv windows ~0.5: compare at each scale
            assert scale > 0, f"{where}: an all-zero state tells nothing"
            assert float(np.abs(landed[key] - value).max()) <= REL * scale, where


def test_a_contiguous_slice_of_the_concatenated_window_is_not_a_rank_conv_state(tp2_states: dict) -> None:
    """What the fix avoids: rank 1's conv window ``q_1|k_1|v_1`` is not the second half of ``q|k|v``."""
    name = "tiny-qwen3-next"
    whole, _ = _transferred(name)
    layer = next(key.split("/")[0] for key in whole if key.endswith("/conv_q"))
    full = np.concatenate([whole[f"{layer}/{part}"] for part in CONVS[name]])
    mine = np.concatenate([tp2_states[name][1][f"{layer}/{part}"] for part in CONVS[name]])
    assert full.shape[0] == 2 * mine.shape[0]
    assert float(np.abs(full[mine.shape[0] :] - mine).max()) > 1000 * REL
