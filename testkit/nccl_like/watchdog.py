"""ProcessGroupNCCL's watchdog, for the NCCL-like groups of this process.

Every ``POLL_S`` (torch's watchdog sleeps 100 ms) it looks at each group's oldest unfinished
op. Two things end one, as in torch:

* **a timeout**: the op is older than its group's timeout (``init_process_group`` /
  ``new_group``'s ``timeout``; Megatron's edit 6.2 sets ``TTP_OT`` + 300 s);
* **an asynchronous NCCL error**: ``NCCL_LIKE_ASYNC_ERROR_S=S`` makes a group whose gloo op
  failed (a dead peer) report ncclRemoteError S seconds later, as an IB transport does on some
  ranks; unset (the default), never, as with NVLink/SHM peers.

A second thread, the *peer watcher*, asks the store every ``PEER_POLL_S`` whether another
member of a group with an op waiting longer than that saw a dead peer (backend: ``SPIN_KEY``),
and makes the group spin if so; it is a thread of its own because a store can block.

Then the group's async-error-handling mode (`versions.Emulated.error_handling`, read when the
group was made) decides: 0 logs only (the op keeps spinning; its result says TIMEOUT); 1 aborts
the group's communicators then takes the process down (SIGABRT, as torch's rethrow from the
watchdog thread does: the process is gone before any waiter could see the abort); 2 aborts
only (the op ends with the error, the process lives); 3 takes
the process down without aborting.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional, Set

from torch.distributed import DistBackendError

from testkit.nccl_like import backend
from testkit.nccl_like.versions import CLEAN_UP_ONLY, NO_HANDLING, SKIP_CLEAN_UP, TEAR_DOWN

POLL_S = 0.1
PEER_POLL_S = 0.5
ASYNC_ERROR_ENV = "NCCL_LIKE_ASYNC_ERROR_S"

_started = threading.Lock()
_threads: list = []
_logged: Set[int] = set()  # id of ops already reported in mode 0


def ensure_running() -> None:
    with _started:
        if not _threads:
            for target, name in ((_loop, "nccl-like-watchdog"),
                                 (_peers_loop, "nccl-like-peer-watcher")):
                _threads.append(threading.Thread(target=target, name=name, daemon=True))
                _threads[-1].start()


def _peers_loop() -> None:
    while True:
        time.sleep(PEER_POLL_S)
        now = time.monotonic()
        for group in backend.live_groups():
            since = group.waiting_since()
            if since and now - since > PEER_POLL_S and group.peer_says_spinning():
                group.start_spinning("another member's gloo saw a dead peer", seen_here=False)


def _async_error_s() -> Optional[float]:
    value = os.environ.get(ASYNC_ERROR_ENV, "").strip()
    return float(value) if value else None


def _loop() -> None:
    async_error_s = _async_error_s()
    while True:
        time.sleep(POLL_S)
        for group in backend.live_groups():
            check(group, time.monotonic(), async_error_s)


def check(group: backend.NcclLikeGroup, now: float, async_error_s: Optional[float]) -> None:
    """One look at `group` (module doc)."""
    op = group.oldest_pending()
    if op is None:
        return
    rank = group.rank()
    ran_ms = int((now - op.issued) * 1000)
    since = group.spinning_since()
    if now - op.issued > group.timeout.total_seconds():
        message = (f"[Rank {rank}] Watchdog caught collective operation timeout: "
                   f"{op.describe()} ran for {ran_ms} milliseconds before timing out.")
        result = backend.WorkResult.TIMEOUT
    elif async_error_s is not None and since and now - since > async_error_s:
        message = (f"[Rank {rank}] NCCL watchdog thread terminated with exception: NCCL error: "
                   "remote process exited or there was a network error (ncclRemoteError, "
                   f"emulated by {ASYNC_ERROR_ENV}={async_error_s:g}) in {op.describe()}")
        result = backend.WorkResult.COMM_ERROR
    else:
        return
    mode = group.error_handling
    if mode == NO_HANDLING:
        if id(op) not in _logged:
            _logged.add(id(op))
            op.result = result
            if op.result_future is not None and not op.result_future.done():
                op.result_future.set_result(result)
            _say(f"{message} Async error handling is "
                 f"{backend.error_mode_name(mode)} ({group.error_handling_source}): the "
                 "collective keeps spinning.")
        return
    _say(f"{message} Async error handling: {backend.error_mode_name(mode)} "
         f"({group.error_handling_source}).")
    if mode == CLEAN_UP_ONLY:
        group.watchdog_ends(op, DistBackendError(message), result)
        return
    if mode in (TEAR_DOWN, SKIP_CLEAN_UP):  # TearDown's abort first changes nothing seen here
        _say(f"[Rank {rank}] To avoid data inconsistency, we are taking the entire process "
             "down.")
        sys.stdout.flush()
        os.abort()


def _say(text: str) -> None:
    print(f"[nccl_like pid {os.getpid()}] {text}", file=sys.stderr, flush=True)
