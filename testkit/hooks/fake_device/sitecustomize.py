"""Test-only: a fake accelerator in each worker, whose work completes later than the host call
that enqueued it returns (what NCCL/HCCL do, and what a CPU/gloo run never shows).

Put this folder first on PYTHONPATH and set ``TTP_FAKE_DEVICE=1``. The worker gets a device
module as ``torch.npu`` (the runtime looks there first, mindio_ttp/faulttime/device.py) whose
streams are in-order queues, as a device runs its streams (testkit/nccl_like/device.py, the
NCCL-like backend's device, which also makes collectives spin: testkit/hooks/nccl_like). The
model stays on the CPU: only the runtime's events and streams are on the fake device.

``TTP_FAKE_DEVICE_HANG_GATHER=K``: in iteration K (Megatron's 1-based number) every
``torch.distributed._all_gather_base`` of the training thread is enqueued on the default stream
instead of run, and the stream hangs there, as behind an NCCL all-gather whose peer died inside
it: the host call returns at once, the copies that follow on the host read a buffer that never
received the gather, and nothing enqueued behind it completes (the event the optimizer records
after its copies included). Combine with a fault plan that kills a rank in that iteration
(``R:K:sigkill:after``): the survivors are then stopped by the fault flow. The fault injector of
``../fault_hook`` still runs (this file executes it first).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from testkit.import_hooks import after_import, run_hook_file
from testkit.nccl_like import device as fake_device

_HERE = Path(__file__).resolve().parent


class _EnqueuedWork:
    """What an NCCL call returns once enqueued: wait() only orders the current stream."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return False


def _hang_gathers_in(iteration: int) -> None:
    import torch

    real = torch.distributed._all_gather_base
    hung = threading.Event()  # never set: the peer died inside the all-gather
    training = threading.main_thread()

    def all_gather_base(*args, **kwargs):
        megatron = __import__("sys").modules.get("megatron")
        now = getattr(megatron.get_args(), "curr_iteration", -1) + 1 if megatron else -1
        if threading.current_thread() is not training or now != iteration:
            return real(*args, **kwargs)
        print(f"fake device: the param all-gather of iteration {iteration} is enqueued and "
              "hangs on the device", flush=True)
        fake_device.DEFAULT.enqueue(hung.wait)
        return _EnqueuedWork() if kwargs.get("async_op") else None

    torch.distributed._all_gather_base = all_gather_base


def _install() -> None:
    if os.environ.get("TTP_FAKE_DEVICE") != "1":
        return

    def install(torch) -> None:
        torch.npu = fake_device.FakeDevice()
        hang = os.environ.get("TTP_FAKE_DEVICE_HANG_GATHER")
        if hang:
            _hang_gathers_in(int(hang))

    after_import("torch", install)


run_hook_file(str(_HERE.parent / "fault_hook" / "sitecustomize.py"))
_install()
