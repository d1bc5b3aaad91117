"""Time lost per fault with `ttprun --max-restarts`, against a cold start, on real Megatron.

One job, the tiny GPT of mindio_ttp.demo.rehearsal on 4 CPU ranks of a tree patched with
`ttp-patch apply --device cpu`, is launched twice in the same run of this script:

* cold: a fresh start (no checkpoint), launch -> Megatron's "[before the start of training
  step]" line;
* faults: the same job under `ttprun --max-restarts 3` with a SIGKILL of one rank in each of
  three attempts (testkit/hooks/fault_hook, one plan per attempt); per fault: the moment the
  controller declared it (its FAULT log line) -> the next attempt's "[before the start of
  training step]" line. The clock starts at detection: the time from the fault to its
  detection is not in it (milliseconds for a killed rank, whose connection drops; up to
  TTP_HEARTBEAT_TIMEOUT for a hung one; docs/benchmarks.md, Crash to detection), nor is the
  training redone (at most the step in flight: the dying checkpoint holds the newest
  consistent step). What is in it: the dying checkpoint (collect, save, rename), the workers'
  exit, ttprun's restart of the worker group, Megatron's start-up and its load of the dying
  checkpoint.

Megatron prints those lines with one-second resolution, so each figure is +-1 s.

    python bench/bench_restart.py --megatron DIR   # a Megatron-LM checkout at 285068c
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit: the repository's rig

from mindio_ttp.demo.rehearsal.data import make_tiny_dataset  # noqa: E402
from mindio_ttp.demo.rehearsal.launch import (  # noqa: E402
    Launcher,
    PretrainJob,
    pick_free_port,
    tiny_gpt_args,
)
from mindio_ttp.demo.rehearsal.tree import apply_ttp_patch, copy_megatron_tree  # noqa: E402
from testkit.hooks import FAULT_HOOK_DIR, pythonpath  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PLAN = "1:3:sigkill:before|2:6:sigkill:inside|0:8:sigkill:after"
ITERS = 10
_START = re.compile(r"\[before the start of training step\] datetime: (\S+ \S+)")
_FAULT = re.compile(r"^(\S+ \S+),(\d{3}) \[ttp rank \d+\] ERROR mindio_ttp\.controller: .*FAULT",
                    re.M)


def _run(tree: Path, args: List[str], log: Path, env: dict, launcher_args=()) -> float:
    t0 = time.time()
    with PretrainJob(tree, args, nproc=4, log_path=log, launcher=Launcher.TTPRUN, env=env,
                     launcher_args=launcher_args) as job:
        result = job.wait(900)
    if result.timed_out:
        raise SystemExit(f"timed out; see {log}")
    return t0


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S").timestamp()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", type=Path, required=True)
    parser.add_argument("--keep", type=Path, help="work in this new folder and keep the logs")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        work = opts.keep or Path(tmp)
        tree = copy_megatron_tree(opts.megatron, work / "Megatron-LM")
        apply_ttp_patch(tree, "cpu")
        data = make_tiny_dataset(tree, work / "data")
        env = {"TTP_OT": "60", "TTP_CONTROLLER_PORT": str(pick_free_port()),
               "PYTHONPATH": pythonpath(FAULT_HOOK_DIR)}

        cold_log = work / "cold.log"
        t0 = _run(tree, tiny_gpt_args(data, train_iters=4), cold_log, env)
        cold = _START.search(cold_log.read_text())
        cold_s = _stamp(cold.group(1)) - t0 if cold else float("nan")

        ckpt = work / "ckpt"
        faults_log = work / "faults.log"
        args = tiny_gpt_args(data, train_iters=ITERS, save=ckpt, load=ckpt, save_interval=10_000)
        env = dict(env, TTP_FAULT_PLAN=PLAN, TTP_CONTROLLER_PORT=str(pick_free_port()))
        _run(tree, args, faults_log, env, launcher_args=["--max-restarts", "3"])
        text = faults_log.read_text()
        # attempt i runs from its start line to the next one; its first FAULT line is the fault
        starts = list(_START.finditer(text))
        lost = []
        for this, restart in zip(starts, starts[1:]):
            fault = _FAULT.search(text, this.end(), restart.start())
            if fault is not None:
                at = _stamp(fault.group(1)) + int(fault.group(2)) / 1000
                lost.append(_stamp(restart.group(1)) - at)
        if cold_s != cold_s or len(lost) != 3:  # nan, or a fault not found
            raise SystemExit(f"unexpected logs: cold {cold_s}, lost {lost}; rerun with --keep")
    print(f"| measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} "
          f"cores, load average {os.getloadavg()[0]:.1f} at the end | seconds |")
    print("|---|---|")
    print(f"| cold start: launch -> first training step | {cold_s:.0f} |")
    for i, seconds in enumerate(lost, 1):
        print(f"| fault {i}: detected -> first training step of the restarted attempt | "
              f"{seconds:.0f} |")
    if lost:
        mean = sum(lost) / len(lost)
        print(f"| mean time lost per fault / cold start | {mean:.0f} / {cold_s:.0f} = "
              f"{mean / cold_s:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
