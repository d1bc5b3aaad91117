"""Crash-to-detection latency, and fault to checkpoint-in-place, in the real 4-rank demo job.

Each run is the demo job under ttprun with one fault injected at step 3. The fault injector
records the wall time just before it fires; the controller logs the moment it declares the fault
(the first ``FAULT`` line of ``mindio_ttp.controller``, millisecond timestamps); the rename handler
records when the checkpoint was in place; the runner records when ttprun exited. Heartbeat settings
are the demo's (interval 0.25 s, timeout 2 s), so a hang is found by the heartbeat timeout while
a death is found by the dropped connection.

    python bench/bench_detection.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from mindio_ttp.demo.faults import Fault, FaultPlan, Phase
from mindio_ttp.demo.runner import FAST_ENV, LaunchResult, launch

CASES: List[Tuple[str, int, Fault]] = [
    ("SIGKILL rank 1 (connection drops)", 1, Fault.SIGKILL),
    ("exception in train, rank 1 (reported)", 1, Fault.EXCEPTION),
    ("SIGSTOP rank 1 (heartbeats stop)", 1, Fault.SIGSTOP),
    ("SIGKILL rank 0 (its controller process runs on)", 0, Fault.SIGKILL),
]
_FAULT_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[ttp rank \d+\] \w+ mindio_ttp\.controller: .*FAULT"
)


def detected_at(result: LaunchResult) -> Optional[float]:
    """Wall time of the controller's first FAULT line (local time, as logging writes it)."""
    for line in result.lines:
        match = _FAULT_LINE.match(line)
        if match:
            return datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def measure(rank: int, fault: Fault, work: Path) -> Dict[str, float]:
    plan = FaultPlan().fail_at(rank, 3, fault, Phase.INSIDE)
    result = launch(work, 4, plan)
    fault_time = result.fault_times()[rank]
    detect = detected_at(result)
    loaded = result.load_checkpoint()
    if detect is None or loaded is None:
        raise RuntimeError(f"{plan.describe()}: no detection or no checkpoint\n{result.output}")
    return {
        "detect": detect - fault_time,
        "in_place": float(loaded.manifest["renamed_at"]) - fault_time,
        "exit": result.ended_at - fault_time,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-detection-") as tmp:
        for label, rank, fault in CASES:
            runs = [
                measure(rank, fault, Path(tmp) / f"{fault.value}-{rank}-{i}")
                for i in range(args.repeats)
            ]
            rows.append((label, {k: [r[k] for r in runs] for k in runs[0]}))
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.1f} at the end: "
          f"demo job, 4 ranks, fault inside the update window of step 3; heartbeat interval "
          f"{FAST_ENV['TTP_HEARTBEAT_INTERVAL']} s, timeout {FAST_ENV['TTP_HEARTBEAT_TIMEOUT']} s; "
          f"median (min-max) of {args.repeats} runs")  # fmt: skip
    print("| fault | fault -> detected | fault -> checkpoint in place | fault -> ttprun exit |")
    print("|---|---:|---:|---:|")
    for label, cols in rows:
        cells = [
            f"{1000 * statistics.median(v):.0f} ms ({1000 * min(v):.0f}-{1000 * max(v):.0f})"
            for v in (cols["detect"], cols["in_place"], cols["exit"])
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
