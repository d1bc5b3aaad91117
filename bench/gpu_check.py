"""The dying checkpoint's production hazards, reproduced on one NVIDIA GPU: one command.

    python bench/gpu_check.py                 # every case, a PASS/FAIL/SKIP table, gpu_check.json
    python bench/gpu_check.py --dry-run       # list the cases, run nothing (any machine)
    python bench/gpu_check.py --only save     # the cases whose name contains "save"

Budget: at most 9 minutes on one GPU with 16 cores (``--hang-s`` sets the length of the
emulated hang, 12 s by default; each case runs in its own child process, so environment
variables read when CUDA or NCCL start take effect). Every child gets
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` as ttprun sets it (mindio_ttp/faulttime/collective_env.py)
and a 1-rank NCCL group.

**The hang.** NCCL forbids two ranks of one communicator on one GPU, so a dead peer cannot be
had on one GPU. Instead an NCCL all-reduce is issued from a side stream that first runs
``torch.cuda._sleep`` for ``--hang-s``: ProcessGroupNCCL makes its stream wait for the issuing
stream, so the NCCL kernel cannot start; ``work.wait()`` then makes the default (training)
stream wait for it, and a training kernel is queued behind. That is the survivor's device queue
after a peer died inside a collective, for ``--hang-s`` seconds.

Cases (`CASES`):

* ``save[wait=W,max_conn=C]``: the main thread blocks the ways Megatron's does (W: ``barrier``,
  ``item``, ``synchronize``, ``empty_cache``), with ``CUDA_DEVICE_MAX_CONNECTIONS`` unset and 1
  (C); a handler thread, bound to the device as the processor's is, runs the real save path:
  ``device_copy.prepare`` (wait for the update's event, note the gather's, abort every
  communicator: faulttime/abort.py) then ``checkpoint_writer.write_torch`` of device tensors.
  PASS: the file is written and equal to the state well before the hang ends.
* ``fallback[max_conn=C]``: the same read without the abort, on the private stream from outside
  torch's pool alone (what runs when an abort times out). PASS as above. This is the row that
  says whether a copy on another stream passes a blocked default stream with one hardware
  queue, which no document promises.
* ``stale_gather``: the param all-gather of a step hangs behind the side stream; the copies into
  the params and the optimizer's event (``device_copy.GATHERED``) follow, as in
  ``ReplicatedOptimizer.gather_model_params``. PASS: "gathered" is False while it hangs, True
  once it completed.
* ``pool_alias``: ``torch.cuda.Stream()`` cycles through a pool (shared with ProcessGroupNCCL),
  and ``device.private_stream`` is not one of them. PASS: the pool repeats within 32 streams
  and the private stream is none of them.
* ``ready_timeout``: the update's event never completes (the update waits on the hang):
  ``prepare`` refuses with DeviceNotReady within its bound instead of saving a half-updated
  state, and aborts nothing. PASS: refused in time.
* ``watchdog[handling=ttprun]`` / ``watchdog[handling=3]``: the hang outlasts the group's
  timeout (5 s). With ttprun's setting the process stays alive and the save succeeds (PASS);
  with torch's default 3 it is killed (PASS when killed: the case can tell the two apart).
* ``handler_device``: the handler thread's device after ``DeviceBinding.bind`` (2 GPUs needed to
  discriminate; SKIP with one).
* ``hooks_barrier``: per-step cost of the guide's barrier plus the hooks on a 1-rank group.
* ``save_path[cpu]``, ``load_vote[devices]``: host parts that also run without a GPU: the save
  path on CPU tensors with a gloo group (abort is a no-op there), and the load's agreement
  (needs ``TTP_MEGATRON_DIR``) with every tensor on the device Megatron uses.

Without CUDA every GPU case is a SKIP with its reason and the host parts run, so CI runs this
script's code (tests/writer/test_gpu_check.py). Not yet run on a GPU: no device figure in the
docs comes from it until it has (docs/benchmarks.md says which rows have run: none).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
BUDGET_S = 9 * 60
WAITS = ("barrier", "item", "synchronize", "empty_cache")
CONNECTIONS = ("unset", "1")


@dataclass(frozen=True)
class Case:
    name: str
    run: str  # the child function's name in this module
    gpu: bool = True
    env: Dict[str, str] = field(default_factory=dict)
    args: Dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 60.0  # beyond the hang itself


def _connections(value: str) -> Dict[str, str]:
    return {} if value == "unset" else {"CUDA_DEVICE_MAX_CONNECTIONS": value}


CASES: List[Case] = (
    [Case(f"save[wait={w},max_conn={c}]", "child_save", env=_connections(c),
          args={"wait": w, "abort": True}) for c in CONNECTIONS for w in WAITS]
    + [Case(f"fallback[max_conn={c}]", "child_save", env=_connections(c),
            args={"wait": "synchronize", "abort": False}) for c in CONNECTIONS]
    + [Case("stale_gather", "child_stale_gather"),
       Case("pool_alias", "child_pool_alias"),
       Case("ready_timeout", "child_ready_timeout"),
       Case("watchdog[handling=ttprun]", "child_watchdog", args={"expect_alive": True}),
       Case("watchdog[handling=3]", "child_watchdog",
            env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, args={"expect_alive": False}),
       Case("handler_device", "child_handler_device"),
       Case("hooks_barrier", "child_hooks_barrier"),
       Case("save_path[cpu]", "child_save_path_cpu", gpu=False),
       Case("load_vote[devices]", "child_load_vote", gpu=False)]
)


# -- helpers used in the children ---------------------------------------------------------------

def _sleep_cycles(torch, seconds: float) -> int:
    rate_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 1_500_000
    return int(seconds * rate_khz * 1000)


@contextlib.contextmanager
def _one_rank_group(backend: str, timeout_s: float = 600.0):
    import torch
    import torch.distributed as dist

    store = dist.FileStore(tempfile.mktemp(prefix="ttp-gpu-check-"), 1)
    extra = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s), **extra)
    try:
        yield dist
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _arm(step: int) -> None:
    """As the runtime does: capture the device, arm the end-of-update mark, record it."""
    from mindio_ttp.control import hooks
    from mindio_ttp.faulttime import device as ttp_device
    from mindio_ttp.faulttime import device_copy

    device_copy.MARK.install(ttp_device.capture())
    hooks.end_updating_os(step)


def _in_handler_thread(fn: Callable[[], Any], started: Optional[threading.Event] = None,
                       delay_s: float = 0.0) -> Dict[str, Any]:
    """Run `fn` in a thread bound like the processor's handler thread (after `started` is set
    and `delay_s` more, so the main thread is inside its blocking call by then)."""
    from mindio_ttp.faulttime import device as ttp_device

    binding = ttp_device.capture()
    box: Dict[str, Any] = {"done": threading.Event()}

    def run() -> None:
        if started is not None:
            started.wait()
        time.sleep(delay_s)
        t0 = time.perf_counter()
        try:
            binding.bind()
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported in the row
            box["error"] = f"{type(exc).__name__}: {exc}"[:500]
        box["seconds"] = time.perf_counter() - t0
        box["done"].set()

    threading.Thread(target=run, name="ttp-save-handler", daemon=True).start()
    return box


def _hang(torch, dist, seconds: float):
    """The emulated hung collective (module doc); returns the training kernel's output."""
    side = torch.cuda.Stream()
    x = torch.ones(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(_sleep_cycles(torch, seconds))
        work = dist.all_reduce(x, async_op=True)  # its NCCL stream waits for `side`
    work.wait()  # the default stream waits for the NCCL kernel
    return x * 2  # a training kernel queued behind


def _block(torch, dist, how: str, y) -> None:
    if how == "barrier":
        dist.barrier()
    elif how == "item":
        y.sum().item()
    elif how == "synchronize":
        torch.cuda.synchronize()
    elif how == "empty_cache":
        torch.cuda.empty_cache()
    else:
        raise ValueError(how)


# -- the children ---------------------------------------------------------------------------------

def child_save(wait: str, abort: bool, hang_s: float) -> Dict[str, Any]:
    import torch

    from mindio_ttp.faulttime import checkpoint_writer, device_copy

    torch.cuda.set_device(0)
    state = {"w": torch.randn(64 << 20, device="cuda"), "step": 3}  # 256 MiB
    with _one_rank_group("nccl") as dist:
        torch.cuda.synchronize()
        expected = state["w"].cpu()
        _arm(3)
        out = Path(tempfile.mkdtemp()) / "x.pt"
        t0 = time.perf_counter()
        y = _hang(torch, dist, hang_s)
        started = threading.Event()

        def save() -> Dict[str, Any]:
            report = device_copy.prepare(3).abort.describe() if abort else "no abort"
            checkpoint_writer.write_torch(out, state)
            return {"abort": report}

        box = _in_handler_thread(save, started, delay_s=0.5)
        started.set()
        main_error = ""
        try:
            _block(torch, dist, wait, y)  # the main thread, as Megatron's is
        except Exception as exc:  # noqa: BLE001 - an aborted group may fail the main thread
            main_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        main_s = time.perf_counter() - t0
        box["done"].wait(hang_s + 60)
        row: Dict[str, Any] = {"main_blocked_s": main_s, "hang_s": hang_s,
                               "main_error": main_error}
        row.update({k: box[k] for k in ("result", "error", "seconds") if k in box})
        if "error" in row or "seconds" not in row:
            row["status"] = "FAIL"
            return row
        loaded = torch.load(out, map_location="cpu", weights_only=True)
        row["bytes_equal"] = bool(torch.equal(loaded["w"], expected))
        passed = row["seconds"] + 0.5 < 0.5 * hang_s and row["bytes_equal"]
        row["status"] = "PASS" if passed else "FAIL"
        if main_s < 0.5 * hang_s:
            row["status"] += " (inconclusive: the main thread was not blocked)"
        return row


def child_stale_gather(hang_s: float) -> Dict[str, Any]:
    import torch

    from mindio_ttp.faulttime import device_copy

    torch.cuda.set_device(0)
    with _one_rank_group("nccl") as dist:
        params = [torch.zeros(1 << 16, device="cuda") for _ in range(4)]
        buf = torch.ones(4 << 16, device="cuda")
        _arm(7)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(_sleep_cycles(torch, hang_s))
            work = dist.all_gather_into_tensor(buf, buf[: buf.numel()], async_op=True)
        work.wait()
        for i, p in enumerate(params):  # gather_model_params' copies
            p.copy_(buf[i << 16:(i + 1) << 16])
        device_copy.GATHERED.record(7, [work])
        during = device_copy.GATHERED.done_at(7)
        torch.cuda.synchronize()
        after = device_copy.GATHERED.done_at(7)
    ok = during is False and after is True
    return {"gathered_while_hung": during, "gathered_after": after,
            "status": "PASS" if ok else "FAIL"}


def child_pool_alias(hang_s: float) -> Dict[str, Any]:
    import torch

    from mindio_ttp.faulttime import device as ttp_device

    torch.cuda.set_device(0)
    with _one_rank_group("nccl") as dist:
        x = torch.ones(16, device="cuda")
        dist.all_reduce(x)  # ProcessGroupNCCL took its stream from the pool
        pool = [torch.cuda.Stream().cuda_stream for _ in range(64)]
        private = ttp_device.private_stream(torch.cuda, ttp_device.capture())
    distinct = len(set(pool))
    ok = distinct <= 32 and private.cuda_stream not in set(pool)
    return {"pool_streams_seen": distinct, "private_is_external":
            type(private).__name__ == "ExternalStream", "status": "PASS" if ok else "FAIL"}


def child_ready_timeout(hang_s: float) -> Dict[str, Any]:
    import torch

    from mindio_ttp.control import hooks
    from mindio_ttp.faulttime import abort, device_copy
    from mindio_ttp.faulttime import device as ttp_device

    torch.cuda.set_device(0)
    with _one_rank_group("nccl"):
        device_copy.MARK.install(ttp_device.capture())
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(_sleep_cycles(torch, hang_s))
        torch.cuda.current_stream().wait_stream(side)  # the update waits on the hang
        hooks.end_updating_os(2)
        aborted: List[str] = []
        real = abort.abort_all
        abort.abort_all = lambda *a, **k: aborted.append("abort") or real(*a, **k)
        t0 = time.perf_counter()
        try:
            device_copy.prepare(2, ready_timeout_s=2.0)
            error = ""
        except device_copy.DeviceNotReady as exc:
            error = str(exc)
        took = time.perf_counter() - t0
        torch.cuda.synchronize()
    ok = bool(error) and 1.5 < took < 4.0 and not aborted
    return {"refused_after_s": took, "error": error[:200], "aborted": bool(aborted),
            "status": "PASS" if ok else "FAIL"}


def child_watchdog(expect_alive: bool, hang_s: float) -> Dict[str, Any]:
    import torch

    from mindio_ttp.faulttime import checkpoint_writer, device_copy

    torch.cuda.set_device(0)
    group_timeout = 5.0
    state = {"w": torch.randn(1 << 20, device="cuda")}
    with _one_rank_group("nccl", timeout_s=group_timeout) as dist:
        torch.cuda.synchronize()
        _arm(4)
        y = _hang(torch, dist, max(hang_s, group_timeout + 10))
        del y
        time.sleep(group_timeout + 5)  # past the group's timeout: the watchdog has acted
        out = Path(tempfile.mkdtemp()) / "x.pt"
        device_copy.prepare(4)
        checkpoint_writer.write_torch(out, state)
    # reached only when the process survived the timeout
    return {"alive_after_timeout": True, "status": "PASS" if expect_alive else "FAIL"}


def child_handler_device(hang_s: float) -> Dict[str, Any]:
    import torch

    target = 1 if torch.cuda.device_count() > 1 else 0
    torch.cuda.set_device(target)
    box = _in_handler_thread(torch.cuda.current_device)
    box["done"].wait(30)
    if target == 0:
        return {"status": "SKIP (1 GPU: device 0 is the only answer; needs 2)",
                "bound_thread": box.get("result")}
    return {"bound_thread": box.get("result"), "expected": target,
            "status": "PASS" if box.get("result") == target else "FAIL"}


def child_hooks_barrier(hang_s: float, steps: int = 200) -> Dict[str, Any]:
    import torch

    from mindio_ttp.control import hooks

    torch.cuda.set_device(0)
    _arm(0)
    x = torch.randn(2048, 2048, device="cuda")
    times: Dict[bool, List[float]] = {}
    with _one_rank_group("nccl") as dist:
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


def child_save_path_cpu(hang_s: float) -> Dict[str, Any]:
    """The save path on CPU tensors, in a handler thread, with a 1-rank gloo group: the abort
    leaves gloo alone and the file is written (host part: no device figure)."""
    import torch

    from mindio_ttp.faulttime import checkpoint_writer, device_copy

    state = {"w": torch.randn(1 << 20), "step": 3}
    with _one_rank_group("gloo"):
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


def child_load_vote(hang_s: float) -> Dict[str, Any]:
    """load's checkpoint agreement on a 1-rank group: NCCL on a GPU (every tensor it hands to
    a collective must be on the device), gloo on CPU (runs the same code)."""
    import torch

    megatron = os.environ.get("TTP_MEGATRON_DIR")
    if megatron:
        sys.path.insert(0, megatron)
    on_gpu = torch.cuda.is_available()
    try:
        if not on_gpu:
            import mindio_ttp.cpu_adaptor  # noqa: F401 - Megatron needs it (apex) on CPU
        from mindio_ttp.megatron_ttp import load, manifest
    except Exception as exc:  # noqa: BLE001 - the reason is the row
        return {"status": f"SKIP (Megatron not importable: {str(exc)[:120]}; set "
                          "TTP_MEGATRON_DIR)"}
    if on_gpu:
        torch.cuda.set_device(0)
    seen: List[str] = []
    with _one_rank_group("nccl" if on_gpu else "gloo") as dist:
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


# -- the parent ---------------------------------------------------------------------------------

def _run_child(case: Case, hang_s: float) -> Dict[str, Any]:
    from mindio_ttp.faulttime import collective_env

    env = dict(os.environ)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    collective_env.apply_defaults(env)  # as ttprun sets them for its workers
    env.update(case.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", case.name,
                               "--hang-s", str(hang_s)], env=env, capture_output=True,
                              text=True, timeout=case.timeout_s + 2 * hang_s)
    except subprocess.TimeoutExpired:
        return {"status": "FAIL (timed out: the child hung)", "wall_s": time.perf_counter() - t0}
    row: Dict[str, Any] = {"wall_s": time.perf_counter() - t0}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode == 0 and lines:
        row.update(json.loads(lines[-1]))
    elif case.run == "child_watchdog" and not case.args.get("expect_alive"):
        row.update(status="PASS (killed by the watchdog)", exit=done.returncode)
    else:
        row.update(status="FAIL", exit=done.returncode, detail=done.stderr[-1500:])
    return row


def _child(name: str, hang_s: float) -> int:
    case = next(c for c in CASES if c.name == name)
    fn = globals()[case.run]
    result = fn(hang_s=hang_s, **case.args)
    print(json.dumps(result, default=str), flush=True)
    os._exit(0)  # a hung NCCL op or an aborted group must not hold the interpreter's exit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    ap.add_argument("--only", action="append", default=[],
                    help="run the cases whose name contains this (repeatable)")
    ap.add_argument("--json", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--hang-s", type=float, default=12.0, help="length of the emulated hang")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child, args.hang_s)
    cases = [c for c in CASES if not args.only or any(o in c.name for o in args.only)]
    if args.dry_run:
        for c in cases:
            print(f"{c.name:38} {'GPU' if c.gpu else 'host (runs without a GPU too)'}")
        return 0
    import torch

    gpu = torch.cuda.is_available()
    started = time.perf_counter()
    rows = []
    for c in cases:
        if c.gpu and not gpu:
            rows.append({"case": c.name, "status": f"SKIP ({NO_CUDA})"})
            continue
        rows.append({"case": c.name, **_run_child(c, args.hang_s)})
    device = torch.cuda.get_device_name(0) if gpu else "no CUDA device"
    seconds = time.perf_counter() - started
    print(f"gpu_check on {device}, torch {torch.__version__}, {seconds:.0f} s "
          f"(budget {BUDGET_S} s)")
    print(f"| {'case':38} | result |")
    print(f"|{'-' * 40}|--------|")
    for row in rows:
        figures = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items()
                            if k not in ("case", "status", "detail") and not isinstance(v, dict))
        print(f"| {row['case']:38} | {row['status']}" + (f" [{figures}]" if figures else "") + " |")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device, "torch": torch.__version__, "seconds": seconds, "rows": rows}
    args.json.write_text(json.dumps(report, indent=1, default=str))
    failed = [r for r in rows if str(r["status"]).startswith("FAIL")]
    return 1 if failed or seconds > BUDGET_S else 0


if __name__ == "__main__":
    sys.exit(main())
