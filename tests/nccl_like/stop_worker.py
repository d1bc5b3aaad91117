"""One rank of test_stop_nccl_like.py, on the NCCL-like backend (testkit/hooks/nccl_like first on
PYTHONPATH, NCCL_LIKE=1, NCCL_LIKE_TORCH=...).

``stop_worker.py SIGNAL RANK STORE [AFTER]``: both ranks build a world and a subgroup and run an
all-reduce on each; the runtime's device mark is armed (the fake device is torch.npu) and the
param all-gather's event recorded. Then rank 1 sends itself SIGNAL (KILL or STOP) and rank 0's
main thread loops over an all-reduce and a host read, which blocks behind the op that now spins.
Rank 0's "processor" thread runs the runtime's fault-time stop (control/rank/release.py) half a
second later, as it would at the controller's lock. Then, as the dying save does, `prepare()`
twice; with AFTER=reinit, the groups are destroyed, the device checked, and a new world built
with a replacement rank 1 (``stop_worker.py - 1 STORE2``), whose all-reduce must be right.
Rank 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SIG, RANK, STORE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
AFTER = sys.argv[4] if len(sys.argv) > 4 else "save"


def world(store: str) -> dist.ProcessGroup:
    dist.init_process_group("nccl", store=dist.FileStore(store, 2), rank=RANK, world_size=2,
                            timeout=timedelta(seconds=600))
    sub = dist.new_group([0, 1])
    for group in (None, sub):
        t = torch.ones(4)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [2.0] * 4, t
    return sub


def replacement() -> None:
    """Rank 1 of the new world: one all-reduce of ones, then wait to be killed."""
    dist.init_process_group("nccl", store=dist.FileStore(STORE, 2), rank=1, world_size=2,
                            timeout=timedelta(seconds=600))
    t = torch.ones(4)
    dist.all_reduce(t)
    t.tolist()
    time.sleep(600)


def main() -> None:
    if SIG == "-":
        return replacement()
    sub = world(STORE)
    from mindio_ttp import hooks
    from mindio_ttp.control.rank import release
    from mindio_ttp.faulttime import abort, device_copy
    from mindio_ttp.faulttime import device as ttp_device

    device_copy.MARK.install(ttp_device.capture())
    hooks.end_updating_os(1)
    params = torch.zeros(8)
    dist.all_gather_into_tensor(params, torch.full((4,), float(RANK)), group=sub)
    device_copy.GATHERED.record(1)
    if RANK == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), getattr(signal, f"SIG{SIG}"))
        time.sleep(600)
    out: dict = {"binding": ttp_device.capture().describe()}
    fault_at = time.monotonic() + 0.3  # rank 1 signals itself 0.3 s from now

    def processor() -> None:
        time.sleep(max(0.0, fault_at - time.monotonic()) + 0.5)  # detection, then the lock
        out["lock_after_fault_s"] = time.monotonic() - fault_at
        outcome = release.stop("lock of flow 1")
        out["stop"] = outcome.describe()
        out["stop_ok"], out["raised"] = outcome.ok, outcome.raised

    threading.Thread(target=processor, name="ttp-fault-stop", daemon=True).start()
    hooks.TRAINING.enter()
    t = torch.ones(4)
    try:
        while True:  # training: a collective and a host read per step
            dist.all_reduce(t)
            t.sum().item()
            t.fill_(1.0)
    except BaseException as exc:  # noqa: BLE001 - the way out of the step
        hooks.TRAINING.leave()
        out["left_after_fault_s"] = time.monotonic() - fault_at
        out["main_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    deadline = time.monotonic() + 30
    while "stop_ok" not in out and time.monotonic() < deadline:
        time.sleep(0.01)
    first, second = device_copy.prepare(1), device_copy.prepare(1)
    out["gathered"] = [first.gathered, second.gathered]
    out["event_done_after_abort"] = bool(device_copy.GATHERED.event.query())
    out["aborted"] = sorted(first.abort.aborted)
    if AFTER == "reinit":
        binding = ttp_device.capture()
        out["destroyed"] = abort.destroy_groups(10.0)
        out["health"] = ttp_device.health_check(binding, 10.0) or "ok"
        second_store = STORE + ".2"
        peer = subprocess.Popen([sys.executable, __file__, "-", "1", second_store])
        try:
            dist.init_process_group("nccl", store=dist.FileStore(second_store, 2), rank=0,
                                    world_size=2, timeout=timedelta(seconds=60))
            t = torch.full((4,), 2.0)
            dist.all_reduce(t)
            out["new_world_sum"] = t.tolist()[0]
        finally:
            peer.kill()
            peer.wait(30)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # the old world's gloo threads must not hold the exit


if __name__ == "__main__":
    main()
