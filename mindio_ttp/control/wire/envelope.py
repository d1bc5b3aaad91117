"""Orders and verdicts sealed once by the controller and verified by each rank, end to end.

An envelope is built once per order, whatever the number of ranks it reaches:

    magic "TTPE" | incarnation (16 bytes) | seq u64 | message type u8 | n blocks u16 |
    payload length u32 | destination ranks as n blocks of 5 int32 (ranksets.py) | payload |
    HMAC-SHA256(order key, everything before)

Relays and node agents route it by its destination blocks (`peek`, no key needed) and forward
the bytes unchanged inside their own hop frames. A rank opens it with `Inbox`: the MAC under the
order key (which no agent or relay holds: wire/keys.py), that the rank is a destination, that the
incarnation is one that welcomed this rank, and that the sequence number is new for it. So a hop
can delay or drop an order but never forge, alter, redirect or replay one.

`incarnation` is 16 random bytes chosen by each controller (the primary and every standby that
takes over), `seq` counts its envelopes. A rank learns an incarnation only from a `Welcome`
(wire/tier.py) that carries one of this rank's own registration nonces, so a Welcome recorded
for another rank or another registration does not enrol it.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import ranksets

MAGIC = b"TTPE"
HEAD = struct.Struct("!4s16sQBHI")
BLOCK = struct.Struct("!5i")
MAC_LEN = 32
MAX_BLOCKS = 4096  # a destination with no structure at all is one block per rank: bounded


@dataclass(frozen=True)
class Envelope:
    incarnation: bytes
    seq: int
    code: int
    dst: List[List[int]]
    payload: bytes

    def reaches(self, rank: int) -> bool:
        return ranksets.contains(self.dst, rank)


def seal(key: bytes, incarnation: bytes, seq: int, dst: Sequence[Sequence[int]],
         msg: P.Message) -> bytes:
    """The envelope of `msg` for the ranks `dst` (blocks, ranksets.encode), sealed with the
    order key."""
    payload = P.encode_payload(msg)
    if len(dst) > MAX_BLOCKS:
        raise P.ProtocolError(f"an envelope names at most {MAX_BLOCKS} blocks of ranks")
    body = (HEAD.pack(MAGIC, incarnation, seq, msg.TYPE, len(dst), len(payload))
            + b"".join(BLOCK.pack(*b) for b in dst) + payload)
    return body + hmac.digest(key, body, "sha256")


def peek(blob: bytes) -> Envelope:
    """The envelope's fields without checking its MAC (what a relay or agent routes by): the
    shape and the destination's bounds are checked; ProtocolError otherwise."""
    if len(blob) < HEAD.size + MAC_LEN:
        raise P.ProtocolError(f"an envelope of {len(blob)} bytes is too short")
    magic, inc, seq, code, n, length = HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise P.ProtocolError("not an envelope (bad magic)")
    if n > MAX_BLOCKS or HEAD.size + n * BLOCK.size + length + MAC_LEN != len(blob):
        raise P.ProtocolError("an envelope's lengths do not add up")
    dst = [list(BLOCK.unpack_from(blob, HEAD.size + i * BLOCK.size)) for i in range(n)]
    if not ranksets.valid_wire(dst, P.MAX_RANKS):
        raise P.ProtocolError(f"an envelope's destination is not a rank list: {str(dst)[:80]}")
    start = HEAD.size + n * BLOCK.size
    return Envelope(inc, seq, code, dst, blob[start:start + length])


def verify(key: bytes, blob: bytes) -> Envelope:
    """The envelope, once its MAC under the order key is right; ProtocolError otherwise."""
    env = peek(blob)
    if not hmac.compare_digest(blob[-MAC_LEN:], hmac.digest(key, blob[:-MAC_LEN], "sha256")):
        raise P.ProtocolError("an envelope's MAC is wrong: not sealed by this job's controller")
    return env


OK, DUPLICATE, REFUSED = "ok", "duplicate", "refused"


class Inbox:
    """What one rank accepts: envelopes of incarnations that welcomed it, each seq once."""

    def __init__(self, key: bytes, rank: int, registry: Dict[int, type]) -> None:
        self.key, self.rank, self.registry = key, rank, registry
        self.nonces: Set[str] = set()  # every registration nonce this rank sent
        self.last: Dict[bytes, int] = {}  # incarnation -> newest seq accepted

    def open(self, blob: bytes) -> Tuple[str, Optional[P.Message], str]:
        """(OK | DUPLICATE | REFUSED, message, why refused). A duplicate is a new copy of an
        order already accepted (a controller sends a rank that registers mid-flow the phase
        orders it broadcast before): the caller may answer it again, not act on it twice."""
        try:
            env = verify(self.key, blob)
            if not env.reaches(self.rank):
                return REFUSED, None, f"addressed to other ranks ({str(env.dst)[:60]})"
            msg = P.decode_payload(env.code, env.payload, self.registry)
        except P.ProtocolError as exc:
            return REFUSED, None, str(exc)
        if type(msg).__name__ == "Welcome":
            mine = [n for r, n in zip(msg.ranks, msg.nonces)  # type: ignore[attr-defined]
                    if r == self.rank]
            if not any(n in self.nonces for n in mine):
                return REFUSED, None, "a Welcome that does not carry this rank's nonce"
            self.last[env.incarnation] = max(self.last.get(env.incarnation, -1), env.seq)
            return OK, msg, ""
        last = self.last.get(env.incarnation)
        if last is None:
            return REFUSED, None, "from a controller that has not welcomed this rank"
        if env.seq <= last:
            return DUPLICATE, msg, ""
        self.last[env.incarnation] = env.seq
        return OK, msg, ""
