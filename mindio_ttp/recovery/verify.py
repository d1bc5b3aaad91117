"""Which copies must agree after an in-memory recovery's refill: a pure function of every
rank's digests (megatron_ttp/refill.py gathers them), so every rank reaches the same verdict
and a mismatch stops the recovery on all of them alike.

Each rank's entry: {"rank", "dp_ranks"} and any of: "stripes" {DP position: digest} for the
optimizer stripes it holds (both holders of a stripe must agree), "replica" (weights and RNG:
every data-parallel peer must agree, Megatron seeds by pipeline and tensor rank only),
"global" (step, consumed samples, scheduler count: every rank must agree).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple


def check_digests(everyone: List[Dict[str, Any]]) -> List[str]:
    """What differs among the ranks' digests (pure; every rank computes the same list)."""
    problems = []
    globals_ = {d["global"] for d in everyone if "global" in d}
    if len(globals_) > 1:
        problems.append(f"step/consumed samples/scheduler differ: {sorted(globals_)}")
    by_group: Dict[Tuple[int, ...], List[Dict[str, Any]]] = {}
    for d in everyone:
        by_group.setdefault(tuple(d["dp_ranks"]), []).append(d)
    for group, members in sorted(by_group.items()):
        holders: Dict[int, Dict[int, str]] = {}
        for d in members:
            for position, digest in d.get("stripes", {}).items():
                holders.setdefault(int(position), {})[d["rank"]] = digest
        for position, copies in sorted(holders.items()):
            if len(set(copies.values())) > 1:
                problems.append(f"DP group {list(group)[:8]}: stripe {position} differs between "
                                f"ranks {sorted(copies)}")
        replicas = {d["rank"]: d["replica"] for d in members if "replica" in d}
        if len(set(replicas.values())) > 1:
            problems.append(f"DP group {list(group)[:8]}: weights or RNG differ between ranks "
                            f"{sorted(replicas)}")
    return problems
