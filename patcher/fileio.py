"""Writes a set of files all-or-nothing: temp file beside each target, fsync, os.replace.

A rename is atomic per file, never across files, so on any failure every file already
replaced is put back from the bytes read before writing (or removed, if it was new). Against
what no `except` can catch (SIGKILL, power loss) the caller passes a journal, written before
the first replace, from which the next command rolls back (patcher/journal.py). SIGINT and
SIGTERM are deferred while files are replaced and acted on between two files: roll back, then
raise Interrupted. They are deferred with Python-level handlers that only record the signal, not
with a signal mask: a mask is per thread, and a process-directed signal goes to any thread that
does not block it, so in a process with other threads (a host program, pytest with torch loaded)
a mask lets the signal through as KeyboardInterrupt in the middle of a write.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple

from .errors import (
    Interrupted,
    ModifiedTarget,
    PatchError,
    ReadOnlyTarget,
    UnsafeTarget,
    WriteFailed,
)

TEMP_SUFFIX = ".ttp-tmp"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Journal(Protocol):
    """What a write needs of the journal (journal.py, which builds on this module): a record of
    the originals before the first replace, dropped once every file is written or restored."""

    def begin(self, entries: Sequence[Tuple[Path, Snapshot, Optional[bytes]]]) -> None: ...

    def end(self) -> None: ...


@dataclass(frozen=True)
class Change:
    """`new` None means delete. `mode` applies to files we create; existing files keep theirs."""

    path: Path
    new: Optional[bytes]
    mode: int = 0o644


def check_writable(path: Path, shown: str) -> None:
    """Refuse files the user made read-only, even when we run as root and could replace them."""
    if path.exists():
        mode = path.stat().st_mode
        if not mode & stat.S_IWUSR or not os.access(path, os.W_OK):
            raise ReadOnlyTarget(
                f"{shown} is read-only (mode {stat.S_IMODE(mode):04o})",
                f"make it writable (`chmod u+w {shown}`) if it may be patched, then run again",
            )
    parent = path.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ReadOnlyTarget(
            f"{shown}: its directory is not writable", "fix the directory's permissions"
        )


@dataclass(frozen=True)
class Snapshot:
    """What is at a path, without following a final symlink: enough to put it back exactly."""

    kind: str  # "absent", "file" or "symlink"
    data: bytes = b""  # the file's bytes, or the link's target
    mode: int = 0o644

    @property
    def content(self) -> Optional[bytes]:
        """The bytes a reader sees at the path, None when there is no regular file."""
        return self.data if self.kind == "file" else None


def snapshot(path: Path) -> Snapshot:
    """Refuse anything that is neither a regular file, a symlink, nor absent (a directory...)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Snapshot("absent")
    if stat.S_ISLNK(st.st_mode):
        return Snapshot("symlink", os.fsencode(os.readlink(path)))
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeTarget(
            f"{path} is not a regular file ({_kind(st.st_mode)})",
            "move it away; ttp-patch only replaces regular files",
        )
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return Snapshot("file", f.read(), stat.S_IMODE(os.fstat(f.fileno()).st_mode))


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


def check_inside(path: Path, roots: Sequence[Path]) -> None:
    """The real directory of every write is one of ours: no symlinked parent can redirect it."""
    real = Path(os.path.realpath(path.parent))
    if not any(real == r or real.is_relative_to(r) for r in (x.resolve() for x in roots)):
        raise UnsafeTarget(
            f"{path} resolves to {real / path.name}, outside the work tree",
            "a directory on the way is a symlink: replace it with the real directory",
        )


def _replace_file(tmp: str, target: Path) -> None:
    """The one rename; a seam the tests use to fail a write half-way."""
    os.replace(tmp, target)


def temp_file(path: Path) -> Tuple[int, str]:
    """A new temp file beside `path`, named so every command can find and remove strays."""
    return tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)


def _write_one(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        _replace_file(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def restore(path: Path, old: Snapshot) -> None:
    """Put back exactly what `snapshot` saw (a file with its mode, a link, or nothing)."""
    if old.kind == "file":
        _write_one(path, old.data, old.mode)
    elif old.kind == "symlink":
        tmp = f"{path.parent}/.{path.name}.{os.getpid()}.link{TEMP_SUFFIX}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.symlink(os.fsdecode(old.data), tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    elif os.path.lexists(path):
        os.unlink(path)
        fsync_dir(path.parent)


def _apply(change: Change, old: Snapshot) -> None:
    """One file of the write phase (a seam: the safety tests stretch the phase here)."""
    if change.new is None:
        restore(change.path, Snapshot("absent"))
    else:
        _write_one(change.path, change.new, old.mode if old.kind == "file" else change.mode)


class _Deferred:
    """The SIGINT/SIGTERM that arrived during the write phase, in arrival order."""

    def __init__(self) -> None:
        self.caught: List[int] = []

    def pending(self) -> Optional[int]:
        return self.caught[0] if self.caught else None

    def consume(self) -> None:
        self.caught.clear()


_RUN = {"committed": False}  # did this command's write phase reach its commit point?


def reset_committed() -> None:
    _RUN["committed"] = False


def committed() -> bool:
    """True once a write_all of this command completed: a signal after it must not claim that
    nothing was written."""
    return _RUN["committed"]


@contextlib.contextmanager
def _deferred_signals() -> Iterator[_Deferred]:
    """Record SIGINT/SIGTERM instead of acting on them, until the block ends.

    Python runs signal handlers in the main thread only, whichever thread the kernel picked,
    so recording handlers defer the signal for the whole process. Called from another thread,
    the signal cannot interrupt this thread at all (it raises in the main thread), so nothing
    needs installing.
    """
    box = _Deferred()
    if threading.current_thread() is not threading.main_thread():
        yield box
        return

    def record(signum: int, _frame: object) -> None:
        box.caught.append(signum)

    old = {s: signal.signal(s, record) for s in _SIGNALS}
    try:
        yield box
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _changed(change: Change, shown: str) -> ModifiedTarget:
    return ModifiedTarget(
        f"{shown} changed while ttp-patch was running",
        [shown],
        "something else is writing the checkout: let it finish, then run again",
    )


def write_all(
    changes: Sequence[Change],
    journal: Optional[Journal] = None,
    expected: Optional[Mapping[Path, Optional[bytes]]] = None,
    inside: Sequence[Path] = (),
) -> None:
    """Apply every change or none; raise WriteFailed (or Interrupted) after rolling back.

    `expected` holds what preflight read per path; a file that differs now, or right before its
    replace, was changed under us and is refused. `inside` bounds where writes may land.
    """
    originals: List[Tuple[Change, Snapshot]] = []
    for ch in changes:
        if inside:
            check_inside(ch.path, inside)
        old = snapshot(ch.path)
        if old.kind == "symlink" and ch.new is not None:
            raise UnsafeTarget(f"{ch.path} is a symlink", "replace it with a regular file")
        if expected is not None and ch.path in expected and expected[ch.path] != old.content:
            raise _changed(ch, str(ch.path))
        originals.append((ch, old))
    if journal is not None:
        journal.begin([(ch.path, old, ch.new) for ch, old in originals])
    done: List[Tuple[Change, Snapshot]] = []
    caught: Optional[int] = None
    failing: Optional[Path] = None
    with _deferred_signals() as deferred:
        try:
            for entry in originals:
                caught = deferred.pending()
                if caught is not None:
                    raise Interrupted(caught, "interrupted")
                ch, old = entry
                failing = ch.path
                if snapshot(ch.path) != old:
                    raise _changed(ch, str(ch.path))
                _apply(ch, old)
                done.append(entry)
            caught = deferred.pending()  # the last chance to cancel: before the commit point
            if caught is not None:
                raise Interrupted(caught, "interrupted")
            if journal is not None:
                journal.end()
            _RUN["committed"] = True
        except BaseException as exc:
            _roll_back(done, journal, exc, failing)
        caught = deferred.pending()
    if caught is not None:
        raise Interrupted(
            caught,
            f"interrupted by {signal.Signals(caught).name} after the last file was written: "
            "the command completed",
        )


def _roll_back(
    done: Sequence[Tuple[Change, Snapshot]],
    journal: Optional[Journal],
    exc: BaseException,
    failing: Optional[Path],
) -> None:
    problems = []
    for ch, old in reversed(done):
        try:
            restore(ch.path, old)
        except Exception as undo_exc:  # pragma: no cover - disk gone bad during rollback
            problems.append(f"{ch.path}: {undo_exc}")
    if journal is not None and not problems:
        journal.end()  # else keep it: the next command retries the rollback
    restored = f"the {len(done)} file(s) written before were restored"
    if problems:  # pragma: no cover
        restored += "; could NOT restore: " + "; ".join(problems)
    if isinstance(exc, Interrupted):
        signum = exc.exit_code - 128
        raise Interrupted(
            signum,
            f"interrupted by {signal.Signals(signum).name}: nothing changed ({restored})",
        ) from None
    if isinstance(exc, PatchError):
        exc.message += f" ({restored})"
        raise exc
    raise WriteFailed(
        f"writing {failing} failed ({exc}); {restored}",
        "fix the cause (disk full? permissions?) and run again",
    ) from exc
