"""Which DP positions hold each optimizer shard together: partners on different hosts.

ReplicatedOptimizer keeps every stock stripe on two DP positions, a *pair*; a shard is one pair
(both positions hold both stripes). Losing a host must never lose both holders of a shard, so a
pair should span two hosts. Megatron's DP order and the placement of ranks on hosts decide
whether the natural pairing, position p with p + d/2, does that: it does for consecutive blocks
of ranks per host, but not when ranks are placed round-robin over hosts (a scheduler's cyclic
distribution, a pod order that is not the rank order), where p and p + d/2 can share a host for
every p. Any perfect matching of the positions works for the optimizer, so:

* the natural pairing when every one of its pairs spans two hosts (or the job has one host);
* otherwise a pairing that puts every pair on two hosts, which exists exactly when no host holds
  more than half of the DP group's positions: order the positions by host, largest host first,
  and pair slot i with slot i + d/2 (a host's block never spans more than d/2 slots, so the two
  ends of a pair never fall in one block);
* otherwise (a host holds more than half the group) no pairing can, and the natural one is kept,
  with a warning that names the host (`same_host_pairs`).

The runtime counts shards by DP position: position i holds shard i % (d/2). `runtime_order`
lists the DP group's ranks so that this rule gives back the chosen pairs (ranks of pair k at
places k and k + d/2), and the optimizer declares that order to the runtime.

Pure functions, no torch, no Megatron: tests/runtime/test_pairing.py checks them exhaustively.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Sequence, Tuple

Pair = Tuple[int, int]


def natural_pairs(d: int) -> List[Pair]:
    s = d // 2
    return [(k, k + s) for k in range(s)]


def choose_pairs(hosts: Sequence[str]) -> List[Pair]:
    """Pairs of DP positions (each (a, b) with a < b, sorted by a) for a DP group whose position
    p runs on host `hosts[p]` (module doc)."""
    d = len(hosts)
    if d % 2:
        raise ValueError(f"a DP group of {d} positions cannot be paired: the DP size must be even")
    natural = natural_pairs(d)
    if all(hosts[a] != hosts[b] for a, b in natural) or len(set(hosts)) < 2:
        return natural
    count = Counter(hosts)
    if max(count.values()) > d // 2:
        return natural  # no pairing spans two hosts everywhere: keep Megatron's, and warn
    slots = sorted(range(d), key=lambda p: (-count[hosts[p]], hosts[p], p))
    s = d // 2
    return sorted(tuple(sorted((slots[i], slots[i + s]))) for i in range(s))  # type: ignore[misc]


def partner_map(pairs: Sequence[Pair]) -> Dict[int, int]:
    out: Dict[int, int] = {}
    for a, b in pairs:
        out[a], out[b] = b, a
    return out


def runtime_order(dp_ranks: Sequence[int], pairs: Sequence[Pair]) -> List[int]:
    """The DP group's ranks ordered for the runtime: pair k's ranks at places k and k + d/2."""
    firsts = [dp_ranks[a] for a, _ in pairs]
    seconds = [dp_ranks[b] for _, b in pairs]
    return firsts + seconds


def same_host_pairs(pairs: Sequence[Pair], hosts: Sequence[str]) -> List[Pair]:
    return [(a, b) for a, b in pairs if hosts[a] == hosts[b]]


def crowded_host(hosts: Sequence[str]) -> Tuple[str, int]:
    """The host with the most positions of the group, and how many."""
    host, n = Counter(hosts).most_common(1)[0]
    return host, n
