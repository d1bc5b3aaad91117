"""What one NVIDIA GPU can prove about the dying checkpoint's device path, in a few minutes.

    python bench/gpu_check.py [--json gpu_check.json] [--mib 512] [--sleep-s 10]

Checks (each prints one table row; all of them land in the JSON):

* ``d2h_blocked[max_conn=unset|1]``: the save path (``checkpoint_writer.write_torch`` of a
  device state, in a handler thread bound to the device) completes while the default stream is
  blocked behind a long kernel (``torch.cuda._sleep``), once without and once with
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (each in a fresh process: the variable is read when CUDA
  starts). The control, a plain ``.cpu()`` on the default stream, must wait for the kernel:
  if it does not, the check proves nothing and says so.
* ``handler_device``: the handler thread's current device after ``DeviceBinding.bind`` is the
  one the training thread set (a real test needs 2 GPUs: with one, device 0 is the only answer).
* ``save_memory``: peak host memory (VmHWM) added by saving a device state, per parameter, and
  the save path's device-to-host GB/s (pageable, inside torch.save) beside the pinned
  ``DeviceReader.to_host`` copy.
* ``hooks_barrier``: per-step cost of the guide's ``torch.distributed.barrier()`` plus
  ``ttp_start/end_updating_os`` (event record included) on a 1-rank NCCL group.
* ``collective_devices``: the tensors the glue hands to collectives are on the CUDA device
  (load's checkpoint agreement on a 1-rank NCCL group; needs Megatron importable from
  ``TTP_MEGATRON_DIR``, else skipped).

Without CUDA every device check is skipped with its reason and the host-only parts run (the
save on CPU tensors; the barrier loop and load's agreement on a 1-rank gloo group, labelled
"host only"), so the script's own code is exercised on CPU (tests/writer/test_gpu_check.py).
It has not yet been run on a GPU: no GPU figure in the docs comes from it until it has.
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
from pathlib import Path
from typing import Any, Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mindio_ttp.control import hooks  # noqa: E402
from mindio_ttp.faulttime import checkpoint_writer, device_copy  # noqa: E402
from mindio_ttp.faulttime import device as ttp_device  # noqa: E402

NO_CUDA = "skipped: no CUDA device (torch.cuda.is_available() is False)"


def _status(key: str = "VmHWM") -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def _reset_peak() -> int:
    """Reset this process's peak RSS to its RSS now (Linux clear_refs 5); the RSS, or -1."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return -1
    return _status("VmRSS")


def _arm() -> None:
    """As ttp_register_save_ckpt_handler does: capture the device, arm the end-of-update mark."""
    device_copy.MARK.install(ttp_device.capture())


def _in_handler_thread(fn: Callable[[], Any]) -> Any:
    """Run `fn` in a new thread bound like the processor's handler thread; its result."""
    binding = ttp_device.capture()
    box: Dict[str, Any] = {}

    def run() -> None:
        try:
            binding.bind()
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported in the row
            box["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=run, name="ttp-save-handler")
    t.start()
    t.join()
    if "error" in box:
        raise RuntimeError(box["error"])
    return box["result"]


def _sleep_cycles(seconds: float) -> int:
    rate_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 1_500_000
    return int(seconds * rate_khz * 1000)


def d2h_blocked_child(mib: int, sleep_s: float) -> Dict[str, Any]:
    """In this process (CUDA_DEVICE_MAX_CONNECTIONS as the parent set it)."""
    torch.cuda.set_device(0)
    state = {"w": torch.randn(mib * 2**18, device="cuda"), "step": 4}
    torch.cuda.synchronize()
    _arm()
    hooks.end_updating_os(4)  # the event, on the default stream, before the blocking kernel
    out = Path(tempfile.mkdtemp()) / "x.pt"
    row: Dict[str, Any] = {"max_conn": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset")}
    torch.cuda._sleep(_sleep_cycles(sleep_s))  # the default stream is busy for ~sleep_s
    t0 = time.perf_counter()
    _in_handler_thread(lambda: checkpoint_writer.write_torch(out, state))
    row["save_s"] = time.perf_counter() - t0
    row["default_stream_still_blocked"] = not torch.cuda.default_stream().query()
    torch.cuda.synchronize()
    row["kernel_s"] = time.perf_counter() - t0
    loaded = torch.load(out, map_location="cpu", weights_only=True)
    row["bytes_equal"] = bool(torch.equal(loaded["w"], state["w"].cpu()))
    # the pinned one-tensor path (DeviceReader.to_host), the same way
    torch.cuda._sleep(_sleep_cycles(sleep_s))
    t0 = time.perf_counter()
    host = _in_handler_thread(
        lambda: device_copy.DeviceReader(device_copy.MARK).to_host(state["w"]).clone())
    row["to_host_s"] = time.perf_counter() - t0
    row["to_host_default_stream_still_blocked"] = not torch.cuda.default_stream().query()
    torch.cuda.synchronize()
    row["to_host_equal"] = bool(torch.equal(host, state["w"].cpu()))
    # control: the same copy on the default stream must wait for the kernel
    torch.cuda._sleep(_sleep_cycles(sleep_s))
    t0 = time.perf_counter()
    state["w"].cpu()
    row["control_default_stream_s"] = time.perf_counter() - t0
    row["ok"] = bool(row["default_stream_still_blocked"] and row["bytes_equal"]
                     and row["to_host_default_stream_still_blocked"] and row["to_host_equal"])
    row["control_ok"] = row["control_default_stream_s"] > 0.5 * sleep_s
    return row


def check_d2h_blocked(mib: int, sleep_s: float) -> List[Dict[str, Any]]:
    rows = []
    for value in (None, "1"):
        name = f"d2h_blocked[max_conn={value or 'unset'}]"
        if not torch.cuda.is_available():
            rows.append({"check": name, "status": NO_CUDA})
            continue
        env = dict(os.environ)
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        if value is not None:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = value
        done = subprocess.run([sys.executable, __file__, "--child-d2h", str(mib), str(sleep_s)],
                              env=env, capture_output=True, text=True, timeout=120 + 4 * sleep_s)
        if done.returncode != 0:
            rows.append({"check": name, "status": "error", "detail": done.stderr[-1500:]})
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        status = "pass" if row["ok"] else "FAIL"
        if not row["ok"] and max(row["save_s"], row["to_host_s"]) >= 0.9 * sleep_s:
            status = "inconclusive (the copy took about as long as the kernel: raise --sleep-s)"
        if not row["control_ok"]:
            status += " (control did not wait: inconclusive)"
        rows.append({"check": name, "status": status, **row})
    return rows


def check_handler_device() -> Dict[str, Any]:
    if not torch.cuda.is_available():
        return {"check": "handler_device", "status": NO_CUDA}
    target = 1 if torch.cuda.device_count() > 1 else 0
    torch.cuda.set_device(target)
    got = _in_handler_thread(torch.cuda.current_device)
    unbound = []
    t = threading.Thread(target=lambda: unbound.append(torch.cuda.current_device()))
    t.start()
    t.join()
    torch.cuda.set_device(0)
    row = {"check": "handler_device", "expected": target, "bound_thread": got,
           "unbound_thread": unbound[0], "gpus": torch.cuda.device_count()}
    row["status"] = "pass" if got == target else "FAIL"
    if target == 0:
        row["status"] += " (1 GPU: device 0 is the only answer; needs 2 GPUs to discriminate)"
    return row


def check_save_memory(mib: int) -> Dict[str, Any]:
    """Peak host memory a save adds, per parameter; D2H rates. On CPU: the host-only part."""
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    n = mib * 2**18  # fp32 parameters
    state = {"a": torch.randn(n // 2, device=device), "b": torch.randn(n // 4, device=device),
             "c": torch.randn(n - n // 2 - n // 4, device=device)}
    if on_gpu:
        torch.cuda.synchronize()
        _arm()
        hooks.end_updating_os(1)
    out = Path(tempfile.mkdtemp()) / "x.pt"
    before = _reset_peak()
    t0 = time.perf_counter()
    written = _in_handler_thread(lambda: checkpoint_writer.write_torch(out, state))
    seconds = time.perf_counter() - t0
    extra = _status("VmHWM") - before
    out.unlink()
    row: Dict[str, Any] = {"check": "save_memory", "device": device, "params": n,
                           "file_mib": written.size / 2**20, "save_s": seconds,
                           "save_gb_s": written.size / seconds / 1e9,
                           "peak_extra_host_bytes_per_param": extra / n if before >= 0 else None,
                           "largest_tensor_bytes_per_param": 4 * (n // 2) / n}
    if on_gpu:
        reader = device_copy.DeviceReader(device_copy.MARK)
        big = state["a"]
        reader.to_host(big)  # allocate the pinned staging once
        t0 = time.perf_counter()
        reader.to_host(big)
        row["pinned_d2h_gb_s"] = big.numel() * 4 / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        big.cpu()
        row["pageable_d2h_gb_s"] = big.numel() * 4 / (time.perf_counter() - t0) / 1e9
        row["status"] = "measured"
    else:
        row["status"] = f"host only ({NO_CUDA}): CPU tensors, no D2H"
    return row


@contextlib.contextmanager
def _one_rank_group(backend: str = "nccl"):
    import torch.distributed as dist

    store = dist.FileStore(tempfile.mktemp(prefix="ttp-gpu-check-"), 1)
    extra = {"device_id": torch.device("cuda", 0)} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **extra)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def check_hooks_barrier(steps: int) -> Dict[str, Any]:
    """Per-step cost of the guide's barrier + the hooks; on CPU the same loop on gloo (the code
    runs; the figure says nothing about a device)."""
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(0)
        _arm()
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    x = torch.randn(2048 if on_gpu else 256, 2048 if on_gpu else 256,
                    device="cuda" if on_gpu else "cpu")

    def step(i: int, guide: bool, dist) -> None:
        y = x @ x
        if guide:
            dist.barrier()
            hooks.start_updating_os(-1)
        y.add_(1.0)
        if guide:
            hooks.end_updating_os(i)

    try:
        with _one_rank_group("nccl" if on_gpu else "gloo") as dist:
            times: Dict[bool, List[float]] = {}
            for guide in (False, True, False, True):
                for i in range(10):
                    step(i, guide, dist)
                sync()
                t0 = time.perf_counter()
                for i in range(steps):
                    step(i, guide, dist)
                sync()
                times.setdefault(guide, []).append((time.perf_counter() - t0) / steps)
    finally:
        hooks.STATE.reset()
    base, with_guide = min(times[False]), min(times[True])
    status = "measured" if on_gpu else f"host only (gloo, {NO_CUDA})"
    return {"check": "hooks_barrier", "status": status, "step_us": base * 1e6,
            "step_with_barrier_and_hooks_us": with_guide * 1e6,
            "cost_per_step_us": (with_guide - base) * 1e6}


def check_collective_devices() -> Dict[str, Any]:
    """load's checkpoint agreement on a 1-rank group: NCCL on a GPU (every tensor must be on
    the device), gloo on CPU (runs the same code; CPU tensors are right there)."""
    name = "collective_devices"
    on_gpu = torch.cuda.is_available()
    megatron = os.environ.get("TTP_MEGATRON_DIR")
    if megatron:
        sys.path.insert(0, megatron)
    try:
        if not on_gpu:
            import mindio_ttp.cpu_adaptor  # noqa: F401 - Megatron needs it (apex) on CPU
        from mindio_ttp.megatron_ttp import load, manifest
    except Exception as exc:  # noqa: BLE001 - the reason is the row
        return {"check": name, "status": f"skipped: Megatron not importable ({exc}); set "
                                          "TTP_MEGATRON_DIR"}
    seen: List[str] = []
    if on_gpu:
        torch.cuda.set_device(0)
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
        old_layout, dist.all_reduce = load.parallel_layout, spy
        load.parallel_layout = lambda: par
        error = None
        try:
            chosen = load.choose_checkpoint(ckpt)
        except Exception as exc:  # noqa: BLE001 - NCCL refusing a CPU tensor lands here
            chosen, error = None, f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            dist.all_reduce, load.parallel_layout = real, old_layout
    want = "cuda" if on_gpu else "cpu"
    ok = error is None and chosen == 3 and seen and all(d.startswith(want) for d in seen)
    status = "pass" if ok else "FAIL"
    if not on_gpu:
        status = f"host only (gloo, {NO_CUDA}): {status}"
    return {"check": name, "status": status, "devices": seen, "chosen": chosen, "error": error}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--mib", type=int, default=512, help="state size of the save checks")
    ap.add_argument("--sleep-s", type=float, default=10.0, help="length of the blocking kernel")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--child-d2h", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_d2h:
        print(json.dumps(d2h_blocked_child(int(args.child_d2h[0]), float(args.child_d2h[1]))))
        return 0
    started = time.perf_counter()
    rows: List[Dict[str, Any]] = []
    rows += check_d2h_blocked(args.mib, args.sleep_s)
    for fn in (check_handler_device, lambda: check_save_memory(args.mib),
               lambda: check_hooks_barrier(args.steps), check_collective_devices):
        try:
            rows.append(fn())
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            rows.append({"check": getattr(fn, "__name__", "?"), "status": "error",
                         "detail": f"{type(exc).__name__}: {exc}"[:1500]})
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": device, "torch": torch.__version__, "seconds": 0.0, "rows": rows}
    report["seconds"] = time.perf_counter() - started
    print(f"gpu_check on {device}, torch {torch.__version__}")
    print(f"{'check':32} status / figures")
    for row in rows:
        figures = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items() if k not in ("check", "status"))
        print(f"{row['check']:32} {row['status']}" + (f"  [{figures}]" if figures else ""))
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json} ({report['seconds']:.1f} s)")
    failed = [r for r in rows if "FAIL" in str(r["status"]) or r["status"] == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
