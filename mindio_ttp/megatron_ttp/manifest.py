"""Names, checksums and completeness of a checkpoint in Megatron 285068c's distributed-optimizer
layout, without importing Megatron (so the rules are unit-testable).

Layout of step t under the save directory:
`iter_{t:07d}/mp_rank_TT[_PPP]/model_rng.pt` (one per model-parallel rank) and
`iter_{t:07d}/mp_rank_TT[_PPP]_DDD/optim.pt` (one per DP rank). A TTP checkpoint also carries
`ttp_manifest.json`: the sha256 and size of every file, so a half-written or corrupted dying
checkpoint is refused at load instead of crashing (or silently exiting 0) inside Megatron.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

MANIFEST = "ttp_manifest.json"
PART_PREFIX = "ttp_manifest.rank"
FORMAT = "ttp-checkpoint/1"
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    dp: int

    def model_dir(self, tp_rank: int, pp_rank: int) -> str:
        if self.pp > 1:
            return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        return f"mp_rank_{tp_rank:02d}"

    def model_file(self, tp_rank: int, pp_rank: int) -> str:
        return f"{self.model_dir(tp_rank, pp_rank)}/model_rng.pt"

    def optim_file(self, tp_rank: int, pp_rank: int, dp_rank: int) -> str:
        return f"{self.model_dir(tp_rank, pp_rank)}_{dp_rank:03d}/optim.pt"

    def expected_files(self) -> List[str]:
        files = []
        for t in range(self.tp):
            for p in range(self.pp):
                files.append(self.model_file(t, p))
                files.extend(self.optim_file(t, p, d) for d in range(self.dp))
        return files

    def as_dict(self) -> Dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def tmp_root(save_dir: str, step: int) -> Path:
    """Where the chosen ranks write step `step` before the rename makes it visible."""
    return Path(save_dir) / f".ttp_tmp_{iter_dir_name(step)}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return digest.hexdigest()
            digest.update(block)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_part(iter_dir: Path, rank: int, entries: Dict[str, Dict[str, object]]) -> None:
    """Each saving rank lists the files it wrote; the rename step merges the parts."""
    write_atomic(iter_dir / f"{PART_PREFIX}{rank}.json",
                 json.dumps(entries, sort_keys=True).encode())


def merge_parts(iter_dir: Path, step: int, parallel: ParallelLayout) -> Dict[str, object]:
    """Merge the part manifests into the final one; raises if a file is missing or unlisted."""
    files: Dict[str, Dict[str, object]] = {}
    parts = sorted(iter_dir.glob(f"{PART_PREFIX}*.json"))
    for part in parts:
        files.update(json.loads(part.read_text()))
    missing = [f for f in parallel.expected_files() if f not in files]
    if missing:
        raise RuntimeError(
            f"dying checkpoint of step {step} is incomplete: no rank wrote {', '.join(missing)}"
        )
    for rel, entry in files.items():
        size = (iter_dir / rel).stat().st_size if (iter_dir / rel).is_file() else -1
        if size != entry["size"]:
            raise RuntimeError(f"{rel}: size {size} on disk, {entry['size']} in the manifest")
    manifest = {"format": FORMAT, "step": step, "layout": parallel.as_dict(), "files": files}
    write_atomic(iter_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    for part in parts:
        part.unlink()
    return manifest


def verify(iter_dir: Path, parallel: ParallelLayout,
           hash_files: Optional[Iterable[str]] = None) -> Optional[str]:
    """None when `iter_dir` is a usable checkpoint for `parallel`, else the reason it is not.

    Without a manifest (a stock Megatron checkpoint) only presence is checked. `hash_files`
    limits which listed files are re-hashed (ranks split the hashing work).
    """
    if not iter_dir.is_dir():
        return f"{iter_dir} does not exist"
    manifest_path = iter_dir / MANIFEST
    if not manifest_path.is_file():
        if any(iter_dir.glob(f"{PART_PREFIX}*.json")):
            return f"{iter_dir} is an unfinished TTP checkpoint (part manifests, no {MANIFEST})"
        missing = [f for f in parallel.expected_files() if not (iter_dir / f).is_file()]
        return f"{iter_dir} lacks {', '.join(missing)}" if missing else None
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT:
            return f"{manifest_path}: unknown format {manifest.get('format')!r}"
    except (ValueError, KeyError) as exc:
        return f"{manifest_path} is unreadable: {exc}"
    if manifest.get("layout") != parallel.as_dict():
        return (f"{iter_dir} was written for layout {manifest.get('layout')}, this run is "
                f"{parallel.as_dict()}")
    missing = [f for f in parallel.expected_files() if f not in files]
    if missing:
        return f"{iter_dir} is incomplete: manifest lacks {', '.join(missing)}"
    wanted = set(files) if hash_files is None else set(hash_files) & set(files)
    for rel in sorted(wanted):
        path = iter_dir / rel
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != files[rel]["size"] or sha256_file(path) != files[rel]["sha256"]:
            return f"{path} fails its checksum"
    return None


def read_tracker(save_dir: Path) -> Tuple[Optional[int], Optional[str]]:
    """(iteration, None) from Megatron's tracker file, or (None, reason)."""
    tracker = save_dir / TRACKER
    if not tracker.is_file():
        return None, f"no {TRACKER} in {save_dir}"
    text = tracker.read_text().strip()
    try:
        return int(text), None
    except ValueError:
        return None, f"{tracker} holds {text!r}, not an iteration"


def candidate_steps(save_dir: Path, newest: int) -> List[int]:
    """Complete-looking `iter_*` directories at or below `newest`, newest first."""
    steps = []
    for entry in save_dir.glob("iter_*"):
        try:
            step = int(entry.name[len("iter_"):])
        except ValueError:
            continue
        if entry.is_dir() and step <= newest:
            steps.append(step)
    return sorted(steps, reverse=True)


def write_tracker(save_dir: Path, step: int) -> None:
    write_atomic(save_dir / TRACKER, str(step).encode())
