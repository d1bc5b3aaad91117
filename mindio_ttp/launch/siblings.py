"""Launchers of one job on one host find each other, so a replacement request reaches the
ttprun that runs the lost rank.

The controller asks a survivor on the lost rank's host to relay a replacement request to "its"
launcher. With one ttprun per host that is the launcher of the lost rank; with two (a two-node
rehearsal on one machine, two tasks per node under Slurm) the survivor may belong to the other
one, which runs no such rank. Each ttprun therefore lists itself in a per-user directory of the
host (its pid, its run directory, the global ranks it runs) under the job's id, a digest of the
job key (the same on every launcher of the job, telling nothing about the key); a launcher
asked for a rank it does not run hands the request to the sibling that does, through that
sibling's own request directory, and relays its answers back.

The directory is private (mode 0700, owned by the user, not a link): only the user's own
processes can list or reach a launcher there, as only they can write its run directory.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

logger = logging.getLogger("ttprun")

MAX_BYTES = 1 << 20


def registry_dir() -> Optional[Path]:
    """This user's directory of launchers on this host, or None when it cannot be trusted."""
    path = Path(tempfile.gettempdir()) / f"ttprun-launchers-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        logger.warning("ttprun: %s is not a private directory of yours: launchers of one job on "
                       "this host cannot find each other (a lost rank of another ttprun here "
                       "then ends in the dying checkpoint)", path)
        return None
    return path


def job_id(key: bytes) -> str:
    return hmac.new(key, b"ttprun launchers", hashlib.sha256).hexdigest()[:16]


class Siblings:
    """This launcher's entry, and lookups of the others of the same job on this host."""

    def __init__(self, folder: Path, job: str, run_dir: Path) -> None:
        self.folder, self.job, self.run_dir = folder, job, run_dir
        self.path = folder / f"{job}-{os.getpid()}.json"
        self._said = False

    @classmethod
    def open(cls, key: Optional[bytes], run_dir: Path) -> Optional[Siblings]:
        folder = registry_dir() if key else None
        return None if folder is None or key is None else cls(folder, job_id(key), run_dir)

    def publish(self, ranks: Sequence[int]) -> None:
        """List this launcher with the global ranks it runs now (atomically)."""
        record = {"pid": os.getpid(), "run_dir": str(self.run_dir),
                  "ranks": sorted(int(r) for r in ranks)}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("ttprun: cannot list this launcher in %s (%s)", self.folder, exc)
            return
        others = self.others()
        if others and not self._said:
            self._said = True
            logger.warning("ttprun: %d other ttprun of this job on this host (%s): a lost "
                           "rank's replacement is asked of the launcher that runs it",
                           len(others), "; ".join(f"pid {o['pid']}, ranks {o['ranks'][:8]}"
                                                  for o in others[:4]))

    def others(self) -> List[Dict]:
        out = []
        for path in sorted(self.folder.glob(f"{self.job}-*.json")):
            if path == self.path:
                continue
            try:
                with open(path, "rb") as f:
                    obj = json.loads(f.read(MAX_BYTES))
                pid, run_dir = int(obj["pid"]), str(obj["run_dir"])
                ranks = [int(r) for r in obj["ranks"]]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not _alive(pid):
                continue
            out.append({"pid": pid, "run_dir": run_dir, "ranks": ranks})
        return out

    def owner(self, rank: int) -> Optional[Dict]:
        """The other launcher of this job on this host that runs global rank `rank`."""
        return next((o for o in self.others() if rank in o["ranks"]), None)

    def close(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
