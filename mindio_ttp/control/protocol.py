"""The control-plane wire format: the only code in the runtime that turns bytes into messages.

Frame = header (magic b"TP", version u8, type u8, sequence number u64, payload length u32, big
endian) + JSON payload + HMAC-SHA256(key, header + payload). Every message type is a named
dataclass whose field types are checked on decode, so a peer with the wrong key, another version,
a truncated or garbled stream is rejected with `ProtocolError` before any field reaches
controller logic. The key is the job key for the two handshake frames and a per-connection,
per-direction session key afterwards (session.py); the sequence number counts the frames of one
direction of one connection, so a replayed, reordered or dropped frame is refused too.
A stream that produced one bad frame cannot be re-synchronised, so callers close it.
"""

from __future__ import annotations

import hmac
import json
import math
import struct
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple, Type

MAGIC = b"TP"
VERSION = 2  # 2: challenge-response handshake, session keys, sequence numbers
HEADER = struct.Struct("!2sBBQI")
_PREFIX = struct.Struct("!2sB")  # magic and version: checked before the rest of a header
MAC_LEN = 32
MAX_PAYLOAD = 16 * 1024 * 1024


def pre_auth_max_payload(world_size: int) -> int:
    """The frame cap until a connection has registered: a Register frame carries the rank's DP
    group (at most 8 bytes a rank in JSON), so this fits the largest legal one, and an
    unauthenticated peer cannot make the listener buffer more per connection."""
    return 4096 + 8 * world_size


class ProtocolError(ValueError):
    """A frame that is malformed, unauthenticated, of another version or an unknown type."""


# -- field checkers -------------------------------------------------------------------------------
def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _opt_int(v: Any) -> bool:
    return v is None or _int(v)


def _float(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _str(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 65536


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_int(x) for x in v)


def _backups(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(b, list) and len(b) == 3 and _int(b[0]) and _str(b[1]) and _int(b[2])
        and 0 <= b[2] <= 65535 for b in v)


_CHECKERS: Dict[str, Callable[[Any], bool]] = {
    "int": _int, "Optional[int]": _opt_int, "float": _float, "bool": _bool, "str": _str,
    "List[int]": _int_list, "List[List[Any]]": _backups,
}


@dataclass
class Message:
    TYPE: ClassVar[int] = 0


_REGISTRY: Dict[int, Type[Message]] = {}
_SCHEMA: Dict[Type[Message], Tuple[Tuple[str, Callable[[Any], bool]], ...]] = {}


def _message(code: int) -> Callable[[Type[Message]], Type[Message]]:
    def deco(cls: Type[Message]) -> Type[Message]:
        cls.TYPE = code
        assert code not in _REGISTRY, code
        for f in fields(cls):
            assert f.type in _CHECKERS, (cls.__name__, f.name, f.type)
        _REGISTRY[code] = cls
        _SCHEMA[cls] = tuple((f.name, _CHECKERS[f.type]) for f in fields(cls))
        return cls
    return deco


@_message(1)
@dataclass
class Register(Message):
    """Processor → controller, first frame on every connection (also after a failover)."""
    rank: int
    world_size: int
    dp_ranks: List[int]
    replica: int
    host: str
    standby_port: int
    pid: int
    step: Optional[int]
    updating: bool
    locked: bool
    failover: bool
    challenge: str = ""  # the listener's nonce, echoed: binds this frame to one connection
    nonce: str = ""  # the rank's own fresh nonce (session.py)


@_message(18)
@dataclass
class Challenge(Message):
    """Listener → processor, first frame on every connection: a fresh random nonce."""
    nonce: str


@_message(2)
@dataclass
class RegisterAck(Message):
    role: str
    controller_rank: int
    backups: List[List[Any]] = field(default_factory=list)  # [rank, host, port], in order


@_message(3)
@dataclass
class Reject(Message):
    reason: str


@_message(4)
@dataclass
class Heartbeat(Message):
    rank: int
    seq: int
    step: Optional[int]
    updating: bool


@_message(5)
@dataclass
class HeartbeatAck(Message):
    seq: int


@_message(6)
@dataclass
class Backups(Message):
    backups: List[List[Any]]


@_message(7)
@dataclass
class FaultReport(Message):
    """A rank reports its own fault: `kind` is "exception", "preempted" or "controller_lost"."""
    rank: int
    kind: str
    detail: str


@_message(8)
@dataclass
class Lock(Message):
    """Fault: start no new optimizer update (ttp_start_updating_os blocks) and report
    (step, updating) at once (phase 1)."""
    flow_id: int


@_message(17)
@dataclass
class AdvanceTo(Message):
    """Phase 2: a rank below `limit` may finish updates up to step `limit` (its partners are
    there already); wait up to `grace` s for that, then stop for good (TTPForceStop) and
    report the final state."""
    flow_id: int
    limit: int
    grace: float


@_message(9)
@dataclass
class StateReport(Message):
    flow_id: int
    phase: int
    rank: int
    step: Optional[int]
    updating: bool


@_message(10)
@dataclass
class SaveOrder(Message):
    """`store` is "host:port" of a TCPStore the ordering controller hosts for this save alone
    (the chosen ranks build their gloo groups on it, not on the job's rendezvous store, which
    dies with node 0); `tag` is a random per-order token: the store-key prefix and the name of
    this flow's own staging directory."""
    flow_id: int
    step: int
    save_ranks: List[int]
    time_limit: float
    store: str
    tag: str


@_message(11)
@dataclass
class SaveResult(Message):
    flow_id: int
    rank: int
    ok: bool
    error: str
    seconds: float


@_message(12)
@dataclass
class RenameOrder(Message):
    flow_id: int
    step: int
    time_limit: float


@_message(13)
@dataclass
class RenameResult(Message):
    flow_id: int
    rank: int
    ok: bool
    error: str
    seconds: float


@_message(14)
@dataclass
class ExitOrder(Message):
    flow_id: int
    outcome: str
    step: Optional[int]
    ranks: List[int]
    exit_code: int
    reason: str


@_message(15)
@dataclass
class Goodbye(Message):
    """The rank's train returned normally: its disconnect is not a fault."""
    rank: int


@_message(16)
@dataclass
class Closing(Message):
    """The controller stops after a normal end of training: do not fail over."""
    reason: str


# -- in-memory recovery (docs/recovery.md) ------------------------------------------------------
@_message(40)
@dataclass
class RecoverOrder(Message):
    """Controller → every survivor: leave the step, roll back to `step`, rejoin the world on the
    TCPStore at `store` ("host:port"); `lost` are replaced; READY is awaited `deadline` s."""
    flow_id: int
    recovery_id: int
    step: int
    lost: List[int]
    store: str
    deadline: float


@_message(41)
@dataclass
class ReplaceOrder(Message):
    """Controller → one survivor on the lost rank's host: ask that host's launcher (through
    this rank's TTP_RUN_DIR) to start a replacement for `rank`; `controller` is the acting
    controller's "host:port", where the replacement registers."""
    recovery_id: int
    flow_id: int
    rank: int
    step: int
    lost: List[int]
    store: str
    controller: str
    deadline: float


@_message(42)
@dataclass
class ReplaceStatus(Message):
    """Relay → controller: what the launcher did with the request (started, exited, failed)."""
    recovery_id: int
    rank: int
    state: str
    pid: int
    detail: str


@_message(43)
@dataclass
class RecoverReady(Message):
    """Any rank → controller: it holds the recovery's step, checked against the other copies
    by hash (`ok`), or why not; `digest` summarises its state for the log."""
    recovery_id: int
    rank: int
    ok: bool
    detail: str
    digest: str
    seconds: float


@_message(44)
@dataclass
class RecoverCommit(Message):
    """Controller → every rank: every rank is ready; train on."""
    recovery_id: int


# -- codec ---------------------------------------------------------------------------------------
def encode_payload(msg: Message) -> bytes:
    """The JSON body alone, so one message sent to many connections is serialised once."""
    body = {name: getattr(msg, name) for name, _ in _SCHEMA[type(msg)]}
    payload = json.dumps(body, separators=(",", ":")).encode()
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"{type(msg).__name__} payload is {len(payload)} bytes, over "
                            f"{MAX_PAYLOAD}")
    return payload


def seal(code: int, payload: bytes, key: bytes, seq: int) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, code, seq, len(payload))
    data = head + payload
    return data + hmac.digest(key, data, "sha256")


def encode(msg: Message, key: bytes, seq: int = 0) -> bytes:
    return seal(msg.TYPE, encode_payload(msg), key, seq)


def _decode_payload(code: int, payload: bytes) -> Message:
    cls = _REGISTRY.get(code)
    if cls is None:
        raise ProtocolError(f"unknown message type {code}")
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"{cls.__name__}: payload is not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{cls.__name__}: payload is not an object")
    schema = _SCHEMA[cls]
    if len(obj) != len(schema) or any(name not in obj for name, _ in schema):
        raise ProtocolError(f"{cls.__name__}: fields {sorted(obj)} != "
                            f"{sorted(n for n, _ in schema)}")
    for name, check in schema:
        if not check(obj[name]):
            raise ProtocolError(f"{cls.__name__}.{name}: bad value {obj[name]!r:.80}")
    return cls(**obj)


class FrameDecoder:
    """Incremental decoder for one stream: feed bytes, get whole messages. Raises ProtocolError
    on the first bad frame; the decoder (and the connection) is unusable afterwards.

    Frames must carry the sequence numbers `seq`, `seq + 1`, ... With `handshake=True` a feed
    returns after the first message and keeps the rest buffered: the handshake frame changes
    the key, so the owner calls `rekey` and then `feed(b"")` for the frames behind it."""

    def __init__(self, key: bytes, max_payload: int = MAX_PAYLOAD, *, seq: int = 0,
                 handshake: bool = False) -> None:
        self._key = key
        self._max = max_payload
        self._seq = seq
        self._handshake = handshake
        self._held = False  # a handshake frame was returned; the rest waits for rekey
        self._buf = bytearray()

    def rekey(self, key: bytes, seq: int, max_payload: Optional[int] = None) -> None:
        """Switch to the session key after the handshake frame; ends handshake mode."""
        self._key, self._seq = key, seq
        self._handshake = self._held = False
        if max_payload is not None:
            self._max = max_payload

    def feed(self, data: bytes) -> List[Message]:
        self._buf += data
        out: List[Message] = []
        if self._held and len(self._buf) > HEADER.size + self._max + MAC_LEN:
            raise ProtocolError(f"{len(self._buf)} bytes sent behind a handshake frame")
        while len(self._buf) >= _PREFIX.size and not self._held:
            magic, version = _PREFIX.unpack_from(self._buf)
            if magic != MAGIC:
                raise ProtocolError(f"bad magic {bytes(magic)!r}: not a TTP peer")
            if version != VERSION:
                raise ProtocolError(f"peer speaks TTP protocol version {version}, this runtime "
                                    f"speaks {VERSION}: run the same mindio_ttp on every rank")
            if len(self._buf) < HEADER.size:
                break
            _, _, code, seq, length = HEADER.unpack_from(self._buf)
            if length > self._max:
                raise ProtocolError(f"frame of {length} bytes exceeds {self._max}")
            end = HEADER.size + length + MAC_LEN
            if len(self._buf) < end:
                break
            body = bytes(self._buf[: HEADER.size + length])
            mac = bytes(self._buf[HEADER.size + length: end])
            del self._buf[:end]
            want = hmac.digest(self._key, body, "sha256")
            if not hmac.compare_digest(mac, want):
                raise ProtocolError("bad HMAC: peer does not share TTP_AUTH_KEY (or the frame "
                                    "belongs to another connection)")
            if seq != self._seq:
                raise ProtocolError(f"frame sequence number {seq}, expected {self._seq}: a "
                                    "replayed, reordered or dropped frame")
            self._seq += 1
            out.append(_decode_payload(code, body[HEADER.size:]))
            self._held = self._handshake
        return out

    def authenticated(self, max_payload: int = MAX_PAYLOAD) -> None:
        """The peer registered with a valid MAC: lift the pre-authentication frame cap."""
        self._max = max_payload

    @property
    def pending(self) -> int:
        return len(self._buf)


def decode_one(data: bytes, key: bytes, seq: int = 0) -> Message:
    """Decode exactly one whole frame (tests and tools)."""
    dec = FrameDecoder(key, seq=seq)
    msgs = dec.feed(data)
    if len(msgs) != 1 or dec.pending:
        raise ProtocolError(f"expected one whole frame, got {len(msgs)} and {dec.pending} "
                            "bytes left over")
    return msgs[0]


MESSAGE_TYPES: Dict[int, Type[Message]] = dict(_REGISTRY)
