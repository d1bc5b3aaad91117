"""The private torch names ttprun's agent depends on, and a check that the installed torch still
has them as ttprun uses them.

ttprun is torch's own launcher with one class replaced (launch/agent.py): it overrides private
methods of `LocalElasticAgent`, reads attributes torch's agent sets, patches a process
context's `close` and the rendezvous handler's `num_nodes_waiting` and `shutdown`, and swaps
the `LocalElasticAgent` name in `torch.distributed.launcher.api`. None of that is API, so a torch
release may rename or re-sign any of it; this check says so by name instead of letting ttprun
fail (or silently stop overriding) mid-job. `tests/runtime/test_torch_private.py` runs it on the
installed torch; `bench/bench_stack.py` runs `python -m mindio_ttp.launch.torch_private` in
every venv of the stack table.
"""

from __future__ import annotations

import inspect
import sys
from typing import Dict, List, Tuple

# methods TTPElasticAgent overrides (and calls through super()): name -> parameter names
OVERRIDDEN: Dict[str, Tuple[str, ...]] = {
    "_rendezvous": ("self", "worker_group"),
    "_assign_worker_ranks": ("self", "store", "group_rank", "group_world_size", "spec"),
    "_restart_workers": ("self", "worker_group"),
    "_start_workers": ("self", "worker_group"),
    "_monitor_workers": ("self", "worker_group"),
    "_shutdown": ("self", "death_sig", "timeout"),
    "_invoke_run": ("self", "role"),
}
# attributes of torch's agent that ttprun reads or sets
ATTRIBUTES = ("_worker_group", "_pcontext", "_remaining_restarts", "_store")


def problems() -> List[str]:
    """What of the above the installed torch lacks or has otherwise ([] when all is there)."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    from torch.distributed.elastic.rendezvous.api import RendezvousHandler

    from mindio_ttp.launch.agent import TTPElasticAgent

    out: List[str] = []
    base = lea.LocalElasticAgent
    for name, params in OVERRIDDEN.items():
        fn = getattr(base, name, None)
        if fn is None:
            out.append(f"LocalElasticAgent.{name} is gone: ttprun's override is never called")
            continue
        theirs = tuple(inspect.signature(fn).parameters)
        if theirs != params:
            out.append(f"LocalElasticAgent.{name}{theirs} is not {params}")
    ours = {n for n, v in vars(TTPElasticAgent).items()
            if callable(v) and n.startswith("_") and not n.startswith("__")}
    for name in sorted(ours - set(OVERRIDDEN)):
        if hasattr(base, name):
            out.append(f"LocalElasticAgent now has {name}: ttprun's own helper overrides it")
    source = inspect.getsource(api) + inspect.getsource(lea)
    for attr in ATTRIBUTES:
        if f"self.{attr}" not in source:
            out.append(f"torch's agent no longer sets self.{attr}")
    for cls, names in ((SubprocessContext, ("close", "pids")),
                       (RendezvousHandler, ("num_nodes_waiting", "shutdown", "get_backend"))):
        out += [f"{cls.__name__}.{n} is gone" for n in names if not hasattr(cls, n)]
    import torch.distributed.launcher.api as launcher_api
    if getattr(launcher_api, "LocalElasticAgent", None) is None:
        out.append("torch.distributed.launcher.api.LocalElasticAgent is gone: ttprun cannot "
                   "install its agent")
    return out


if __name__ == "__main__":
    found = problems()
    for line in found:
        print(line)
    if not found:
        import torch
        print(f"torch {torch.__version__}: every private name ttprun uses is there")
    sys.exit(1 if found else 0)
