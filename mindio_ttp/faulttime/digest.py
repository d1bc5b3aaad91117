"""The digest of a checkpoint file, chosen by what it has to stand up to.

* **Unkeyed manifest** (the default): the digest is there to catch a torn, truncated or
  corrupted file. `xxh3_128` (the `xxhash` package) does that at ~34 GB/s per core, about 20
  times sha256's speed with SHA-NI on the machine we measured, so the dying save costs what
  torch.save + fsync costs.
* **Signed manifest** (`TTP_CHECKPOINT_KEY` set): the manifest's HMAC covers the file digests,
  so the digest must resist someone who can write the checkpoint directory and looks for a
  second file with the same digest. xxh3 is not built for that; `blake3` is cryptographic and
  ~2.7 times cheaper than sha256 here.
* `sha256`: what manifests held before the choice existed; they still load and verify, and it
  is the fallback when a package is missing (said once per process).

A manifest entry names its digest by its key: ``{"xxh3_128": "<32 hex>", "size": n}``,
``{"blake3": "<64 hex>", "size": n}`` or, as before, ``{"sha256": "<64 hex>", "size": n}``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any, Dict, FrozenSet, Optional

from mindio_ttp.config import ENV_CHECKPOINT_KEY

log = logging.getLogger("mindio_ttp.checkpoint")

XXH3_128 = "xxh3_128"
BLAKE3 = "blake3"
SHA256 = "sha256"
HEX_DIGITS: Dict[str, int] = {XXH3_128: 32, BLAKE3: 64, SHA256: 64}
ALGOS: FrozenSet[str] = frozenset(HEX_DIGITS)
CRYPTOGRAPHIC: FrozenSet[str] = frozenset({BLAKE3, SHA256})
_PACKAGE = {XXH3_128: "xxhash", BLAKE3: "blake3"}

# blake3 hashing one buffer on all cores (its own thread pool) instead of one: faster where
# cores are free, slower on a loaded node (docs/checkpoint-writer.md, "Digest and overlap")
BLAKE3_THREADS = False

_said: set = set()
_said_lock = threading.Lock()


def _module(algo: str) -> Optional[Any]:
    """The package behind `algo`, or None when it is not installed (sha256: hashlib)."""
    try:
        if algo == XXH3_128:
            import xxhash

            return xxhash
        if algo == BLAKE3:
            import blake3

            return blake3
    except ImportError:
        return None
    return hashlib


def available(algo: str) -> bool:
    return algo in ALGOS and _module(algo) is not None


def for_mode(keyed: bool) -> str:
    """The digest new files get: blake3 for a signed manifest, xxh3_128 otherwise; sha256
    (said once per process) when that package is not installed."""
    wanted = BLAKE3 if keyed else XXH3_128
    if available(wanted):
        return wanted
    with _said_lock:
        if wanted not in _said:
            _said.add(wanted)
            log.warning("mindio_ttp: the %s package is not installed: checkpoint files are "
                        "digested with sha256 instead of %s, which is slower (pip install %s)",
                        _PACKAGE[wanted], wanted, _PACKAGE[wanted])
    return SHA256


def default_algo() -> str:
    """The digest for this process's checkpoints, by `TTP_CHECKPOINT_KEY`."""
    return for_mode(bool(os.environ.get(ENV_CHECKPOINT_KEY, "")))


def new(algo: str) -> Any:
    """A hasher with `update(buffer)` (releases the GIL on large buffers) and `hexdigest()`.
    Raises LookupError naming the package to install when `algo` cannot be computed here."""
    module = _module(algo) if algo in ALGOS else None
    if module is None:
        if algo in _PACKAGE:
            raise LookupError(f"digest {algo} needs the {_PACKAGE[algo]} package: "
                              f"pip install {_PACKAGE[algo]}")
        raise LookupError(f"unknown digest {algo!r}: one of {sorted(ALGOS)}")
    if algo == XXH3_128:
        return module.xxh3_128()
    if algo == BLAKE3:
        return module.blake3(max_threads=module.blake3.AUTO if BLAKE3_THREADS else 1)
    return module.sha256()


def of_bytes(algo: str, data: Any) -> str:
    hasher = new(algo)
    hasher.update(data)
    return hasher.hexdigest()


def of_file(path: Path, algo: str, chunk: int = 8 << 20) -> str:
    """The digest of a file's bytes, read in `chunk`s into one reused buffer."""
    hasher = new(algo)
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return hasher.hexdigest()
            hasher.update(view[:n])


def is_hex(value: Any, algo: str) -> bool:
    """`value` is a lower-case hex digest of `algo`'s length."""
    return (isinstance(value, str) and len(value) == HEX_DIGITS[algo]
            and set(value) <= set("0123456789abcdef"))
