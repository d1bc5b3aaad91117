"""Replacing a lost rank's worker: the one entry point of the in-memory recovery in ttprun.

The controller decides (control/controller/recovery_plan.py) and asks a survivor on the lost rank's
host to
relay the request; that survivor writes it into its launcher's ``$TTP_RUN_DIR/replace/``
(private to the launcher and its workers: mkdtemp, mode 0700). The launcher (agent.py) serves
requests in its monitor loop with a `ReplacementDesk`: it kills what is left of the lost worker
(a hung or raising process still holds sockets the survivors wait on), then starts the
replacement with the worker's own command line and environment, pointed at the recovery's
store (``MASTER_ADDR``/``MASTER_PORT``) and told what it is (``TTP_RECOVERY_JOIN``), and swaps it
into torch's process context so torch monitors it like the worker it replaces. It answers in a
status file (started, exited, failed), which the relay forwards to the controller.

Starting is delegated to `ReplacementStarter`s, tried in order: warm spares first when the
launcher has them (launch/spares.py), then `cold_start`, a new process as torch starts workers.

Nothing here imports torch at module level: the relay (a worker's processor thread) only writes
requests and reads statuses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence

from mindio_ttp.launch.procstate import signal_worker

logger = logging.getLogger("ttprun")

REPLACE_DIR = "replace"
STARTED, EXITED, FAILED = "started", "exited", "failed"
MAX_FILE_BYTES = 64 * 1024
KILL_WAIT_S = 10.0


@dataclass(frozen=True)
class ReplacementRequest:
    """Start a replacement for global rank `rank` in recovery `recovery_id` with `env` added to
    the lost worker's environment."""

    recovery_id: int
    rank: int
    env: Dict[str, str]

    @property
    def name(self) -> str:
        return f"r{self.recovery_id}-rank{self.rank}"


@dataclass(frozen=True)
class ReplacementStatus:
    state: str  # STARTED, EXITED or FAILED
    pid: int = 0
    detail: str = ""
    time: float = 0.0


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: Path) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        obj = json.loads(data) if len(data) <= MAX_FILE_BYTES else None
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


# -- the relay's side (a worker) ------------------------------------------------------------------
def write_request(run_dir: str, request: ReplacementRequest) -> Path:
    """Hand `request` to this host's launcher (atomically: it never reads half a request)."""
    folder = Path(run_dir) / REPLACE_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{request.name}.json"
    _write_json(path, asdict(request))
    return path


def read_status(run_dir: str, recovery_id: int, rank: int) -> Optional[ReplacementStatus]:
    obj = _read_json(Path(run_dir) / REPLACE_DIR / f"r{recovery_id}-rank{rank}.status.json")
    if obj is None:
        return None
    try:
        return ReplacementStatus(str(obj["state"]), int(obj["pid"]), str(obj["detail"])[:2000],
                                 float(obj["time"]))
    except (KeyError, TypeError, ValueError):
        return None


# -- the launcher's side --------------------------------------------------------------------------
class ReplacementStarter(Protocol):
    """Starts the worker that replaces lost local rank `local_rank`: `env` is its whole
    environment, `args` its command line as torch built it for that rank (interpreter and
    script included), `stdout`/`stderr` its log files or None to inherit the launcher's. None:
    this starter has nothing to start it with (the next one is tried)."""

    def __call__(self, local_rank: int, env: Mapping[str, str], args: Sequence[str],
                 stdout: Optional[str], stderr: Optional[str]) -> Optional[subprocess.Popen]:
        ...


def cold_start(local_rank: int, env: Mapping[str, str], args: Sequence[str],
               stdout: Optional[str], stderr: Optional[str]) -> Optional[subprocess.Popen]:
    """A new process, as torch starts a worker: its own session (so killing its process group
    ends its children too), log files appended to, not truncated."""
    out = open(stdout, "a") if stdout else None  # noqa: SIM115 - owned by the handler
    err = open(stderr, "a") if stderr else None  # noqa: SIM115
    try:
        proc = subprocess.Popen(list(args), env=dict(env), stdout=out, stderr=err,
                                start_new_session=True)
    finally:
        for f in (out, err):
            if f is not None:
                f.close()  # the child holds its own descriptors
    return proc


class AdoptedHandler:
    """torch's SubprocessHandler for a worker torch did not spawn (a replacement, cold or a
    warm spare): what its SubprocessContext needs of a handler, `proc` and `close()`."""

    def __init__(self, proc: subprocess.Popen, local_rank: int) -> None:
        self.proc = proc
        self.local_rank_id = local_rank

    def close(self, death_sig: Optional[signal.Signals] = None) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL a worker with its process group (a hung process does not exit on anything
    else); torch 2.1's workers share the launcher's group: the worker alone there."""
    if proc.poll() is None:
        signal_worker(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(KILL_WAIT_S)


class ReplacementDesk:
    """Serves this launcher's replacement requests (call `serve` from its monitor loop).

    `foreign` takes a request for a rank this launcher does not run (a lost node's, for a
    spare node to take over: launch/takeover.py) and says whether it will see to it; without
    it, or when it will not, such a request fails at once."""

    def __init__(self, run_dir: Path, starters: Sequence[ReplacementStarter] = (cold_start,),
                 foreign: Optional[Callable[[ReplacementRequest], bool]] = None,
                 sibling: Optional[Callable[[int], Optional[Dict[str, Any]]]] = None):
        self.dir = Path(run_dir) / REPLACE_DIR
        self.starters = list(starters)
        self.foreign = foreign
        # another launcher of this job on this host that runs a rank (launch/siblings.py)
        self.sibling = sibling
        self._done: Dict[str, Optional[subprocess.Popen]] = {}  # request name -> its process
        self._exit_reported: set = set()
        self._forwarded: Dict[str, Path] = {}  # request name -> the sibling's request folder
        self._relayed: Dict[str, bytes] = {}  # request name -> the status last copied back

    def fresh(self) -> ReplacementDesk:
        """The desk for a restarted worker group: its recoveries are numbered from 1 again,
        so the previous attempt's requests and statuses go."""
        shutil.rmtree(self.dir, ignore_errors=True)
        return ReplacementDesk(self.dir.parent, self.starters, self.foreign, self.sibling)

    def serve(self, pcontext: Any, workers: Sequence[Any]) -> List[int]:
        """Start a replacement for every new request; report replacements that exited.
        Returns the local ranks replaced by this call."""
        replaced: List[int] = []
        if self.dir.is_dir():
            for path in sorted(self.dir.glob("r*-rank*.json")):
                if path.name.endswith(".status.json") or path.stem in self._done:
                    continue
                request = self._parse(path)
                if request is None:
                    continue
                local = self._start(request, pcontext, workers)
                if local is not None:
                    replaced.append(local)
        self._watch()
        return replaced

    def _parse(self, path: Path) -> Optional[ReplacementRequest]:
        obj = _read_json(path)
        try:
            assert obj is not None
            env = {str(k): str(v) for k, v in dict(obj["env"]).items()}
            request = ReplacementRequest(int(obj["recovery_id"]), int(obj["rank"]), env)
        except (AssertionError, KeyError, TypeError, ValueError):
            logger.error("ttprun: unreadable replacement request %s: ignored", path)
            self._done[path.stem] = None
            return None
        if request.name != path.stem:
            logger.error("ttprun: replacement request %s names %s: ignored", path, request.name)
            self._done[path.stem] = None
            return None
        return request

    def _status(self, request_name: str, status: ReplacementStatus) -> None:
        _write_json(self.dir / f"{request_name}.status.json", asdict(status))

    def answer(self, request: ReplacementRequest, state: str, detail: str) -> None:
        """The answer to a request handed to `foreign` (its replacement runs elsewhere)."""
        self._status(request.name, ReplacementStatus(state, 0, detail, time.time()))

    def _start(self, request: ReplacementRequest, pcontext: Any,
               workers: Sequence[Any]) -> Optional[int]:
        name = request.name
        self._done[name] = None
        local = next((i for i, w in enumerate(workers) if w.global_rank == request.rank), None)
        if local is None and self.foreign is not None and self.foreign(request):
            return None
        if local is None and self._forward(request):
            return None
        if local is None:
            self._status(name, ReplacementStatus(FAILED, 0, f"rank {request.rank} is not a "
                                                 "worker of this launcher, nor of another "
                                                 "ttprun of this job on this host",
                                                 time.time()))
            return None
        old = pcontext.subprocess_handlers[local]
        _kill(old.proc)  # a hung or raising worker: its sockets hold the survivors up
        # the launcher's environment, then torch's per-rank variables, as torch starts workers
        env = {**os.environ, **pcontext.envs[local], **request.env}
        args = [pcontext.entrypoint, *[str(a) for a in pcontext.args[local]]]
        stdout, stderr = pcontext.stdouts.get(local), pcontext.stderrs.get(local)
        proc, why = None, "no starter"
        for starter in self.starters:
            try:
                proc = starter(local, env, args, stdout or None, stderr or None)
            except OSError as exc:
                why = f"{getattr(starter, '__name__', starter)}: {exc}"
                continue
            if proc is not None:
                break
        if proc is None:
            logger.error("ttprun: could not start a replacement for rank %d: %s",
                         request.rank, why)
            self._status(name, ReplacementStatus(FAILED, 0, why, time.time()))
            return None
        pcontext.subprocess_handlers[local] = AdoptedHandler(proc, local)
        failures = getattr(pcontext, "_failures", None)
        if failures is not None:
            failures.pop(local, None)
        running = getattr(pcontext, "_running_local_ranks", None)
        if running is not None:
            running.add(local)
        workers[local].id = proc.pid
        self._done[name] = proc
        logger.warning("ttprun: rank %d (local %d) replaced by pid %d for recovery %d",
                       request.rank, local, proc.pid, request.recovery_id)
        self._status(name, ReplacementStatus(STARTED, proc.pid, "", time.time()))
        return local

    def _forward(self, request: ReplacementRequest) -> bool:
        """Hand `request` to the sibling launcher that runs its rank; its answers are copied
        back by `_watch`. False when no sibling runs it."""
        owner = self.sibling(request.rank) if self.sibling is not None else None
        if owner is None:
            return False
        try:
            write_request(owner["run_dir"], request)
        except OSError as exc:
            logger.error("ttprun: cannot hand the replacement of rank %d to ttprun pid %s "
                         "(%s)", request.rank, owner["pid"], exc)
            return False
        self._forwarded[request.name] = Path(owner["run_dir"]) / REPLACE_DIR
        logger.warning("ttprun: rank %d is run by another ttprun of this job on this host (pid "
                       "%s): its replacement for recovery %d is asked of it", request.rank,
                       owner["pid"], request.recovery_id)
        return True

    def _watch(self) -> None:
        """Tell the relay when a replacement dies before or during its recovery."""
        for name, folder in self._forwarded.items():  # a sibling's answers, copied back
            try:
                data = (folder / f"{name}.status.json").read_bytes()[:MAX_FILE_BYTES]
            except OSError:
                continue
            if data != self._relayed.get(name):
                self._relayed[name] = data
                tmp = self.dir / f".{name}.status.json.{os.getpid()}.tmp"
                try:
                    tmp.write_bytes(data)
                    os.replace(tmp, self.dir / f"{name}.status.json")
                except OSError:
                    continue
        for name, proc in self._done.items():
            if proc is None or name in self._exit_reported:
                continue
            code = proc.poll()
            if code is not None:
                self._exit_reported.add(name)
                how = (f"killed by {signal.Signals(-code).name}" if code < 0
                       else f"exit code {code}")
                self._status(name, ReplacementStatus(EXITED, proc.pid, how, time.time()))
