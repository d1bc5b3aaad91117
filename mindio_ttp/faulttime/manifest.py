"""Names, checksums and completeness of a checkpoint in Megatron 285068c's distributed-optimizer
layout, without importing Megatron (so the rules are unit-testable).

Layout of step t under the save directory:
`iter_{t:07d}/mp_rank_TT[_PPP]/model_rng.pt` (one per model-parallel rank) and
`iter_{t:07d}/mp_rank_TT[_PPP]_DDD/optim.pt` (one per DP rank). A TTP checkpoint also carries
`ttp_manifest.json`: the digest and size of every file (the digest named per file:
xxh3_128, or blake3 when the manifest is signed, or sha256 in manifests written before the
choice; `mindio_ttp.faulttime.digest`), so a half-written or corrupted dying checkpoint is
refused at load instead of crashing (or silently exiting 0) inside Megatron, and
the marker `ttp_checkpoint`, so a TTP checkpoint whose manifest was deleted is refused instead of
being taken for a stock one.

Everything read from the checkpoint directory is hostile until checked: the tracker and the
manifest are read with a size cap, the manifest must match one exact schema, its file names
must be exactly the layout's (so nothing outside the iteration directory is ever opened), and a
listed file must be a regular file, not a symlink. With `TTP_CHECKPOINT_KEY` set, the manifest
also carries an HMAC-SHA256 over the file digests, so a shard altered and re-hashed by someone
without the key is refused as well; the file digests must then be cryptographic (blake3 or
sha256), so that nobody can make a second file with a signed digest. `verify` returns a reason
instead of raising, so every rank reaches the agreement collective in `load.choose_checkpoint`
whatever it found.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from mindio_ttp.faulttime import checkpoint_writer, digest

MANIFEST = "ttp_manifest.json"
PART_PREFIX = "ttp_manifest.rank"
FORMAT = "ttp-checkpoint/1"
TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "ttp_checkpoint"
STEP_LOG = "ttp_step_log.pt"  # the saved step's log record, when no run printed it (log_record.py)
OPTIONAL_FILES = (STEP_LOG,)  # listed (so verified) when written; a checkpoint is whole without
CHECKPOINT_KEY_ENV = "TTP_CHECKPOINT_KEY"
MAX_MANIFEST_BYTES = 64 << 20  # ~400k files; a real manifest is ~150 bytes per file
MAX_TRACKER_BYTES = 64


class TrackerError(RuntimeError):
    """The tracker file exists but does not name an iteration: refuse to guess."""


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


def tmp_root(save_dir: str, step: int, tag: str = "") -> Path:
    """Where the chosen ranks write step `step` before the rename makes it visible: one
    directory per save order (`tag`), so no flow writes into or deletes another's."""
    return Path(save_dir) / f".ttp_tmp_{iter_dir_name(step)}{'.' + tag if tag else ''}"


def write_atomic(path: Path, data: bytes) -> None:
    """Small files (manifests, marker, tracker): `.part`, fsync, rename, fsync the directory."""
    checkpoint_writer.write_bytes(path, data)


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
    manifest: Dict[str, Any] = {"format": FORMAT, "step": step, "layout": parallel.as_dict(),
                                "files": files}
    key = checkpoint_key()
    if key is not None:
        manifest["mac"] = manifest_mac(manifest, key)
    write_atomic(iter_dir / MARKER, FORMAT.encode())
    write_atomic(iter_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    for part in parts:
        part.unlink()
    return manifest


def checkpoint_key() -> Optional[bytes]:
    """The manifest MAC key from the environment, or None (no MAC written or demanded)."""
    value = os.environ.get(CHECKPOINT_KEY_ENV, "")
    return value.encode() if value else None


def manifest_mac(manifest: Dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in manifest.items() if k != "mac"}
    return hmac.new(key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def read_capped(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a regular file; raises ValueError for anything else."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return data


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_manifest(data: bytes, step: int, parallel: ParallelLayout,
                   key: Optional[bytes]) -> Dict[str, Dict[str, Any]]:
    """The manifest's `files`, after checking every field; raises ValueError naming the defect."""
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
    extra = set(manifest) - {"format", "step", "layout", "files", "mac"}
    if extra:
        raise ValueError(f"unexpected keys {sorted(extra)}")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"unknown format {str(manifest.get('format'))[:40]!r}")
    if manifest.get("step") != step or not _is_count(manifest.get("step")):
        raise ValueError(f"names step {str(manifest.get('step'))[:20]}, the directory is {step}")
    if manifest.get("layout") != parallel.as_dict():
        raise ValueError(f"was written for layout {str(manifest.get('layout'))[:80]}, this run "
                         f"is {parallel.as_dict()}")
    if key is not None:
        mac = manifest.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, manifest_mac(manifest, key)):
            raise ValueError(f"its MAC does not match {CHECKPOINT_KEY_ENV} (altered, or written "
                             "with another key or none)")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError("'files' is not an object")
    expected = set(parallel.expected_files())
    missing = sorted(expected - set(files))
    unknown = sorted(set(files) - expected - set(OPTIONAL_FILES))
    if unknown:
        raise ValueError(f"lists files this layout does not have: {[u[:80] for u in unknown[:3]]}")
    if missing:
        raise ValueError(f"is incomplete: it lacks {', '.join(missing)}")
    for rel, entry in files.items():
        algo = entry_algo(entry)
        if algo is None:
            raise ValueError(f"entry for {rel} is not {{<digest>: hex digits, 'size': int}} "
                             f"with <digest> one of {sorted(digest.ALGOS)}")
        if key is not None and algo not in digest.CRYPTOGRAPHIC:
            raise ValueError(f"entry for {rel} has a {algo} digest, which is not cryptographic: "
                             f"with {CHECKPOINT_KEY_ENV} set only {sorted(digest.CRYPTOGRAPHIC)} "
                             "are accepted")
    return files


def entry_algo(entry: Any) -> Optional[str]:
    """The digest a manifest entry names (``{algo: hex, "size": n}``), None when it is not
    exactly such an entry."""
    if not isinstance(entry, dict) or len(entry) != 2 or not _is_count(entry.get("size")):
        return None
    algo = next(k for k in entry if k != "size")
    if algo not in digest.ALGOS or not digest.is_hex(entry[algo], algo):
        return None
    return algo


def verify(iter_dir: Path, parallel: ParallelLayout,
           hash_files: Optional[Iterable[str]] = None) -> Optional[str]:
    """None when `iter_dir` is a usable checkpoint for `parallel`, else the reason it is not.

    Never raises (a rank that raised would leave the others waiting in the agreement
    collective). Without a manifest or marker (a stock Megatron checkpoint) only presence is
    checked. `hash_files` limits which listed files are re-hashed (ranks split the hashing).
    """
    try:
        return _verify(iter_dir, parallel, hash_files)
    except Exception as exc:  # noqa: BLE001 - any defect is a refusal, never a crash
        return f"{iter_dir} cannot be checked: {type(exc).__name__}: {str(exc)[:200]}"


def _verify(iter_dir: Path, parallel: ParallelLayout,
            hash_files: Optional[Iterable[str]]) -> Optional[str]:
    if not iter_dir.is_dir():
        return f"{iter_dir} does not exist"
    manifest_path = iter_dir / MANIFEST
    if not os.path.lexists(manifest_path):
        if any(iter_dir.glob(f"{PART_PREFIX}*.json")):
            return f"{iter_dir} is an unfinished TTP checkpoint (part manifests, no {MANIFEST})"
        if os.path.lexists(iter_dir / MARKER):
            return f"{iter_dir} was written by TTP but its {MANIFEST} is gone: not verifiable"
        if checkpoint_key() is not None:
            return (f"{iter_dir} has no {MANIFEST}, and {CHECKPOINT_KEY_ENV} is set: only "
                    "MACed checkpoints are accepted")
        missing = [f for f in parallel.expected_files() if not (iter_dir / f).is_file()]
        return f"{iter_dir} lacks {', '.join(missing)}" if missing else None
    try:
        files = parse_manifest(read_capped(manifest_path, MAX_MANIFEST_BYTES),
                               _step_of(iter_dir), parallel, checkpoint_key())
    except (OSError, ValueError) as exc:
        return f"{manifest_path} refused: {exc}"
    wanted = set(files) if hash_files is None else set(hash_files) & set(files)
    for rel in sorted(wanted):
        path = iter_dir / rel
        if not _regular(path):
            return f"{path} is missing or not a regular file"
        entry = files[rel]
        algo = entry_algo(entry)
        try:
            if path.stat().st_size != entry["size"] or digest.of_file(path, algo) != entry[algo]:
                return f"{path} fails its checksum"
        except LookupError as exc:  # a digest whose package this environment lacks
            return f"{path} cannot be checked: {exc}"
    return None


def listed(iter_dir: Path, parallel: ParallelLayout, rel: str) -> Optional[Dict[str, Any]]:
    """`rel`'s entry in the manifest of `iter_dir` (checked as `verify` checks it), or None
    when the manifest does not list it (a file it does not list is not read)."""
    manifest_path = iter_dir / MANIFEST
    if not os.path.lexists(manifest_path):
        return None
    files = parse_manifest(read_capped(manifest_path, MAX_MANIFEST_BYTES), _step_of(iter_dir),
                           parallel, checkpoint_key())
    return files.get(rel)


def _regular(path: Path) -> bool:
    """A regular file that is not a symlink (a link could point anywhere)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _step_of(iter_dir: Path) -> int:
    name = iter_dir.name
    if not name.startswith("iter_") or not name[len("iter_"):].isdigit():
        raise ValueError(f"{iter_dir} is not named iter_NNNNNNN")
    return int(name[len("iter_"):])


def read_tracker(save_dir: Path) -> Tuple[Optional[int], Optional[str]]:
    """(iteration, None) from Megatron's tracker; (None, reason) when there is none (start from
    scratch) or it says `release` (Megatron's own release checkpoint). A tracker holding
    anything else raises TrackerError: Megatron would print "Invalid metadata file" and
    `sys.exit()` with status 0, and a scheduler would take the job as finished."""
    tracker = save_dir / TRACKER
    if not os.path.lexists(tracker):
        return None, f"no {TRACKER} in {save_dir}"
    hint = ("write the iteration to load (e.g. the newest complete iter_* directory's number) "
            "into it, or remove it to start from scratch")
    try:
        text = read_capped(tracker, MAX_TRACKER_BYTES).decode("ascii").strip()
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise TrackerError(f"mindio_ttp: cannot read checkpoint tracker {tracker} "
                           f"({exc}); {hint}") from None
    if text == "release":
        return None, f"{tracker} says release"
    if not text.isdigit():
        raise TrackerError(f"mindio_ttp: checkpoint tracker {tracker} holds {text[:20]!r}, not "
                           f"an iteration number or 'release'; {hint}")
    return int(text), None


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
