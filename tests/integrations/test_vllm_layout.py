"""The vLLM connector's engine-neutral half (no vLLM needed): keys and the hit rule."""

from __future__ import annotations

from hybridkv.integrations.vllm.layout import (
    BlockIndex,
    GroupKind,
    GroupLayout,
    block_key,
    block_names,
    group_prefix,
    split_key,
)

BS = 4


def full(i: int = 0, spec: str = "full-spec") -> GroupLayout:
    return GroupLayout(i, GroupKind.FULL, BS, None, (f"layers.{i}",), spec)


def window(i: int, w: int) -> GroupLayout:
    return GroupLayout(i, GroupKind.WINDOW, BS, w, (f"layers.{i}",), f"swa-{w}")


def test_keys_name_model_layout_group_and_prefix() -> None:
    a = group_prefix("m", "fp1", full())
    assert a != group_prefix("m", "fp2", full())  # another model / dtype
    assert a != group_prefix("m", "fp1", full(spec="other heads"))  # another layout
    assert a != group_prefix("m", "fp1", full(1))  # another group
    assert a != group_prefix("m", "fp1", full(), tp=(1, 2))  # another shard
    names = block_names(list(range(10)), BS, ("vllm", None, None))
    assert len(names) == 2
    assert names[1] == block_names(list(range(4, 8)), BS, None, parent=names[0])[0]
    assert names != block_names(list(range(10)), BS, ("vllm", "salt", None))  # the namespace roots the chain
    assert split_key(block_key(a, names[1])) == (a, names[1])


def test_hit_needs_every_full_block_and_only_the_window() -> None:
    names = list(range(100, 110))
    idx = BlockIndex([full(0), window(1, 2 * BS)])
    idx.add((0, n) for n in names)
    assert idx.hit_blocks(names) == 0  # the window group holds nothing
    idx.add((1, n) for n in names[6:8])  # window blocks 6, 7: a hit of 8 blocks needs exactly those
    assert idx.hit_blocks(names) == 8
    idx.discard([(0, names[2])])  # a full block missing caps the hit before it ...
    assert idx.hit_blocks(names) == 0  # ... and a hit of 2 blocks needs window blocks 0 and 1
    idx.add([(1, names[0]), (1, names[1])])
    assert idx.hit_blocks(names) == 2


def test_a_group_it_cannot_restore_refuses_every_hit() -> None:
    names = list(range(5))
    state = GroupLayout(1, GroupKind.UNSUPPORTED, BS, None, ("mamba",), "MambaSpec", why="recurrent state")
    idx = BlockIndex([full(0), state])
    idx.add((g, n) for g in (0, 1) for n in names)
    assert "recurrent state" in idx.supported
    assert idx.hit_blocks(names) == 0
    assert BlockIndex([full(0), GroupLayout(1, GroupKind.FULL, 2 * BS, None, ("x",), "s")]).supported


def test_a_state_group_hits_only_where_its_checkpoint_is_held() -> None:
    names = list(range(200, 208))
    state = GroupLayout(1, GroupKind.STATE, BS, None, ("mamba",), "MambaSpec align")
    idx = BlockIndex([full(0), state])
    idx.add((0, n) for n in names)
    assert idx.supported == ""
    assert idx.hit_blocks(names) == 0  # every KV block, no state: nothing restorable
    idx.add([(1, names[2]), (1, names[4])])  # the states after 3 and after 5 blocks
    assert idx.hit_blocks(names) == 5
    assert idx.hit_blocks(names[:4]) == 3  # a shorter request: the longest checkpoint inside it
    idx.discard([(0, names[3])])  # a KV block missing before the later checkpoint: the earlier one
    assert idx.hit_blocks(names) == 3
    two = BlockIndex([full(0), state, GroupLayout(2, GroupKind.STATE, BS, None, ("gdn",), "g")], set(idx.held))
    assert two.hit_blocks(names) == 0  # every state group must hold the checkpoint
    two.add([(2, names[2])])
    assert two.hit_blocks(names) == 3


def test_a_tail_hit_needs_the_full_blocks_before_it_its_block_and_every_state() -> None:
    tokens = list(range(1, 4 * BS + 1))
    ns = ("vllm", None, None)
    names = block_names(tokens, BS, ns)
    tails = block_names(tokens[2 * BS : 3 * BS], BS // 2, ns, parent=names[1])  # after 2.5 and 3 blocks
    assert tails[0] not in names and tails[1] != names[2]  # a tail's name is never a block's
    state = GroupLayout(1, GroupKind.STATE, BS, None, ("mamba",), "MambaSpec align")
    idx = BlockIndex([full(0), state])
    idx.add([(0, names[0]), (0, names[1]), (0, names[3])])
    assert idx.full_blocks(names) == 2  # block 2 missing: the run stops there
    assert not idx.holds_tail(tails[0])
    idx.add([(0, tails[0])])
    assert not idx.holds_tail(tails[0])  # the block it ends in, without the state after it
    idx.add([(1, tails[0])])
    assert idx.holds_tail(tails[0]) and not idx.holds_tail(tails[1])
    two = BlockIndex([full(0), state, GroupLayout(2, GroupKind.STATE, BS, None, ("gdn",), "g")], set(idx.held))
    assert not two.holds_tail(tails[0])  # every state group needs the state after it
    with_window = BlockIndex([full(0), state, window(2, 2 * BS)], set(idx.held))
    with_window.add([(2, tails[0])])
    assert not with_window.holds_tail(tails[0])  # vLLM makes no sub-block hits with a sliding window
    assert not BlockIndex([full(0)], {(0, tails[0])}).holds_tail(tails[0])  # no state: nothing to restore
