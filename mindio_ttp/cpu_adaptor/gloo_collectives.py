"""The flat-buffer collectives Megatron-LM 285068c calls, on a gloo that lacks them.

Megatron gathers and reduce-scatters flat buffers with ``torch.distributed._all_gather_base``
and ``_reduce_scatter_base`` (``timers.py:200``, ``optimizer/distrib_optimizer.py:577,611``,
``core/tensor_parallel/mappings.py:102,122``, ``layers.py:232,257,292``, ``utils.py:83``).
NCCL has had both since torch 1.x; gloo only in recent releases (torch 2.13's does, 2.1.2's
refuses both before sending anything). For
Megatron's calls (:mod:`mindio_ttp.compat.scope`) a missing one is done with the collectives
every gloo has: ``all_gather`` into the output's chunks, and ``all_reduce`` of a copy of the
input followed by a copy of this rank's chunk. Whether gloo has them is learnt from gloo's own
refusal, once per process, never from a version number.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from mindio_ttp.compat.journal import Journal
from mindio_ttp.compat.scope import called_from_megatron

# How gloo says it lacks one: its C++ ("no support for _allgather_base in Gloo process group")
# and torch's Python check ("Backend gloo does not support _reduce_scatter_base").
_UNSUPPORTED = ("no support for", "does not support")
_missing: Dict[str, bool] = {}


class _Done:
    """What an ``async_op=True`` call returns when the fallback already ran synchronously."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _gather(output: torch.Tensor, input: torch.Tensor, group: Optional[Any] = None) -> None:
    world = dist.get_world_size(group)
    dist.all_gather(list(output.chunk(world)), input, group=group)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                    group: Optional[Any] = None) -> None:
    reduced = input.clone()
    dist.all_reduce(reduced, op=op, group=group)
    output.copy_(reduced.chunk(dist.get_world_size(group))[dist.get_rank(group)])


def _with_fallback(name: str, fallback: Callable[..., None]) -> Callable[[Any], Any]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if not _missing.get(name) or not called_from_megatron():
                try:
                    return original(*args, **kwargs)
                except RuntimeError as exc:
                    if not any(m in str(exc) for m in _UNSUPPORTED) or not called_from_megatron():
                        raise
                    _missing[name] = True
            async_op = kwargs.pop("async_op", False)
            fallback(*args, **kwargs)
            return _Done() if async_op else None

        return collective

    return make


def install(journal: Journal) -> None:
    """Wrap both collectives (a call that gloo serves goes straight through)."""
    journal.wrap(dist, "_all_gather_base", _with_fallback("_all_gather_base", _gather))
    journal.wrap(dist, "_reduce_scatter_base",
                 _with_fallback("_reduce_scatter_base", _reduce_scatter))
