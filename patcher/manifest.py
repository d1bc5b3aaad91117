"""The record of an apply, kept in the checkout's git directory so `git status` never shows it.

It is a claim to check, not a truth to trust: revert compares it with live file hashes, and a
record whose files went back to HEAD behind our back (git checkout) is reported as stale. It is
read like hostile input: bounded, never through a symlink, every field checked, and any defect
is one ManifestError (never a traceback), which `revert --force` steps over.
"""

from __future__ import annotations

import errno
import importlib.metadata
import json
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from . import __version__
from .edits import TARGET_FILES
from .errors import ManifestError
from .options import PORT_RANGE, Device, Options

MANIFEST_NAME = "ttp-patch.json"
SCHEMA = 1
MAX_BYTES = 1 << 20  # a real record is about 1 KiB; the cap bounds what a hostile one costs
PORTS = PORT_RANGE  # what apply accepts, so a record with another port was not written by us
_SHA = r"[0-9a-f]{64}"


@dataclass
class FileRecord:
    before: str  # sha256 of the HEAD blob
    after: str  # sha256 of what apply wrote


@dataclass
class Manifest:
    commit: str
    device: str
    port: int
    files: Dict[str, FileRecord] = field(default_factory=dict)
    launch_script: Optional[str] = None  # sha256 of pretrain_gpt_ttp.sh as written
    tool_version: str = __version__
    libcst_version: str = field(default_factory=lambda: _dist_version("libcst"))
    schema: int = SCHEMA

    @property
    def options(self) -> Options:
        return Options(device=Device(self.device), port=self.port)

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "unknown"


def manifest_path(git_dir: Path) -> Path:
    return git_dir / MANIFEST_NAME


def read_bytes(path: Path) -> Optional[bytes]:
    """The record's bytes, None when absent; never follows a link, never reads past the cap."""
    hint = _hint(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ManifestError(f"{path} is a symlink, not a record we wrote", hint) from None
        raise ManifestError(f"{path} cannot be read: {exc.strerror}", hint) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # checked before fdopen, which raises for a directory
        os.close(fd)
        if stat.S_ISDIR(mode) and any(os.scandir(path)):
            hint = f"it holds files ttp-patch did not write: look, then `rm -r {path}`"
        raise ManifestError(f"{path} is not a regular file: not a record we wrote", hint)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ManifestError(f"{path} is over {MAX_BYTES} bytes: not a record ttp-patch wrote", hint)
    return data


def clear_unreadable(path: Path) -> bool:
    """For `revert --force`: take away a record that is not a file or a link (a FIFO, a socket,
    an empty directory), which the journaled write cannot snapshot; True when one was removed.
    A directory with something in it is refused, so nobody's files go with it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return False  # the journaled write removes (and can restore) these
    if stat.S_ISDIR(mode):
        try:
            os.rmdir(path)
        except OSError:
            raise ManifestError(
                f"{path} is a directory with files in it, not a record ttp-patch wrote",
                f"look, then `rm -r {path}`, and run `ttp-patch revert --force` again",
            ) from None
    else:
        os.unlink(path)  # a FIFO or socket holds no bytes to lose
    return True


def _hint(path: Path) -> str:
    return f"remove it with `ttp-patch revert --force` (or delete {path}) and apply again"


def _text(raw: Dict[str, Any], key: str, pattern: Optional[str] = None) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or (pattern and not re.fullmatch(pattern, value)):
        raise ValueError(f"{key} is {value!r}")
    return value


def parse(data: bytes, path: Path) -> Manifest:
    """A Manifest or ManifestError: every field is type- and range-checked, nothing else escapes."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{path} is corrupt: {str(exc)[:200]}", _hint(path)) from None
    try:
        if not isinstance(raw, dict):
            raise ValueError(f"the record is a JSON {type(raw).__name__}, not an object")
        if raw.get("schema") != SCHEMA or isinstance(raw.get("schema"), bool):
            raise ValueError(f"schema {raw.get('schema')!r}, this tool reads {SCHEMA}")
        port = raw.get("port")
        if isinstance(port, bool) or not isinstance(port, int) or not PORTS[0] <= port <= PORTS[1]:
            raise ValueError(f"port {port!r} is not an integer in {PORTS[0]}..{PORTS[1]}")
        files_raw = raw.get("files")
        if not isinstance(files_raw, dict):
            raise ValueError(f"files is {type(files_raw).__name__}, not an object")
        files = {}
        for k, v in files_raw.items():
            if k not in TARGET_FILES or not isinstance(v, dict):
                raise ValueError(f"files has an entry {k!r} that is not a target")
            files[k] = FileRecord(before=_text(v, "before", _SHA), after=_text(v, "after", _SHA))
        script = raw.get("launch_script")
        man = Manifest(
            commit=_text(raw, "commit", r"[0-9a-f]{40}"),
            device=Device(_text(raw, "device")).value,
            port=port,
            files=files,
            launch_script=None if script is None else _text(raw, "launch_script", _SHA),
            tool_version=_text(raw, "tool_version", r".{0,100}"),
            libcst_version=_text(raw, "libcst_version", r".{0,100}"),
        )
    except ValueError as exc:
        raise ManifestError(f"{path} is corrupt: {str(exc)[:200]}", _hint(path)) from None
    return man


def load(git_dir: Path) -> Optional[Manifest]:
    path = manifest_path(git_dir)
    data = read_bytes(path)
    return None if data is None else parse(data, path)
