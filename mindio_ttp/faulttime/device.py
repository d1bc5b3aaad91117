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
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

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
