"""The record of an apply, kept in the checkout's git directory so `git status` never shows it.

It is a claim to check, not a truth to trust: revert compares it with live file hashes, and a
record whose files went back to HEAD behind our back (git checkout) is reported as stale.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Optional

from . import __version__
from .errors import ManifestError
from .options import Device, Options

MANIFEST_NAME = "ttp-patch.json"
SCHEMA = 1


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


def load(git_dir: Path) -> Optional[Manifest]:
    path = manifest_path(git_dir)
    if not path.exists():
        return None
    hint = f"remove it with `ttp-patch revert --force` (or delete {path}) and apply again"
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path} is corrupt: {exc}", hint) from None
    try:
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"schema {raw.get('schema')!r}, this tool reads {SCHEMA}")
        files = {
            str(k): FileRecord(before=str(v["before"]), after=str(v["after"]))
            for k, v in raw["files"].items()
        }
        man = Manifest(
            commit=str(raw["commit"]),
            device=Device(raw["device"]).value,
            port=int(raw["port"]),
            files=files,
            launch_script=raw.get("launch_script"),
            tool_version=str(raw.get("tool_version", "?")),
            libcst_version=str(raw.get("libcst_version", "?")),
        )
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{path} is corrupt: {exc!r}", hint) from None
    return man
