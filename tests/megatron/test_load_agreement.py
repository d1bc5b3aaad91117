"""The checkpoint a load picks is agreed by all ranks, also when their directory listings
differ (a shared filesystem's attribute cache, a mount that came back late): real processes on
a gloo group, running `mindio_ttp.megatron_ttp.load.choose_checkpoint` (Megatron imported from
TTP_MEGATRON_DIR, on the CPU adaptor). Each rank looks at its own copy of the directory:

* rank 0 sees iterations 8 (incomplete), 7 and 6, and a tracker naming 8;
* rank 1 sees 8 (incomplete) and 6: iteration 7 is not in its listing.

Walking each rank's own list would pair rank 0's vote on 7 with rank 1's vote on 6, both
"complete", and the ranks would load different iterations. They must all load 6."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from mindio_ttp.faulttime import manifest
from testkit.procs import run_together

pytestmark = [pytest.mark.megatron]

LAYOUT = manifest.ParallelLayout(tp=1, pp=1, dp=2)
WORKER = """
import json, sys
from datetime import timedelta
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch
import mindio_ttp.cpu_adaptor  # Megatron 285068c on CPU
import torch.distributed as dist
from mindio_ttp.megatron_ttp import load
from mindio_ttp.faulttime import manifest
rank, store_path, ckpt = int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
load.parallel_layout = lambda: manifest.ParallelLayout(1, 1, 2)
chosen = load.choose_checkpoint(ckpt)
print(json.dumps({"rank": rank, "chosen": chosen}), flush=True)
dist.destroy_process_group()
"""


def _checkpoint(root: Path, step: int, complete: bool) -> None:
    files = LAYOUT.expected_files()
    for rel in files if complete else files[:-1]:
        path = root / manifest.iter_dir_name(step) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"iteration": step}, path)


def test_ranks_whose_listings_differ_load_the_same_checkpoint(megatron_dir: Path,
                                                              tmp_path: Path) -> None:
    views = {0: (8, [7, 6]), 1: (8, [6])}
    for rank, (broken, steps) in views.items():
        root = tmp_path / f"view{rank}"
        _checkpoint(root, broken, complete=False)
        for step in steps:
            _checkpoint(root, step, complete=True)
        manifest.write_tracker(root, broken)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = run_together([[sys.executable, str(script), str(megatron_dir), str(r),
                             str(tmp_path / "store"), str(tmp_path / f"view{r}")]
                            for r in views], timeout=180)
    chosen = {}
    for returncode, stdout, stderr in results:
        assert returncode == 0, stderr[-3000:]
        got = json.loads(stdout.strip().splitlines()[-1])
        chosen[got["rank"]] = got["chosen"]
    assert chosen == {0: 6, 1: 6}, chosen
