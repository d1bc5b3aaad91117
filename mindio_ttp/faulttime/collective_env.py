"""What NCCL and HCCL must be told so that survivors live long enough to write the checkpoint.

A survivor of a fault usually sits in a collective with the dead peer. What the collective
library does when that collective times out decides whether a dying checkpoint can happen:

* ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: torch's default 3 kills the process without aborting the
  communicator (PyTorch's ProcessGroupNCCL docs). 2 aborts the communicator and leaves the
  process alive: the hung collective then raises in the training thread, which the TTP decorator
  turns into "wait for the verdict", and the hung kernel no longer blocks device work.
* ``NCCL_ASYNC_ERROR_HANDLING``: the same setting under its old name, the only one torch 2.1
  reads (the ``TORCH_NCCL_`` names came with 2.2, PR #114077, which read the ``TORCH_`` name
  first and the old one after it). torch's elastic agent writes the old name into every worker's
  environment, as 1 (abort, then kill the process) unless the launcher's own environment sets
  it: so ttprun sets both names, or on torch 2.1 the survivors die in the dying save.
* ``HCCL_ASYNC_ERROR_HANDLING``: torch_npu's default 1 (torch >= 2.1) terminates the process on
  an ERROR CQE, the error a dead peer's link gives (Ascend's torch_npu environment docs); 0 keeps
  the process, and the TTP heartbeat detects the fault instead.

Either way the dying save aborts the communicators itself before it reads device memory
(`abort.py`), after noting what the device had finished (`device_copy.prepare`): a watchdog
abort that came first shows in the collective's result, which that note reads.

ttprun sets these for its workers only where the user has not set them (their value wins and
is logged). The process-group timeout is the other clock: a survivor's hung collective fails
when it runs out (``mindio_ttp.launch.timeouts`` checks it against ``TTP_OT``).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Mapping, MutableMapping, Tuple

log = logging.getLogger("mindio_ttp.launch.agent")

# (name, value for the workers, why): the one table of collective settings ttprun gives.
WORKER_DEFAULTS: Tuple[Tuple[str, str, str], ...] = (
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2",
     "abort the hung communicator, keep the survivor alive for the dying checkpoint"),
    ("NCCL_ASYNC_ERROR_HANDLING", "2",
     "the same under the old name, the one torch 2.1 reads (torch's elastic agent sets it to 1 "
     "otherwise: abort, then kill the survivor)"),
    ("HCCL_ASYNC_ERROR_HANDLING", "0",
     "a dead peer's ERROR CQE must not terminate the survivors before they save"),
)
NAMES = tuple(name for name, _, _ in WORKER_DEFAULTS)
# What a user's own value does to the survivors of a fault (values named in the docs above;
# torch: 0 no handling, 1 abort + tear down, 2 abort only, 3 tear down without abort).
FATAL_VALUES = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": {
        "1": "aborts the communicator and then kills the process",
        "3": "kills the process without aborting the communicator",
    },
    "NCCL_ASYNC_ERROR_HANDLING": {
        "1": "(the name torch 2.1 reads; later torch reads it when TORCH_NCCL_ASYNC_ERROR_HANDLING "
             "is unset) aborts the communicator and then kills the process",
        "3": "(the name torch 2.1 reads; later torch reads it when TORCH_NCCL_ASYNC_ERROR_HANDLING "
             "is unset) kills the process without aborting the communicator",
    },
    "HCCL_ASYNC_ERROR_HANDLING": {
        "1": "terminates the process on the dead peer's ERROR CQE",
    },
}


def apply_defaults(environ: MutableMapping[str, str]) -> Dict[str, str]:
    """Set each default the user left unset; return what was set (the user's values stay)."""
    done = {}
    for name, value, why in WORKER_DEFAULTS:
        if name in environ:
            if environ[name] != value:
                log.info("ttprun: keeping your %s=%s (ttprun's default %s would %s)", name,
                         environ[name], value, why)
            continue
        environ[name] = value
        done[name] = value
    return done


def user_value_warnings(environ: Mapping[str, str]) -> List[str]:
    """A warning for each user value that kills the survivors before they save."""
    out = []
    for name, value, why in WORKER_DEFAULTS:
        mine = environ.get(name)
        effect = FATAL_VALUES.get(name, {}).get((mine or "").strip())
        if effect:
            out.append(f"your {name}={mine} {effect} when a collective with a dead rank times "
                       f"out: the survivors die before the dying checkpoint. ttprun keeps your "
                       f"value; unset it (ttprun then gives {value}: {why}) or set {value}")
    return out
