"""D10 on CPU: whether ``torch.cuda.empty_cache()`` holds the GIL while it waits for the device
is measured (compat/features.empty_cache_releases_gil), and a run that calls it every step
(--empty-unused-memory-level >= 1) with a torch that holds it is warned at start-up: behind a
hung collective, its TTP heartbeats would stop. The two behaviours are stood in by a C sleep
called with the GIL held (ctypes.PyDLL) and released (ctypes.CDLL)."""

from __future__ import annotations

import ctypes
import ctypes.util
import types

from mindio_ttp.compat import features
from mindio_ttp.megatron_ttp.args_check import empty_cache_warning

LIBC = ctypes.util.find_library("c") or "libc.so.6"


def holds_the_gil() -> None:
    ctypes.PyDLL(LIBC).usleep(300_000)


def releases_the_gil() -> None:
    ctypes.CDLL(LIBC).usleep(300_000)


def test_an_empty_cache_that_holds_the_gil_is_told_apart_from_one_that_releases_it() -> None:
    assert features.empty_cache_releases_gil(0.3, holds_the_gil, lambda s: None) is False
    assert features.empty_cache_releases_gil(0.3, releases_the_gil, lambda s: None) is True


def test_a_run_that_empties_the_cache_every_step_is_warned_where_it_holds_the_gil() -> None:
    probed = []

    def probe(answer):
        return lambda: probed.append(answer) or answer

    every_step = types.SimpleNamespace(empty_unused_memory_level=1)
    warning = empty_cache_warning(every_step, probe(False))
    assert warning and "holds the GIL" in warning and "heartbeats" in warning
    assert empty_cache_warning(every_step, probe(True)) is None
    assert empty_cache_warning(every_step, probe(None)) is None  # no CUDA: nothing to say
    assert empty_cache_warning(types.SimpleNamespace(empty_unused_memory_level=0),
                               probe(False)) is None
    assert probed == [False, True, None]  # level 0: not even measured (it costs ~0.2 s)
