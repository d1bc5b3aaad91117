"""``$TTP_RUN_DIR/flow-finished.json``: what a rank's exit path records about the flow.

Every rank that obeys an exit order writes it (atomically; the last writer wins, and all of them
write the same decision), and ``ttprun`` reads it to end its grace period and to say in words
what happened. The file crosses a process boundary and may be damaged or left by another
version, so the reader checks one exact schema and names the first field that is wrong instead
of printing a guess. The writer never validates: an exit path must not raise.

``checkpoint`` is where the saved checkpoint is (``None`` when nothing was saved, or the rename
handler gives no ``checkpoint_location``); ``latest`` the iteration the checkpoint directory's
``latest`` names after the flow (the rename handler's optional ``latest_iteration()``): a dying
checkpoint older than it is kept but not marked latest. Files written before either existed
lack the key.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from mindio_ttp.config import FLOW_FINISHED_FILE, Outcome

log = logging.getLogger("mindio_ttp.processor")

MAX_FLOW_FILE_BYTES = 64 * 1024  # a real record is a few hundred bytes (reason <= 2000 chars)

_FIELDS = ("outcome", "step", "ranks", "exit_code", "reason", "rank", "time", "checkpoint",
           "latest")
_OPTIONAL = ("checkpoint", "latest")


class FlowRecordError(ValueError):
    """flow-finished.json is not a record this version can read; the message says why."""


@dataclass(frozen=True)
class FlowRecord:
    """The flow's decision as one rank saw it when it was told to exit."""

    outcome: Outcome
    step: Optional[int]
    ranks: Tuple[int, ...]
    exit_code: int
    reason: str
    rank: int
    time: float
    checkpoint: Optional[str] = None
    latest: Optional[int] = None

    @property
    def marked_latest(self) -> bool:
        """The saved checkpoint is the one a rerun loads (unknown counts as yes: older
        runtimes and rename handlers without `latest_iteration` always marked it)."""
        return self.latest is None or self.latest == self.step

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["outcome"] = Outcome(self.outcome).value
        out["ranks"] = list(self.ranks)
        return out

    @classmethod
    def from_dict(cls, obj: Any) -> FlowRecord:
        """Check every field (raises FlowRecordError naming the first bad one)."""
        if not isinstance(obj, dict):
            raise FlowRecordError(f"holds a JSON {type(obj).__name__}, not an object")
        unknown = sorted(set(obj) - set(_FIELDS))
        missing = [f for f in _FIELDS if f not in obj and f not in _OPTIONAL]
        if unknown or missing:
            raise FlowRecordError(f"has keys {sorted(obj)}; expected {list(_FIELDS)}")
        try:
            outcome = Outcome(obj["outcome"])
        except ValueError:
            raise FlowRecordError(f"outcome {obj['outcome']!r} is not one of "
                                  f"{[o.value for o in Outcome]}") from None
        step = obj["step"]
        if not (step is None or _count(step)):
            raise FlowRecordError(f"step {step!r} is not null or a count")
        if outcome is Outcome.SAVED and step is None:
            raise FlowRecordError("outcome is saved but step is null")
        ranks = obj["ranks"]
        if not isinstance(ranks, list) or not all(_count(r) for r in ranks):
            raise FlowRecordError(f"ranks {ranks!r} is not a list of ranks")
        for name in ("exit_code", "rank"):
            if not _count(obj[name]):
                raise FlowRecordError(f"{name} {obj[name]!r} is not a count")
        if not isinstance(obj["reason"], str):
            raise FlowRecordError(f"reason {obj['reason']!r} is not a string")
        when = obj["time"]
        if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
            raise FlowRecordError(f"time {when!r} is not a number")
        checkpoint = obj.get("checkpoint")
        if checkpoint is not None and not _printable_path(checkpoint):
            raise FlowRecordError(f"checkpoint {checkpoint!r} is not a printable path")
        latest = obj.get("latest")
        if not (latest is None or _count(latest)):
            raise FlowRecordError(f"latest {latest!r} is not null or a count")
        return cls(outcome, step, tuple(ranks), obj["exit_code"], obj["reason"], obj["rank"],
                   float(when), checkpoint, latest)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _printable_path(value: Any) -> bool:
    """A non-empty one-line string: it is printed in ttprun's outcome lines."""
    return isinstance(value, str) and bool(value) and value.isprintable()


def read_flow_record(path: Path) -> FlowRecord:
    """Read and check the file (OSError when it cannot be read, FlowRecordError when invalid)."""
    with open(path, "rb") as f:
        data = f.read(MAX_FLOW_FILE_BYTES + 1)
    if len(data) > MAX_FLOW_FILE_BYTES:
        raise FlowRecordError(f"is larger than {MAX_FLOW_FILE_BYTES} bytes")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FlowRecordError(f"is not JSON ({exc})") from None
    return FlowRecord.from_dict(obj)


def write_flow_record(run_dir: str, record: FlowRecord) -> None:
    """Atomically write $TTP_RUN_DIR/flow-finished.json (the launcher polls for it). Never
    raises: the exit path calls it."""
    payload = record.to_dict()
    try:
        os.makedirs(run_dir, exist_ok=True)
        tmp = os.path.join(run_dir, f".{FLOW_FINISHED_FILE}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(run_dir, FLOW_FINISHED_FILE))
    except OSError as exc:
        log.error("cannot write %s in %s: %s", FLOW_FINISHED_FILE, run_dir, exc)
