"""bench/gpu_check.py on a machine without CUDA: `--dry-run` names every case and exits 0, and
a full run skips every GPU case with its reason while its host parts (the save path on CPU
tensors, the load's agreement) run and pass: the script's own code runs in CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "bench/gpu_check.py")
HAZARDS = {"stale_gather", "pool_alias", "ready_timeout", "watchdog[handling=ttprun]",
           "watchdog[handling=3]", "fallback[max_conn=unset]", "fallback[max_conn=1]"}
SAVES = {f"save[wait={w},max_conn={c}]" for w in ("barrier", "item", "synchronize",
                                                   "empty_cache") for c in ("unset", "1")}
HOST = {"save_path[cpu]", "load_vote[devices]"}


def test_dry_run_lists_every_case_and_runs_nothing(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--json", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    names = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert SAVES | HAZARDS | HOST <= names, sorted(names)
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this is the no-CUDA run; on a GPU run "
                    "bench/gpu_check.py itself")
def test_without_cuda_every_gpu_case_is_skipped_and_the_host_parts_pass(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    done = subprocess.run([sys.executable, SCRIPT, "--json", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = {r["case"]: r for r in report["rows"]}
    assert SAVES | HAZARDS | HOST <= set(rows)
    for name, row in rows.items():
        if name not in HOST:
            assert row["status"].startswith("SKIP (no CUDA device"), row
    assert rows["save_path[cpu]"]["status"] == "PASS", rows["save_path[cpu]"]
    assert "1 skipped" in rows["save_path[cpu]"]["result"]  # gloo: nothing to abort
    vote = rows["load_vote[devices]"]
    if os.environ.get("TTP_MEGATRON_DIR"):
        assert vote["status"] == "PASS" and vote["devices"] == ["cpu"], vote
    else:
        assert vote["status"].startswith("SKIP (Megatron not importable"), vote
    assert report["device"] == "no CUDA device" and "| case" in done.stdout
