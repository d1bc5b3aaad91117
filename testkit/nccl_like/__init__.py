"""The NCCL-like backend: a torch.distributed process-group backend for CPU tests, built on
gloo, that fails as NCCL does (a collective with a dead or stopped peer spins, without raising,
until someone aborts it), with a fake device whose streams complete work after the host call
returns. Test rig: never installed (setup.cfg packages only patcher and mindio_ttp).

Turn it on in a process with `install` (``testkit/hooks/nccl_like/sitecustomize.py`` does, in
every worker, from the environment); docs/rehearsal.md ("Collectives that spin") says how to
run any real-Megatron scenario under it. What `install` does, once torch is imported:

* registers the backend ``nccl_like`` (``torch.distributed.Backend.register_backend``) and
  makes ``init_process_group("nccl")`` / ``new_group(backend="nccl")`` use it, so Megatron
  run with ``--distributed-backend nccl`` (and the runtime, whose groups follow Megatron's)
  creates every group on it, with no edit beyond the patch;
* emulates the NCCL surface of the torch release ``NCCL_LIKE_TORCH`` names (`versions`: abort
  names, async-error-handling env names and defaults, ``get_future_result``, destroy) and
  reports that release in ``torch.__version__`` and its NCCL in ``torch.cuda.nccl.version()``;
  the rest of torch is the installed one;
* puts the fake device at ``torch.npu`` (where the runtime looks first), one work queue for
  every stream with ``NCCL_LIKE_ONE_QUEUE=1``, and makes host reads of device memory
  (``Tensor.item``, ``tolist``, ``bool``/``int``/``float`` of a tensor, ``torch.save``) wait
  behind the calling thread's current stream, as a device-to-host copy does.

``NCCL_LIKE_WAIT=block`` makes ``Work.wait()`` block the host until its op ends even when it
is known to spin (by default it returns then, as NCCL's does: backend module doc).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Mapping, Optional

from testkit.nccl_like import versions

ON_ENV = "NCCL_LIKE"
ONE_QUEUE_ENV = "NCCL_LIKE_ONE_QUEUE"
WAIT_ENV = "NCCL_LIKE_WAIT"
_installed: dict = {}


def enabled(env: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if env is None else env
    return env.get(ON_ENV, "") == "1"


def install(emulated: Optional[versions.Emulated] = None, *, one_queue: Optional[bool] = None,
            wait_blocks: Optional[bool] = None) -> versions.Emulated:
    """Install everything (module doc) in this process, which has imported torch; again with
    the same release is a no-op, with another one an error."""
    emulated = emulated or versions.from_env()
    if _installed:
        if _installed["emulated"] != emulated:
            raise RuntimeError(f"the NCCL-like backend already emulates torch "
                               f"{_installed['emulated'].label} in this process")
        return emulated
    import torch
    import torch.distributed as dist
    from torch.torch_version import TorchVersion

    from testkit.nccl_like import backend
    from testkit.nccl_like import device as fake_device

    one_queue = os.environ.get(ONE_QUEUE_ENV) == "1" if one_queue is None else one_queue
    wait_blocks = os.environ.get(WAIT_ENV) == "block" if wait_blocks is None else wait_blocks
    backend.WAIT_BLOCKS_HOST = wait_blocks
    fake_device.set_one_queue(one_queue)
    group_class = backend.make_class(emulated)

    def create(store: Any, rank: int, size: int, timeout: Any) -> Any:
        group = group_class(store, rank, size, timeout)
        _banner(group, emulated, one_queue)
        return group

    dist.Backend.register_backend(backend.NAME, create, devices=["cpu"])
    c10d = dist.distributed_c10d
    for module in (dist, c10d):
        module.init_process_group = _nccl_means_ours(c10d.init_process_group, "backend", 0)
        module.new_group = _nccl_means_ours(c10d.new_group, "backend", 2)
        module.destroy_process_group = _destroy_sees_every_name(c10d.destroy_process_group)
    if not emulated.has_abort_process_group and hasattr(c10d, "_abort_process_group"):
        _installed["_abort_process_group"] = c10d._abort_process_group
        del c10d._abort_process_group
    torch.__version__ = TorchVersion(emulated.version)
    nccl = emulated.nccl_version()
    import torch.cuda.nccl

    torch.cuda.nccl.version = lambda: nccl
    torch.npu = fake_device.FakeDevice()
    _host_reads_wait(torch, fake_device)
    _installed.update(emulated=emulated, one_queue=one_queue)
    return emulated


def _nccl_means_ours(real: Callable[..., Any], arg: str, position: int) -> Callable[..., Any]:
    from testkit.nccl_like import backend

    @functools.wraps(real)
    def call(*args: Any, **kwargs: Any) -> Any:
        if arg in kwargs:
            if str(kwargs[arg]).lower() == "nccl":
                kwargs[arg] = backend.NAME
        elif len(args) > position and str(args[position]).lower() == "nccl":
            args = (*args[:position], backend.NAME, *args[position + 1:])
        return real(*args, **kwargs)

    return call


def _destroy_sees_every_name(real: Callable[..., Any]) -> Callable[..., Any]:
    from testkit.nccl_like import backend

    @functools.wraps(real)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        backend.INTERNAL.active = True
        try:
            return real(*args, **kwargs)
        finally:
            backend.INTERNAL.active = False

    return destroy_process_group


def _host_reads_wait(torch: Any, fake_device: Any) -> None:
    """A host read of device memory is a copy on the current stream, waited for."""

    def reading(real: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(real)
        def read(*args: Any, **kwargs: Any) -> Any:
            fake_device.current_stream().host_read()
            return real(*args, **kwargs)

        return read

    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        setattr(torch.Tensor, name, reading(getattr(torch.Tensor, name)))
    torch.save = reading(torch.save)


def _banner(group: Any, emulated: versions.Emulated, one_queue: bool) -> None:
    if _installed.get("banner"):
        return
    _installed["banner"] = True
    from testkit.nccl_like import backend

    nccl = ".".join(str(p) for p in emulated.nccl_version())
    print(f"[nccl_like pid {os.getpid()}] NCCL {nccl} of torch {emulated.label} emulated on gloo: "
          f"abort by {', '.join(emulated.abort_names)}; async error handling "
          f"{backend.error_mode_name(group.error_handling)} ({group.error_handling_source}); "
          f"{'one work queue for every stream' if one_queue else 'a work queue per stream'}",
          file=sys.stderr, flush=True)
