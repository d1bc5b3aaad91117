"""Launch the tiny GPT through real ``pretrain_gpt.py`` and read its log.

The argument set is the smallest GPT that still exercises tensor and data parallelism on CPU:
2 layers, hidden 64, 4 heads, sequence 64, micro-batch 2, global batch 8, fp32, gloo, CUDA
fusions off, dropout 0, seed 1234, a loss line every iteration. torch elastic starts every
rank in a session of its own, so killing the launcher's process group does not reach the
ranks: a job remembers every descendant it has seen (psutil handles, safe against pid reuse)
and kills those individually, and reports any rank still alive after its launcher exited.
"""

from __future__ import annotations

import enum
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import psutil

from mindio_ttp.demo.ports import pick_free_port
from mindio_ttp.demo.rehearsal.data import TinyDataset

RUNNER_MODULE = "mindio_ttp.demo.rehearsal.runner"
_LOSS_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")
_TIME_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


class Launcher(enum.Enum):
    """Which elastic launcher starts the ranks."""

    TORCHRUN = "torchrun"
    TTPRUN = "ttprun"


def tiny_gpt_args(
    data: TinyDataset,
    *,
    train_iters: int,
    tensor_parallel: int = 1,
    distributed_optimizer: bool = True,
    save: Optional[Path] = None,
    load: Optional[Path] = None,
    save_interval: int = 10_000,
    exit_interval: Optional[int] = None,
    extra: Sequence[str] = (),
) -> List[str]:
    """Megatron command-line arguments for the tiny GPT."""
    args = [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", str(train_iters),
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--clip-grad", "1.0",
        "--tensor-model-parallel-size", str(tensor_parallel),
        "--data-path", str(data.prefix), "--vocab-file", str(data.vocab_file),
        "--merge-file", str(data.merge_file), "--tokenizer-type", "GPT2BPETokenizer",
        "--split", "949,50,1",
        "--distributed-backend", "gloo",
        "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
        "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1",
        "--num-workers", "0",
    ]
    if distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if save is not None:
        args += ["--save", str(save), "--save-interval", str(save_interval)]
    if load is not None:
        args += ["--load", str(load)]
    if exit_interval is not None:
        args += ["--exit-interval", str(exit_interval)]
    return args + list(extra)


def parse_losses(log: str) -> Dict[int, str]:
    """``{iteration: printed lm loss}``; strings, so equality means bit-equal printed values."""
    return {int(m.group(1)): m.group(2) for m in _LOSS_RE.finditer(log)}


def parse_iteration_ms(log: str) -> Dict[int, float]:
    """``{iteration: elapsed ms}`` from Megatron's per-iteration log line."""
    return {int(m.group(1)): float(m.group(2)) for m in _TIME_RE.finditer(log)}


@dataclass
class PretrainResult:
    """Outcome of one launch."""

    returncode: int
    log_path: Path
    wall_s: float
    timed_out: bool = False
    #: pids of processes the launcher left running after it exited (the job killed them)
    leftovers: List[int] = field(default_factory=list)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def losses(self) -> Dict[int, str]:
        return parse_losses(self.log)

    def ms_per_iter(self, skip: int = 2) -> Optional[float]:
        """Mean iteration time without the first ``skip`` (warm-up) iterations."""
        times = [ms for it, ms in sorted(parse_iteration_ms(self.log).items()) if it > skip]
        return sum(times) / len(times) if times else None

    def tail(self, n_chars: int = 4000) -> str:
        return self.log[-n_chars:]


def _launcher_cmd(launcher: Launcher) -> List[str]:
    if launcher is Launcher.TORCHRUN:
        return [sys.executable, "-m", "torch.distributed.run"]
    beside = Path(sys.executable).parent / "ttprun"
    found = str(beside) if beside.is_file() else shutil.which("ttprun")
    if found is None:
        raise RuntimeError("ttprun is not installed: pip install -e . (it is a console script)")
    return [found]


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an exited orphan waiting for init to reap it is gone)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def worker_env(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Environment for a CPU run: deterministic hashing, one OpenMP thread per rank. A fault
    ends in the dying checkpoint (what this rehearsal shows) unless `extra` asks for the
    in-memory recovery (TTP_RECOVERY=in-memory, docs/recovery.md)."""
    env = dict(os.environ)
    env.update({"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1",
                "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1",
                "TTP_RECOVERY": "dying-checkpoint"})
    env.update(extra or {})
    return env


class PretrainJob:
    """A running launcher (torchrun / ttprun) with its ranks; use as a context manager."""

    def __init__(self, tree: Path, megatron_args: Sequence[str], *, nproc: int, log_path: Path,
                 master_port: Optional[int] = None, launcher: Launcher = Launcher.TORCHRUN,
                 inject_adaptor: bool = False, env: Optional[Mapping[str, str]] = None,
                 launcher_args: Sequence[str] = ()) -> None:
        script = str(Path(tree).resolve() / "pretrain_gpt.py")
        target = ["-m", RUNNER_MODULE, script] if inject_adaptor else [script]
        self.master_port = master_port or pick_free_port()
        self.cmd = [*_launcher_cmd(launcher), "--nproc_per_node", str(nproc),
                    "--master_addr", "127.0.0.1",
                    "--master_port", str(self.master_port),
                    *launcher_args, *target, *megatron_args]
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.started = time.monotonic()
        self._seen: Dict[int, psutil.Process] = {}
        self.popen = subprocess.Popen(self.cmd, cwd=str(tree), env=worker_env(env),
                                      stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def _descendants(self) -> List[psutil.Process]:
        try:
            found = psutil.Process(self.popen.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        for proc in found:
            self._seen.setdefault(proc.pid, proc)
        return found

    def worker_pids(self) -> Dict[int, int]:
        """``{global rank: pid}`` of the live worker processes (read from their environment)."""
        ranks: Dict[int, int] = {}
        for child in self._descendants():
            try:
                env = child.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if "RANK" in env and "LOCAL_RANK" in env:
                ranks.setdefault(int(env["RANK"]), child.pid)
        return ranks

    def wait_for_workers(self, nproc: int, timeout_s: float = 120) -> Dict[int, int]:
        """Poll :meth:`worker_pids` until ``nproc`` ranks are up; raise if the job ends first."""
        deadline = time.monotonic() + timeout_s
        while True:
            ranks = self.worker_pids()
            if len(ranks) >= nproc:
                return ranks
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(ranks)}/{nproc} ranks up after {timeout_s:.0f}s; "
                                   f"see {self.log_path}")
            try:
                rc = self.popen.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"launcher exited {rc} before {nproc} ranks were up; "
                               f"see {self.log_path}")

    def wait(self, timeout_s: float) -> PretrainResult:
        """Wait for the launcher; on timeout kill it and every rank, and say so."""
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while True:
            self._descendants()  # remember ranks while the launcher can still be asked
            try:
                rc = self.popen.wait(timeout=max(0.01, min(0.5, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    timed_out = True
                    self.kill()
                    rc = self.popen.wait(timeout=30)
                    break
        leftovers = self._kill_leftovers()
        self._log.close()
        return PretrainResult(rc, self.log_path, time.monotonic() - self.started, timed_out,
                              leftovers)

    def kill(self) -> None:
        """SIGKILL the launcher (and its process group) and every rank it started."""
        self._descendants()
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._kill_leftovers()

    def _kill_leftovers(self) -> List[int]:
        alive = [p for p in self._seen.values() if _running(p)]
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        psutil.wait_procs(alive, timeout=10)
        return sorted(p.pid for p in alive)

    def __enter__(self) -> PretrainJob:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.popen.poll() is None:
            self.kill()
            self.popen.wait(timeout=30)
        self._kill_leftovers()
        self._log.close()


def run_pretrain(tree: Path, megatron_args: Sequence[str], *, nproc: int, log_path: Path,
                 master_port: Optional[int] = None, timeout_s: float = 300,
                 launcher: Launcher = Launcher.TORCHRUN, inject_adaptor: bool = False,
                 env: Optional[Mapping[str, str]] = None) -> PretrainResult:
    """Start a job and wait for it (see :class:`PretrainJob`)."""
    with PretrainJob(tree, megatron_args, nproc=nproc, log_path=log_path,
                     master_port=master_port, launcher=launcher,
                     inject_adaptor=inject_adaptor, env=env) as job:
        return job.wait(timeout_s)
