"""The private torch names ttprun depends on, and a check that the installed torch still has
them as ttprun uses them.

ttprun is torch's own launcher with one class replaced (launch/agent.py): it overrides private
methods of `LocalElasticAgent`, reads attributes torch's agent, process context and worker group
set, patches a process context's `close` and the rendezvous handler's `num_nodes_waiting` and
`shutdown`, and swaps the `LocalElasticAgent` name in `torch.distributed.launcher.api`.
`ttprun --check` (launch/check.py) reads the launch's rendezvous arguments with
`torch.distributed.run._parse_rendezvous_config` and `get_rdzv_endpoint`; the node takeover
(launch/takeover.py) reads the c10d rendezvous handler's `_state_holder.state` (`participants`,
`wait_list`, `redundancy_list`, `complete`) and `_this_node`, and starts a newcomer's workers
through `multiprocessing.api.get_subprocess_handler`; a replacement worker (launch/replace.py)
goes into the process context's `subprocess_handlers`, `_running_local_ranks` and `_failures`.
None of that is API, so a torch release may rename or re-sign any of it; this check says so by
name, with what it breaks, instead of letting ttprun fail (or silently stop overriding)
mid-job. ttprun runs it at start and refuses a torch it finds a problem in (`main`).

Some differences are known and handled; they are accepted, each with the reason, and listed
apart (`accepted()`): torch 2.1 has no `timeout` in `_shutdown` (the override hands on what torch
passes), no `master_addr`/`master_port` on the worker group (a restart's own store is published
where that torch's agent reads it), no redundancy list (no node takeover: ttprun says so at
start), and workers in the launcher's process group (ttprun signals each worker alone there).
`tests/runtime/test_torch_private.py` runs the check on the installed torch; `bench/bench_stack.py`
runs `python -m mindio_ttp.launch.torch_private`, and that test file, in every venv of the stack
table.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

# TTPElasticAgent's own private helpers: a torch that grows a method of the same name would
# have it silently overridden (tests/runtime/test_torch_private.py keeps this list equal to the
# class's; the class is not imported here, so that the agent can run this check at start)
OWN_HELPERS = ("_complete_despite", "_guard_rendezvous", "_hold_survivors",
               "_rank_consequences_last", "_runtime_started", "_say_recovery_mode",
               "_serve_replacements", "_start_node_agent", "_stop_node_agent")
# methods TTPElasticAgent overrides (and calls through super()): name -> the parameter names
# accepted, the current torch's first
OVERRIDDEN: Dict[str, Tuple[Tuple[str, ...], ...]] = {
    "_rendezvous": (("self", "worker_group"),),
    "_assign_worker_ranks": (("self", "store", "group_rank", "group_world_size", "spec"),),
    "_restart_workers": (("self", "worker_group"),),
    "_start_workers": (("self", "worker_group"),),
    "_monitor_workers": (("self", "worker_group"),),
    # torch 2.1 (and 1.13) have no `timeout`: torch calls `_shutdown()` or `_shutdown(sig)`
    # there, `_shutdown(sig, timeout=...)` later; the override hands on exactly what it is
    # given, so both shapes work
    "_shutdown": (("self", "death_sig", "timeout"), ("self", "death_sig")),
    "_invoke_run": (("self", "role"),),
}
# what breaks when an overridden method drifts (by name; the default below otherwise)
OVERRIDE_BREAKS = {
    "_shutdown": "ttprun's override closes the warm spares and the node agent, then calls it",
}
# attributes of torch's agent that ttprun reads or sets
ATTRIBUTES = ("_worker_group", "_pcontext", "_remaining_restarts", "_store")
# a process context's attributes that the grace period and a replacement worker (replace.py)
# read or change: a replaced worker goes into subprocess_handlers and back into
# _running_local_ranks, its predecessor's failure out of _failures; under other names torch would
# not watch the replacement and would report the old failure again
PCONTEXT_ATTRIBUTES = ("subprocess_handlers", "envs", "entrypoint", "args", "stdouts", "stderrs",
                       "_running_local_ranks", "_failures")
# torch.distributed.run's names that ttprun and `ttprun --check` call: name -> parameter names
RUN_FUNCTIONS: Dict[str, Tuple[str, ...]] = {
    "_parse_rendezvous_config": ("config_str",),
    "get_rdzv_endpoint": ("args",),
}


def _params(fn: Callable) -> Tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _source(*objs: Any) -> str:
    return "".join(inspect.getsource(o) for o in objs)


def _probe_handler() -> Any:
    """A c10d-style rendezvous handler on an in-process store: nothing is joined or started."""
    from torch.distributed import HashStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    store = HashStore()
    kwargs = {"local_addr": "localhost"}  # never the slow getfqdn (no local_addr before 2.0)
    if "local_addr" not in inspect.signature(DynamicRendezvousHandler.from_backend).parameters:
        kwargs = {}
    return DynamicRendezvousHandler.from_backend(
        run_id="ttp-torch-private", store=store,
        backend=C10dRendezvousBackend(store, "ttp-torch-private"), min_nodes=1, max_nodes=1,
        **kwargs)


def _rendezvous_state_problems() -> List[str]:
    """The c10d handler's internals the takeover and the spare's notice read (takeover.py)."""
    breaks = ("ttprun cannot tell which nodes are still in the round (the takeover's check of "
              "a takeover-wanted key) nor that this node is a spare (launch/takeover.py)")
    try:
        handler = _probe_handler()
    except Exception as exc:  # noqa: BLE001 - any drift of the classes used to build it
        return [f"a c10d rendezvous handler cannot be built to check its internals "
                f"({type(exc).__name__}: {exc}): {breaks}"]
    out: List[str] = []
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    if holder is None:
        out.append(f"the c10d rendezvous handler has no _state_holder: {breaks}")
    elif state is None:
        out.append(f"the c10d rendezvous handler's _state_holder has no state: {breaks}")
    else:
        for name, kind in (("participants", dict), ("wait_list", set), ("complete", bool)):
            value = getattr(state, name, None)
            if not isinstance(value, kind):
                out.append(f"the c10d rendezvous state's {name} is "
                           f"{type(value).__name__ if hasattr(state, name) else 'gone'}, not a "
                           f"{kind.__name__}: {breaks}")
    if not hasattr(handler, "_this_node"):
        out.append(f"the c10d rendezvous handler has no _this_node: {breaks}")
    return out


NO_REDUNDANCY_LIST = ("the rendezvous state's redundancy_list (where a node that finds the round "
                      "full waits, with no deadline)")


def takeover_missing() -> List[str]:
    """What a node takeover (launch/takeover.py) needs and the installed torch lacks."""
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.rendezvous import api as rdzv_api

    out: List[str] = []
    try:
        state = _probe_handler()._state_holder.state
    except Exception:  # noqa: BLE001 - said by _rendezvous_state_problems
        state = None
    if not isinstance(getattr(state, "redundancy_list", None), set):
        out.append(NO_REDUNDANCY_LIST)
    if not hasattr(rdzv_api, "RendezvousInfo"):
        out.append("RendezvousInfo (next_rendezvous returns a tuple)")
    store_info = getattr(rdzv_api, "RendezvousStoreInfo", None)
    if not (hasattr(store_info, "MASTER_ADDR_KEY") and hasattr(store_info, "MASTER_PORT_KEY")):
        out.append("RendezvousStoreInfo.MASTER_ADDR_KEY/MASTER_PORT_KEY")
    if not (callable(getattr(mp_api, "get_subprocess_handler", None))
            and "get_subprocess_handler(" in _source(mp_api.SubprocessContext)):
        out.append("multiprocessing.api.get_subprocess_handler, called where SubprocessContext "
                   "starts a worker (the newcomer's workers get their requests through it)")
    return out


def _takeover_verdict() -> Tuple[List[str], List[str]]:
    """(problems, accepted) for the takeover: a torch without a redundancy list cannot keep a
    spare node beside a full round at all, so ttprun runs without takeovers there (and says
    so); a torch that has one but lacks another piece has drifted."""
    missing = takeover_missing()
    if not missing:
        return [], []
    if NO_REDUNDANCY_LIST in missing:
        return [], [f"no node takeover: this torch lacks {'; '.join(missing)}; ttprun says so "
                    "at start and a lost node's ranks go to the dying checkpoint"]
    return [f"this torch has a redundancy list but lacks {'; '.join(missing)}: a spare node "
            "cannot take over a lost node's ranks (launch/takeover.py)"], []


def _worker_group_verdict() -> Tuple[List[str], List[str]]:
    """A restarted attempt's own store (agent._rendezvous) reaches the workers as MASTER_PORT:
    through the worker group's master_port (torch 2.2 on), or through the round store's
    MASTER_PORT key, which torch 2.1's _start_workers reads (`_get_master_addr_port`)."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea

    source = _source(api.WorkerGroup)
    if "self.master_addr" in source and "self.master_port" in source:
        return [], []
    if (callable(getattr(api.SimpleElasticAgent, "_get_master_addr_port", None))
            and "_get_master_addr_port(" in _source(lea.LocalElasticAgent._start_workers)):
        return [], ["WorkerGroup has no master_addr/master_port: a restart's own store goes to "
                    "the round store's MASTER_PORT key, which this torch's _start_workers reads"]
    return ["torch's WorkerGroup has no master_addr/master_port and its _start_workers does "
            "not read _get_master_addr_port: a restarted attempt's workers cannot be given "
            "their own store (launch/agent.py _rendezvous)"], []


def _session_note() -> List[str]:
    """torch 2.13 starts each worker in a session of its own, where a `killpg` reaches its
    children too; torch 2.1 in the launcher's group, where ttprun signals the worker alone
    (launch/procstate.signal_worker), as torch itself does there."""
    from torch.distributed.elastic.multiprocessing import api as mp_api

    if "start_new_session" in _source(mp_api.SubprocessHandler):
        return []
    return ["torch starts its workers in the launcher's process group: ttprun signals each "
            "worker alone there (its own children are not reached), as torch does"]


def _launcher_problems() -> List[str]:
    """torch's own launcher, as ttprun runs it: what fails here fails torchrun too."""
    from torch.distributed.elastic.multiprocessing.api import Std

    out: List[str] = []
    got = Std.from_str("0")
    if got != Std.NONE:
        out.append(f"torch's Std.from_str('0') is {got!r}, not Std.NONE (its enum drops the zero "
                   f"member on Python {sys.version.split()[0]}): torch's launcher, torchrun's "
                   "too, cannot start any worker ('NoneType' object has no attribute 'get')")
    return out


def check() -> Tuple[List[str], List[str]]:
    """(problems, accepted): what the installed torch lacks or has otherwise, and the known
    differences ttprun handles (each with why it is accepted); both [] on the current torch."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.rendezvous.api import RendezvousHandler

    out: List[str] = []
    accepted: List[str] = []
    base = lea.LocalElasticAgent
    for name, shapes in OVERRIDDEN.items():
        fn = getattr(base, name, None)
        if fn is None:
            out.append(f"LocalElasticAgent.{name} is gone: ttprun's override is never called")
            continue
        theirs = _params(fn)
        if theirs not in shapes:
            breaks = OVERRIDE_BREAKS.get(name, "ttprun's override calls it with those arguments")
            out.append(f"LocalElasticAgent.{name}{theirs} is not {shapes[0]}: {breaks}")
        elif theirs != shapes[0]:
            accepted.append(f"LocalElasticAgent.{name}{theirs}: an older shape of "
                            f"{shapes[0]}; ttprun's override hands on what torch passes")
    for name in OWN_HELPERS:
        if hasattr(base, name):
            out.append(f"LocalElasticAgent now has {name}: ttprun's own helper overrides it")
    source = _source(api, lea)
    for attr in ATTRIBUTES:
        if f"self.{attr}" not in source:
            out.append(f"torch's agent no longer sets self.{attr}: ttprun reads it "
                       "(launch/agent.py)")
    context = _source(*[c for c in mp_api.SubprocessContext.__mro__
                        if c.__module__.startswith("torch.")])
    for attr in PCONTEXT_ATTRIBUTES:
        if f"self.{attr}" not in context:
            out.append(f"SubprocessContext no longer sets self.{attr}: the grace period and a "
                       "replacement worker (launch/replace.py) read or change it")
    if "self.proc" not in _source(mp_api.SubprocessHandler):
        out.append("SubprocessHandler no longer sets self.proc: the grace period polls and "
                   "kills the workers through it")
    for cls, names in ((mp_api.SubprocessContext, ("close", "pids")),
                       (RendezvousHandler, ("num_nodes_waiting", "shutdown", "get_backend",
                                            "next_rendezvous", "get_run_id"))):
        out += [f"{cls.__name__}.{n} is gone: ttprun calls or patches it" for n in names
                if not hasattr(cls, n)]
    import torch.distributed.launcher.api as launcher_api
    if getattr(launcher_api, "LocalElasticAgent", None) is None:
        out.append("torch.distributed.launcher.api.LocalElasticAgent is gone: ttprun cannot "
                   "install its agent")
    import torch.distributed.run as run
    for name in ("get_args_parser", "run"):
        if not callable(getattr(run, name, None)):
            out.append(f"torch.distributed.run.{name} is gone: ttprun is torch's launcher "
                       "with its parser")
    for name, params in RUN_FUNCTIONS.items():
        fn = getattr(run, name, None)
        if fn is None:
            out.append(f"torch.distributed.run.{name} is gone: ttprun --check cannot read the "
                       "launch's rendezvous arguments (launch/check.py)")
        elif _params(fn) != params:
            out.append(f"torch.distributed.run.{name}{_params(fn)} is not {params}: ttprun "
                       "--check calls it with those arguments (launch/check.py)")
    parse = getattr(run, "_parse_rendezvous_config", None)
    if parse is not None and _params(parse) == RUN_FUNCTIONS["_parse_rendezvous_config"]:
        try:
            got: Optional[Any] = parse("join_timeout=5,x=y")
        except Exception as exc:  # noqa: BLE001 - any drift
            got = f"{type(exc).__name__}: {exc}"
        if got != {"join_timeout": "5", "x": "y"}:
            out.append(f"torch.distributed.run._parse_rendezvous_config('join_timeout=5,x=y') "
                       f"gives {got!r}, not a dict of strings: ttprun --check reads "
                       "join_timeout from it (launch/check.py)")
    out += _rendezvous_state_problems()
    for bad, notes in (_takeover_verdict(), _worker_group_verdict()):
        out += bad
        accepted += notes
    accepted += _session_note()
    out += _launcher_problems()
    return out, accepted


def problems() -> List[str]:
    """What of the above the installed torch lacks or has otherwise ([] when all is there)."""
    return check()[0]


def accepted() -> List[str]:
    """The known differences of the installed torch that ttprun handles, with why."""
    return check()[1]


if __name__ == "__main__":
    import torch

    found, notes = check()
    for line in found:
        print(line)
    if not found:
        print(f"torch {torch.__version__}: every private name ttprun uses is there")
    for line in notes:
        print(f"accepted: {line}")
    sys.exit(1 if found else 0)
