"""Process groups for the dying checkpoint, over the chosen ranks only.

The save handler runs while peers are dead and the main thread may be stuck in one of
Megatron's collectives, so it can use neither Megatron's groups nor `torch.distributed.new_group`
(a collective over the world). A `ProcessGroupGloo` built directly on a `PrefixStore` of the
job's store needs only its members. Under torchrun/ttprun that store lives in the launcher
agent, so it outlives dead workers (rank 0 included). Store keys are never reused: each save
attempt for the same step and ranks gets its own prefix.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

EXCHANGE_TIMEOUT = timedelta(seconds=120)
_attempts: Dict[Tuple[int, Tuple[int, ...]], itertools.count[int]] = {}


def attempt_tag(step: int, save_ranks: Sequence[int]) -> str:
    """A store prefix unique to this save attempt (same on every chosen rank: each of them
    counts the attempts for exactly this step and rank set)."""
    key = (step, tuple(sorted(save_ranks)))
    return f"ttp_save/{step}/{next(_attempts.setdefault(key, itertools.count()))}"


def gloo_group(ranks: Sequence[int], my_rank: int, prefix: str,
               store: Optional[dist.Store] = None,
               timeout: timedelta = EXCHANGE_TIMEOUT) -> Optional[dist.ProcessGroupGloo]:
    """A gloo group over `ranks` (global ranks, any order); None for a single rank."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return None
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), ranks.index(my_rank),
                                 len(ranks), timeout)


def barrier(group: Optional[dist.ProcessGroupGloo]) -> None:
    if group is not None:
        group.allreduce([torch.zeros(1)]).wait()


def allgather(group: Optional[dist.ProcessGroupGloo], tensor: torch.Tensor,
              size: int) -> List[torch.Tensor]:
    """Every member's `tensor` (all the same shape), in rank order; [tensor] without a group."""
    if group is None:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    group.allgather([parts], [tensor]).wait()
    return parts
