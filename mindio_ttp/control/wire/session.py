"""The control-plane handshake: a challenge, an answer bound to it, per-connection session keys.

A MAC with the job key alone proves a frame was made by a key holder once, not that it was made
for this connection: a `Register` recorded on the wire could be replayed on a new connection.
So every listener (the controller and each standby) opens a connection with a fresh nonce,
the rank's `Register` echoes it and adds its own, and everything after is MACed with keys
derived from (job key, both nonces), one per direction, with a sequence number per frame:

    listener                                                      rank
       | --- Challenge(nl)                        job key, seq 0 --> |
       | <-- Register(..., challenge=nl, nonce=nr) job key, seq 0 --- |
       | --- RegisterAck | Reject                  K_lr,  seq 1 --> |
       | --- later frames                          K_lr,  seq 2.. --> |
       | <-- later frames                          K_rl,  seq 1.. --- |

Only a key holder can derive K_lr from nl and nr, so an acknowledgement the rank can verify
comes from a key holder that saw this rank's fresh nonce, not from a replayer. This module has
no I/O: the controller, the processor, the test fakes and the benchmark's asyncio clients all
drive it over their own sockets.
"""

from __future__ import annotations

import dataclasses
import hmac
import secrets
from typing import Any, Dict, Optional, Tuple

from mindio_ttp.control.wire import protocol as P

NONCE_BYTES = 16
_LABEL = b"mindio-ttp v%d " % P.VERSION
CHALLENGE_MAX_PAYLOAD = 256  # what a rank buffers before the listener proved anything


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _nonce_bytes(value: str, who: str) -> bytes:
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise P.ProtocolError(f"{who} nonce is not hex") from None
    if len(raw) < NONCE_BYTES:
        raise P.ProtocolError(f"{who} nonce is {len(raw)} bytes, under {NONCE_BYTES}")
    return raw


def hkdf_sha256(salt: bytes, ikm: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF (RFC 5869) with SHA-256: extract, then expand to `length` bytes."""
    prk = hmac.digest(salt, ikm, "sha256")
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.digest(prk, block + info + bytes([i]), "sha256")
        out += block
    return out[:length]


def session_keys(job_key: bytes, listener_nonce: str, rank_nonce: str) -> Tuple[bytes, bytes]:
    """(listener→rank, rank→listener) keys: HKDF-SHA256 with both nonces as the salt and one
    label per direction, so a frame cannot be reflected back at its sender and no two
    connections share a key."""
    salt = _nonce_bytes(listener_nonce, "listener") + _nonce_bytes(rank_nonce, "rank")
    return (hkdf_sha256(salt, job_key, _LABEL + b"listener->rank"),
            hkdf_sha256(salt, job_key, _LABEL + b"rank->listener"))


class Sealer:
    """The sending half of one connection: the current key and the next sequence number."""

    __slots__ = ("key", "seq")

    def __init__(self, key: bytes, seq: int = 0) -> None:
        self.key, self.seq = key, seq

    def seal(self, msg: P.Message) -> bytes:
        return self.seal_payload(msg.TYPE, P.encode_payload(msg))

    def seal_payload(self, code: int, payload: bytes) -> bytes:
        data = P.seal(code, payload, self.key, self.seq)
        self.seq += 1
        return data

    def rekey(self, key: bytes, seq: int) -> None:
        self.key, self.seq = key, seq


class ListenerHandshake:
    """The accepting side of one connection, from accept to the verified Register.

    `accept_keys` (type of first frame -> the key it must be made with): a controller takes
    a rank's `Register` under the job key and a node agent's `NodeRegister` under the hop key
    (control/wire/); the session keys then derive from that key. Default: Register only."""

    def __init__(self, job_key: bytes, max_payload: int,
                 accept_keys: Optional[Dict[type, bytes]] = None,
                 registry: Optional[Dict[int, type]] = None) -> None:
        self.job_key = job_key
        self.keys = {P.Register: job_key} if accept_keys is None else dict(accept_keys)
        self.nonce = new_nonce()
        self.tx = Sealer(job_key)
        self.dec = P.FrameDecoder(job_key, max_payload, handshake=True, registry=registry,
                                  first_keys={cls.TYPE: k for cls, k in self.keys.items()})
        self.done = False

    def challenge(self) -> bytes:
        return self.tx.seal(P.Challenge(self.nonce))

    def accept(self, reg: Any) -> None:
        """Check that `reg` (a Register, or another first frame of `accept_keys`) answers this
        connection's challenge and switch both directions to the session keys (before any
        RegisterAck or Reject goes out). Raises ProtocolError for a first frame made for
        another connection: a replay."""
        if self.done:
            raise P.ProtocolError("a second Register on one connection")
        key = self.keys.get(type(reg))
        if key is None:
            raise P.ProtocolError(f"a {type(reg).__name__} cannot open this connection")
        if not hmac.compare_digest(reg.challenge.encode(), self.nonce.encode()):
            raise P.ProtocolError(f"{type(reg).__name__} for rank {getattr(reg, 'rank', '-')} "
                                  "answers another connection's challenge: a replayed or "
                                  "relayed frame")
        to_rank, to_listener = session_keys(key, self.nonce, reg.nonce)
        self.tx.rekey(to_rank, 1)
        self.dec.rekey(to_listener, 1)
        self.done = True


class RankHandshake:
    """The connecting side: read the Challenge, answer with the Register, then expect the
    RegisterAck or Reject under the new session key."""

    def __init__(self, job_key: bytes, registry: Optional[Dict[int, type]] = None,
                 verify_challenge: bool = True) -> None:
        self.job_key = job_key
        # a node agent cannot verify a controller's challenge (made with the job key, which
        # it does not hold) and need not: see FrameDecoder's unverified_first
        self.dec = P.FrameDecoder(job_key, CHALLENGE_MAX_PAYLOAD, handshake=True,
                                  registry=registry,
                                  unverified_first=() if verify_challenge else (P.Challenge.TYPE,))
        self.tx = Sealer(job_key)
        self.listener_nonce: Optional[str] = None
        self.nonce: Optional[str] = None  # ours, as sent in the Register

    def answer(self, challenge: P.Message, reg: Any) -> bytes:
        """The Register frame answering `challenge`; raises ProtocolError when the listener's
        first frame is something else."""
        if not isinstance(challenge, P.Challenge):
            raise P.ProtocolError(f"the listener's first frame is a {type(challenge).__name__}, "
                                  "not a Challenge")
        nonce = new_nonce()
        to_rank, to_listener = session_keys(self.job_key, challenge.nonce, nonce)
        frame = self.tx.seal(dataclasses.replace(reg, challenge=challenge.nonce, nonce=nonce))
        self.listener_nonce, self.nonce = challenge.nonce, nonce
        self.tx.rekey(to_listener, 1)
        self.dec.rekey(to_rank, 1, P.MAX_PAYLOAD)
        return frame
