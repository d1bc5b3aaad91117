"""One opened Megatron checkout: its HEAD blobs, current files, manifest, and planned outputs.

Plans are always computed from the HEAD blobs (never from the files on disk), so "our patched
state" is one deterministic byte string per file and option set.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from . import launch_script, manifest
from .diffs import FileDiff
from .edits import TARGET_FILES
from .engine import FilePlan, plan_file
from .errors import MissingTarget
from .options import DEFAULT_PORT, Device, Options
from .repo import Checkout, open_checkout


@dataclass
class Tree:
    checkout: Checkout
    _manifest: Optional[manifest.Manifest] = None
    _manifest_loaded: bool = False
    _plans: Dict[Tuple[Optional[Device], Optional[int]], Dict[str, FilePlan]] = field(
        default_factory=dict
    )
    _head: Dict[str, bytes] = field(default_factory=dict)

    @classmethod
    def open(cls, directory: str) -> Tree:
        return cls(open_checkout(directory))

    def close(self) -> None:
        self.checkout.close()

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def root(self) -> Path:
        return self.checkout.root

    @property
    def manifest_path(self) -> Path:
        return manifest.manifest_path(self.checkout.git_dir)

    def manifest(self) -> Optional[manifest.Manifest]:
        """The recorded apply; raises ManifestError when the record is corrupt."""
        if not self._manifest_loaded:
            self._manifest = manifest.load(self.checkout.git_dir)
            self._manifest_loaded = True
        return self._manifest

    def head(self, path: str) -> bytes:
        if path not in self._head:
            self._head[path] = self.checkout.require_head_blob(path)
        return self._head[path]

    def path(self, rel: str) -> Path:
        return self.root / rel

    def current(self, rel: str) -> Optional[bytes]:
        p = self.path(rel)
        return p.read_bytes() if p.is_file() else None

    def require_current(self, rel: str) -> bytes:
        data = self.current(rel)
        if data is None:
            raise MissingTarget(
                f"{rel} is missing from the work tree", f"restore it: git checkout -- {rel}"
            )
        return data

    def plans(self, opts: Options) -> Dict[str, FilePlan]:
        """Every target's patched bytes for `opts`, from HEAD; raises AnchorError on a bad HEAD."""
        key = (opts.device, opts.port)
        if key not in self._plans:
            self._plans[key] = {p: plan_file(p, self.head(p), opts) for p in TARGET_FILES}
        return self._plans[key]

    def script(self, device: Device) -> bytes:
        return launch_script.build(self.head(launch_script.EXAMPLE), device)

    def diffs(self, opts: Options) -> List[FileDiff]:
        assert opts.device is not None
        out = [FileDiff(p, plan.before, plan.after) for p, plan in self.plans(opts).items()]
        out.append(
            FileDiff(
                launch_script.SCRIPT, None, self.script(opts.device), launch_script.SCRIPT_MODE
            )
        )
        return out

    def inferred_options(self) -> List[Options]:
        """Option sets that may explain the files when no manifest says which was used."""
        port = DEFAULT_PORT
        training = self.current("megatron/training.py") or b""
        found = re.search(rb"^[ \t]+port = (\d+)[ \t]*$", training, flags=re.M)
        if found and 1 <= int(found.group(1)) <= 65535:
            port = int(found.group(1))
        return [Options(device=d, port=port) for d in Device]
