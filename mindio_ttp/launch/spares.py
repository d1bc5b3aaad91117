"""Warm spares: workers that have already paid a replacement's start-up, waiting for a rank.

A cold replacement for a lost rank starts an interpreter, imports torch, Megatron and the rest
of the training script's imports (seconds on a CPU, 11-22 s for torch alone in some
containers), imports what torch loads lazily at the first optimizer (torch._dynamo: seconds
more), and only then builds its model. A warm spare did the imports while the job trained: a
process of the workers' interpreter, with the workers' flags, that imported torch, the entry's
module-level imports and torch._dynamo, and now blocks on a private socket. Given a rank it becomes
that rank's worker in place: the environment torch would have given it, its argv, sys.path[0],
its log files, then the entry through :mod:`runpy`, as ``python -u script.py`` or
``python -u -m module`` would have run it.

What a spare cannot do ahead is everything that depends on the rank: the device, the process
groups, the model, the data. It binds no device (importing torch starts no CUDA/NPU context),
so any local rank's device can be given to it at assignment (``CUDA_VISIBLE_DEVICES`` set then
still counts: it is read at the first device call, not at import).

Which imports: the entry's leading import block, in order (imports, docstring, ``def`` and
``class``, and ``try`` blocks holding only imports), up to the first other statement, since
that statement may be what a later import depends on (``os.environ[...] = ...``). A failed
import is skipped: the worker will import it again and fail the same way a cold one would. A
spare is started with the launcher's environment, not a rank's, so a module that reads
``RANK``/``LOCAL_RANK`` at import time sees them unset.

A spare never outlives its launcher:

* ``PR_SET_PDEATHSIG`` = SIGKILL, set first thing, then a check that the launcher is still the
  parent (one that died before the ``prctl`` would otherwise go unnoticed). The death signal
  is tied to the *thread* that spawned the spare, so the pool spawns only from the launcher's
  main thread, which lives as long as the launcher (SIGKILL of ``ttprun`` included);
* each spare runs in a session of its own, like torch's workers, so the ``killpg`` that ends a
  worker also ends a spare turned worker and its children;
* :meth:`SparePool.close` kills the idle spares on every exit of the launcher (normal, failed,
  SIGTERM/SIGINT), and a spare whose socket closes exits by itself.

The spare's side is ``python -m mindio_ttp.launch.spares`` (started only by the pool); the
messages are JSON lines over an ``AF_UNIX`` socket pair, private to the two processes.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import ctypes
import importlib
import json
import logging
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger("ttprun")

SPARE_MODULE = "mindio_ttp.launch.spares"
# Interpreter flags torch or a user may put before the script: the spare starts with the same.
_FLAGS_WITHOUT_VALUE = frozenset("-u -O -OO -B -E -s -S -I -b -bb -d -q -v".split())
_FLAGS_WITH_VALUE = frozenset(("-X", "-W"))
# Rank-specific variables torch sets per worker; never part of a spare's own environment.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "ROLE_RANK", "GROUP_RANK", "TORCHELASTIC_ERROR_FILE")
# What a worker imports whatever its script: torch and its distributed package first; after
# the script's own imports (which may patch torch, as a device adaptor does), torch._dynamo,
# which every torch.optim optimizer imports on first use: some 800 modules, sympy among them,
# 4-8 s of a cold start on a loaded CPU (torch >= 2.0).
TORCH_MODULES = ("torch", "torch.distributed")
LATE_TORCH_MODULES = ("torch._dynamo",)
MAX_MESSAGE = 16 * 1024 * 1024  # an assignment carries one environment: far below this
PR_SET_PDEATHSIG = 1
CLOSE_WAIT_S = 5.0
# Spares that die before they are ready (an interpreter without this package, a crash in an
# import) are not restarted forever: after this many, the pool stops starting them.
MAX_EARLY_DEATHS = 3


@dataclass(frozen=True)
class Entry:
    """What a worker runs: ``python FLAGS script ARGS`` or ``python FLAGS -m module ARGS``."""

    interpreter: str
    flags: Tuple[str, ...]
    module: bool
    target: str

    @classmethod
    def parse(cls, entrypoint: str, args: Sequence[str]) -> Tuple[Optional[Entry], List[str]]:
        """``(entry, script arguments)`` from torch's worker command, or ``(None, [])`` when
        the workers are not Python scripts or modules (``--no-python``, ``-c``): no spare can
        stand in for those."""
        args = [str(a) for a in args]
        flags: List[str] = []
        i = 0
        while i < len(args) and args[i].startswith("-"):
            arg = args[i]
            if arg == "-m" and i + 1 < len(args):
                return cls(entrypoint, tuple(flags), True, args[i + 1]), args[i + 2:]
            if arg in _FLAGS_WITHOUT_VALUE:
                flags.append(arg)
            elif arg in _FLAGS_WITH_VALUE and i + 1 < len(args):
                flags += [arg, args[i + 1]]
                i += 1
            else:
                return None, []
            i += 1
        if not flags or i >= len(args):  # torch always passes -u to a Python entry
            return None, []
        return cls(entrypoint, tuple(flags), False, args[i]), args[i + 1:]

    def source(self) -> Optional[Path]:
        """The file whose imports a spare runs ahead (None when it cannot be found)."""
        if not self.module:
            return Path(self.target).resolve()
        import importlib.util

        try:
            spec = importlib.util.find_spec(self.target)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None
        if spec.submodule_search_locations:  # a package run with -m: its __main__
            main = Path(spec.origin).parent / "__main__.py"
            return main if main.is_file() else None
        return Path(spec.origin)


def leading_imports(source: str) -> List[Tuple[str, Tuple[str, ...]]]:
    """``[(module, names imported from it)]`` of the script's leading import block.

    The block ends at the first statement that is not an import, a docstring, a ``def``, a
    ``class`` or a ``try`` holding only imports: running imports past such a statement could
    run them without what it sets up. Relative imports are skipped."""
    found: List[Tuple[str, Tuple[str, ...]]] = []

    def take(node: ast.stmt) -> bool:
        if isinstance(node, ast.Import):
            found.extend((alias.name, ()) for alias in node.names)
            return True
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module != "__future__":
                found.append((node.module, tuple(a.name for a in node.names if a.name != "*")))
            return True
        return False

    for node in ast.parse(source).body:
        if take(node):
            continue
        if isinstance(node, ast.Try) and all(isinstance(n, (ast.Import, ast.ImportFrom))
                                             for n in node.body):
            for inner in node.body:
                take(inner)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            continue
        break
    return found


@dataclass
class PreloadReport:
    seconds: float
    imported: List[str] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)


def preload(entry: Entry) -> PreloadReport:
    """Import torch, the entry's leading imports, then what torch imports lazily at the first
    optimizer (TORCH_MODULES, LATE_TORCH_MODULES), as the worker would (see the module doc).

    sys.path[0] is what the worker's interpreter would have put there: the script's folder, or
    for ``-m`` the working directory (which the spare already has)."""
    start = time.monotonic()
    report = PreloadReport(0.0)
    path = entry.source()
    if not entry.module and path is not None:
        sys.path[0] = str(path.parent)
    wanted: List[Tuple[str, Tuple[str, ...]]] = [(name, ()) for name in TORCH_MODULES]
    if path is not None:
        try:
            wanted += leading_imports(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError) as exc:
            report.failed.append(f"{path}: {exc}")
    wanted += [(name, ()) for name in LATE_TORCH_MODULES]
    for name, names in wanted:
        try:
            module = importlib.import_module(name)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the worker will see it again
            report.failed.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        report.imported.append(name)
        for attr in names:
            if hasattr(module, attr):
                continue
            with contextlib.suppress(Exception, SystemExit):  # only submodules matter here
                importlib.import_module(f"{name}.{attr}")
    report.seconds = time.monotonic() - start
    return report


# -- the wire: JSON lines over a private socket pair -------------------------------------------
def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode("utf-8") + b"\n")


class _Lines:
    """Reads JSON lines from a socket, blocking or not."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self.eof = False

    def read(self, timeout: Optional[float]) -> Optional[dict]:
        """The next message; None on timeout or end of stream (``eof`` says which)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            if self.eof:
                return None
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.sock], [], [], wait)
            if not ready:
                return None
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionError, OSError):
                chunk = b""
            if not chunk:
                self.eof = True
                return None
            self._buf += chunk
            if len(self._buf) > MAX_MESSAGE:
                raise ValueError("spare message larger than MAX_MESSAGE")
        line, self._buf = self._buf.split(b"\n", 1)
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError(f"spare message is not an object: {line[:80]!r}")
        return message


# -- the spare's side ---------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that spawned it exits; exit now if it already has."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(0)  # the launcher died before the prctl: nothing to wait for


def _become(message: dict, entry: Entry) -> None:
    """Turn this process into the assigned worker and run the entry (returns when it does)."""
    env = message["env"]
    args = message["args"]
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                          for k, v in env.items())):
        raise ValueError("assignment env must map str to str")
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise ValueError("assignment args must be a list of str")
    for stream, fd in (("stdout", 1), ("stderr", 2)):
        path = message.get(stream)
        if path:
            sys.stdout.flush()
            sys.stderr.flush()
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(target, fd)
            os.close(target)
    os.environ.clear()
    os.environ.update(env)
    if entry.module:
        sys.argv = [entry.target, *args]
        runpy.run_module(entry.target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [entry.target, *args]
        runpy.run_path(entry.target, run_name="__main__")


def spare_main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog=SPARE_MODULE, description="a warm spare (internal)")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--target", required=True)
    opts = parser.parse_args(argv)
    _die_with_parent(opts.parent)
    sock = socket.socket(fileno=opts.fd)
    entry = Entry(sys.executable, (), opts.module, opts.target)
    report = preload(entry)
    lines = _Lines(sock)
    with contextlib.suppress(OSError):  # a pool that already assigned and closed: read on
        _send(sock, {"ready": True, "pid": os.getpid(), "preload_s": report.seconds,
                     "imported": len(report.imported), "failed": report.failed})
    try:
        message = lines.read(None)
    except (OSError, ValueError):
        message = None
    if message is None:  # the pool closed this spare (or the launcher is gone)
        os._exit(0)
    sock.close()
    _become(message, entry)


# -- the launcher's side ------------------------------------------------------------------------
@dataclass
class Spare:
    proc: subprocess.Popen
    lines: _Lines
    spawned: float
    ready_at: Optional[float] = None
    preload_s: Optional[float] = None

    @property
    def ready(self) -> bool:
        return self.ready_at is not None


class SparePool:
    """Up to ``size`` warm spares for one launcher's workers (see the module doc).

    Call :meth:`replenish` and :meth:`poll` from the launcher's main thread only (the spare's
    death signal follows the spawning thread); :meth:`start` hands a spare a rank."""

    def __init__(self, size: int, entry: Optional[Entry], cwd: Optional[str] = None) -> None:
        if size < 0:
            raise ValueError(f"size={size}: the number of warm spares is 0 or more")
        self.size = size if entry is not None else 0
        self.entry = entry
        self.cwd = cwd
        self._spares: List[Spare] = []
        self._early_deaths = 0
        self._closed = False
        self._owner = threading.get_ident()

    @property
    def spares(self) -> List[Spare]:
        return list(self._spares)

    def replenish(self) -> None:
        """Start spares until ``size`` are alive (ready or still importing)."""
        if self._closed or self.entry is None:
            return
        if threading.get_ident() != self._owner:
            raise RuntimeError("SparePool.replenish: spawn spares from the thread that made the "
                               "pool (their death signal follows the spawning thread)")
        self.poll()
        while len(self._spares) < self.size:
            self._spares.append(self._spawn(self.entry))

    def _spawn(self, entry: Entry) -> Spare:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [entry.interpreter, *entry.flags, "-m", SPARE_MODULE, "--parent", str(os.getpid()),
               "--fd", str(theirs.fileno()), "--target", entry.target]
        if entry.module:
            cmd.append("--module")
        try:
            proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), cwd=self.cwd,
                                    start_new_session=True)
        finally:
            theirs.close()
        logger.info("ttprun: warm spare pid %d started (%s)", proc.pid, entry.target)
        return Spare(proc, _Lines(mine), time.monotonic())

    def poll(self) -> None:
        """Note spares that finished their imports; drop (and log) spares that died."""
        for spare in list(self._spares):
            if spare.proc.poll() is not None:
                logger.warning("ttprun: warm spare pid %d exited with %s before it was used",
                               spare.proc.pid, spare.proc.returncode)
                self._discard(spare)
                if not spare.ready:
                    self._early_deaths += 1
                    if self._early_deaths >= MAX_EARLY_DEATHS and self.size:
                        logger.warning(
                            "ttprun: %d warm spares died before they were ready (see their "
                            "output above): starting no more; replacements start cold",
                            self._early_deaths)
                        self.size = 0
                continue
            if spare.ready:
                continue
            try:
                message = spare.lines.read(0)
            except ValueError as exc:
                logger.warning("ttprun: warm spare pid %d: %s", spare.proc.pid, exc)
                self._discard(spare)
                continue
            if message is not None and message.get("ready"):
                spare.ready_at = time.monotonic()
                spare.preload_s = float(message.get("preload_s", 0.0))
                failed = message.get("failed") or []
                logger.info("ttprun: warm spare pid %d ready (imports took %.2f s%s)",
                            spare.proc.pid, spare.preload_s,
                            f"; not imported: {'; '.join(map(str, failed))}" if failed else "")

    def take(self) -> Optional[Spare]:
        """A spare for a rank, ready ones first (one still importing beats a cold start)."""
        self.poll()
        if not self._spares:
            return None
        spare = min(self._spares, key=lambda s: (not s.ready, s.spawned))
        self._spares.remove(spare)
        return spare

    def start(self, local_rank: int, env: Mapping[str, str], args: Sequence[str],
              stdout: Optional[str] = None,
              stderr: Optional[str] = None) -> Optional[subprocess.Popen]:
        """Give a spare the rank's worker: ``env`` its whole environment, ``args`` its command
        line as torch built it (interpreter first), ``stdout``/``stderr`` its log files (None:
        the launcher's). The spare's process, or None when there is no spare (start the
        worker cold then). A ``ReplacementStarter`` of ``launch/replace.py``."""
        if self.entry is None or not args:
            return None
        entry, script_args = Entry.parse(str(args[0]), [str(a) for a in args[1:]])
        if entry != self.entry:
            logger.warning("ttprun: local rank %d runs %s, not what the spares preloaded (%s): "
                           "no spare for it", local_rank, args, self.entry.target)
            return None
        while True:
            spare = self.take()
            if spare is None:
                return None
            try:
                _send(spare.lines.sock, {"env": dict(env), "args": script_args,
                                         "stdout": stdout, "stderr": stderr})
            except OSError as exc:  # it died just now: try the next one
                logger.warning("ttprun: warm spare pid %d lost (%s)", spare.proc.pid, exc)
                self._discard(spare)
                continue
            spare.lines.sock.close()
            logger.warning("ttprun: local rank %d replaced by warm spare pid %d (%s)",
                           local_rank, spare.proc.pid, "ready" if spare.ready else "importing")
            return spare.proc

    def _discard(self, spare: Spare) -> None:
        with contextlib.suppress(ValueError):
            self._spares.remove(spare)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(spare.proc.pid, signal.SIGKILL)
        spare.lines.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            spare.proc.wait(CLOSE_WAIT_S)

    def close(self) -> None:
        """Kill every idle spare (their process groups) and reap them; idempotent."""
        self._closed = True
        for spare in list(self._spares):
            self._discard(spare)


def pool_from_spec(size: int, entrypoint: object, args: Sequence[str]) -> SparePool:
    """The pool for a worker spec: empty when the workers are not Python entries."""
    entry = None
    if size > 0 and isinstance(entrypoint, str):
        entry, _ = Entry.parse(entrypoint, args)
        if entry is None:
            logger.warning("ttprun: warm spares need a Python script or module entry; this "
                           "job's workers run %s: starting none", entrypoint)
    return SparePool(size, entry)


if __name__ == "__main__":
    spare_main()
