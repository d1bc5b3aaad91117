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
import io
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional

import torch

from mindio_ttp.faulttime import device_copy, digest
from mindio_ttp.faulttime.durable import fsync_dir

PART_SUFFIX = ".part"


@dataclass(frozen=True)
class Written:
    """What a finished file is: its digest (of the bytes on disk, by `algo`: see
    `mindio_ttp.faulttime.digest`), size and write time, and where that time went: ``serialize``
    (torch.save's own work: pickling, zip records), ``write`` (the write calls), ``digest``
    (hashing the main thread waited for), ``fsync``, ``rename`` (rename + directory fsync)."""

    algo: str
    digest: str
    size: int
    seconds: float
    phases: Dict[str, float] = field(default_factory=dict)

    def entry(self) -> Dict[str, object]:
        """The file's manifest entry: ``{algo: digest, "size": size}``."""
        return {self.algo: self.digest, "size": self.size}


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
                live_params: bool = False, algo: Optional[str] = None,
                helper: Optional[bool] = None) -> Written:
    """torch.save `obj` to `path` (see the module docstring); `midway` runs after the first
    write (fault injection: a rank that dies there leaves a torn `.part` file); `live_params`:
    `obj` holds the model's live params, so the device read also waits for the event of their
    all-gather (`device_copy.GATHERED`). `algo`: the digest (default: by the manifest's mode,
    `digest.default_algo`); `helper`: hash large buffers on a helper thread (default: while a
    core is free, `HashingWriter.helper_pays`)."""
    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    part = part_path(path)
    with open(part, "wb") as f:
        writer = HashingWriter(f, midway, algo=algo, helper=helper)
        try:
            with _without_torch_crc32(), device_copy.reading(live_params):
                torch.save(obj, writer)
            f.flush()
            saved = time.perf_counter()
            os.fsync(f.fileno())
        finally:
            writer.abandon()
    synced = time.perf_counter()
    hexdigest = writer.hexdigest()
    os.replace(part, path)
    fsync_dir(path.parent)
    done = time.perf_counter()
    phases = {"serialize": max(0.0, saved - started - writer.write_s - writer.digest_s),
              "write": writer.write_s, "digest": writer.digest_s, "fsync": synced - saved,
              "rename": done - synced}
    return Written(writer.algo, hexdigest, writer.size, done - started, phases)


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
    """File wrapper for torch.save that digests every byte it writes, in the same pass.

    torch.save hands over the tensor storages themselves as large memoryviews; nothing is
    copied. Each large one is written in chunks, and after each chunk the kernel is asked to
    start writing it back (`_START_WRITEBACK`), so the closing fsync waits for the tail only.
    The digest (`algo`, see `mindio_ttp.faulttime.digest`) is computed one of two ways:

    * inline, after the buffer's write (the default when no core is free: `helper_pays`);
    * on a helper thread while the same buffer is written (`helper=True`, the default when a
      core is free): ``write`` and
      ``update`` both release the GIL, so with a free core the hash costs no wall time;
      ``write`` returns only when both are done, so the buffer is never used after torch may
      free it (a device tensor's host copy lives only for the call).

    Small buffers (pickle records, zip headers) are always hashed inline. ``midway`` runs after
    the first write. ``max_write`` is the largest single buffer torch handed over: the host
    memory this file's save staged at once (one storage). ``write_s`` / ``digest_s``: time spent
    in the write calls, and waiting for the digest (inline: all of it; helper: what it did not
    hide).
    """

    BIG = 1 << 20  # hashing on the helper pays off above this
    CHUNK = 16 << 20  # writeback is started after every chunk

    def __init__(self, f, midway: Optional[Callable[[], None]] = None,
                 algo: Optional[str] = None, helper: Optional[bool] = None) -> None:
        super().__init__()
        self._f, self._midway = f, midway
        self._fd = f.fileno()
        self.algo = digest.default_algo() if algo is None else algo
        self._hash = digest.new(self.algo)
        self.size = 0
        self.max_write = 0
        self.write_s = 0.0
        self.digest_s = 0.0
        self._todo: Optional[memoryview] = None
        self._hasher: Optional[threading.Thread] = None
        if self.helper_pays(self.algo) if helper is None else helper:
            self._go = threading.Semaphore(0)
            self._done = threading.Semaphore(0)
            self._hasher = threading.Thread(target=self._hash_loop, daemon=True,
                                            name=f"ckpt-{self.algo}")
            self._hasher.start()

    @staticmethod
    def helper_pays(algo: str) -> bool:
        """Whether hashing on a helper thread beside the write is the faster design now: when
        a core is free, for every digest (`algo` is kept for callers that ask per digest).
        Measured both ways (docs/checkpoint-writer.md, "Digest and overlap"): on a 2-core
        machine with no free core the helper thread was slower than inline for every digest
        (it competes with the write for the cores); on an idle one it hid the digest, for
        xxh3_128 too (tmpfs, 41.4M parameters: 99% of the baseline against 91% inline)."""
        return _free_cores() >= 1.0

    def _hash_loop(self) -> None:
        while True:
            self._go.acquire()
            buf, self._todo = self._todo, None
            if buf is None:
                return
            try:
                self._hash.update(buf)  # releases the GIL for large buffers
            finally:
                self._done.release()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        self.max_write = max(self.max_write, n)
        t0 = time.perf_counter()
        if n < self.BIG:
            self._f.write(mv)
            t1 = time.perf_counter()
            self._hash.update(mv)
        elif self._hasher is None:
            self._write_big(mv, n)
            t1 = time.perf_counter()
            self._hash.update(mv)
        else:
            self._todo = mv
            self._go.release()
            try:
                self._write_big(mv, n)
            finally:
                t1 = time.perf_counter()
                self._done.acquire()  # the helper is done with the buffer before we return
        t2 = time.perf_counter()
        self.write_s += t1 - t0
        self.digest_s += t2 - t1
        self.size += n
        if self._midway is not None:
            self._f.flush()
            midway, self._midway = self._midway, None
            midway()
        return n

    def _write_big(self, mv: memoryview, n: int) -> None:
        self._f.flush()
        for off in range(0, n, self.CHUNK):
            self._f.write(mv[off:off + self.CHUNK])
            _START_WRITEBACK(self._fd, self.size + off, min(self.CHUNK, n - off))

    def hexdigest(self) -> str:
        """The digest of everything written (all hashing finished inside ``write``)."""
        self.abandon()
        return self._hash.hexdigest()

    def abandon(self) -> None:
        """Stop the helper thread (its current buffer, if any, was already waited for)."""
        if self._hasher is not None and self._hasher.is_alive():
            self._todo = None
            self._go.release()
            self._hasher.join(5.0)


def _free_cores() -> float:
    """CPUs this process may run on (its affinity mask) minus the 1-minute load average: how
    many are idle, roughly; 0 where the load average cannot be read."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        return cores - os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
