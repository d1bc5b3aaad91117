"""What differs, where faults are concerned, between the NCCL backends of the torch releases the
NCCL-like backend emulates (``NCCL_LIKE_TORCH``), each line with its source.

* **Abort names** on ProcessGroupNCCL: ``_abort`` (torch 2.1: bound by pytorch #96017, removed
  by #111392 after 2.1.0 branched); ``_shutdown`` (2.2 to 2.4: #111392, an abort); ``abort`` and
  ``distributed_c10d._abort_process_group`` (2.5 on: #132291), with ``shutdown`` a graceful
  destroy that waits for the queued kernels (2.6 on).
* **Async error handling**: 2.1 reads only ``NCCL_ASYNC_ERROR_HANDLING``, default 1
  (TearDown); from 2.2 (#114077) ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` first, then the old name,
  default 3 (SkipCleanUp). The modes: 0 nothing, 1 abort the communicators and take the
  process down, 2 abort only, 3 take the process down without aborting.
* **Work.get_future_result**: 2.6 on (#137799); older releases only have ``exception()``.
* **destroy_process_group**: from 2.6 each group's graceful ``shutdown()``, which waits for
  unfinished work; before, the group is dropped and its communicators aborted.
* **_group_start / _group_end** (torch's group abort brackets its aborts with them): 2.5 on.
* **NCCL** (``torch.cuda.nccl.version()``): the release's pip wheel bundles 2.18.1 (torch 2.1)
  and 2.20.5 (2.4); for 2.6 the emulation answers 2.26.2, an NGC container's newer NCCL (NVRx's
  floor for in-process restart), so that the newest release can abort and re-initialise.
  ``NCCL_LIKE_NCCL=2.21.5`` says another (2.21.5 is torch 2.6's own wheel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

ENV = "NCCL_LIKE_TORCH"
NCCL_ENV = "NCCL_LIKE_NCCL"
NEWEST = "2.6"

# the watchdog's modes (ProcessGroupNCCL's ErrorHandlingMode)
NO_HANDLING, TEAR_DOWN, CLEAN_UP_ONLY, SKIP_CLEAN_UP = 0, 1, 2, 3
OLD_NAME, NEW_NAME = "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@dataclass(frozen=True)
class Emulated:
    """The NCCL backend surface of one torch release."""

    minor: int  # torch 2.<minor>
    version: str  # what torch.__version__ says under the emulation
    nccl: Tuple[int, int, int]  # what torch.cuda.nccl.version() says (NCCL_LIKE_NCCL wins)

    @property
    def label(self) -> str:
        return f"2.{self.minor}"

    @property
    def abort_names(self) -> Tuple[str, ...]:
        """The backend's methods that abort its communicators."""
        if self.minor <= 1:
            return ("_abort",)
        if self.minor <= 4:
            return ("_shutdown",)
        return ("abort",)

    @property
    def graceful_shutdown(self) -> bool:
        """``shutdown()`` is bound and waits for unfinished work (destroy calls it)."""
        return self.minor >= 6

    @property
    def has_abort_process_group(self) -> bool:
        return self.minor >= 5

    @property
    def has_future_result(self) -> bool:
        return self.minor >= 6

    @property
    def has_group_calls(self) -> bool:
        """``_group_start`` / ``_group_end`` on the backend."""
        return self.minor >= 5

    def nccl_version(self, env: Optional[Mapping[str, str]] = None) -> Tuple[int, int, int]:
        env = os.environ if env is None else env
        value = env.get(NCCL_ENV, "").strip()
        if not value:
            return self.nccl
        try:
            major, minor, patch = (int(p) for p in value.split("."))
        except ValueError:
            raise ValueError(f"{NCCL_ENV}={value!r}: an NCCL version such as 2.21.5") from None
        return major, minor, patch

    def hidden_names(self) -> Tuple[str, ...]:
        """Names torch 2.13's ProcessGroup has that this release's NCCL backend lacks."""
        every = ("_abort", "_shutdown", "abort", "shutdown", "_group_start", "_group_end")
        shown = set(self.abort_names) | ({"shutdown"} if self.graceful_shutdown else set())
        if self.has_group_calls:
            shown |= {"_group_start", "_group_end"}
        return tuple(n for n in every if n not in shown)

    def error_handling(self, env: Optional[Mapping[str, str]] = None) -> Tuple[int, str]:
        """(mode, where it came from), read as this release's ProcessGroupNCCL constructor
        reads it."""
        env = os.environ if env is None else env
        names = (OLD_NAME,) if self.minor <= 1 else (NEW_NAME, OLD_NAME)
        for name in names:
            value = env.get(name)
            if value is not None:
                try:
                    return int(value), f"{name}={value}"
                except ValueError:
                    raise ValueError(f"invalid value for environment variable {name}: "
                                     f"{value!r} (an integer 0-3)") from None
        default = TEAR_DOWN if self.minor <= 1 else SKIP_CLEAN_UP
        return default, f"default {default} of torch {self.label} ({' and '.join(names)} unset)"


RELEASES = {"2.1": Emulated(1, "2.1.2", (2, 18, 1)), "2.4": Emulated(4, "2.4.1", (2, 20, 5)),
            "2.6": Emulated(6, "2.6.0", (2, 26, 2))}


def from_env(env: Optional[Mapping[str, str]] = None) -> Emulated:
    """The release ``NCCL_LIKE_TORCH`` names (default: the newest)."""
    env = os.environ if env is None else env
    value = env.get(ENV, "").strip() or NEWEST
    try:
        return RELEASES[value]
    except KeyError:
        raise ValueError(f"{ENV}={value!r}: the NCCL-like backend emulates torch "
                         f"{', '.join(RELEASES)} (unset: {NEWEST})") from None
