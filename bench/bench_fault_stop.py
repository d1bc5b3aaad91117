"""From the fault to every survivor out of the failed step, and what a recovery that cannot
proceed adds to the dying checkpoint, on real Megatron-LM 285068c on CPU (issue 22 §3).

On gloo a collective with a dead peer raises by itself; on the test rig's NCCL-like backend
(testkit/nccl_like, docs/rehearsal.md) it spins until aborted, as NCCL's does, so a survivor's
main thread leaves the step only because the runtime's fault-time stop aborts its communicators
off the main thread at the controller's lock (control/rank/release.py). Measured, wall clock, on the
tiny GPT of bench_recover.py (DP4, SIGKILL of rank 1 in the forward step of iteration 4):

* **out of the step**: the fault (the fault hook's timestamp just before the kill) to the
  controller's FAULT line (detect), and to the last survivor's main thread out of the step (the
  time each survivor's stop logs: ``main thread out of the step ... (at T)``). Target: detect
  + 1 s. In-memory recovery (no spare) and the dying checkpoint, gloo and NCCL-like (torch 2.6).
* **the fallback's extra time**: the fault to the dying checkpoint's flow finished, in
  in-memory mode where the recovery cannot proceed, against the dying-checkpoint mode: (a) the
  stack cannot abort and re-initialise (NCCL-like as torch 2.1: rank 0's gate chooses the
  dying checkpoint before any fault), (b) the recovery is ordered but its replacement dies at
  start (torch 2.6), so the controller abandons it and saves. Both runs restart once and
  resume from the checkpoint, so each launch ends.

Medians over the rounds (min-max), paths interleaved in every round.

    TTP_MEGATRON_DIR=/path/to/Megatron-LM python bench/bench_fault_stop.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_recover import (  # noqa: E402 - the job, its launch and its records
    _LOG_LINE,
    COLD,
    FAULT_RANK,
    RESTART,
    Bench,
    _cell,
    _stamp,
)

from mindio_ttp.demo.rehearsal.data import make_tiny_dataset  # noqa: E402
from mindio_ttp.demo.rehearsal.tree import apply_ttp_patch, copy_megatron_tree  # noqa: E402

WORLD = 4
_OUT = re.compile(r"fault-time stop \(.*main thread out of the step .* \(at ([0-9.]+)\)")
_FAULT = re.compile(r"mindio_ttp\.controller: .*FAULT")
_GATE = re.compile(r"recovery mode: (.*)")
IN_MEMORY = {"TTP_RECOVERY": "in-memory"}
REPLACEMENT_DIES = f"{FAULT_RANK}:4:sigkill:before,{FAULT_RANK}:3:sigkill:replacement"

# (label, backend, bench_recover path, fault plan, settings)
OUT_OF_STEP = [
    ("gloo, in-memory", "gloo", COLD, None, {}),
    ("gloo, dying checkpoint", "gloo", RESTART, None, {}),
    ("NCCL-like 2.6, in-memory", "nccl-like@2.6", COLD, None, {}),
    ("NCCL-like 2.6, dying checkpoint", "nccl-like@2.6", RESTART, None, {}),
]
FALLBACK = [
    ("NCCL-like 2.1, dying checkpoint", "nccl-like@2.1", RESTART, None, {}),
    ("NCCL-like 2.1, in-memory (the stack cannot: gate)", "nccl-like@2.1", RESTART, None,
     IN_MEMORY),
    ("NCCL-like 2.6, dying checkpoint", "nccl-like@2.6", RESTART, None, {}),
    ("NCCL-like 2.6, in-memory (replacement dies at start)", "nccl-like@2.6", RESTART,
     REPLACEMENT_DIES, IN_MEMORY),
]


def _survivors_out(log_dir: Path, after: float) -> Dict[int, float]:
    """{survivor rank: when its main thread left the failed step}, from its stop's line."""
    out: Dict[int, float] = {}
    for path in log_dir.glob("ttp-rank*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m, hit = _LOG_LINE.match(line), _OUT.search(line)
            if m and hit and float(hit.group(1)) >= after and int(m.group(2)) != FAULT_RANK:
                out.setdefault(int(m.group(2)), float(hit.group(1)))
    return out


def _first(log_dir: Path, pattern: re.Pattern, after: float) -> Optional[float]:
    times = []
    for path in log_dir.glob("ttp-rank*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = _LOG_LINE.match(line)
            if m and pattern.search(m.group(3)) and _stamp(m.group(1)) >= after:
                times.append(_stamp(m.group(1)))
    return min(times) if times else None


def measure(bench: Bench, label: str, path: str, plan: Optional[str],
            settings: Dict[str, str], tag: str) -> Dict[str, float]:
    run = bench.launch(path, tag, plan=plan, env_extra=settings)
    out = bench.work / tag
    fault = float(json.loads((out / "records" / f"fault-{FAULT_RANK}.json").read_text())["time"])
    detected = _first(out / "logs", _FAULT, fault)
    left = _survivors_out(out / "logs", fault - 1.0)
    row: Dict[str, float] = {}
    if detected is not None:
        row["detect"] = detected - fault
    if len(left) == WORLD - 1:
        row["out"] = max(left.values()) - fault
        if detected is not None:
            row["out after detect"] = max(left.values()) - detected
    if run.flow_at is not None:
        row["saved"] = run.flow_at - fault
    row["time lost"] = run.lost_s
    gate = _GATE.search((out / "job.log").read_text(errors="replace"))
    print(f"# {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items())
          + (f"; {gate.group(1)[:100]}" if gate else ""), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", type=Path, default=os.environ.get("TTP_MEGATRON_DIR"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="work in this new folder and keep every log")
    parser.add_argument("--only", choices=("out", "fallback"), help="one of the two tables")
    opts = parser.parse_args()
    if opts.megatron is None:
        parser.error("name a Megatron-LM 285068c checkout with --megatron or TTP_MEGATRON_DIR")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    started, load = time.time(), os.getloadavg()[0]
    tables: List[Tuple[str, list]] = [("out", OUT_OF_STEP), ("fallback", FALLBACK)]
    results: Dict[str, Dict[str, List[Dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fault-stop-") as tmp:
        work = opts.keep or Path(tmp)
        tree = copy_megatron_tree(opts.megatron, work / "Megatron-LM")
        apply_ttp_patch(tree, "cpu")
        data = make_tiny_dataset(tree, work / "data")
        for name, cases in tables:
            if opts.only and opts.only != name:
                continue
            results[name] = {label: [] for label, *_ in cases}
            for round_ in range(opts.rounds):
                order = cases[round_ % len(cases):] + cases[:round_ % len(cases)]
                for i, (label, backend, path, plan, settings) in enumerate(order):
                    bench = Bench(tree, data, work, backend=backend)
                    results[name][label].append(measure(bench, label, path, plan, settings,
                                                        f"{name}-r{round_}-{i}"))
    print(f"\nmeasured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
          f"{os.cpu_count()} cores, load average {load:.2f} at the start, "
          f"{(time.time() - started) / 60:.1f} min in all; seconds, median (min-max) of "
          f"{opts.rounds} run(s); DP4 tiny GPT, SIGKILL rank {FAULT_RANK} in iteration 4\n")
    columns = {"out": ("detect", "out", "out after detect"),
               "fallback": ("detect", "saved", "time lost")}
    for name, rows in results.items():
        cols = columns[name]
        print("| " + ("case" if name == "out" else "fallback case") + " | " + " | ".join(cols)
              + " |\n|---|" + "---:|" * len(cols))
        for label, runs in rows.items():
            print(f"| {label} | " + " | ".join(_cell([r[c] for r in runs if c in r])
                                             for c in cols) + " |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
