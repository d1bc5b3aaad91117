"""What "Megatron-LM 285068c" means to the edits: the target files' exact bytes, not one commit id.

The edits only read the target files, so a fork commit, an empty commit on top, or any
later commit that leaves them byte-identical is as good as the pin. Identity is the git blob id
(sha1 of "blob LEN\\0" + bytes), the same id `git ls-tree` prints, so a checkout is matched from
its object store without reading 285068c itself (shallow clones and forks do not have it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional

from .edits import TARGET_FILES

PINNED_COMMIT = "285068c8108e0e8e6538f54fe27c3ee86c5217a2"
# `git ls-tree 285068c8108e -- <targets>` of NVIDIA/Megatron-LM.
PINNED_BLOBS: Dict[str, str] = {
    "pretrain_gpt.py": "b5d92f770e8dd7402d1cf29c196881ceec8f8947",
    "megatron/training.py": "2179f63417f3408ca8f629cb233fc197cbc9dd85",
    "megatron/optimizer/__init__.py": "484e9b322e98dff2bb7b12756acc22694e2b0100",
    "megatron/core/parallel_state.py": "ef4e886d874b5fc94204d329ce662274b6958629",
    "megatron/initialize.py": "ba68a8fd5bff04fd1d7765b964acd0b2ad2a3e0e",
}


def blob_id(data: bytes) -> str:
    """git's object id of a file with these bytes (what `git hash-object` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Pin:
    """The commit the edits were written for and its target files' blob ids."""

    commit: str
    blobs: Dict[str, str]

    def matches(self, path: str, data: Optional[bytes]) -> bool:
        return data is not None and blob_id(data) == self.blobs.get(path)


PIN = Pin(PINNED_COMMIT, dict(PINNED_BLOBS))


def pinned() -> Pin:
    """The pin every command checks a checkout against. Nothing in the product changes it; the
    patcher's tests substitute their fixture repository's commit for it (testkit/patcher_pin.py)."""
    return PIN


def differing(pin: Pin, blobs: Dict[str, Optional[str]]) -> List[str]:
    """Targets whose blob id (None: absent) is not the pin's, in TARGET_FILES order."""
    return [p for p in TARGET_FILES if blobs.get(p) != pin.blobs.get(p)]
