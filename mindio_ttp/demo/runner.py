"""Launch the demo job under ttprun and collect what it left behind.

Shared by `ttp-demo`, the fault-matrix tests and the benchmarks, so all of them run the very same
command line. Everything a launch writes stays under its own work directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from mindio_ttp.demo import checkpoint
from mindio_ttp.demo.faults import FaultPlan
from mindio_ttp.demo.model import FullState, ShardLayout
from mindio_ttp.demo.ports import pick_free_port
from mindio_ttp.launch.flow_record import read_flow_record

WORLD = 4

# Short timings so a fault case takes seconds; a real job keeps the runtime's defaults.
FAST_ENV: Dict[str, str] = {
    "TTP_OT": "40",
    "TTP_HEARTBEAT_INTERVAL": "0.25",
    "TTP_HEARTBEAT_TIMEOUT": "2.0",
    "TTP_SAVE_TIME_LIMIT": "15",
    "TTP_RENAME_TIME_LIMIT": "5",
    "TTP_COLLECT_TIMEOUT": "3",
    "TTP_UPDATE_GRACE": "0.5",
    "TTP_LOG_LEVEL": "WARNING",
    # what most callers check; ttp-demo passes its --recovery (default: the product's, in-memory)
    "TTP_RECOVERY": "dying-checkpoint",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


def free_port() -> int:
    return pick_free_port()


@dataclass
class LaunchResult:
    """One ttprun launch: exit code, merged output, wall time and what it wrote."""

    returncode: int
    output: str
    seconds: float
    ckpt_dir: Path
    out_dir: Path
    run_dir: Path
    lines: List[str] = field(default_factory=list)
    ended_at: float = 0.0  # wall-clock time.time() when ttprun exited

    @property
    def flow(self) -> Optional[dict]:
        """``flow-finished.json`` written by the runtime (outcome, step, ranks, checkpoint), if
        any, checked against its schema (FlowRecordError if it is not valid)."""
        for path in sorted(self.run_dir.glob("*/flow-finished.json")):
            return read_flow_record(path).to_dict()
        return None

    def final_state(self) -> FullState:
        path = self.out_dir / "final.pt"
        if not path.is_file():
            raise RuntimeError(f"the job wrote no final state ({path}); its output:\n{self.output}")
        return FullState.from_dict(torch.load(path, weights_only=True))

    def snapshots(self) -> Dict[int, FullState]:
        data = torch.load(self.out_dir / "snapshots.pt", weights_only=True)
        return {int(k): FullState.from_dict(v) for k, v in data.items()}

    def fault_times(self) -> Dict[int, float]:
        records = [json.loads(p.read_text()) for p in self.out_dir.glob("fault-*.json")]
        return {int(r["rank"]): float(r["time"]) for r in records}

    def latest_step(self) -> Optional[int]:
        return checkpoint.latest_step(self.ckpt_dir)

    def recoveries(self) -> List[dict]:
        """The in-memory recoveries the workers saw committed (ttprun's launch directory)."""
        from mindio_ttp.launch.outcome import read_recovered

        found: List[dict] = []
        for launch_dir in sorted(p for p in self.run_dir.iterdir() if p.is_dir()):
            found += read_recovered(launch_dir)
        return found

    def load_checkpoint(self) -> Optional[checkpoint.LoadedCheckpoint]:
        return checkpoint.load(self.ckpt_dir, ShardLayout.for_world(WORLD))


def launch(
    work: Path,
    steps: int,
    plan: Optional[FaultPlan] = None,
    *,
    resume: bool = False,
    snapshots: bool = False,
    ckpt_dir: Optional[Path] = None,
    env: Optional[Dict[str, str]] = None,
    echo: Optional[Callable[[str], None]] = None,
    timeout: float = 120.0,
    step_delay: float = 0.0,
    preempt_after_step: Optional[int] = None,
    preempt_every_process: bool = False,
    loader_workers: int = 0,
) -> LaunchResult:
    """Run the 4-rank demo job under ttprun to completion (or its dying checkpoint).

    ``preempt_after_step`` sends SIGTERM to ttprun once rank 0 reports that step, as a scheduler
    preempting the job would; with ``preempt_every_process`` it goes to every process of the job
    at once (ttprun, the ranks and their DataLoader workers), as Slurm signals a job step.
    """
    work.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir or work / "ckpt"
    out = work / "out"
    runs = work / "runs"
    for d in (ckpt, out, runs):
        d.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, **FAST_ENV)
    full_env.pop("TTP_AUTH_KEY", None)  # ttprun generates one per launch
    full_env.update(TTP_CONTROLLER_PORT=str(free_port()), TTP_RUN_DIR=str(runs))
    full_env.update(env or {})
    cmd = [
        sys.executable, "-m", "mindio_ttp.launch.agent", "--nnodes=1", f"--nproc-per-node={WORLD}",
        "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        "--node-rank=0", "--monitor-interval=0.05", "-m", "mindio_ttp.demo.job",
        f"--steps={steps}", f"--ckpt-dir={ckpt}", f"--out={out}",
        f"--faults={(plan or FaultPlan()).to_text()}",
    ]  # fmt: skip
    if resume:
        cmd.append("--resume")
    if snapshots:
        cmd.append("--snapshots")
    if step_delay:
        cmd.append(f"--step-delay={step_delay}")
    if loader_workers:
        cmd.append(f"--loader-workers={loader_workers}")
    preempt_line = None if preempt_after_step is None else f"rank 0 | step {preempt_after_step}/"
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines: List[str] = []

    sent: List[float] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if preempt_line is not None and not sent and line.startswith(preempt_line):
                sent.append(time.monotonic())
                targets = [proc.pid, *(_descendants(proc.pid) if preempt_every_process else [])]
                for pid in targets:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
            if echo is not None:
                echo(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        reader.join(5)
        raise RuntimeError(
            f"ttprun did not finish within {timeout:.0f} s; output:\n" + "\n".join(lines)
        ) from None
    finally:
        if proc.poll() is None:
            _kill_session(proc)
    ended_at = time.time()
    reader.join(10)
    seconds = time.monotonic() - start
    text = "\n".join(lines)
    return LaunchResult(proc.returncode, text, seconds, ckpt, out, runs, lines, ended_at)


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill ttprun; its workers run in their own sessions, so find them through /proc."""
    children = _descendants(proc.pid)
    for pid in [proc.pid, *children]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


def _descendants(root: int) -> List[int]:
    parents: Dict[int, List[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
