"""One rank of a test of the NCCL-like backend (test_nccl_like_backend.py), started with
testkit/hooks/nccl_like first on PYTHONPATH and NCCL_LIKE=1.

``nccl_like_worker.py SCENARIO RANK WORLD PORT``: every rank runs every collective once and
checks its values against what gloo gives; then the last rank SIGKILLs (or SIGSTOPs) itself and
the others run SCENARIO, whose main thread blocks in a collective with the dead peer while an
observer thread watches it, then aborts the group by whichever name the emulated torch has.
Each survivor prints ``RESULT {json}``. ``WORKER_GROUP_TIMEOUT_S`` sets the group's timeout
(the watchdog's clock).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SCENARIO, RANK, WORLD, PORT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
OBSERVE_S = 1.5  # how long a blocked main thread is watched before the abort
NAMES = ("abort", "_shutdown", "_abort", "shutdown", "_group_start", "_group_end")
state: dict = {}


def abort_by_feature(pg) -> str:
    for name in ("abort", "_shutdown", "_abort"):
        if hasattr(pg, name):
            getattr(pg, name)()
            return name
    raise AssertionError("no abort name at all")


def warm_up(pg) -> dict:
    """Every collective Megatron and the runtime use, with the values gloo would give."""
    checks = {}
    t = torch.full((4,), float(RANK + 1))
    dist.all_reduce(t)
    checks["all_reduce"] = t.tolist() == [float(sum(range(1, WORLD + 1)))] * 4
    out = torch.empty(2 * WORLD)
    dist.all_gather_into_tensor(out, torch.full((2,), float(RANK)))
    checks["all_gather_into_tensor"] = out.tolist() == [float(r) for r in range(WORLD)
                                                        for _ in range(2)]
    rows = [torch.empty(3) for _ in range(WORLD)]
    dist.all_gather(rows, torch.full((3,), float(RANK)))
    checks["all_gather"] = [r.tolist() for r in rows] == [[float(r)] * 3 for r in range(WORLD)]
    shard = torch.empty(2)
    dist.reduce_scatter_tensor(shard, torch.arange(2.0 * WORLD))
    checks["reduce_scatter_tensor"] = shard.tolist() == [WORLD * (2.0 * RANK),
                                                         WORLD * (2.0 * RANK + 1)]
    b = torch.full((2,), float(RANK))
    dist.broadcast(b, src=1)
    checks["broadcast"] = b.tolist() == [1.0, 1.0]
    objs = [None] * WORLD
    dist.all_gather_object(objs, {"rank": RANK})
    checks["all_gather_object"] = objs == [{"rank": r} for r in range(WORLD)]
    got = torch.empty(3, requires_grad=True)  # as Megatron's pipeline receives
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(RANK)), (RANK + 1) % WORLD),
           dist.P2POp(dist.irecv, got, (RANK - 1) % WORLD)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    checks["batch_isend_irecv"] = got.detach().tolist() == [float((RANK - 1) % WORLD)] * 3
    sub = dist.new_group([0, 1])
    if RANK in (0, 1):
        s = torch.ones(2)
        dist.all_reduce(s, group=sub)
        checks["new_group"] = s.tolist() == [2.0, 2.0] and sub.name() == "nccl"
    dist.barrier()
    return checks


def peer_fault() -> None:
    """The last rank dies (or stops); the others survive."""
    if RANK == WORLD - 1:
        sig = signal.SIGSTOP if SCENARIO.startswith(("stop", "watchdog")) else signal.SIGKILL
        os.kill(os.getpid(), sig)
        time.sleep(60)  # never reached by a killed rank; a stopped one is killed by the test


def spinning(pg, timeout_s: float = 30.0) -> bool:
    """Wait (bounded) until gloo saw the dead peer: the group spins from then on (or until the
    main thread is no longer blocked)."""
    deadline = time.monotonic() + timeout_s
    left = state.setdefault("left", threading.Event())
    while not pg.spinning_since():
        if time.monotonic() > deadline or left.is_set():
            return False
        time.sleep(0.01)
    return True


def observer(pg, before_abort=None, wait_spinning: bool = True,
             observe_s: float = OBSERVE_S) -> threading.Thread:
    """Watch the main thread block for `observe_s`, then abort the group."""

    def run() -> None:
        entered = state.setdefault("entered", threading.Event())
        entered.wait(60)
        if wait_spinning:
            state["spinning"] = spinning(pg)
        left = state.setdefault("left", threading.Event())
        state["blocked"] = not left.wait(observe_s)
        if before_abort is not None:
            before_abort()
        state["aborted_at"] = time.monotonic()  # before: the abort releases the main thread
        state["abort_name"] = abort_by_feature(pg)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def blocking(fn):
    """Run `fn` on the main thread between the marks the observer reads; what it did."""
    state.setdefault("entered", threading.Event()).set()
    try:
        value = fn()
        outcome = {"raised": None, "value": value}
    except Exception as exc:  # noqa: BLE001 - what the test asserts on
        outcome = {"raised": type(exc).__name__, "message": str(exc)[:300]}
    state.setdefault("left", threading.Event()).set()
    outcome["released_after_abort_s"] = (round(time.monotonic() - state["aborted_at"], 3)
                                         if "aborted_at" in state else None)
    return outcome


def scenario_kill_item(pg, result) -> None:
    """wait() returns (the op is known to spin, as NCCL's wait returns at once); an event
    recorded after it stays pending and .item() blocks, until the abort."""
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)
    result["wait_returned"] = work.wait()
    event = torch.npu.Event()
    event.record()

    def before_abort() -> None:
        result["before_abort"] = {"event_done": event.query(), "completed": work.is_completed(),
                                  "exception": work.exception() is not None}

    thread = observer(pg, before_abort)
    result["main"] = blocking(lambda: t.sum().item())
    thread.join(10)
    result["after_abort"] = {"event_done": event.query(), "exception": repr(work.exception())}
    try:
        work.wait()
        result["after_abort"]["wait"] = "returned"
    except dist.DistBackendError as exc:
        result["after_abort"]["wait"] = f"DistBackendError: {exc}"
    try:
        dist.all_reduce(torch.ones(1))
        result["after_abort"]["next_collective"] = "ran"
    except dist.DistBackendError as exc:
        result["after_abort"]["next_collective"] = f"DistBackendError: {exc}"


def scenario_stop_wait(pg, result) -> None:
    """A stopped peer: gloo reports nothing, wait() itself blocks until the abort."""
    thread = observer(pg, wait_spinning=False)
    result["main"] = blocking(lambda: dist.all_reduce(torch.ones(4)))
    thread.join(10)


def scenario_kill_barrier(pg, result) -> None:
    """barrier() blocks the host even when its op is known to spin (it synchronizes)."""
    thread = observer(pg)
    result["main"] = blocking(dist.barrier)
    thread.join(10)


def scenario_kill_destroy(pg, result) -> None:
    """destroy_process_group with unfinished work: 2.6+ waits for it (until the abort)."""
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    thread = observer(pg)
    result["main"] = blocking(dist.destroy_process_group)
    thread.join(10)
    result["initialized_after"] = dist.is_initialized()


def scenario_watchdog(pg, result) -> None:
    """The group times out (WORKER_GROUP_TIMEOUT_S): what the watchdog does by its mode."""
    work = dist.all_reduce(torch.ones(4), async_op=True)
    # the watchdog acts after the group's timeout; the observer only after that and 3 s more
    thread = observer(pg, wait_spinning=False, observe_s=pg.timeout.total_seconds() + 3)
    result["main"] = blocking(work.wait)
    result["has_get_future_result"] = hasattr(work, "get_future_result")
    if result["has_get_future_result"]:
        future = work.get_future_result()
        result["future_result"] = str(future.value()) if future.done() else "not done"
    result["exception"] = repr(work.exception())
    thread.join(10)


def scenario_one_queue_read(pg, result) -> None:
    """A read on a private stream while the main thread is stuck behind a spinning
    collective: with one work queue it waits behind it, until the abort."""
    t = torch.ones(4)
    dist.all_reduce(t)  # returns: the op is known to spin; the default stream waits for it
    read = {}

    def reader() -> None:
        state.setdefault("entered", threading.Event()).wait(60)
        private = torch.npu.Stream()
        with torch.npu.stream(private):
            start = time.monotonic()
            torch.ones(2).sum().item()
            read["took_s"] = round(time.monotonic() - start, 3)
            read["before_abort"] = "aborted_at" not in state

    reading = threading.Thread(target=reader, daemon=True)
    reading.start()
    thread = observer(pg)
    result["main"] = blocking(lambda: t.sum().item())
    thread.join(10)
    reading.join(10)
    result["private_read"] = read


def scenario_kill_all_spin(pg, result) -> None:
    """Three ranks, one dead: every survivor's group spins (the one whose gloo saw the reset
    tells the others through the store), so every survivor's wait() returns."""
    out = torch.empty(2 * WORLD)
    work = dist.all_gather_into_tensor(out, torch.ones(2), async_op=True)
    thread = observer(pg)
    result["main"] = blocking(work.wait)
    result["wait_returned_before_abort"] = "aborted_at" not in state
    thread.join(10)


SCENARIOS = {"kill_all_spin": scenario_kill_all_spin, "kill_item": scenario_kill_item,
             "stop_wait": scenario_stop_wait, "kill_barrier": scenario_kill_barrier,
             "kill_destroy": scenario_kill_destroy,
             "watchdog": scenario_watchdog, "one_queue_read": scenario_one_queue_read}


def main() -> None:
    timeout = timedelta(seconds=float(os.environ.get("WORKER_GROUP_TIMEOUT_S", "1800")))
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK,
                            world_size=WORLD, timeout=timeout)
    pg = dist.group.WORLD
    result = {"version": str(torch.__version__), "backend": dist.get_backend(),
              "name": pg.name(), "names": {n: hasattr(pg, n) for n in NAMES},
              "abort_process_group": hasattr(dist.distributed_c10d, "_abort_process_group"),
              "nccl": list(torch.cuda.nccl.version())}
    result["warm_up"] = warm_up(pg)
    peer_fault()
    SCENARIOS[SCENARIO](pg, result)
    result["blocked"] = state.get("blocked")
    result["spinning"] = state.get("spinning")
    result["abort_name"] = state.get("abort_name")
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    if SCENARIO == "kill_all_spin":
        return  # an ordinary exit, an aborted group's gloo op still pending: must end rc 0
    os._exit(0)  # the dead peer's gloo group is left behind on purpose: no teardown


if __name__ == "__main__":
    main()
