"""Which accelerator device the dying-checkpoint handlers run on.

The save and rename handlers run in the processor's handler thread, not in the thread that set
training up. CUDA's current device is per host thread and starts at device 0 in a new thread,
and torch_npu needs ``set_device`` in every thread before device work (Ascend's docs), so a
handler that reads device memory without binding first would allocate on, or read from,
device 0 (on CUDA) or fail (on NPU). The device is captured in the thread that registers the
save handler (training's main thread, after Megatron's ``torch.cuda.set_device(local_rank)``)
and bound again at the start of every handler thread.

The runtime never imports torch itself: it looks at ``sys.modules``, so a job without torch (or
one that never touched a device) binds nothing.

`private_stream` is the one place that says, per device kind, which stream the fault-time reads
run on: one that no collective can share (see its docstring).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, List, Optional

log = logging.getLogger("mindio_ttp.processor")

# torch_npu registers torch.npu; it wins over torch.cuda because megatron_npu maps cuda calls
# onto the NPU, so on Ascend both may answer and the NPU is the real device.
KINDS = ("npu", "cuda")


@dataclass(frozen=True)
class DeviceBinding:
    """A device to bind in another thread: kind "npu", "cuda" or "none" (nothing to bind)."""

    kind: str = "none"
    index: int = -1

    def bind(self) -> None:
        module = _module(self.kind)
        if module is not None:
            module.set_device(self.index)

    def describe(self) -> str:
        return "no accelerator" if self.kind == "none" else f"{self.kind}:{self.index}"


NO_DEVICE = DeviceBinding()


def _module(kind: str) -> Optional[ModuleType]:
    if kind == "none":
        return None
    torch = sys.modules.get("torch")
    return getattr(torch, kind, None) if torch is not None else None


def capture() -> DeviceBinding:
    """The device the calling thread uses now; call it in the thread that set the device."""
    for kind in KINDS:
        module = _module(kind)
        if module is None:
            continue
        try:
            initialized = getattr(module, "is_initialized", lambda: True)
            if module.is_available() and initialized():
                return DeviceBinding(kind, int(module.current_device()))
        except Exception as exc:  # a broken driver must not stop training from registering
            log.warning("cannot read the current %s device (%s): handlers bind none", kind, exc)
    return NO_DEVICE


def health_check(binding: DeviceBinding, timeout_s: float) -> str:
    """"" when the device finishes everything queued on it, twice, within `timeout_s`; else
    what went wrong. NVRx's CudaHealthCheck before it re-initialises: a bounded synchronize,
    then a second one to surface a sticky error the first returned before. Run in a thread of
    its own (a device that never finishes keeps it forever: it is left behind)."""
    module = _module(binding.kind)
    if module is None or not hasattr(module, "synchronize"):
        return ""
    box: List[str] = []

    def run() -> None:
        try:
            binding.bind()
            module.synchronize()
            module.synchronize()
        except BaseException as exc:  # noqa: BLE001 - the answer
            box.append(f"{type(exc).__name__}: {exc}"[:300])
        else:
            box.append("")

    thread = threading.Thread(target=run, name="ttp-device-health", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return (f"{binding.describe()} did not finish its queued work within {timeout_s:g} s "
                "(a kernel still hangs)")
    return box[0] if box else "the health check ended without an answer"


# external CUDA stream handles: created once per device, never destroyed (torch does not own
# them and the process ends after the dying checkpoint)
_EXTERNAL: List[ctypes.c_void_p] = []
CUDA_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking / CU_STREAM_NON_BLOCKING


def private_stream(module: Any, binding: DeviceBinding) -> Any:
    """A stream for the fault-time reads that no collective can share.

    ``torch.cuda.Stream()`` comes from torch's round-robin pool (32 streams per priority per
    device, ``c10/cuda/CUDAStream.h``), the same pool ProcessGroupNCCL takes its streams from,
    so a "private" pool stream can be an NCCL stream; torch_npu's pool is smaller and HCCL draws
    from it too. So:

    * CUDA: a stream made by the CUDA runtime itself, ``cudaStreamCreateWithFlags(...,
      cudaStreamNonBlocking)`` (non-blocking: no implicit wait for the legacy default stream,
      the training stream), handed to torch with ``torch.cuda.ExternalStream``; from the
      driver (``cuStreamCreate``) when the runtime library cannot be found.
    * NPU: ``torch_npu.npu.SyncLaunchStream``, documented by Ascend for exactly this (a stream
      whose tasks bypass the device's task queue, "for saving a checkpoint on the other devices
      when one device of the cluster fails").
    * Otherwise (an older stack, a test double), a pool stream, with a warning.
    """
    index = binding.index
    if binding.kind == "cuda" and hasattr(module, "ExternalStream"):
        try:
            return module.ExternalStream(_cuda_stream_handle(module, index), device=index)
        except Exception as exc:  # noqa: BLE001 - fall back, loudly
            log.warning("cannot create a CUDA stream outside torch's pool (%s): the dying "
                        "checkpoint reads on a pool stream, which may be an NCCL stream", exc)
    if binding.kind == "npu":
        sync = getattr(getattr(sys.modules.get("torch_npu"), "npu", None), "SyncLaunchStream",
                       None)
        if sync is not None:
            return sync(index)
        if sys.modules.get("torch_npu") is not None:
            log.warning("this torch_npu has no SyncLaunchStream: the dying checkpoint reads on a "
                        "pool stream, which HCCL may share")
    return module.Stream(device=index)


def _loaded_library(stem: str) -> Optional[str]:
    """The path of an already loaded shared library whose name starts with `stem` (torch's own
    copy of the CUDA runtime: never a second one from elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if path.rsplit("/", 1)[-1].startswith(stem):
                    return path
    except OSError:
        pass
    return None


def _cuda_stream_handle(module: Any, index: int) -> int:
    """A new non-blocking stream on device `index` from the CUDA runtime (or driver)."""
    handle = ctypes.c_void_p()
    with module.device(index):  # the runtime makes the stream on the current device
        runtime = _loaded_library("libcudart")
        if runtime is not None:
            rc = ctypes.CDLL(runtime).cudaStreamCreateWithFlags(
                ctypes.byref(handle), ctypes.c_uint(CUDA_STREAM_NON_BLOCKING))
            what = "cudaStreamCreateWithFlags"
        else:  # cudart linked statically into torch: the driver, in the primary context
            module.current_stream().query()  # make the device's primary context current here
            rc = ctypes.CDLL("libcuda.so.1").cuStreamCreate(
                ctypes.byref(handle), ctypes.c_uint(CUDA_STREAM_NON_BLOCKING))
            what = "cuStreamCreate"
    if rc != 0 or not handle.value:
        raise RuntimeError(f"{what} failed with error {rc}")
    _EXTERNAL.append(handle)
    return int(handle.value)
