"""The fault-time path against a real NVIDIA GPU, its NCCL and its driver: one command.

    python bench/gpu_check.py --json $OUT/gpu_check.json   # every case; a row per case as it ends
    python bench/gpu_check.py --dry-run                    # list the cases, run nothing
    python bench/gpu_check.py --only hang --only leak      # the cases whose name contains these

Written for one GPU, one command of at most 9 minutes, no network, nothing installed: Python
3.12, torch (2.11.0+cu130 on the machine this project may be lent), CuPy 14, the standard
library. The versions come first (torch, ``torch.cuda.nccl.version()``, the driver, CuPy,
the GPU); then each case runs in a child process of its own (so an environment read when CUDA
or NCCL starts, ``CUDA_DEVICE_MAX_CONNECTIONS``, takes effect, and a hung case cannot take the
rest with it). After every case its row is printed and the JSON at ``--json`` is rewritten
(atomically): a run cut at its time limit still returns every row it finished. A global
deadline (``--deadline-s``, 540 s) skips the cases that would not fit in what is left, each
with a row saying so. Statuses: PASS, FAIL, MEASURED (a figure, no verdict), INFO, SKIP (why).

**What it settles** (device_review_2.md §4; docs/benchmarks.md has the table once it has run):

* ``abortable_hang[wait=W,max_conn=C]``: the survivor's device queue after a peer died inside
  the param all-gather: a CuPy spin kernel on torch's training stream stands for the hung
  collective (it polls a flag in mapped pinned host memory), the params' copies and the
  all-gather's event (``device_copy.GATHERED``) queue behind it, a training kernel too; the main
  thread blocks behind it (W: ``synchronize``, ``item``). A handler thread runs the real
  ``device_copy.prepare`` with a fake NCCL group whose ``abort()`` sets the flag: the snapshot,
  then the abort that releases the kernel, then the read on the private stream, under both
  ``CUDA_DEVICE_MAX_CONNECTIONS`` settings (C). PASS: the first ``prepare`` notes the params as
  not gathered, the abort releases the kernel and the main thread (within 1 s), the event then
  completes but a second ``prepare`` still says not gathered (D2), and the file written equals
  the state of the step.
* ``fallback[max_conn=C]``: the same, with an abort that fails (the flag is never set): with
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` the save is refused at once (D5); unset, the read on the
  private stream passes the spinning kernel or not (MEASURED: the row says which; no document
  promises it).
* ``dead_peer[sig=S,op=O,group=G,mode=M]``: real dead peers, where NCCL is 2.30 or newer (two
  ranks on one GPU, ``NCCL_MULTI_RANK_GPU_ENABLE=1``; older NCCL refuses, "Duplicate GPU
  detected": SKIP). Rank 1 is SIGKILLed or SIGSTOPped (S) while both loop over an all-reduce or
  an all-gather (O) on the world group or a subgroup (G); rank 0's main thread spins in it. The
  runtime's own fault-time stop (control/rank/release.py) aborts from another thread and releases
  the
  main thread; then either the dying save reads device memory on the private stream, or the
  process destroys its groups, checks the device and builds a new world with a fresh rank 1 (M).
  PASS: out of the step within 1 s of the stop, and the save's bytes right or the new world's
  all-reduce right.
* ``leak_loop``: a one-rank NCCL world built, used, aborted and destroyed 20 times in one
  process: device memory, threads and open files before and after (PASS within small bounds).
* ``empty_cache_gil``: whether this torch's ``empty_cache`` lets Python threads run while it
  waits for the device (D10), measured as the runtime measures it at start-up.
* ``watchdog[handling=ttprun]`` / ``watchdog[handling=3]``: a collective that cannot start
  outlives a 5 s group timeout. With ttprun's settings (2, under both names) the process lives
  and the work's result says it failed (what D9's check reads); with torch's default 3 it is
  killed by SIGABRT (PASS only then: another crash is a FAIL).
* ``ready_timeout``: the update's event never completes: ``prepare`` refuses within its bound
  and aborts nothing. ``pool_alias``: torch's stream pool repeats within 32 streams and the
  private stream is none of them. ``hooks_barrier``: per-step cost of the guide's barrier and
  the hooks (MEASURED). ``save_path[cpu]``, ``load_vote[devices]``: host parts that also run
  without a GPU (so CI runs this script's code: tests/writer/test_gpu_check.py).

Without CUDA every GPU case is a SKIP with its reason. Not yet run on a GPU: no device figure in
the docs comes from it until it has (docs/benchmarks.md says which rows have run: none).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
DEADLINE_S = 540.0
WAITS = ("synchronize", "item")
CONNECTIONS = ("unset", "1")
MULTI_RANK_NCCL = (2, 30, 0)  # NCCL_MULTI_RANK_GPU_ENABLE: two ranks of a communicator, one GPU
RESULT = "RESULT "


@dataclass(frozen=True)
class Case:
    name: str
    run: str  # the child function's name in this module
    needs: Tuple[str, ...] = ("cuda",)  # "cuda", "cupy", "multi_rank"; () = runs anywhere
    env: Dict[str, str] = field(default_factory=dict)
    args: Dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 90.0
    cost_s: float = 15.0  # a typical run, for the deadline


def _connections(value: str) -> Dict[str, str]:
    return {} if value == "unset" else {"CUDA_DEVICE_MAX_CONNECTIONS": value}


def _dead_peers(first: bool) -> List[Case]:
    """The 16 dead-peer cases, the four that matter most first (`first`) or the rest."""
    out = []
    for group in ("world", "subgroup"):
        for op in ("all_reduce", "all_gather"):
            for sig in ("SIGKILL", "SIGSTOP"):
                for mode in ("save", "reinit"):
                    core = group == "world" and op == "all_reduce"
                    if core is first:
                        out.append(Case(f"dead_peer[sig={sig},op={op},group={group},mode={mode}]",
                                        "child_dead_peer", ("cuda", "multi_rank"),
                                        args={"sig": sig, "op": op, "group": group,
                                              "mode": mode},
                                        timeout_s=150, cost_s=40 if mode == "reinit" else 30))
    return out


# in priority order: what the deadline drops first is last
CASES: List[Case] = (
    [Case(f"abortable_hang[wait={w},max_conn={c}]", "child_abortable_hang", ("cuda", "cupy"),
          env=_connections(c), args={"wait": w}, cost_s=15)
     for c in CONNECTIONS for w in WAITS]
    + [Case(f"fallback[max_conn={c}]", "child_fallback", ("cuda", "cupy"), env=_connections(c),
            cost_s=20) for c in CONNECTIONS]
    + _dead_peers(first=True)
    + [Case("leak_loop", "child_leak_loop", cost_s=40, timeout_s=150),
       Case("empty_cache_gil", "child_empty_cache_gil", cost_s=10),
       Case("watchdog[handling=ttprun]", "child_watchdog", ("cuda", "cupy"),
            args={"expect_alive": True}, cost_s=25),
       Case("watchdog[handling=3]", "child_watchdog", ("cuda", "cupy"),
            env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_ASYNC_ERROR_HANDLING": "3"},
            args={"expect_alive": False}, cost_s=25),
       Case("ready_timeout", "child_ready_timeout", ("cuda", "cupy"), cost_s=12),
       Case("pool_alias", "child_pool_alias", cost_s=10)]
    + _dead_peers(first=False)
    + [Case("hooks_barrier", "child_hooks_barrier", cost_s=20),
       Case("save_path[cpu]", "child_save_path_cpu", (), cost_s=10),
       Case("load_vote[devices]", "child_load_vote", (), cost_s=15)]
)


# -- what the machine has -------------------------------------------------------------------------

def versions() -> Dict[str, Any]:
    """torch, NCCL, the driver, CuPy and the GPU, each "none" (with why) when absent."""
    import torch

    out: Dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                           "cuda_available": torch.cuda.is_available()}
    try:
        out["nccl"] = ".".join(str(p) for p in torch.cuda.nccl.version())
    except Exception as exc:  # noqa: BLE001 - a CPU build
        out["nccl"] = f"none ({type(exc).__name__})"
    out["driver"] = _driver_version()
    try:
        import cupy

        out["cupy"] = cupy.__version__
    except Exception as exc:  # noqa: BLE001 - reported
        out["cupy"] = f"none ({type(exc).__name__}: {str(exc)[:80]})"
    out["device"] = torch.cuda.get_device_name(0) if out["cuda_available"] else "no CUDA device"
    out["torch_cuda"] = getattr(torch.version, "cuda", None)
    return out


def _driver_version() -> str:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        value = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(value)) != 0:
            return "none (cuDriverGetVersion failed)"
        return f"{value.value // 1000}.{value.value % 1000 // 10}"
    except OSError:
        return "none (no libcuda.so.1)"


def _nccl_tuple(text: str) -> Optional[Tuple[int, ...]]:
    try:
        return tuple(int(p) for p in text.split(".")[:3])
    except ValueError:
        return None


def skip_reason(case: Case, found: Dict[str, Any]) -> str:
    """Why `case` cannot run on this machine ("" when it can)."""
    if "cuda" in case.needs and not found["cuda_available"]:
        return NO_CUDA
    if "cupy" in case.needs and str(found["cupy"]).startswith("none"):
        return f"CuPy is not importable: {found['cupy']}"
    if "multi_rank" in case.needs:
        nccl = _nccl_tuple(str(found["nccl"]))
        if nccl is None or nccl < MULTI_RANK_NCCL:
            return (f"NCCL {found['nccl']} < 2.30: two ranks of one communicator cannot share "
                    "this GPU (NCCL_MULTI_RANK_GPU_ENABLE needs 2.30)")
    return ""


# -- helpers used in the children -----------------------------------------------------------------

SPIN_SOURCE = r"""
extern "C" __global__ void ttp_spin(const volatile int* flag, unsigned long long* spins) {
    unsigned long long n = 0;
    while (*flag == 0) {
        ++n;
#if __CUDA_ARCH__ >= 700
        __nanosleep(1000);
#endif
    }
    *spins = n;
}
"""


class HostFlag:
    """A kernel that spins until the host sets a flag: a collective hung on a dead peer that
    only an abort (here: setting the flag) ends. The flag lives in mapped pinned host memory,
    read by the kernel over the bus at every turn."""

    def __init__(self) -> None:
        import cupy

        runtime = cupy.cuda.runtime
        cupy.cuda.Device(0).use()
        mapped = getattr(runtime, "hostAllocMapped", 2)  # cudaHostAllocMapped
        self._host = runtime.hostAlloc(8, mapped)
        ctypes.memset(self._host, 0, 8)
        get_device_pointer = getattr(runtime, "hostGetDevicePointer", None)
        # with unified addressing (every 64-bit Linux CUDA) the device pointer of mapped
        # pinned memory is the host pointer itself
        device_ptr = get_device_pointer(self._host, 0) if get_device_pointer else self._host
        memory = cupy.cuda.UnownedMemory(device_ptr, 8, self, 0)
        self.flag = cupy.ndarray((1,), dtype=cupy.int32,
                                 memptr=cupy.cuda.MemoryPointer(memory, 0))
        self.spins = cupy.zeros(1, dtype=cupy.uint64)
        cupy.cuda.Device(0).synchronize()
        self._kernel = cupy.RawKernel(SPIN_SOURCE, "ttp_spin")
        self._kernel.compile()

    def launch(self, torch_stream: Any) -> None:
        """Enqueue the spin on `torch_stream` (a torch.cuda.Stream)."""
        import cupy

        with cupy.cuda.ExternalStream(torch_stream.cuda_stream, 0):
            self._kernel((1,), (1,), (self.flag, self.spins))

    def release(self) -> None:
        ctypes.c_int32.from_address(self._host).value = 1

    @property
    def released(self) -> bool:
        return ctypes.c_int32.from_address(self._host).value != 0


class FlagGroup:
    """A process group as abort.py sees one: an NCCL backend whose abort() ends the spin (or,
    `fails`, raises without ending it: an abort that did not work)."""

    group_name = "gpu-check"

    def __init__(self, flag: HostFlag, fails: bool = False) -> None:
        self.flag, self.fails = flag, fails
        self.aborted_at: Optional[float] = None

    def name(self) -> str:
        return "nccl"

    def abort(self) -> None:
        self.aborted_at = time.monotonic()
        if self.fails:
            raise RuntimeError("ncclCommAbort: unhandled system error (gpu_check)")
        self.flag.release()


def _arm(step: int) -> None:
    """As the runtime does: capture the device, arm the end-of-update mark, record it."""
    from mindio_ttp import hooks
    from mindio_ttp.faulttime import device as ttp_device
    from mindio_ttp.faulttime import device_copy

    device_copy.MARK.install(ttp_device.capture())
    hooks.end_updating_os(step)


def _in_handler_thread(fn: Callable[[], Any], delay_s: float = 0.0) -> Dict[str, Any]:
    """Run `fn` in a thread bound like the processor's handler thread, `delay_s` later (the
    main thread is inside its blocking call by then)."""
    from mindio_ttp.faulttime import device as ttp_device

    binding = ttp_device.capture()
    box: Dict[str, Any] = {"done": threading.Event()}

    def run() -> None:
        time.sleep(delay_s)
        t0 = time.monotonic()
        box["t0"] = t0
        try:
            binding.bind()
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported in the row
            box["error"] = f"{type(exc).__name__}: {exc}"[:500]
        box["seconds"] = time.monotonic() - t0
        box["done"].set()

    threading.Thread(target=run, name="ttp-save-handler", daemon=True).start()
    return box


@contextlib.contextmanager
def _one_rank_group(timeout_s: float = 600.0):
    import torch
    import torch.distributed as dist

    store = dist.FileStore(tempfile.mktemp(prefix="ttp-gpu-check-"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=torch.device("cuda", 0))
    try:
        yield dist
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _counts() -> Dict[str, int]:
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return {"device_used_mib": (total - free) >> 20, "threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd"))}


def _block(how: str, torch: Any, y: Any) -> None:
    if how == "synchronize":
        torch.cuda.synchronize()
    elif how == "item":
        y.sum().item()
    else:
        raise ValueError(how)


# -- the children ---------------------------------------------------------------------------------

def child_abortable_hang(wait: str) -> Dict[str, Any]:
    """Snapshot, then the abort that releases the kernel, then the read (module doc)."""
    import torch

    from mindio_ttp.faulttime import abort, checkpoint_writer, device_copy

    torch.cuda.set_device(0)
    state = {"w": torch.randn(16 << 20, device="cuda"), "step": 3}  # 64 MiB
    params = torch.zeros_like(state["w"])
    torch.cuda.synchronize()
    expected = state["w"].cpu()
    flag = HostFlag()
    group = FlagGroup(flag)
    abort._all_groups = lambda: [group]  # this process's only "NCCL group"
    _arm(3)  # the update of step 3 is done: its event
    flag.launch(torch.cuda.current_stream())  # the param all-gather, hung on a dead peer
    params.copy_(state["w"])  # gather_model_params' copies, queued behind it
    device_copy.GATHERED.record(3)
    y = params * 2  # a training kernel behind
    out = Path(tempfile.mkdtemp()) / "x.pt"
    seen: Dict[str, Any] = {}

    def save() -> Dict[str, Any]:
        first = device_copy.prepare(3)
        seen["event_after_abort"] = _poll(lambda: device_copy.GATHERED.event.query(), 5.0)
        second = device_copy.prepare(3)
        checkpoint_writer.write_torch(out, state)
        return {"first_gathered": first.gathered, "second_gathered": second.gathered,
                "abort": first.abort.describe(), "abort_ok": first.abort.ok}

    box = _in_handler_thread(save, delay_s=0.5)
    t0 = time.monotonic()
    main_error = ""
    try:
        _block(wait, torch, y)  # the main thread, as Megatron's is
    except Exception as exc:  # noqa: BLE001 - reported
        main_error = f"{type(exc).__name__}: {str(exc)[:200]}"
    released = time.monotonic()
    box["done"].wait(60)
    flag.release()  # whatever happened, end the spin
    torch.cuda.synchronize()
    row: Dict[str, Any] = {"main_blocked_s": released - t0, "main_error": main_error,
                           "spins": int(flag.spins.get()[0]), **seen}
    if group.aborted_at is not None:
        row["main_out_after_abort_s"] = released - group.aborted_at
    row.update({k: box[k] for k in ("result", "error", "seconds") if k in box})
    if "error" in row or "result" not in row:
        return {**row, "status": "FAIL"}
    result = row["result"]
    loaded = torch.load(out, map_location="cpu", weights_only=True)
    row["bytes_equal"] = bool(torch.equal(loaded["w"], expected))
    ok = (result["first_gathered"] is False and result["second_gathered"] is False
          and result["abort_ok"] and row["bytes_equal"] and seen.get("event_after_abort")
          and row.get("main_out_after_abort_s", 99) < 1.0)
    return {**row, "status": "PASS" if ok else "FAIL"}


def _poll(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def child_fallback() -> Dict[str, Any]:
    """An abort that does not work: refused at once with one work queue; otherwise, does the
    read on the private stream get past the spinning kernel? (module doc)"""
    import torch

    from mindio_ttp.faulttime import abort, checkpoint_writer, device_copy

    torch.cuda.set_device(0)
    state = {"w": torch.randn(4 << 20, device="cuda")}
    torch.cuda.synchronize()
    expected = state["w"].cpu()
    flag = HostFlag()
    abort._all_groups = lambda: [FlagGroup(flag, fails=True)]
    _arm(3)
    flag.launch(torch.cuda.current_stream())
    one_queue = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1"
    out = Path(tempfile.mkdtemp()) / "x.pt"

    def save() -> Dict[str, Any]:
        read = device_copy.prepare(3)
        checkpoint_writer.write_torch(out, state)
        return {"abort": read.abort.describe(), "spin_still_running": not flag.released}

    box = _in_handler_thread(save)
    box["done"].wait(60)
    flag.release()
    torch.cuda.synchronize()
    row = {k: box[k] for k in ("result", "error", "seconds") if k in box}
    if one_queue:
        refused = "FallbackUnsafe" in row.get("error", "") and row.get("seconds", 99) < 2.0
        return {**row, "status": "PASS (refused at once)" if refused else "FAIL"}
    if "result" in row and row["result"]["spin_still_running"]:
        equal = bool(torch.equal(torch.load(out, weights_only=True)["w"], expected))
        return {**row, "bytes_equal": equal,
                "status": ("MEASURED (the private stream passed the spinning kernel)" if equal
                           else "FAIL (read, but wrong bytes)")}
    return {**row, "status": "MEASURED (the private stream did not pass the spinning kernel: "
                             "the read gave up within its bound)"
            if "DeviceNotReady" in row.get("error", "") else "FAIL"}


def child_ready_timeout() -> Dict[str, Any]:
    import torch

    from mindio_ttp import hooks
    from mindio_ttp.faulttime import abort, device_copy
    from mindio_ttp.faulttime import device as ttp_device

    torch.cuda.set_device(0)
    flag = HostFlag()
    aborted: List[str] = []
    abort._all_groups = lambda: aborted.append("abort") or []
    device_copy.MARK.install(ttp_device.capture())
    flag.launch(torch.cuda.current_stream())  # the update waits behind the hang
    hooks.end_updating_os(2)
    t0 = time.monotonic()
    try:
        device_copy.prepare(2, ready_timeout_s=2.0)
        error = ""
    except device_copy.DeviceNotReady as exc:
        error = str(exc)
    took = time.monotonic() - t0
    flag.release()
    torch.cuda.synchronize()
    ok = bool(error) and 1.5 < took < 4.0 and not aborted
    return {"refused_after_s": took, "error": error[:200], "aborted": bool(aborted),
            "status": "PASS" if ok else "FAIL"}


def child_pool_alias() -> Dict[str, Any]:
    import torch

    from mindio_ttp.faulttime import device as ttp_device

    torch.cuda.set_device(0)
    with _one_rank_group() as dist:
        x = torch.ones(16, device="cuda")
        dist.all_reduce(x)  # ProcessGroupNCCL took its stream from the pool
        pool = [torch.cuda.Stream().cuda_stream for _ in range(64)]
        private = ttp_device.private_stream(torch.cuda, ttp_device.capture())
    distinct = len(set(pool))
    ok = distinct <= 32 and private.cuda_stream not in set(pool)
    return {"pool_streams_seen": distinct, "private_is_external":
            type(private).__name__ == "ExternalStream", "status": "PASS" if ok else "FAIL"}


def child_watchdog(expect_alive: bool) -> Dict[str, Any]:
    """A collective that cannot start (its stream waits behind the spin) outlives a 5 s group
    timeout (module doc)."""
    import torch

    from mindio_ttp.faulttime import device_copy

    torch.cuda.set_device(0)
    group_timeout = 5.0
    flag = HostFlag()
    with _one_rank_group(timeout_s=group_timeout) as dist:
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        flag.launch(side)
        with torch.cuda.stream(side):
            work = dist.all_reduce(x, async_op=True)  # its NCCL stream waits for `side`
        time.sleep(group_timeout + 8)  # past the group's timeout: the watchdog has acted
        failed = device_copy._work_failed(work)
        flag.release()
        torch.cuda.synchronize()
    # reached only when the process survived the timeout
    return {"alive_after_timeout": True, "work_failed": failed,
            "status": "PASS" if expect_alive and failed else "FAIL"}


def child_leak_loop(rounds: int = 20) -> Dict[str, Any]:
    """Build, use, abort and destroy a one-rank NCCL world `rounds` times (module doc)."""
    import torch
    import torch.distributed as dist

    from mindio_ttp.faulttime import abort
    from mindio_ttp.faulttime import device as ttp_device

    torch.cuda.set_device(0)
    binding = ttp_device.DeviceBinding("cuda", 0)
    seconds: List[float] = []
    first: Dict[str, int] = {}
    for i in range(rounds):
        t0 = time.monotonic()
        dist.init_process_group("nccl", store=dist.FileStore(tempfile.mktemp(), 1), rank=0,
                                world_size=1, device_id=torch.device("cuda", 0))
        sub = dist.new_group([0])
        x = torch.full((1 << 20,), float(i), device="cuda")
        dist.all_reduce(x)
        dist.all_reduce(x, group=sub)
        assert x[0].item() == float(i)
        report = abort.abort_all(10.0, binding=binding)
        if not report.ok:
            return {"round": i, "abort": report.describe(), "status": "FAIL"}
        if not abort.destroy_groups(10.0):
            return {"round": i, "status": "FAIL (destroy did not return)"}
        seconds.append(time.monotonic() - t0)
        if i == 1:  # after the first round's one-time allocations
            torch.cuda.synchronize()
            first = _counts()
    torch.cuda.synchronize()
    last = _counts()
    grew = {k: last[k] - first[k] for k in last}
    ok = grew["threads"] <= 2 and grew["fds"] <= 4 and grew["device_used_mib"] <= 64
    return {"rounds": rounds, "first": first, "last": last, "grew": grew,
            "round_s_median": sorted(seconds)[len(seconds) // 2],
            "status": "PASS" if ok else "FAIL (grows: a leak per recovery)"}


def child_empty_cache_gil() -> Dict[str, Any]:
    import torch

    from mindio_ttp.compat import features

    torch.cuda.set_device(0)
    releases = features.empty_cache_releases_gil()
    if releases is None:
        return {"status": "FAIL (no CUDA answer)"}
    return {"releases_gil": releases,
            "status": "MEASURED (releases the GIL)" if releases else
            "MEASURED (holds the GIL: the start-up warning applies, D10)"}


def child_hooks_barrier(steps: int = 200) -> Dict[str, Any]:
    import torch

    from mindio_ttp import hooks

    torch.cuda.set_device(0)
    _arm(0)
    x = torch.randn(2048, 2048, device="cuda")
    times: Dict[bool, List[float]] = {}
    with _one_rank_group() as dist:
        for guide in (False, True, False, True):
            for i in range(steps + 10):
                if i == 10:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                y = x @ x
                if guide:
                    dist.barrier()
                    hooks.start_updating_os(-1)
                y.add_(1.0)
                if guide:
                    hooks.end_updating_os(i + 1)
            torch.cuda.synchronize()
            times.setdefault(guide, []).append((time.perf_counter() - t0) / steps)
    base, with_guide = min(times[False]), min(times[True])
    return {"step_us": base * 1e6, "cost_per_step_us": (with_guide - base) * 1e6,
            "status": "MEASURED"}


# -- dead peers: two ranks on one GPU -------------------------------------------------------------

def _peer_env() -> Dict[str, str]:
    from mindio_ttp.faulttime import collective_env

    env = dict(os.environ, NCCL_MULTI_RANK_GPU_ENABLE="1")
    collective_env.apply_defaults(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _spawn_rank1(store: str, op: str, group: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--peer", store, op, group],
                            env=_peer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _world(store: str, group: str, rank: int) -> Tuple[Any, Any]:
    """(torch.distributed, the group the ops run on) for a 2-rank world on `store`."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600),
                            device_id=torch.device("cuda", 0))
    sub = dist.new_group([0, 1]) if group == "subgroup" else None
    return dist, sub


def _op(dist: Any, op: str, group: Any, x: Any, out: Any) -> None:
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    else:
        dist.all_gather_into_tensor(out, x, group=group)


def peer_main(store: str, op: str, group: str) -> int:
    """Rank 1: loops over the op until rank 0 signals it; op "once": a replacement's one
    all-reduce of ones (the new world's check), then it waits to be killed."""
    import torch

    torch.cuda.set_device(0)
    dist, sub = _world(store, group, 1)
    if op == "once":
        dist.all_reduce(torch.ones(1 << 20, device="cuda"))
        torch.cuda.synchronize()
        threading.Event().wait()
    x = torch.ones(1 << 22, device="cuda")
    out = torch.empty(2 * x.numel(), device="cuda")
    while True:
        _op(dist, op, sub, x, out)
        x.fill_(1.0)
        torch.cuda.synchronize()


def child_dead_peer(sig: str, op: str, group: str, mode: str) -> Dict[str, Any]:
    """Rank 0 (module doc): its main thread loops over the op with rank 1; rank 1 gets `sig`;
    the runtime's fault-time stop releases rank 0; then the save or the new world."""
    import torch

    from mindio_ttp import hooks
    from mindio_ttp.control.rank import release
    from mindio_ttp.faulttime import abort, checkpoint_writer, device_copy
    from mindio_ttp.faulttime import device as ttp_device

    os.environ.update(_peer_env())
    torch.cuda.set_device(0)
    first_store = tempfile.mktemp(prefix="ttp-gpu-check-w1-")
    peers = [_spawn_rank1(first_store, op, group)]
    try:
        dist, sub = _world(first_store, group, 0)
        x = torch.ones(1 << 22, device="cuda")
        out = torch.empty(2 * x.numel(), device="cuda")
        state = {"w": torch.randn(1 << 20, device="cuda")}
        for _ in range(3):  # both ranks in step: the communicators exist
            _op(dist, op, sub, x, out)
            x.fill_(1.0)
        torch.cuda.synchronize()
        expected = state["w"].cpu()
        _arm(1)
        row: Dict[str, Any] = {}

        def fault() -> None:  # the processor's side: rank 1 dies, the stop follows
            time.sleep(1.0)
            os.kill(peers[0].pid, getattr(signal, sig))
            row["fault_at"] = time.monotonic()
            time.sleep(0.5)  # the controller's detection, then its lock
            outcome = release.stop("gpu_check")
            row["stop"] = outcome.describe()
            row["stop_ok"] = outcome.ok
            row["out_after_stop_s"] = outcome.seconds

        threading.Thread(target=fault, name="ttp-fault-stop", daemon=True).start()
        hooks.TRAINING.enter()
        main_error = ""
        try:
            while True:
                _op(dist, op, sub, x, out)
                x.fill_(1.0)
                x.sum().item()  # the host waits for the device, as Megatron's does
        except BaseException as exc:  # noqa: BLE001 - the way out of the step
            hooks.TRAINING.leave()
            main_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        row["main_error"] = main_error
        row["main_out_after_fault_s"] = time.monotonic() - row.get("fault_at", time.monotonic())
        _poll(lambda: "stop_ok" in row, 30.0)
        if mode == "save":
            target = Path(tempfile.mkdtemp()) / "x.pt"
            box = _in_handler_thread(lambda: (device_copy.prepare(1),
                                              checkpoint_writer.write_torch(target, state)))
            box["done"].wait(60)
            row.update({k: str(box[k])[:300] for k in ("error",) if k in box})
            row["save_s"] = box.get("seconds")
            done = "error" not in box and bool(torch.equal(
                torch.load(target, weights_only=True)["w"], expected))
        else:
            binding = ttp_device.capture()
            peers[0].kill()  # a stopped rank 1 is killed by its launcher, then replaced
            destroyed = abort.destroy_groups(10.0)
            sick = ttp_device.health_check(binding, 10.0)
            second = tempfile.mktemp(prefix="ttp-gpu-check-w2-")
            peers.append(_spawn_rank1(second, "once", "world"))
            t0 = time.monotonic()
            dist, _ = _world(second, "world", 0)
            y = torch.full((1 << 20,), 2.0, device="cuda")
            dist.all_reduce(y)
            value = y[0].item()
            row.update(destroyed=destroyed, health=sick or "ok", new_world_s=time.monotonic() - t0,
                       new_world_sum=value)
            done = destroyed and not sick and value == 3.0  # rank 1 of the new world adds 1
        out_ok = row.get("stop_ok") and row.get("out_after_stop_s", 99) < 1.0
        return {**row, "status": "PASS" if done and out_ok else "FAIL"}
    finally:
        for peer in peers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(peer.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                peer.wait(10)


# -- host parts (run without a GPU too) -----------------------------------------------------------

@contextlib.contextmanager
def _gloo_one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0,
                            world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def child_save_path_cpu() -> Dict[str, Any]:
    """The save path on CPU tensors, in a handler thread, with a 1-rank gloo group: the abort
    leaves gloo alone and the file is written (host part: no device figure)."""
    import torch

    from mindio_ttp.faulttime import checkpoint_writer, device_copy

    state = {"w": torch.randn(1 << 20), "step": 3}
    with _gloo_one_rank():
        _arm(3)
        out = Path(tempfile.mkdtemp()) / "x.pt"

        def save() -> str:
            ready = device_copy.prepare(3)
            checkpoint_writer.write_torch(out, state)
            return ready.abort.describe()

        box = _in_handler_thread(save)
        box["done"].wait(60)
    row = {k: box[k] for k in ("result", "error", "seconds") if k in box}
    ok = "error" not in row and torch.equal(
        torch.load(out, weights_only=True)["w"], state["w"])
    row["status"] = "PASS" if ok else "FAIL"
    return row


def child_load_vote() -> Dict[str, Any]:
    """load's checkpoint agreement on a 1-rank group: NCCL on a GPU (every tensor it hands to
    a collective must be on the device), gloo on CPU (runs the same code)."""
    import torch

    megatron = os.environ.get("TTP_MEGATRON_DIR")
    if megatron:
        sys.path.insert(0, megatron)
    on_gpu = torch.cuda.is_available()
    try:
        import mindio_ttp.compat  # noqa: F401 - before Megatron, as the patched tree does
        if not on_gpu:
            import mindio_ttp.cpu_adaptor  # noqa: F401 - Megatron needs it (apex) on CPU
        from mindio_ttp.faulttime import manifest
        from mindio_ttp.megatron_ttp import load
    except Exception as exc:  # noqa: BLE001 - the reason is the row
        return {"status": f"SKIP (Megatron not importable: {str(exc)[:120]}; set "
                          "TTP_MEGATRON_DIR)"}
    if on_gpu:
        torch.cuda.set_device(0)
    seen: List[str] = []
    group = _one_rank_group() if on_gpu else _gloo_one_rank()
    with group as dist:
        real = dist.all_reduce

        def spy(tensor, *a, **k):
            seen.append(str(tensor.device))
            return real(tensor, *a, **k)

        ckpt = Path(tempfile.mkdtemp())
        par = manifest.ParallelLayout(1, 1, 1)
        for rel in par.expected_files():
            path = ckpt / manifest.iter_dir_name(3) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({}, path)
        manifest.write_tracker(ckpt, 3)
        dist.all_reduce, load.parallel_layout = spy, lambda: par
        chosen = load.choose_checkpoint(ckpt)
        dist.all_reduce = real
    want = "cuda" if on_gpu else "cpu"
    ok = chosen == 3 and seen and all(d.startswith(want) for d in seen)
    return {"devices": sorted(set(seen)), "chosen": chosen, "status": "PASS" if ok else "FAIL"}


# -- the parent -----------------------------------------------------------------------------------

def _run_child(case: Case, limit_s: float) -> Dict[str, Any]:
    from mindio_ttp.faulttime import collective_env

    env = dict(os.environ)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    collective_env.apply_defaults(env)  # as ttprun sets them for its workers
    env.update(case.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, __file__, "--child", case.name], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return {"status": f"FAIL (timed out after {limit_s:.0f} s: the case hung)",
                "wall_s": time.monotonic() - t0, "detail": err[-1500:]}
    row: Dict[str, Any] = {"wall_s": time.monotonic() - t0}
    lines = [ln[len(RESULT):] for ln in out.splitlines() if ln.startswith(RESULT)]
    if proc.returncode == 0 and lines:
        row.update(json.loads(lines[-1]))
    elif case.run == "child_watchdog" and not case.args.get("expect_alive"):
        by_watchdog = proc.returncode == -signal.SIGABRT and any(
            w in err for w in ("Watchdog", "watchdog", "timeout", "Timeout"))
        row.update(status="PASS (killed by the watchdog, SIGABRT)" if by_watchdog else
                   f"FAIL (exit {proc.returncode}, not the watchdog's SIGABRT)",
                   exit=proc.returncode, detail=err[-600:])
    else:
        row.update(status="FAIL", exit=proc.returncode, detail=err[-1500:])
    return row


def _child(name: str) -> int:
    case = next(c for c in CASES if c.name == name)
    try:
        result = globals()[case.run](**case.args)
    except BaseException:  # noqa: BLE001 - the row says what broke
        result = {"status": "FAIL (raised)", "detail": traceback.format_exc()[-1500:]}
    print(RESULT + json.dumps(result, default=str), flush=True)
    os._exit(0)  # a hung NCCL op or an aborted group must not hold the interpreter's exit


def _write_json(path: Path, report: Dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def _print_row(row: Dict[str, Any]) -> None:
    figures = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()
                        if k not in ("case", "status", "detail") and not isinstance(v, dict))
    print(f"| {row['case']:58} | {row['status']}" + (f" [{figures}]" if figures else "") + " |",
          flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    ap.add_argument("--only", action="append", default=[],
                    help="run the cases whose name contains this (repeatable)")
    ap.add_argument("--json", type=Path, default=Path("gpu_check.json"),
                    help="rewritten after every case")
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S,
                    help="skip what would not fit after this many seconds (default 540)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--peer", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child)
    if args.peer:
        return peer_main(*args.peer)
    cases = [c for c in CASES if not args.only or any(o in c.name for o in args.only)]
    if args.dry_run:
        for c in cases:
            where = ("GPU" + (" + CuPy" if "cupy" in c.needs else "")
                     + (" + NCCL >= 2.30" if "multi_rank" in c.needs else "")
                     if c.needs else "host (runs without a GPU too)")
            print(f"{c.name:60} {where}, ~{c.cost_s:.0f} s")
        return 0
    started = time.monotonic()
    found = versions()
    print("gpu_check: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    report: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": found, "deadline_s": args.deadline_s, "rows": []}
    rows: List[Dict[str, Any]] = report["rows"]
    rows.append({"case": "versions", "status": "INFO", **found})
    _write_json(args.json, report)
    print(f"| {'case':58} | result |\n|{'-' * 60}|--------|", flush=True)
    _print_row(rows[-1])
    for c in cases:
        left = args.deadline_s - (time.monotonic() - started)
        why = skip_reason(c, found)
        if why:
            row = {"case": c.name, "status": f"SKIP ({why})"}
        elif left < c.cost_s:
            row = {"case": c.name, "status": f"SKIP (global deadline: {max(left, 0):.0f} s of "
                                             f"{args.deadline_s:.0f} s left, this case needs "
                                             f"~{c.cost_s:.0f} s)"}
        else:
            row = {"case": c.name, **_run_child(c, min(c.timeout_s, left))}
        rows.append(row)
        report["seconds"] = time.monotonic() - started
        _write_json(args.json, report)
        _print_row(row)
    failed = [r for r in rows if str(r["status"]).startswith("FAIL")]
    print(f"gpu_check: {len(rows) - 1} cases in {report['seconds']:.0f} s on {found['device']}: "
          f"{len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
