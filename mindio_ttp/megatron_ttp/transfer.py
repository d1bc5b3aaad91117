"""Moving a nested state (dicts, lists, tensors, anything picklable) from one rank to another.

Used by the in-memory recovery to refill a replacement from its replica partner over the new
pair group. The structure travels once as a pickled skeleton (`broadcast_object_list`, which
torch runs on the group's device); the tensors travel packed, one flat buffer per dtype, on the
device the job's collectives use (`torch.cuda.current_device()`, Megatron's idiom: the device
adaptor maps it to the NPU, the CPU adaptor to the CPU), so a refill is a handful of
broadcasts whatever the number of tensors. Tensors that lived on the host on the sender (Adam's
`step` counters) are put back on the host on the receiver.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist


class _Slot:
    """Where a tensor was in the tree: its index among the tensors of its dtype."""

    __slots__ = ("dtype", "index", "shape", "host")

    def __init__(self, dtype: torch.dtype, index: int, shape: Tuple[int, ...], host: bool):
        self.dtype, self.index, self.shape, self.host = dtype, index, shape, host


def _strip(tree: Any, tensors: Dict[torch.dtype, List[torch.Tensor]]) -> Any:
    if torch.is_tensor(tree):
        group = tensors.setdefault(tree.dtype, [])
        group.append(tree.detach())
        return _Slot(tree.dtype, len(group) - 1, tuple(tree.shape), tree.device.type == "cpu")
    if isinstance(tree, dict):
        return type(tree)((k, _strip(v, tensors)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(_strip(v, tensors) for v in tree)
    return tree


def _fill(skeleton: Any, tensors: Dict[torch.dtype, List[torch.Tensor]]) -> Any:
    if isinstance(skeleton, _Slot):
        t = tensors[skeleton.dtype][skeleton.index]
        return t.cpu() if skeleton.host else t
    if isinstance(skeleton, dict):
        return type(skeleton)((k, _fill(v, tensors)) for k, v in skeleton.items())
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_fill(v, tensors) for v in skeleton)
    return skeleton


def _device() -> torch.device:
    return torch.device(torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def _layout(skeleton: Any, out: Dict[torch.dtype, List[Tuple[int, Tuple[int, ...]]]]) -> None:
    if isinstance(skeleton, _Slot):
        out.setdefault(skeleton.dtype, []).append((skeleton.index, skeleton.shape))
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            _layout(v, out)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            _layout(v, out)


def send_tree(tree: Any, src: int, group: Any) -> None:
    """Broadcast `tree` from this rank (global rank `src`) to the other member of `group`."""
    tensors: Dict[torch.dtype, List[torch.Tensor]] = {}
    skeleton = _strip(tree, tensors)
    dist.broadcast_object_list([skeleton], src=src, group=group)
    device = _device()
    for dtype in sorted(tensors, key=str):
        flat = torch.cat([t.reshape(-1).to(device) for t in tensors[dtype]]) if tensors[dtype] \
            else torch.empty(0, dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)


def recv_tree(src: int, group: Any) -> Any:
    """The tree `send_tree` broadcast from global rank `src` (tensors on this rank's device,
    or on the host where they were on the host)."""
    holder: List[Any] = [None]
    dist.broadcast_object_list(holder, src=src, group=group)
    skeleton = holder[0]
    layout: Dict[torch.dtype, List[Tuple[int, Tuple[int, ...]]]] = {}
    _layout(skeleton, layout)
    device = _device()
    tensors: Dict[torch.dtype, List[torch.Tensor]] = {}
    for dtype in sorted(layout, key=str):
        shapes = [shape for _, shape in sorted(layout[dtype])]
        sizes = [_numel(s) for s in shapes]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        parts, offset = [], 0
        for shape, size in zip(shapes, sizes):
            # a tensor of its own (torch.set_rng_state, for one, reads a view's storage from
            # its start)
            parts.append(flat[offset:offset + size].view(shape).clone())
            offset += size
        tensors[dtype] = parts
    return _fill(skeleton, tensors)


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
