"""The fire drill: one real fault, provoked on purpose in the user's own job (``ttprun --drill``).

``ttprun --drill kill:rank=5:iter=200`` kills rank 5 (SIGKILL) once its update of iteration 200
is done; ``hang`` stops it instead (SIGSTOP: its heartbeats stop, as a hung process's do);
``exception`` makes it raise from the training loop. ``rank=random`` (the default) picks one
rank, the same on every node: derived from the job's key, so each node's ttprun and workers
agree without talking. The rank fires right after ``ttp_end_updating_os(iteration)``: every
rank has then passed the guide's barrier of that iteration and no collective runs until the
parameter all-gather, so every survivor holds ``iteration`` too, and it is the newest
consistent one: what an in-memory recovery must continue from, and what a dying checkpoint
must hold. ttprun checks exactly that afterwards (launch/drill.py).

A drill is a user feature, not a test switch: nothing fires unless ttprun was given
``--drill``. ttprun hands the drill to its workers in ``TTP_DRILL`` together with its own
launch's run directory, and a worker arms it only when that is its ``TTP_RUN_DIR``: a
``TTP_DRILL`` left in a shell, or given to another launcher, does nothing. It fires once per
launch (a marker file in the run directory), so a replacement or a restarted attempt that
passes the same iteration again does not fire it a second time; both ttprun and the armed rank
say so, loudly, at start.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from mindio_ttp.config import ENV_DRILL

log = logging.getLogger("mindio_ttp")

ENV = ENV_DRILL
KINDS = ("kill", "hang", "exception")
FIRED_FILE = "drill-fired.json"  # in TTP_RUN_DIR, written by the rank as it fires
USAGE = ("--drill KIND[:rank=R|random][:iter=N]: KIND is kill (SIGKILL), hang (SIGSTOP) or "
         "exception (the training loop raises), e.g. kill:rank=5:iter=200")
_WHAT = {"kill": "killed (SIGKILL)", "hang": "stopped (SIGSTOP, a hang)",
         "exception": "made to raise an exception in its training loop"}


class DrillFault(RuntimeError):
    """What a rank raises in an ``exception`` drill."""


@dataclass(frozen=True)
class DrillSpec:
    kind: str
    rank: Optional[int]  # None: a random rank (random_rank)
    iteration: int

    @classmethod
    def parse(cls, text: str) -> DrillSpec:
        """From the command line; ValueError saying what is wrong and the form."""
        parts = [p.strip() for p in str(text).split(":") if p.strip()]
        if not parts or parts[0] not in KINDS:
            raise ValueError(f"{text!r}: the fault must be one of {', '.join(KINDS)}; {USAGE}")
        rank: Optional[int] = None
        iteration: Optional[int] = None
        for part in parts[1:]:
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"{text!r}: {part!r} is not name=value; {USAGE}")
            if name == "rank":
                if value != "random":
                    rank = _count(text, "rank", value, 0)
            elif name in ("iter", "iteration"):
                iteration = _count(text, "iter", value, 1)
            else:
                raise ValueError(f"{text!r}: unknown {name!r} (rank, iter); {USAGE}")
        if iteration is None:
            raise ValueError(f"{text!r}: say at which iteration (iter=N, after that "
                             f"iteration's update); {USAGE}")
        return cls(parts[0], rank, iteration)

    def text(self) -> str:
        rank = "random" if self.rank is None else str(self.rank)
        return f"{self.kind}:rank={rank}:iter={self.iteration}"

    def what(self) -> str:
        return _WHAT[self.kind]

    def to_env(self, run_dir: str) -> str:
        return json.dumps({"kind": self.kind, "rank": self.rank, "iteration": self.iteration,
                           "run_dir": run_dir}, sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> tuple:
        """(spec, the run directory it belongs to); ValueError when malformed."""
        try:
            obj = json.loads(text)
            spec = cls(str(obj["kind"]), None if obj["rank"] is None else int(obj["rank"]),
                       int(obj["iteration"]))
            run_dir = str(obj["run_dir"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{ENV} is not a drill ({exc})") from None
        if spec.kind not in KINDS or spec.iteration < 1 or (spec.rank or 0) < 0:
            raise ValueError(f"{ENV} is not a drill: {text[:200]!r}")
        return spec, run_dir


def _count(text: str, name: str, value: str, low: int) -> int:
    if not value.isdigit() or int(value) < low:
        raise ValueError(f"{text!r}: {name}={value!r} must be a whole number >= {low}; {USAGE}")
    return int(value)


def random_rank(key: bytes, world_size: int) -> int:
    """The rank a ``rank=random`` drill strikes: the same on every node of the job (all hold
    the key), different from job to job (ttprun makes a key per launch on one node)."""
    digest = hmac.new(key, f"ttp-drill|{world_size}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") % world_size


class ArmedDrill:
    """The drill on the rank it strikes; `at(iteration)` runs on every update (hooks.py)."""

    def __init__(self, spec: DrillSpec, rank: int, run_dir: str) -> None:
        self.spec, self.rank, self.run_dir = spec, rank, run_dir
        self._checked_start = False

    def at(self, iteration: int) -> None:
        spec = self.spec
        if not self._checked_start:
            self._checked_start = True
            if iteration > spec.iteration:
                _loud(f"DRILL: iteration {spec.iteration} has already passed (this run is at "
                      f"{iteration}): the drill will not fire")
                disarm()
                return
        if iteration != spec.iteration:
            return
        disarm()
        if not self._claim(iteration):
            return
        _loud(f"DRILL: rank {self.rank} is {spec.what()} now, after the update of iteration "
              f"{iteration} (ttprun --drill {spec.text()}): this fault is on purpose")
        if spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise DrillFault(f"DRILL: the exception of ttprun --drill {spec.text()} on rank "
                             f"{self.rank} after iteration {iteration}")

    def _claim(self, iteration: int) -> bool:
        """Once per launch: the marker ttprun reads for its verdict."""
        path = os.path.join(self.run_dir, FIRED_FILE)
        record = {"kind": self.spec.kind, "rank": self.rank, "iteration": iteration,
                  "pid": os.getpid(), "time": time.time()}
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            log.warning("DRILL: already fired in this launch (%s): not again", path)
            return False
        except OSError as exc:
            log.warning("DRILL: cannot record the drill in %s (%s): firing anyway", path, exc)
            return True
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        return True


ARMED: Optional[ArmedDrill] = None


def disarm() -> None:
    global ARMED
    ARMED = None
    from mindio_ttp import hooks

    hooks.DRILL = None


def arm(rank: int, world_size: int, key: bytes,
        env: Mapping[str, str] = os.environ) -> Optional[ArmedDrill]:
    """Arm the drill ttprun gave this launch, on the rank it strikes (None elsewhere)."""
    global ARMED
    text = env.get(ENV)
    if not text:
        return None
    try:
        spec, run_dir = DrillSpec.from_env(text)
    except ValueError as exc:
        log.error("%s; no drill", exc)
        return None
    if not run_dir or run_dir != env.get("TTP_RUN_DIR"):
        log.warning("%s is set but not by the ttprun that started this process: ignored (a "
                    "drill runs only with `ttprun --drill`)", ENV)
        return None
    if os.path.exists(os.path.join(run_dir, FIRED_FILE)):
        return None  # fired already in this launch (this is a replacement or a restart)
    target = spec.rank if spec.rank is not None else random_rank(key, world_size)
    if target >= world_size:
        if rank == 0:
            _loud(f"DRILL: rank {target} does not exist (world size {world_size}): no drill")
        return None
    if rank != target:
        return None
    ARMED = ArmedDrill(spec, rank, run_dir)
    from mindio_ttp import hooks

    hooks.DRILL = ARMED
    _loud(f"DRILL ARMED: this rank ({rank}) will be {spec.what()} after the update of "
          f"iteration {spec.iteration} (ttprun --drill {spec.text()}); a fire drill, not a "
          "failure")
    return ARMED


def _loud(text: str) -> None:
    """To the log, and to stderr when the log would not show it there (a higher
    TTP_LOG_LEVEL, or TTP_LOG_PATH): nobody may miss a drill."""
    log.warning("%s", text)
    if log.isEnabledFor(logging.WARNING) and not os.environ.get("TTP_LOG_PATH"):
        return
    try:
        print(f"mindio_ttp: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
