"""What the chosen ranks of a dying checkpoint say to each other: one flag, and (rarely) main
params sent to the model-file writer. O(1) connections per rank, nothing over the world.

The save handler runs while peers are dead and the main thread may be stuck in one of
Megatron's collectives, so it can use neither Megatron's groups nor `torch.distributed.new_group`
(a collective over the world). Everything goes through the store the save order names
(faulttime/save_session.py: a fresh store the ordering controller hosts for this order alone),
never the job's rendezvous store, which lives in node 0's launcher agent and is gone with node 0.
Outside a save order (tools, tests) the job's store is used. Any `torch.distributed.Store` works
(a TCPStore, or an authenticated store with the same interface). Store keys are never reused:
each save order has its own random tag, and each attempt on the job's store its own counter.

* A **flag** from one rank to the others (`share_flag` / `read_flag`): one ``set`` by the
  deciding rank, one ``get`` (which waits for the key) by each other rank: one store operation
  per rank and the store's one connection, however many ranks read it. No full mesh: a gloo
  group over n ranks would open n-1 sockets per rank for one bit.
* **Tensors to one rank** (`send_to` / `receive_from`): each sender builds a 2-rank gloo group
  with the receiver only (CPU tensors), so a sender holds one connection and its own tensor;
  the receiver one connection per sender, and what it asked for.

`gloo_group` / `allgather` (a full mesh over given ranks) remain for callers that want every
member's tensor everywhere (the demo job's cross-check of its shards).
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
_TRUE, _FALSE = b"1", b"0"


def attempt_tag(step: int, save_ranks: Sequence[int]) -> str:
    """A store prefix unique to this save attempt (same on every chosen rank): the save
    order's tag, or (outside an order) a count of the attempts for exactly this step and rank
    set, which every chosen rank keeps alike."""
    session = save_session.current()
    if session is not None and session.step == step:
        return f"ttp_save/{session.tag}"
    key = (step, tuple(sorted(save_ranks)))
    return f"ttp_save/{step}/{next(_attempts.setdefault(key, itertools.count()))}"


def order_store() -> Tuple[dist.Store, timedelta]:
    """The current save order's store and time limit; outside an order, the job's store."""
    session = save_session.current()
    if session is not None:
        return session.store(), session.timeout
    return dist.distributed_c10d._get_default_store(), EXCHANGE_TIMEOUT


def share_flag(store: dist.Store, key: str, flag: bool) -> None:
    """Set `key` for the ranks that `read_flag` it (once per key: keys are never reused)."""
    store.set(key, _TRUE if flag else _FALSE)


def read_flag(store: dist.Store, key: str, timeout: timedelta) -> bool:
    """The flag `share_flag` set, waiting for it at most `timeout` (then the store raises)."""
    store.wait([key], timeout)
    value = store.get(key)
    if value not in (_TRUE, _FALSE):
        raise ValueError(f"store key {key!r} holds {value[:16]!r}, not a flag")
    return value == _TRUE


def gloo_group(ranks: Sequence[int], my_rank: int, prefix: str,
               store: Optional[dist.Store] = None,
               timeout: Optional[timedelta] = None) -> Optional[dist.ProcessGroupGloo]:
    """A gloo group over `ranks` (global ranks, any order; rank order inside); None for a
    single rank. Without a `store`: the current save order's store and time limit (else the
    job's store). A full mesh: every member connects to every other."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return None
    if store is None:
        store, default = order_store()
        timeout = timeout or default
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), ranks.index(my_rank),
                                 len(ranks), timeout or EXCHANGE_TIMEOUT)


def allgather(group: Optional[dist.ProcessGroupGloo], tensor: torch.Tensor,
              size: int) -> List[torch.Tensor]:
    """Every member's `tensor` (all the same shape), in rank order; [tensor] without a group."""
    if group is None:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    group.allgather([parts], [tensor]).wait()
    return parts


def pair_group(store: dist.Store, prefix: str, sender: int, me_is_receiver: bool,
               timeout: timedelta) -> dist.ProcessGroupGloo:
    """The 2-rank gloo group of `sender` and the receiver (receiver rank 0, sender rank 1)."""
    group = gloo_group([0, 1], 0 if me_is_receiver else 1, f"{prefix}pair-{sender}/", store,
                       timeout)
    assert group is not None
    return group


def send_to(store: dist.Store, prefix: str, me: int, tensor: torch.Tensor,
            timeout: Optional[timedelta] = None) -> None:
    """Send the CPU `tensor` from rank `me` to the receiver of `prefix` (which calls
    `receive_from` with the same prefix)."""
    group = pair_group(store, prefix, me, False, timeout or EXCHANGE_TIMEOUT)
    group.send([tensor.contiguous()], 0, 0).wait()


def receive_from(store: dist.Store, prefix: str, senders: Sequence[int], numel: int,
                 timeout: Optional[timedelta] = None) -> Dict[int, torch.Tensor]:
    """One float32 tensor of `numel` elements from each of `senders`: {sender: tensor}."""
    out: Dict[int, torch.Tensor] = {}
    for sender in senders:
        group = pair_group(store, prefix, sender, True, timeout or EXCHANGE_TIMEOUT)
        buf = torch.empty(numel, dtype=torch.float32)
        group.recv([buf], 1, 0).wait()
        out[sender] = buf
    return out
