"""Where each element of the optimizer state lives, for any way of cutting Megatron's grad buffers.

Megatron's DistributedOptimizer cuts each contiguous grad buffer into one range per DP rank and
keeps Adam state only for its range; `ReplicatedOptimizer` cuts the same buffer into fewer,
larger ranges. Checkpoints must stay in the stock layout (one `optim.pt` per DP rank), so state
has to move between the two cuts. This module does that with plain tensors and no Megatron
import: a cut is described by `BufferSpec`s, every rank's state is first spread onto flat
per-buffer arrays ("flat state") and then sliced again for the other cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Sequence, Tuple

import torch

BufferKey = Tuple[int, str]  # (model chunk index, grad-buffer dtype name)
PARAM_KEY = "param"  # flat-state key of the fp32 main parameters


@dataclass(frozen=True)
class ParamSpec:
    """One model parameter inside a grad buffer: [start, end) in buffer coordinates."""

    index: int  # position in the buffer's parameter map (Megatron's dict order)
    start: int
    end: int
    group: int  # index of the original optimizer param group
    float16: bool  # True when the main param is a separate fp32 copy


@dataclass(frozen=True)
class BufferSpec:
    key: BufferKey
    numel: int
    numel_padded: int
    params: Tuple[ParamSpec, ...]


@dataclass(frozen=True)
class Slot:
    """The part of one parameter that one rank's optimizer owns."""

    buffer: BufferKey
    param: ParamSpec
    world_start: int  # owned range in buffer coordinates
    world_end: int

    @property
    def size(self) -> int:
        return self.world_end - self.world_start


@dataclass(frozen=True)
class Cut:
    """How a rank's optimizer range is chosen: `parts` ranges of `part_size(buffer)` elements."""

    parts: int
    stock: bool  # Megatron's rounding (ceil(numel/parts)) instead of numel_padded/parts

    def part_size(self, buf: BufferSpec) -> int:
        if self.stock:
            return int(math.ceil(buf.numel / self.parts))
        if buf.numel_padded % self.parts:
            raise ValueError(
                f"grad buffer {buf.key} has {buf.numel_padded} padded elements, not divisible "
                f"by {self.parts} shards"
            )
        return buf.numel_padded // self.parts

    def owned(self, buf: BufferSpec, part: int) -> Tuple[int, int]:
        size = self.part_size(buf)
        start = min(buf.numel, part * size)
        return start, min(buf.numel, start + size)


def optimizer_groups(
    buffers: Sequence[BufferSpec], cut: Cut, part: int, num_groups: int
) -> List[Tuple[int, List[Slot]]]:
    """The param groups Megatron's DistributedOptimizer builds for `part`: (orig index, slots).

    Order matters because torch numbers optimizer state by it: buffers in order, params in
    buffer order, fp32 params before float16 ones inside each group, empty groups dropped
    (distrib_optimizer.py build_optimizer_group_ranges / build_model_and_main_param_groups).
    """
    per_group: List[List[Slot]] = [[] for _ in range(num_groups)]
    for buf in buffers:
        lo, hi = cut.owned(buf, part)
        for p in buf.params:
            start, end = max(lo, p.start), min(hi, p.end)
            if end > start:
                per_group[p.group].append(Slot(buf.key, p, start, end))
    groups = []
    for index, slots in enumerate(per_group):
        if slots:
            ordered = [s for s in slots if not s.param.float16] + [
                s for s in slots if s.param.float16
            ]
            groups.append((index, ordered))
    return groups


FlatState = Dict[BufferKey, Dict[str, torch.Tensor]]  # full-buffer-length fp32 arrays


def empty_flat(buffers: Sequence[BufferSpec], keys: Sequence[str]) -> FlatState:
    return {b.key: {k: torch.zeros(b.numel, dtype=torch.float32) for k in keys} for b in buffers}


def scatter_slots(
    flat: FlatState, slots: Sequence[Slot], values: Sequence[Mapping[str, torch.Tensor]]
) -> None:
    """Write each slot's per-element tensors into the flat arrays (keys missing in flat skipped)."""
    for slot, vals in zip(slots, values):
        arrays = flat[slot.buffer]
        for key, tensor in vals.items():
            if key in arrays:
                arrays[key][slot.world_start : slot.world_end] = tensor.detach().reshape(-1)


def gather_slots(flat: FlatState, slots: Sequence[Slot]) -> List[Dict[str, torch.Tensor]]:
    return [
        {k: a[s.world_start : s.world_end].clone() for k, a in flat[s.buffer].items()}
        for s in slots
    ]


def pack_owned(
    flat: FlatState, buffers: Sequence[BufferSpec], cut: Cut, part: int, keys: Sequence[str]
) -> torch.Tensor:
    """One 1-D tensor with the owned range of every buffer and key, each padded to part size.

    Every part of a cut packs to the same length, so the result can go through an all-gather.
    """
    pieces = []
    for buf in buffers:
        lo, hi = cut.owned(buf, part)
        size = cut.part_size(buf)
        for key in keys:
            piece = torch.zeros(size, dtype=torch.float32)
            piece[: hi - lo] = flat[buf.key][key][lo:hi]
            pieces.append(piece)
    return torch.cat(pieces) if pieces else torch.zeros(0)


def unpack_owned(
    flat: FlatState,
    packed: torch.Tensor,
    buffers: Sequence[BufferSpec],
    cut: Cut,
    part: int,
    keys: Sequence[str],
) -> None:
    offset = 0
    for buf in buffers:
        lo, hi = cut.owned(buf, part)
        size = cut.part_size(buf)
        for key in keys:
            flat[buf.key][key][lo:hi] = packed[offset : offset + hi - lo]
            offset += size
    if offset != packed.numel():
        raise ValueError(f"packed optimizer shard has {packed.numel()} elements, expected {offset}")


def packed_length(buffers: Sequence[BufferSpec], cut: Cut, keys: Sequence[str]) -> int:
    return sum(cut.part_size(b) for b in buffers) * len(keys)


def inner_state_dict(
    groups: Sequence[Tuple[int, List[Slot]]],
    slot_values: Sequence[Sequence[Mapping[str, torch.Tensor]]],
    scalars: Mapping[str, torch.Tensor],
    group_hparams: Mapping[int, Mapping[str, object]],
) -> dict:
    """A torch optimizer state_dict for `groups` (as torch.optim.Optimizer.state_dict builds it).

    `slot_values[g][i]` holds the per-element state of slot i of group g (reshaped to the
    slot's size); `scalars` (e.g. Adam's `step`) are shared by every param.
    """
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    param_groups = []
    index = 0
    for (orig, slots), values in zip(groups, slot_values):
        ids = []
        for _slot, vals in zip(slots, values):
            entry = {k: v for k, v in vals.items() if k != PARAM_KEY}
            if entry or scalars:
                entry.update({k: v.clone() for k, v in scalars.items()})
                state[index] = entry
            ids.append(index)
            index += 1
        hp = {k: v for k, v in group_hparams[orig].items() if k != "params"}
        hp["params"] = ids
        param_groups.append(hp)
    return {"state": state, "param_groups": param_groups}


def split_inner_state(
    groups: Sequence[Tuple[int, List[Slot]]], sd: Mapping
) -> Tuple[List[List[Dict[str, torch.Tensor]]], Dict[str, torch.Tensor]]:
    """Inverse of `inner_state_dict`: per-slot element tensors and the shared scalars."""
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"optimizer state has {len(saved_groups)} param groups where this layout has "
            f"{len(groups)}: the checkpoint was written with another parallel layout"
        )
    per_slot: List[List[Dict[str, torch.Tensor]]] = []
    scalars: Dict[str, torch.Tensor] = {}
    for (_orig, slots), saved in zip(groups, saved_groups):
        if len(saved["params"]) != len(slots):
            raise ValueError(
                f"optimizer group has {len(saved['params'])} params, layout expects {len(slots)}"
            )
        values = []
        for slot, pid in zip(slots, saved["params"]):
            vals = {}
            for key, tensor in sd["state"].get(pid, {}).items():
                if torch.is_tensor(tensor) and tensor.numel() == slot.size and tensor.dim() > 0:
                    vals[key] = tensor.reshape(-1).float()
                else:
                    scalars.setdefault(key, tensor)
            values.append(vals)
        per_slot.append(values)
    return per_slot, scalars
