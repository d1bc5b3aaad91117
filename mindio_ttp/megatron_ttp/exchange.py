"""Process groups for the dying checkpoint, over the chosen ranks only.

The save handler runs while peers are dead and the main thread may be stuck in one of
Megatron's collectives, so it can use neither Megatron's groups nor `torch.distributed.new_group`
(a collective over the world). A `ProcessGroupGloo` built directly on a `PrefixStore` needs only its
members. The store is the one the save order names (faulttime/save_session.py: a fresh
TCPStore the ordering controller hosts), not the job's rendezvous store: that one lives in node
0's launcher agent and is gone with node 0. Outside a save order (tools, tests) the job's store
is used. Store keys are never reused: each save order has its own random tag, and each attempt
on the job's store its own counter.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from mindio_ttp.faulttime import save_session

EXCHANGE_TIMEOUT = timedelta(seconds=120)
_attempts: Dict[Tuple[int, Tuple[int, ...]], itertools.count[int]] = {}


def attempt_tag(step: int, save_ranks: Sequence[int]) -> str:
    """A store prefix unique to this save attempt (same on every chosen rank): the save
    order's tag, or (outside an order) a count of the attempts for exactly this step and rank
    set, which every chosen rank keeps alike."""
    session = save_session.current()
    if session is not None and session.step == step:
        return f"ttp_save/{session.tag}"
    key = (step, tuple(sorted(save_ranks)))
    return f"ttp_save/{step}/{next(_attempts.setdefault(key, itertools.count()))}"


def gloo_group(ranks: Sequence[int], my_rank: int, prefix: str,
               store: Optional[dist.Store] = None,
               timeout: Optional[timedelta] = None) -> Optional[dist.ProcessGroupGloo]:
    """A gloo group over `ranks` (global ranks, any order); None for a single rank. Without a
    `store`: the current save order's store and time limit, else the job's store."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return None
    session = save_session.current()
    if store is None and session is not None:
        store = session.store()
        timeout = timeout or session.timeout
    elif store is None:
        store = dist.distributed_c10d._get_default_store()
    timeout = timeout or EXCHANGE_TIMEOUT
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), ranks.index(my_rank),
                                 len(ranks), timeout)


def barrier(group: Optional[dist.ProcessGroupGloo]) -> None:
    if group is not None:
        group.allreduce([torch.zeros(1)]).wait()


def all_true(group: Optional[dist.ProcessGroupGloo], flag: bool) -> bool:
    """Whether `flag` holds on every member (also a barrier); `flag` without a group."""
    if group is None:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([t], opts).wait()
    return bool(t.item())


def allgather(group: Optional[dist.ProcessGroupGloo], tensor: torch.Tensor,
              size: int) -> List[torch.Tensor]:
    """Every member's `tensor` (all the same shape), in rank order; [tensor] without a group."""
    if group is None:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    group.allgather([parts], [tensor]).wait()
    return parts
