"""Launch `ttp_worker.py` jobs as plain subprocesses and collect what they did.

Every process is reaped: SIGSTOPped ranks are continued and killed at the end, and anything
still running at the deadline is killed, so a broken runtime fails a test instead of hanging
CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from mindio_ttp.demo.ports import pick_free_port
from testkit.forking import clean_context

from . import ttp_worker

WORKER = Path(__file__).with_name("ttp_worker.py")
REPO = Path(__file__).resolve().parents[2]

FAST_ENV = {
    "TTP_HEARTBEAT_INTERVAL": "0.2",
    "TTP_HEARTBEAT_TIMEOUT": "1.5",
    "TTP_UPDATE_GRACE": "1.0",
    "TTP_COLLECT_TIMEOUT": "3",
    "TTP_SAVE_TIME_LIMIT": "4",
    "TTP_RENAME_TIME_LIMIT": "3",
    "TTP_OT": "30",
    "TTP_CONNECT_TIMEOUT": "20",
    "TTP_AUTH_KEY": "00112233445566778899aabbccddeeff",
    "TTP_LOG_LEVEL": "INFO",
}


def free_port() -> int:
    return pick_free_port()


@dataclass
class JobResult:
    codes: Dict[int, Optional[int]]
    out: Path
    run_dir: Path
    logs: Dict[int, str] = field(default_factory=dict)
    elapsed: float = 0.0

    @property
    def flow(self) -> Optional[dict]:
        p = self.run_dir / "flow-finished.json"
        return json.loads(p.read_text()) if p.exists() else None

    @property
    def latest(self) -> Optional[int]:
        p = self.out / "latest"
        return int(p.read_text()) if p.exists() else None

    def saved_ranks(self, step: int) -> List[int]:
        d = self.out / f"iter_{step}"
        if not d.exists():
            return []
        return sorted(int(p.stem.split("_")[1]) for p in d.glob("rank_*.json"))

    def all_logs(self) -> str:
        return "\n".join(f"----- rank {r} -----\n{t}" for r, t in sorted(self.logs.items()))


_FORK = clean_context()  # never a fork of this process (testkit/forking.py)


def _alive(p: Any) -> bool:
    return p.is_alive() if hasattr(p, "is_alive") else p.poll() is None


def _forked_rank(env: dict, log_path: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    ttp_worker.main()


def reap_controller(pid_file: Path) -> None:
    """Rank 0's controller process ends by itself after a flow, but one a test stopped
    (SIGSTOP of node 0) or left without a verdict must not outlive the test."""
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        if b"mindio_ttp.control.controller.host" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return  # gone, and the pid reused
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass


def run_job(tmp: Path, plan: dict, world: int = 4, timeout: float = 40.0,
            stopped: Optional[List[int]] = None, env_extra: Optional[dict] = None,
            fork: bool = True) -> JobResult:
    """Run one job to the end. `stopped`: ranks expected to SIGSTOP themselves; they are
    killed once every other rank has exited."""
    out, run_dir = tmp / "ckpt", tmp / "run"
    out.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = dict(plan, out=str(out))
    base = dict(os.environ, **FAST_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                WORLD_SIZE=str(world), TTP_CONTROLLER_PORT=str(free_port()),
                TTP_RUN_DIR=str(run_dir), TTPW_PLAN=json.dumps(plan),
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    base.update(env_extra or {})
    procs: Dict[int, Any] = {}
    files = {}
    t0 = time.monotonic()
    for r in range(world):
        files[r] = open(tmp / f"rank{r}.log", "w+")
        env = dict(base, RANK=str(r))
        if fork:  # forked from a server with torch imported: ranks start in ~0.1 s
            procs[r] = _FORK.Process(target=_forked_rank, args=(env, str(tmp / f"rank{r}.log")),
                                     daemon=False)
            procs[r].start()
        else:
            procs[r] = subprocess.Popen([sys.executable, str(WORKER)], env=env,
                                        stdout=files[r], stderr=subprocess.STDOUT)
    stopped = set(stopped or [])
    deadline = t0 + timeout
    try:
        while time.monotonic() < deadline:
            running = [r for r, p in procs.items() if _alive(p) and r not in stopped]
            if not running:
                break
            time.sleep(0.05)
    finally:
        codes: Dict[int, Optional[int]] = {}
        for r, p in procs.items():
            if _alive(p):
                if r not in stopped:
                    print(f"rank {r} still running at the deadline: killing it", file=sys.stderr)
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                except ProcessLookupError:
                    pass
                p.join(10) if fork else p.wait(10)
                codes[r] = None
            else:
                codes[r] = p.exitcode if fork else p.returncode
        reap_controller(tmp / ttp_worker.CONTROLLER_PID_FILE)
        logs = {}
        for r, f in files.items():
            f.seek(0)
            logs[r] = f.read()
            f.close()
    return JobResult(codes, out, run_dir, logs, time.monotonic() - t0)
