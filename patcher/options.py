"""The choices `apply` takes, resolved once into one frozen value that every later step reads."""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from typing import Optional

from mindio_ttp.config import CONTROLLER_PORT_RANGE

from .errors import UsageError

DEFAULT_PORT = 8000  # the guide's literal in the start-up block
# The runtime refuses any other port at start-up (ttp_start_controller), so apply refuses it now.
PORT_RANGE = CONTROLLER_PORT_RANGE


class Device(str, enum.Enum):
    """Which accelerator adaptor pretrain_gpt.py imports right after `import torch`."""

    NPU = "npu"
    CUDA = "cuda"
    CPU = "cpu"

    @property
    def adaptor_import(self) -> Optional[str]:
        """The import statement the device needs, or None (CUDA needs no adaptor)."""
        return _ADAPTOR_IMPORTS[self]


def adaptor_warning(device: Device) -> Optional[str]:
    """A warning when this machine cannot import the adaptor the patched pretrain_gpt.py imports.

    Not an error: the tree is often patched on a login node for the cluster. But `--device npu`
    is the default, so on a GPU or CPU machine the user most likely wanted another device, and
    would otherwise learn it from an ImportError at launch. Looked up, never imported: importing
    megatron_npu loads torch_npu and patches torch.
    """
    if device is not Device.NPU or importlib.util.find_spec("megatron_npu") is not None:
        return None
    return (
        "warning: --device npu (the default): the patched pretrain_gpt.py imports megatron_npu, "
        "which is not importable here, so it runs only where the Ascend adaptor is installed; "
        "to train on this machine use --device cuda (NVIDIA GPUs) or --device cpu (a CPU "
        "rehearsal): `ttp-patch revert`, then apply again"
    )


_ADAPTOR_IMPORTS = {
    Device.NPU: "import megatron_npu",
    Device.CUDA: None,
    Device.CPU: "import mindio_ttp.cpu_adaptor",
}


@dataclass(frozen=True)
class Options:
    """What to insert. For detection, None means "accept whatever the file shows"."""

    device: Optional[Device] = Device.NPU
    port: Optional[int] = DEFAULT_PORT

    @classmethod
    def build(cls, device: str = "npu", port: int = DEFAULT_PORT) -> Options:
        try:
            dev = Device(device)
        except ValueError:
            raise UsageError(f"unknown device {device!r}", "use one of: npu, cuda, cpu") from None
        lo, hi = PORT_RANGE
        if not lo <= port <= hi:
            raise UsageError(
                f"--port {port} is out of range: the TTP controller takes {lo}..{hi}",
                f"give a free TCP port in {lo}..{hi} (the default is {DEFAULT_PORT})",
            )
        return cls(device=dev, port=port)

    def describe(self) -> str:
        dev = self.device.value if self.device else "any"
        return f"--device {dev} --port {self.port if self.port is not None else 'any'}"
