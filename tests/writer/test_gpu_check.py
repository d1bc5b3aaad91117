"""bench/gpu_check.py on a machine without CUDA: `--dry-run` names every case and runs nothing;
a full run prints the versions first, skips every GPU case saying why, runs and passes its host
parts, and rewrites the JSON after every case (a run killed half-way keeps the rows it
finished); the global deadline skips what would not fit, each with a row saying so. The
script's own code runs in CI; its GPU cases have not yet run on a GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "bench/gpu_check.py")
HANGS = {f"abortable_hang[wait={w},max_conn={c}]" for w in ("synchronize", "item")
         for c in ("unset", "1")}
DEAD_PEERS = {f"dead_peer[sig={s},op={o},group={g},mode={m}]" for s in ("SIGKILL", "SIGSTOP")
              for o in ("all_reduce", "all_gather") for g in ("world", "subgroup")
              for m in ("save", "reinit")}
OTHERS = {"fallback[max_conn=unset]", "fallback[max_conn=1]", "leak_loop", "empty_cache_gil",
          "watchdog[handling=ttprun]", "watchdog[handling=3]", "ready_timeout", "pool_alias",
          "hooks_barrier"}
HOST = {"save_path[cpu]", "load_vote[devices]"}
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this is the no-CUDA run; on a "
                             "GPU run bench/gpu_check.py itself")


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout)


def test_dry_run_lists_every_case_and_runs_nothing(tmp_path: Path) -> None:
    done = _run("--dry-run", "--json", str(tmp_path / "x"), timeout=60)
    assert done.returncode == 0, done.stderr
    names = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert names == HANGS | DEAD_PEERS | OTHERS | HOST, sorted(names)
    assert not (tmp_path / "x").exists()


@NO_CUDA
def test_without_cuda_the_versions_come_first_and_every_gpu_case_says_why_it_skipped(
        tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    done = _run("--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"gpu_check: torch {torch.__version__}, python "), done.stdout
    report = json.loads(out.read_text())
    assert report["rows"][0]["case"] == "versions" and report["rows"][0]["status"] == "INFO"
    assert report["versions"]["nccl"].startswith("none") and not report["versions"][
        "cuda_available"]
    rows = {r["case"]: r for r in report["rows"][1:]}
    assert set(rows) == HANGS | DEAD_PEERS | OTHERS | HOST
    for name, row in rows.items():
        if name not in HOST:
            assert row["status"] == "SKIP (no CUDA device (torch.cuda.is_available() is " \
                                    "False))", row
    assert rows["save_path[cpu]"]["status"] == "PASS", rows["save_path[cpu]"]
    assert "1 skipped" in rows["save_path[cpu]"]["result"]  # gloo: nothing to abort
    vote = rows["load_vote[devices]"]
    if os.environ.get("TTP_MEGATRON_DIR"):
        assert vote["status"] == "PASS" and vote["devices"] == ["cpu"], vote
    else:
        assert vote["status"].startswith("SKIP (Megatron not importable"), vote
    printed = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert len(printed) == 1 + len(report["rows"])  # the header, then a row per case


@NO_CUDA
def test_a_run_killed_half_way_keeps_the_rows_it_finished(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    proc = subprocess.Popen([sys.executable, SCRIPT, "--json", str(out), "--only", "save_path",
                             "--only", "load_vote"], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the first case's row is printed: kill the run there
            if line.startswith("| save_path[cpu]"):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(60)
    rows = [r["case"] for r in json.loads(out.read_text())["rows"]]
    assert rows[:2] == ["versions", "save_path[cpu]"], rows


@NO_CUDA
def test_the_global_deadline_skips_what_would_not_fit_with_a_row_saying_so(
        tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    done = _run("--json", str(out), "--deadline-s", "0", "--only", "save_path",
                "--only", "dead_peer[sig=SIGKILL,op=all_reduce,group=world,mode=save]")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["case"]: r["status"] for r in json.loads(out.read_text())["rows"]}
    assert rows["save_path[cpu]"].startswith("SKIP (global deadline: 0 s of 0 s left"), rows
    assert rows["dead_peer[sig=SIGKILL,op=all_reduce,group=world,mode=save]"].startswith(
        "SKIP (no CUDA device"), rows  # what cannot run says so first
