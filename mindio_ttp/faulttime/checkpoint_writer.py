"""How every checkpoint file is written: the demo's shards, Megatron's model_rng.pt and optim.pt,
the manifests and the trackers. What goes into a file is the caller's business.

One torch file (`write_torch`):

* **streaming**: torch.save writes straight into the file through `HashingWriter`; nothing holds
  a copy of the whole file (a `BytesIO` + `getvalue()` costs two file-sized host buffers on
  top of the state, at the moment a rank is dying and may have no memory left);
* **sha256 in the same pass** as the bytes go to the file, never re-read;
* **staging bounded by one tensor**: torch.save moves non-CPU storages to the host one at a
  time; under `device_copy.reading` that copy runs on a private stream, not on the training
  stream a hung collective may block (see `mindio_ttp.faulttime.device_copy`);
* **atomic**: written as `<name>.part`, fsynced, renamed, and the directory fsynced, so a rank
  killed (or raising) mid-write leaves only a `.part` file, which no loader takes for a
  checkpoint, and after the rename the name survives a power cut.

Small files (`write_bytes`: manifests, trackers) take the same `.part`, fsync, rename, fsync-dir
path. The order between files (shards, then manifest, then the tracker last) stays the caller's.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from mindio_ttp.faulttime import device_copy
from mindio_ttp.faulttime.durable import fsync_dir

PART_SUFFIX = ".part"


@dataclass(frozen=True)
class Written:
    """What a finished file is: its sha256 (of the bytes on disk), size and write time."""

    sha256: str
    size: int
    seconds: float

    def entry(self) -> Dict[str, object]:
        return {"sha256": self.sha256, "size": self.size}


def part_path(path: Path) -> Path:
    """The name a file has until it is complete (`.part`: never taken for a checkpoint file)."""
    return path.with_name(path.name + PART_SUFFIX)


def write_bytes(path: Path, data: bytes, sync_dir: bool = True) -> None:
    """Write small `data` (a manifest, a tracker) to `path` atomically and durably."""
    part = part_path(path)
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    if sync_dir:
        fsync_dir(path.parent)


def write_torch(path: Path, obj: Any, midway: Optional[Callable[[], None]] = None,
                live_params: bool = False) -> Written:
    """torch.save `obj` to `path` (see the module docstring); `midway` runs after the first
    write (fault injection: a rank that dies there leaves a torn `.part` file); `live_params`:
    `obj` holds the model's live params, so the device read also waits for the event of their
    all-gather (`device_copy.GATHERED`)."""
    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    part = part_path(path)
    with open(part, "wb") as f:
        writer = HashingWriter(f, midway)
        try:
            with _without_torch_crc32(), device_copy.reading(live_params):
                torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
        finally:
            writer.abandon()
    digest = writer.hexdigest()
    os.replace(part, path)
    fsync_dir(path.parent)
    return Written(digest, writer.size, time.perf_counter() - started)


def _writeback_starter() -> Callable[[int, int, int], None]:
    """``start(fd, offset, nbytes)``: ask the kernel to begin writing that range to disk now,
    without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``). The final fsync then
    finds most pages already on their way instead of flushing the whole file at the end; it is
    still what makes the file durable. A no-op where the call does not exist."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    except (OSError, AttributeError, TypeError):  # no libc (Windows) or no such call (macOS)
        return lambda fd, offset, nbytes: None

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the head start

    return start


_START_WRITEBACK = _writeback_starter()


_CRC_LOCK = threading.Lock()
_CRC_USERS = [0, True]  # savers inside _without_torch_crc32, the setting to restore


@contextlib.contextmanager
def _without_torch_crc32() -> Iterator[None]:
    """Skip the CRC-32 torch.save computes for every zip record. It is a second, weaker checksum
    of the same bytes our sha256 covers, torch.load never checks it (a flipped byte in a tensor
    loads silently), and computing it costs about as much as the page-cache write itself. The
    file stays a normal torch.save file (torch.load reads it); its zip CRC fields are zero.
    torch's switch is process-wide, so concurrent savers share one reference-counted setting."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # older torch: nothing to switch off
        yield
        return
    with _CRC_LOCK:
        if _CRC_USERS[0] == 0:
            _CRC_USERS[1] = config.save.compute_crc32
            config.save.compute_crc32 = False
        _CRC_USERS[0] += 1
    try:
        yield
    finally:
        with _CRC_LOCK:
            _CRC_USERS[0] -= 1
            if _CRC_USERS[0] == 0:
                config.save.compute_crc32 = _CRC_USERS[1]


class HashingWriter(io.RawIOBase):
    """File wrapper for torch.save that hashes (sha256) every byte it writes, in the same pass.

    torch.save hands over the tensor storages themselves as large memoryviews. Each large one is
    written in chunks while a helper thread hashes the same buffer: ``write`` and
    ``sha256.update`` both release the GIL, so on two cores the hash costs no extra time and no
    copy is made; ``write`` returns only when both are done, so the buffer is never used after
    torch may free it. Small buffers (pickle records, zip headers) are hashed inline. After each
    chunk the kernel is asked to start writing it back (`_START_WRITEBACK`), so the closing fsync
    waits for the tail only. (Measured on the 2-core dev VM against the previous design, copy
    every buffer and hash on a queue thread: see docs/benchmarks.md, Persist.)
    ``midway`` runs after the first write. ``max_write`` is the largest single buffer torch
    handed over: the host memory this file's save staged at once (one storage).
    """

    BIG = 1 << 20  # hashing on the helper pays off above this
    CHUNK = 16 << 20  # writeback is started after every chunk

    def __init__(self, f, midway: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self._f, self._midway = f, midway
        self._fd = f.fileno()
        self._sha = hashlib.sha256()
        self._todo: Optional[memoryview] = None
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._hasher = threading.Thread(target=self._hash_loop, name="ckpt-sha256", daemon=True)
        self._hasher.start()
        self.size = 0
        self.max_write = 0

    def _hash_loop(self) -> None:
        while True:
            self._go.acquire()
            buf, self._todo = self._todo, None
            if buf is None:
                return
            try:
                self._sha.update(buf)  # releases the GIL for large buffers
            finally:
                self._done.release()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        self.max_write = max(self.max_write, n)
        if n < self.BIG:
            self._f.write(mv)
            self._sha.update(mv)
        else:
            self._todo = mv
            self._go.release()
            try:
                self._f.flush()
                for off in range(0, n, self.CHUNK):
                    self._f.write(mv[off:off + self.CHUNK])
                    _START_WRITEBACK(self._fd, self.size + off, min(self.CHUNK, n - off))
            finally:
                self._done.acquire()  # the helper is done with the buffer before we return
        self.size += n
        if self._midway is not None:
            self._f.flush()
            midway, self._midway = self._midway, None
            midway()
        return n

    def hexdigest(self) -> str:
        """The sha256 of everything written (all hashing finished inside ``write``)."""
        self.abandon()
        return self._sha.hexdigest()

    def abandon(self) -> None:
        """Stop the helper thread (its current buffer, if any, was already waited for)."""
        if self._hasher.is_alive():
            self._todo = None
            self._go.release()
            self._hasher.join(5.0)
