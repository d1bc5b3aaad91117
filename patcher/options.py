"""The choices `apply` takes, resolved once into one frozen value that every later step reads."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from mindio_ttp.framework_ttp.config import CONTROLLER_PORT_RANGE

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
