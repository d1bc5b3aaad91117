"""Bench-only: peak host memory of Megatron's periodic save and of the dying save, per rank.

Put this folder on the workers' PYTHONPATH (bench/bench_megatron_rss.py does). It wraps, right
after their modules are imported, ``megatron.checkpointing.save_checkpoint`` (the periodic
save) and ``mindio_ttp.megatron_ttp.save.ttp_save_checkpoint`` (the dying save): before each
call the process's peak RSS is reset (``/proc/self/clear_refs`` 5), after it VmHWM - VmRSS
before, and the bytes this rank wrote, go to ``$TTP_BENCH_RSS_DIR/<kind>-rank<r>-<pid>.json``.
``TTP_BENCH_WRITER=bytesio`` swaps the dying save's writer for the one it replaced (torch.save
into BytesIO, getvalue, sha256, write) so one tree measures before and after.
Then the fault hook of the tests (``TTP_BENCH_CHAIN``: its sitecustomize.py) is loaded too.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from testkit.import_hooks import after_import, run_hook_file

OUT = os.environ.get("TTP_BENCH_RSS_DIR", "")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return -1


def _measured(kind: str, fn, written):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
        written.clear()
        try:
            return fn(*args, **kwargs)
        finally:
            rank = torch.distributed.get_rank()
            record = {"kind": kind, "rank": rank, "rss_before": before,
                      "peak_extra": _status("VmHWM") - before,
                      "written_bytes": sum(written), "files": len(written),
                      "writer": os.environ.get("TTP_BENCH_WRITER", "checkpoint_writer")}
            Path(OUT, f"{kind}-rank{rank}-{os.getpid()}.json").write_text(json.dumps(record))
    return wrapper


_WRITTEN: list = []


def _patch_save(module) -> None:
    import hashlib
    import io

    import torch

    from mindio_ttp.faulttime import checkpoint_writer, manifest

    inner = module._save

    def counted(iter_dir, rel, state, **kwargs):
        if os.environ.get("TTP_BENCH_WRITER") == "bytesio":
            buffer = io.BytesIO()
            torch.save(state, buffer)
            data = buffer.getvalue()
            (iter_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            manifest.write_atomic(iter_dir / rel, data)
            written = checkpoint_writer.Written("sha256", hashlib.sha256(data).hexdigest(),
                                                len(data), 0.0)
        else:
            written = inner(iter_dir, rel, state, **kwargs)
        _WRITTEN.append(int(written.size))
        return written

    module._save = counted
    module.ttp_save_checkpoint = _measured("dying", module.ttp_save_checkpoint, _WRITTEN)


def _patch_checkpointing(module) -> None:
    import torch

    real_save = torch.save
    periodic: list = []

    def counting_save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        if isinstance(f, (str, os.PathLike)) and os.path.isfile(f):
            periodic.append(os.path.getsize(f))

    inner = module.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        module.torch.save = counting_save  # the name checkpointing.py calls
        try:
            return inner(*args, **kwargs)
        finally:
            module.torch.save = real_save

    module.save_checkpoint = _measured("periodic", save_checkpoint, periodic)


TARGETS = {"megatron.checkpointing": _patch_checkpointing,
           "mindio_ttp.megatron_ttp.save": _patch_save}


if OUT:
    for _name, _patch in TARGETS.items():
        after_import(_name, _patch)
chain = os.environ.get("TTP_BENCH_CHAIN")
if chain:
    run_hook_file(chain)
