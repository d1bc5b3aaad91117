"""The per-fault claim: at most one dying checkpoint per fault, even when the job is split.

A network partition can leave two controllers (the primary and a promoted standby) each
serving half of the ranks, each able to save a consistent checkpoint; neither can tell a dead
half from an unreachable one. What both halves still share is the checkpoint directory (a
checkpoint that spans nodes needs a shared file system anyway), so before its first save order
a controller claims the fault there: `O_CREAT | O_EXCL` of ``.ttp-claims/fault-<id>.json``,
content fsynced, directory fsynced. Exactly one create succeeds; the other flow refuses.

The fault id is one random token per launch. The primary controller makes it when it starts and
hands it to every rank in its RegisterAck, over the authenticated channel; every rank registers
with the primary before it trains, so every rank, and every standby controller a rank hosts,
holds the same id, on both sides of any later partition. Nobody without the job key can choose
it (torch's rendezvous store, which carried it before, is writable by anyone on the network: an
outsider who wrote the id first could aim it at a finished claim and turn the next fault into
`not_claimed`), and it names a file only after `check_fault_id` accepted it.

A claimant holds an exclusive `flock` on its claim file until its process exits. If the
claimant dies mid-flow (e.g. the controller's rank is killed during the save), the kernel (or
the network file system's lock manager) drops that lock, and a later flow of the same fault may
take the claim over, but only while the claim records that no rename was ever ordered: after a
rename order a checkpoint may exist, so the claim is final. A claim whose lock is held belongs
to a live flow (the other half of a partition): never taken over.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from mindio_ttp.faulttime.durable import fsync_dir

log = logging.getLogger("mindio_ttp.controller")

CLAIM_DIR = ".ttp-claims"
MAX_CLAIM_BYTES = 64 * 1024
# states a claim records; only a CLAIMED (no rename ordered yet) claim can be taken over
CLAIMED, RENAMING, DONE = "claimed", "renaming", "done"
_FAULT_ID = re.compile("[0-9a-f]{32}")


def check_fault_id(fault_id: object) -> str:
    """`fault_id` if it is what `new_fault_id` makes (32 lowercase hex digits), else ValueError:
    it becomes part of a file name."""
    if not isinstance(fault_id, str) or not _FAULT_ID.fullmatch(fault_id):
        raise ValueError(f"fault id {str(fault_id)[:80]!r} is not 32 lowercase hex digits "
                         "(the primary controller hands every rank the launch's id when it "
                         "registers)")
    return fault_id


@dataclass(frozen=True)
class ClaimSpace:
    """Where this launch's faults are claimed: the checkpoint directory and the launch's id."""

    directory: Path  # <checkpoint dir>/.ttp-claims
    fault_id: str

    def __post_init__(self) -> None:
        check_fault_id(self.fault_id)

    @property
    def path(self) -> Path:
        return self.directory / f"fault-{self.fault_id}.json"


class Claim:
    """A won claim: the open, flock'ed file. Kept open until the process exits."""

    def __init__(self, space: ClaimSpace, fd: int, record: dict) -> None:
        self.space, self._fd, self.record = space, fd, record

    def update(self, state: str, **info: object) -> None:
        """Rewrite the record durably (fsync before returning): RENAMING must be on disk before
        the rename order leaves, or a successor could take over a claim whose flow renamed."""
        self.record = dict(self.record, state=state, updated=time.time(), **info)
        _write_record(self._fd, self.record)


_directory: Optional[Path] = None


def register(directory: os.PathLike) -> Path:
    """Make `directory`/.ttp-claims (a clear error now, not at the fault, if it cannot be);
    this process's controllers claim faults there."""
    global _directory
    root = Path(directory)
    claims = root / CLAIM_DIR
    try:
        claims.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"checkpoint directory {root}: cannot create {CLAIM_DIR}/ in it "
                         f"({exc.strerror}): pass a writable directory shared by every node") \
            from None
    if not os.access(claims, os.W_OK | os.X_OK):
        raise ValueError(f"{claims} is not writable: the controller claims each fault there")
    _directory = claims
    return claims


def registered(fault_id: Optional[str]) -> Optional[ClaimSpace]:
    """Where a controller claims the launch's fault `fault_id`: None without a registered
    directory; ValueError when there is one but `fault_id` is not a valid id."""
    return None if _directory is None else ClaimSpace(_directory, check_fault_id(fault_id))


def registered_directory() -> Optional[Path]:
    return _directory


def reset() -> None:
    global _directory
    _directory = None


def new_fault_id() -> str:
    return secrets.token_hex(16)


def _write_record(fd: int, record: dict) -> None:
    data = json.dumps(record, sort_keys=True).encode()
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def _holder(record: dict) -> str:
    return (f"{record.get('holder', '?')} (host {record.get('host', '?')}, pid "
            f"{record.get('pid', '?')}, state {record.get('state', '?')})")


def acquire(space: ClaimSpace, holder: str, **info: object) -> Tuple[Optional[Claim], str]:
    """Claim this launch's fault for `holder`; (Claim, why) when won, (None, why) when refused.

    Never raises for a lost race: the reason says who holds the claim, so the refusing flow can
    tell its ranks why they saved nothing."""
    record = {"fault": space.fault_id, "holder": holder, "host": socket.gethostname(),
              "pid": os.getpid(), "state": CLAIMED, "claimed": time.time(), "generation": 1,
              **info}
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(space.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return _take_over(space, record, flags)
    except OSError as exc:
        return None, f"cannot create the claim {space.path}: {exc.strerror}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fresh file: nobody else can hold it
    except OSError as exc:  # e.g. a file system without locks: the claim stands, no takeover
        log.warning("claim %s: flock failed (%s): a successor cannot take it over", space.path,
                    exc)
    try:
        _write_record(fd, record)
        fsync_dir(space.directory)
    except OSError as exc:  # the file exists, so the claim is ours even if its text is short
        log.error("claim %s: created but not fully written (%s)", space.path, exc)
    return Claim(space, fd, record), f"claimed fault {space.fault_id} in {space.path}"


def _take_over(space: ClaimSpace, record: dict,
               flags: int) -> Tuple[Optional[Claim], str]:
    try:
        fd = os.open(space.path, flags)
    except OSError as exc:
        return None, f"fault {space.fault_id} is already claimed ({space.path}: {exc.strerror})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        held = _read(space.path)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            who = _holder(held) if held else "a flow that is still writing its claim"
            return None, f"fault {space.fault_id} is claimed by a live flow: {who}"
        return None, f"fault {space.fault_id} is claimed ({space.path}; lock failed: {exc})"
    old = _read(space.path)
    if not old or old.get("state") != CLAIMED:
        os.close(fd)
        why = _holder(old) if old else "an unreadable or empty claim"
        return None, (f"fault {space.fault_id} was claimed by {why}, which may have renamed a "
                      "checkpoint: not taking it over")
    record["generation"] = int(old.get("generation", 1)) + 1 if \
        isinstance(old.get("generation"), int) else 2
    record["took_over_from"] = _holder(old)
    _write_record(fd, record)
    fsync_dir(space.directory)
    log.warning("claim %s: taken over from %s (its lock was free: that flow ended before any "
                "rename order)", space.path, _holder(old))
    return Claim(space, fd, record), (f"took over the claim of fault {space.fault_id} from "
                                      f"{_holder(old)}")


def _read(path: Path) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CLAIM_BYTES + 1)
        obj = json.loads(data) if len(data) <= MAX_CLAIM_BYTES else None
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
