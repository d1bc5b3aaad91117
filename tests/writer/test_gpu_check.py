"""bench/gpu_check.py on a machine without CUDA: every device check says why it is skipped,
the host-only save check runs, and the report is written (the script's code runs on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this is the no-CUDA run; on a GPU run "
                    "bench/gpu_check.py itself")
def test_gpu_check_skips_device_checks_with_a_reason_and_runs_the_host_part(
        tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu_check.py"), "--json", str(out),
                           "--mib", "64"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = {r["check"]: r for r in report["rows"]}
    assert set(rows) == {"d2h_blocked[max_conn=unset]", "d2h_blocked[max_conn=1]",
                         "handler_device", "save_memory", "hooks_barrier", "collective_devices"}
    for name in ("d2h_blocked[max_conn=unset]", "d2h_blocked[max_conn=1]", "handler_device"):
        assert rows[name]["status"].startswith("skipped: no CUDA device"), rows[name]
    barrier = rows["hooks_barrier"]  # the same loop on gloo: its code runs, no device figure
    assert barrier["status"].startswith("host only (gloo") and barrier["step_us"] > 0
    coll = rows["collective_devices"]
    if os.environ.get("TTP_MEGATRON_DIR"):  # load's agreement on a 1-rank gloo group
        assert coll["status"].endswith(": pass") and coll["devices"] == ["cpu"], coll
    else:
        assert coll["status"].startswith("skipped: Megatron not importable"), coll
    mem = rows["save_memory"]
    assert mem["device"] == "cpu" and mem["params"] == 64 * 2**18
    assert mem["file_mib"] >= 64 and mem["save_gb_s"] > 0
    # CPU storages are written in place: far less than the 4 bytes a copy would add
    assert mem["peak_extra_host_bytes_per_param"] < 0.5
    assert "no CUDA device" in done.stdout and report["device"] == "no CUDA device"
