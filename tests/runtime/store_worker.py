"""One rank of `test_authstore`'s 4-process job: register a real processor with the test's
controller, then build every process group on an `AuthStore`, the way a recovery re-creates
them: `init_process_group(store=AuthStore(ns))` (with torch's store-based barrier on, so add,
wait, set and get all travel the TTP channel), then Megatron's own `initialize_model_parallel`
(the pinned tree's `parallel_state.py`, when TTP_MEGATRON_DIR is set) or the same new_group
sequence, and an all-reduce on every group. Prints one JSON line: what each group summed.

Run as `python -m tests.runtime.store_worker` with RANK, TTPW_PORT, TTPW_NS in the env.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from datetime import timedelta
from typing import Dict, List

import torch
import torch.distributed as dist

from mindio_ttp.config import TTPConfig
from mindio_ttp.control.rank.authstore import AuthStore
from mindio_ttp.control.rank.processor import Processor

WORLD, TP, PP = 4, 2, 2


def megatron_parallel_state(tree: str) -> types.ModuleType:
    """Megatron's parallel_state.py, loaded alone: its only relative import (`.utils`, for the
    memory buffer it makes at the end) is given a stand-in, so nothing else of Megatron (apex,
    CUDA kernels) is needed to run its real new_group sequence."""
    pkg = types.ModuleType("mt_core")
    pkg.__path__ = []  # type: ignore[attr-defined]
    utils = types.ModuleType("mt_core.utils")
    utils.GlobalMemoryBuffer = object  # type: ignore[attr-defined]
    sys.modules.update({"mt_core": pkg, "mt_core.utils": utils})
    spec = importlib.util.spec_from_file_location(
        "mt_core.parallel_state", os.path.join(tree, "megatron/core/parallel_state.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def same_groups_by_hand() -> Dict[str, dist.ProcessGroup]:
    """Megatron 285068c's order of new_group calls for TP=2, PP=2 on 4 ranks, by hand."""
    rank, mine = dist.get_rank(), {}
    for name, groups in [("data", [[0], [1], [2], [3]]), ("model", [[0, 1, 2, 3]]),
                         ("tensor", [[0, 1], [2, 3]]), ("pipeline", [[0, 2], [1, 3]])]:
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[name] = group
            if name == "pipeline":
                for extra, eranks in (("embedding", ranks), ("position", ranks[:1])):
                    g = dist.new_group(eranks)
                    if rank in eranks:
                        mine[extra] = g
    return mine


def main() -> None:
    rank = int(os.environ["RANK"])
    cfg = TTPConfig.from_env(os.environ)
    proc = Processor(cfg, rank, list(range(WORLD)), WORLD, 2)
    proc.exit_fn = lambda code: None
    proc.start("127.0.0.1", int(os.environ["TTPW_PORT"]))
    store = AuthStore(os.environ["TTPW_NS"], timedelta(seconds=60))  # this process's processor
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    tree = os.environ.get("TTP_MEGATRON_DIR")
    if tree:
        ps = megatron_parallel_state(tree)
        ps.initialize_model_parallel(TP, PP)
        groups = {"data": ps.get_data_parallel_group(), "model": ps.get_model_parallel_group(),
                  "tensor": ps.get_tensor_model_parallel_group(),
                  "pipeline": ps.get_pipeline_model_parallel_group(),
                  "embedding": ps.get_embedding_group()}
    else:
        groups = same_groups_by_hand()
    sums: Dict[str, List[float]] = {}
    for name, group in [("world", None), *sorted(groups.items())]:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        sums[name] = [t.item(), float(dist.get_world_size(group))]
    dist.destroy_process_group()
    proc.shutdown()
    print(json.dumps({"rank": rank, "megatron": bool(tree), "sums": sums}), flush=True)


if __name__ == "__main__":
    main()
