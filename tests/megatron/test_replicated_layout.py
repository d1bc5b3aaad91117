"""The re-cutting of optimizer state between Megatron's per-DP-rank shards and the replicated
shards (mindio_ttp.megatron_ttp.layout), on synthetic grad buffers: no Megatron needed.

The dying checkpoint and every periodic save depend on this being exact: the files must be what
stock DistributedOptimizer would have written, element for element.
"""

from __future__ import annotations

import random

import pytest
import torch

from mindio_ttp.megatron_ttp import layout
from mindio_ttp.megatron_ttp.layout import PARAM_KEY, BufferSpec, Cut, ParamSpec

KEYS = ["exp_avg", "exp_avg_sq", PARAM_KEY]


def make_buffers(seed: int, dp: int, n_buffers: int = 2) -> list:
    rng = random.Random(seed)
    buffers = []
    for b in range(n_buffers):
        params, start = [], 0
        for i in range(rng.randint(3, 9)):
            size = rng.choice([1, 2, 5, 7, 16, 33])
            params.append(ParamSpec(index=i, start=start, end=start + size,
                                    group=rng.randint(0, 1), float16=rng.random() < 0.3))
            start += size
        padded = dp * -(-start // dp)
        buffers.append(BufferSpec((0, f"dtype{b}"), start, padded, tuple(params)))
    return buffers


def random_flat(buffers) -> layout.FlatState:
    gen = torch.Generator().manual_seed(7)
    return {b.key: {k: torch.randn(b.numel, generator=gen) for k in KEYS} for b in buffers}


def state_dict_for(flat, buffers, cut, part, num_groups=2):
    groups = layout.optimizer_groups(buffers, cut, part, num_groups)
    values = [layout.gather_slots(flat, slots) for _, slots in groups]
    hp = {g: {"lr": 0.1 * (g + 1), "params": []} for g in range(num_groups)}
    return groups, layout.inner_state_dict(groups, values, {"step": torch.tensor(5.0)}, hp)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dp,shards", [(4, 2), (2, 1), (8, 4), (6, 3)])
def test_stock_files_recut_into_replicated_shards_exactly(seed, dp, shards):
    buffers = make_buffers(seed, dp)
    flat = random_flat(buffers)
    stock = Cut(parts=dp, stock=True)
    rebuilt = layout.empty_flat(buffers, KEYS)
    for pos in range(dp):  # as mega.load does: each DP rank reads its own stock file ...
        groups, sd = state_dict_for(flat, buffers, stock, pos)
        per_slot, scalars = layout.split_inner_state(groups, sd)
        assert float(scalars["step"]) == 5.0
        mine = layout.empty_flat(buffers, KEYS)
        layout.scatter_slots(mine, [s for _, ss in groups for s in ss],
                             [v | {PARAM_KEY: flat[s.buffer][PARAM_KEY][s.world_start:s.world_end]}
                              for (_, ss), vals in zip(groups, per_slot) for s, v in zip(ss, vals)])
        packed = layout.pack_owned(mine, buffers, stock, pos, KEYS)
        assert packed.numel() == layout.packed_length(buffers, stock, KEYS)
        layout.unpack_owned(rebuilt, packed, buffers, stock, pos, KEYS)  # ... and all-gathers
    replicated = Cut(parts=shards, stock=False)
    for shard in range(shards):
        for slot in (s for _, ss in layout.optimizer_groups(buffers, replicated, shard, 2)
                     for s in ss):
            for key in KEYS:
                want = flat[slot.buffer][key][slot.world_start:slot.world_end]
                got = rebuilt[slot.buffer][key][slot.world_start:slot.world_end]
                assert torch.equal(want, got), (slot, key)


@pytest.mark.parametrize("seed", range(4))
def test_every_element_is_owned_by_exactly_one_part(seed):
    buffers = make_buffers(seed, 4)
    for cut in (Cut(4, stock=True), Cut(2, stock=False)):
        for buf in buffers:
            count = torch.zeros(buf.numel, dtype=torch.int64)
            for part in range(cut.parts):
                for _, slots in layout.optimizer_groups(buffers, cut, part, 2):
                    for s in slots:
                        if s.buffer == buf.key:
                            count[s.world_start:s.world_end] += 1
            assert torch.equal(count, torch.ones_like(count)), (cut, buf.key)


def test_group_order_puts_fp32_before_float16_and_drops_empty_groups():
    params = (ParamSpec(0, 0, 4, group=1, float16=True), ParamSpec(1, 4, 8, group=1, float16=False),
              ParamSpec(2, 8, 12, group=0, float16=False))
    buffers = [BufferSpec((0, "f"), 12, 12, params)]
    groups = layout.optimizer_groups(buffers, Cut(3, stock=True), 0, num_groups=2)
    assert [g for g, _ in groups] == [1]  # group 0 has nothing in part 0: squeezed like Megatron
    groups = layout.optimizer_groups(buffers, Cut(1, stock=True), 0, num_groups=2)
    assert [(g, [s.param.index for s in slots]) for g, slots in groups] == [(0, [2]), (1, [1, 0])]


def test_inner_state_dict_numbers_params_like_torch_and_round_trips():
    buffers = make_buffers(3, 2)
    flat = random_flat(buffers)
    groups, sd = state_dict_for(flat, buffers, Cut(2, stock=True), 1)
    flat_ids = [i for g in sd["param_groups"] for i in g["params"]]
    assert flat_ids == list(range(len(flat_ids)))
    assert all(PARAM_KEY not in entry for entry in sd["state"].values())
    per_slot, _ = layout.split_inner_state(groups, sd)
    for (_, slots), vals in zip(groups, per_slot):
        for s, v in zip(slots, vals):
            assert torch.equal(v["exp_avg"], flat[s.buffer]["exp_avg"][s.world_start:s.world_end])


def test_split_refuses_a_state_from_another_layout():
    buffers = make_buffers(1, 4)
    groups, sd = state_dict_for(random_flat(buffers), buffers, Cut(4, stock=True), 0)
    sd["param_groups"] = sd["param_groups"][:1] + sd["param_groups"]
    with pytest.raises(ValueError, match="another parallel layout"):
        layout.split_inner_state(groups, sd)


def test_replicated_cut_needs_padding_divisible_by_shards():
    buf = BufferSpec((0, "f"), 10, 10, (ParamSpec(0, 0, 10, 0, False),))
    with pytest.raises(ValueError, match="not divisible by 4 shards"):
        Cut(4, stock=False).part_size(buf)
