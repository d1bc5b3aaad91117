"""The control-plane wire format: the only code in the runtime that turns bytes into messages.

Frame = header (magic b"TP", version u8, type u8, sequence number u64, payload length u32, big
endian) + payload + HMAC-SHA256(key, header + payload). The payload is JSON, except for the
messages every rank sends or gets at a steady rate or in every flow (heartbeats and their acks,
lock, advance, state reports): those are fixed binary structs, so the controller's cost per
frame is one struct, one MAC and the system calls. Lists of ranks travel as arithmetic blocks
(ranksets.py), so no order grows with the job; each block is increasing and a list names no
rank twice (version 5: an inverted block used to let one key holder register any order).
Every message type is a named dataclass. The key is the job key for the two handshake frames
and a per-connection, per-direction session key afterwards (session.py); the sequence number
counts the frames of one direction of one connection, so a replayed, reordered or dropped
frame is refused too.
A stream that produced one bad frame cannot be re-synchronised, so callers close it.

This module is also the one validation layer. A valid MAC proves that a key holder made the
frame, not that its content is sane (a bug, or a compromised host, holds the key too), so every
field of every decoded message is checked here, for type and range, before any other code sees
it: integers within their ranges (ranks below `MAX_RANKS`, ports within 0..65535, steps not
negative), strings valid UTF-8 and bounded (a lone surrogate is refused: it cannot be encoded),
host fields real IP addresses, lists bounded, store values well-formed base64 of bounded size.
A message that fails is a `ProtocolError`, like a bad MAC: the listener closes that connection
only. The encoder applies the same checks, so this runtime never sends what it would refuse.
"""

from __future__ import annotations

import binascii
import hmac
import ipaddress
import json
import math
import re
import struct
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple, Type

from mindio_ttp.config import MAX_WORLD, Outcome
from mindio_ttp.control.wire import ranksets

MAGIC = b"TP"
# 2: challenge-response handshake, session keys, sequence numbers
# 3: validated fields, the authenticated store (StoreRequest/StoreReply), the launch's fault id
#    in RegisterAck, SaveOrder.store names a store namespace
# 4: binary heartbeats / acks / lock / advance / state reports, rank lists as blocks
# 5: rank blocks strictly increasing (an inverted or self-overlapping block is refused), no
#    rank twice in a list, a Register's DP group a multiple of its replica count (issue 24)
VERSION = 5
HEADER = struct.Struct("!2sBBQI")
_PREFIX = struct.Struct("!2sB")  # magic and version: checked before the rest of a header
MAC_LEN = 32
MAX_PAYLOAD = 16 * 1024 * 1024
MAX_RANKS = MAX_WORLD  # ranks are 0 .. MAX_RANKS - 1
MAX_TEXT = 65536  # characters of a free-text field (reasons, errors)
MAX_STEP = 2**63 - 1
MAX_SECONDS = 1e9
# the authenticated store (control/controller/keyspace.py, control/rank/authstore.py)
STORE_KEY_MAX = 1024  # characters of one key
STORE_VALUE_MAX = 1024 * 1024  # bytes of one value
STORE_KEYS_MAX = 64  # keys of one check/wait
STORE_OPS = ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys")
_STORE_ARITY = {  # op: (keys, values)
    "set": ((1, 1), (1, 1)), "get": ((1, 1), (0, 0)), "add": ((1, 1), (0, 0)),
    "compare_set": ((1, 1), (2, 2)), "check": ((1, STORE_KEYS_MAX), (0, 0)),
    "wait": ((1, STORE_KEYS_MAX), (0, 0)), "delete_key": ((1, 1), (0, 0)),
    "num_keys": ((0, 0), (0, 0)),
}
# "collective": a collective failed because of another rank's fault (hooks.fault_kind)
FAULT_KINDS = ("exception", "preempted", "controller_lost", "collective")


def pre_auth_max_payload(world_size: int) -> int:
    """The frame cap until a connection has registered: a Register frame carries the rank's DP
    group as blocks (ranksets.py: one for a regular group, at most ~24 bytes a rank for a group
    with no structure at all), so this fits the largest legal one, and an unauthenticated peer
    cannot make the listener buffer more per connection."""
    return 4096 + 24 * world_size


class ProtocolError(ValueError):
    """A frame that is malformed, unauthenticated, of another version or an unknown type, or a
    message whose fields are out of range."""


# -- field checkers: value -> bool ----------------------------------------------------------------
Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _opt_int(v: Any) -> bool:
    return v is None or _int(v)


def _float(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _str(v: Any) -> bool:
    """Bounded, and encodable: JSON can carry a lone surrogate ("\\ud800"), which no str method
    that encodes (a socket address, a file name, hmac) accepts."""
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_RANKS and all(_int(x) for x in v)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= MAX_RANKS and all(_str(x) for x in v)


def ip_address(v: Any) -> bool:
    """An address a rank can connect to: an IP literal (what a processor reports, its socket's
    own address), not a name, not unspecified or multicast."""
    if not _str(v) or not 0 < len(v) <= 64:
        return False
    try:
        addr = ipaddress.ip_address(v)
    except ValueError:
        return False
    return not (addr.is_unspecified or addr.is_multicast)


def _rank(v: Any) -> bool:
    return _int(v) and 0 <= v < MAX_RANKS


def _backups(v: Any) -> bool:
    """[[rank, host, port], ...]: at most 16 standby controllers, each reachable."""
    return isinstance(v, list) and len(v) <= 16 and all(
        isinstance(b, list) and len(b) == 3 and _rank(b[0]) and ip_address(b[1])
        and _int(b[2]) and 0 < b[2] <= 65535 for b in v)


Ranks = List[int]  # a field of this type travels as ranksets blocks, checked as a list
_TYPES: Dict[str, Check] = {
    "int": _int, "Optional[int]": _opt_int, "float": _float, "bool": _bool, "str": _str,
    "List[int]": _int_list, "List[str]": _str_list, "List[List[Any]]": _backups,
    "Ranks": _int_list,
    "bytes": lambda v: isinstance(v, bytes) and len(v) <= MAX_PAYLOAD,
}
# binary messages: struct codes per field type; None travels as the one int64 no step is
_BINARY_CODES = {"int": "q", "Optional[int]": "q", "bool": "B", "float": "d"}
_NONE = -(2**63)


def ints(lo: int, hi: int) -> Check:
    return lambda v: lo <= v <= hi


def opt_ints(lo: int, hi: int) -> Check:
    return lambda v: v is None or lo <= v <= hi


def seconds(v: float) -> bool:
    return 0 <= v <= MAX_SECONDS


def one_of(*values: Any) -> Check:
    allowed = frozenset(values)
    return lambda v: v in allowed


def text(max_len: int, pattern: str = "") -> Check:
    rx = re.compile(pattern) if pattern else None
    return lambda v: len(v) <= max_len and (rx is None or rx.fullmatch(v) is not None)


def ranks(v: List[int]) -> bool:
    """Ranks in range, none twice (a DP group, savers, lost ranks: sets in an order)."""
    return all(0 <= r < MAX_RANKS for r in v) and len(set(v)) == len(v)


def _b64(v: str) -> bool:
    if len(v) > 4 * ((STORE_VALUE_MAX + 2) // 3):
        return False
    try:
        binascii.a2b_base64(v, strict_mode=True)
    except (binascii.Error, ValueError):
        return False
    return True


def b64encode(value: bytes) -> str:
    """A store value as it travels in a JSON field."""
    return binascii.b2a_base64(value, newline=False).decode("ascii")


def b64decode(text: str) -> bytes:
    return binascii.a2b_base64(text, strict_mode=True)


def b64_values(max_n: int) -> Check:
    return lambda v: len(v) <= max_n and all(_b64(x) for x in v)


NONNEG = ints(0, 2**63 - 1)
RANK = ints(0, MAX_RANKS - 1)
STEP = opt_ints(0, MAX_STEP)
NONCE = text(128, "(?:[0-9a-f]{2}){16,64}")  # session.new_nonce: 16 random bytes, hex
FAULT_ID = text(32, "(?:[0-9a-f]{32})?")  # claim.new_fault_id; "" where unknown
TAG = text(64, "[0-9a-f]{16,64}")
NAMESPACE = text(128, r"[A-Za-z0-9._\-][A-Za-z0-9._/\-]{0,127}")


def store_keys(v: List[str]) -> bool:
    return len(v) <= STORE_KEYS_MAX and all(len(k) <= STORE_KEY_MAX for k in v)


@dataclass
class Message:
    TYPE: ClassVar[int] = 0

    def problem(self) -> str:
        """What is wrong across fields ("" when nothing): checked after every field is."""
        return ""


_REGISTRY: Dict[int, Type[Message]] = {}
_SCHEMA: Dict[Type[Message], Tuple[Tuple[str, Check, Optional[Check]], ...]] = {}
_RANKS: Dict[Type[Message], Tuple[str, ...]] = {}  # fields sent as blocks
_RAW: Dict[Type[Message], str] = {}  # messages whose payload is one bytes field, as it is


class _Binary:
    """A message as one fixed struct: ints are int64, None is the one int64 a step or id never
    is, bools are 0/1. The struct settles each field's type, so what is checked per frame
    (decoding and encoding alike) is each field's range, and that floats are finite: the
    checks `problem` makes, without the per-field type tests that a heartbeat at 10,000 a
    second would pay for nothing."""

    def __init__(self, cls: Type[Message], ranges: Dict[str, Check]) -> None:
        assert cls.problem is Message.problem, f"{cls.__name__}: no cross-field checks in binary"
        kinds = [str(f.type) for f in fields(cls)]
        self.cls, self.names = cls, [f.name for f in fields(cls)]
        self.struct = struct.Struct("!" + "".join(_BINARY_CODES[k] for k in kinds))
        self.optional = [i for i, k in enumerate(kinds) if k == "Optional[int]"]
        self.bools = [i for i, k in enumerate(kinds) if k == "bool"]
        self.checks = [(i, ranges.get(n) or (_float if k == "float" else None))
                       for i, (n, k) in enumerate(zip(self.names, kinds))]
        self.checks = [(i, c) for i, c in self.checks if c is not None]

    def _check(self, values: List[Any]) -> None:
        for i, check in self.checks:
            if not check(values[i]):
                raise ProtocolError(f"{self.cls.__name__}.{self.names[i]}: bad value "
                                    f"{_show(values[i])}")

    def pack(self, msg: Message) -> bytes:
        values = [getattr(msg, n) for n in self.names]
        try:
            self._check(values)
        except ProtocolError as exc:
            raise ProtocolError(f"refusing to send {exc}") from None
        for i in self.optional:
            if values[i] is None:
                values[i] = _NONE
            elif values[i] == _NONE:
                raise ProtocolError(f"{_NONE} is not representable (it stands for None)")
        try:
            return self.struct.pack(*values)
        except struct.error as exc:
            raise ProtocolError(f"{self.cls.__name__}: {exc}") from None

    def unpack(self, payload: bytes) -> Message:
        name = self.cls.__name__
        if len(payload) != self.struct.size:
            raise ProtocolError(f"{name}: payload is {len(payload)} bytes, not "
                                f"{self.struct.size}")
        values = list(self.struct.unpack(payload))
        for i in self.optional:
            if values[i] == _NONE:
                values[i] = None
        for i in self.bools:
            if values[i] > 1:
                raise ProtocolError(f"{name}.{self.names[i]}: bad value {values[i]}")
            values[i] = bool(values[i])
        self._check(values)
        return self.cls(*values)


_BINARY: Dict[Type[Message], _Binary] = {}


def _message(code: int, binary: bool = False, raw: bool = False,
             registry: Optional[Dict[int, Type[Message]]] = None,
             **ranges: Check) -> Callable[[Type[Message]], Type[Message]]:
    """Register a message class: every field is type-checked by its annotation (bounded by
    default: 64-bit ints, strings of MAX_TEXT encodable characters, lists of MAX_RANKS), and
    `ranges` narrows named fields further. `binary`: sent as a fixed struct (ints, optional
    ints, bools and floats only). `raw`: one `bytes` field that is the payload itself (its
    `problem` checks its structure). `registry`: where decoders look the code up (the tiers'
    own messages, control/wire/tier.py, are not this module's: a rank's connection to a
    controller never decodes them)."""
    def deco(cls: Type[Message]) -> Type[Message]:
        reg = _REGISTRY if registry is None else registry
        cls.TYPE = code
        assert code not in reg and code not in _REGISTRY, code
        names = {f.name for f in fields(cls)}
        assert set(ranges) <= names, (cls.__name__, set(ranges) - names)
        for f in fields(cls):
            assert f.type in (_BINARY_CODES if binary else _TYPES), (cls.__name__, f.name)
        if raw:
            assert [f.type for f in fields(cls)] == ["bytes"], cls.__name__
            _RAW[cls] = fields(cls)[0].name
        reg[code] = cls
        _SCHEMA[cls] = tuple((f.name, _TYPES[f.type], ranges.get(f.name)) for f in fields(cls))
        _RANKS[cls] = tuple(f.name for f in fields(cls) if f.type == "Ranks")
        if binary:
            _BINARY[cls] = _Binary(cls, ranges)
        return cls
    return deco


@_message(1, rank=RANK, world_size=ints(1, MAX_RANKS), dp_ranks=ranks,
          replica=ints(1, MAX_RANKS), host=ip_address, standby_port=ints(0, 65535),
          pid=ints(0, 2**31 - 1), step=STEP, challenge=NONCE, nonce=NONCE)
@dataclass
class Register(Message):
    """Processor → controller, first frame on every connection (also after a failover).
    `host` and `standby_port` are where this rank's standby controller listens (port 0: none);
    the controller hands them to every rank as a failover target, so they are checked here."""
    rank: int
    world_size: int
    dp_ranks: Ranks
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

    def problem(self) -> str:
        # every shard has as many holders (DP position i holds shard i % replica): a group
        # of another size is no DP group of this job (the controller also checks `replica`)
        if not self.dp_ranks or len(self.dp_ranks) % self.replica:
            return (f"a DP group of {len(self.dp_ranks)} rank(s) cannot hold {self.replica} "
                    "shard(s) with as many holders each")
        return ""


@_message(18, nonce=NONCE)
@dataclass
class Challenge(Message):
    """Listener → processor, first frame on every connection: a fresh random nonce."""
    nonce: str


@_message(2, role=one_of("primary", "standby", "agent"), controller_rank=RANK,
          fault_id=FAULT_ID)
@dataclass
class RegisterAck(Message):
    """`fault_id`: the launch's fault id (faulttime/claim.py), made by the primary controller
    and handed to every rank here, over the authenticated channel; a standby hands on the one
    its own rank got ("" if it has none)."""
    role: str
    controller_rank: int
    backups: List[List[Any]] = field(default_factory=list)  # [rank, host, port], in order
    fault_id: str = ""


@_message(3)
@dataclass
class Reject(Message):
    reason: str


@_message(4, binary=True, rank=RANK, seq=NONNEG, step=STEP)
@dataclass
class Heartbeat(Message):
    rank: int
    seq: int
    step: Optional[int]
    updating: bool


@_message(5, binary=True, seq=NONNEG)
@dataclass
class HeartbeatAck(Message):
    seq: int


@_message(6)
@dataclass
class Backups(Message):
    backups: List[List[Any]]


@_message(7, rank=RANK, kind=one_of(*FAULT_KINDS))
@dataclass
class FaultReport(Message):
    """A rank reports a fault: "exception" (its own), "preempted", "controller_lost", or
    "collective" (a collective failed under it because of another rank's fault)."""
    rank: int
    kind: str
    detail: str


@_message(8, binary=True, flow_id=NONNEG)
@dataclass
class Lock(Message):
    """Fault: start no new optimizer update (ttp_start_updating_os blocks) and report
    (step, updating) at once (phase 1)."""
    flow_id: int


@_message(17, binary=True, flow_id=NONNEG, limit=ints(0, MAX_STEP), grace=seconds)
@dataclass
class AdvanceTo(Message):
    """Phase 2: a rank below `limit` may finish updates up to step `limit` (its partners are
    there already); wait up to `grace` s for that, then stop for good (TTPForceStop) and
    report the final state."""
    flow_id: int
    limit: int
    grace: float


@_message(9, binary=True, flow_id=NONNEG, phase=one_of(1, 2), rank=RANK, step=STEP)
@dataclass
class StateReport(Message):
    flow_id: int
    phase: int
    rank: int
    step: Optional[int]
    updating: bool


@_message(10, flow_id=NONNEG, step=ints(0, MAX_STEP), save_ranks=ranks, time_limit=seconds,
          store=NAMESPACE, tag=TAG)
@dataclass
class SaveOrder(Message):
    """`store` is the namespace of the authenticated store (control/rank/authstore.py) the chosen
    ranks build their gloo groups on: the acting controller keeps it over their TTP
    connections, for this order alone, and drops it when the flow ends (the job's rendezvous
    store dies with node 0 and is open to anyone); `tag` is a random per-order token: the name
    of this flow's own staging directory."""
    flow_id: int
    step: int
    save_ranks: Ranks
    time_limit: float
    store: str
    tag: str


@_message(11, flow_id=NONNEG, rank=RANK, seconds=seconds)
@dataclass
class SaveResult(Message):
    flow_id: int
    rank: int
    ok: bool
    error: str
    seconds: float


@_message(12, flow_id=NONNEG, step=ints(0, MAX_STEP), time_limit=seconds)
@dataclass
class RenameOrder(Message):
    flow_id: int
    step: int
    time_limit: float


@_message(13, flow_id=NONNEG, rank=RANK, seconds=seconds)
@dataclass
class RenameResult(Message):
    flow_id: int
    rank: int
    ok: bool
    error: str
    seconds: float


@_message(14, flow_id=NONNEG, outcome=one_of(*(o.value for o in Outcome)), step=STEP,
          ranks=ranks, exit_code=ints(0, 255))
@dataclass
class ExitOrder(Message):
    flow_id: int
    outcome: str
    step: Optional[int]
    ranks: Ranks
    exit_code: int
    reason: str


@_message(15, rank=RANK)
@dataclass
class Goodbye(Message):
    """The rank's train returned normally: its disconnect is not a fault."""
    rank: int


@_message(16)
@dataclass
class Closing(Message):
    """The controller stops after a normal end of training: do not fail over."""
    reason: str


@_message(30, req=ints(1, 2**63 - 1), ns=NAMESPACE, op=one_of(*STORE_OPS),
          keys=store_keys, values=b64_values(2), timeout=seconds)
@dataclass
class StoreRequest(Message):
    """Rank → controller: one operation on the authenticated store (control/rank/authstore.py).
    `values` are base64; `amount` is add's increment; `timeout` bounds a get or wait."""
    req: int
    ns: str
    op: str
    keys: List[str]
    values: List[str]
    amount: int
    timeout: float

    def problem(self) -> str:
        (klo, khi), (vlo, vhi) = _STORE_ARITY[self.op]
        if not (klo <= len(self.keys) <= khi and vlo <= len(self.values) <= vhi):
            return (f"{self.op} takes {klo}..{khi} key(s) and {vlo}..{vhi} value(s), got "
                    f"{len(self.keys)} and {len(self.values)}")
        return ""


@_message(31, req=ints(1, 2**63 - 1), values=b64_values(1))
@dataclass
class StoreReply(Message):
    """Controller → rank: the answer to StoreRequest `req`: `values` (base64: get and
    compare_set), `number` (add, num_keys; 1/0 for check and delete_key), or `error`."""
    req: int
    ok: bool
    values: List[str]
    number: int
    error: str


# -- in-memory recovery (docs/recovery.md) ------------------------------------------------------
# "host:port" as recovery.rank.format_address writes it (the acting controller)
ADDRESS = text(80, r"(?:\[[0-9A-Fa-f:.]+\]|[0-9.]+):[0-9]{1,5}")
REPLACE_STATES = ("started", "exited", "failed")


@_message(40, flow_id=NONNEG, recovery_id=ints(1, 2**62), step=ints(0, MAX_STEP), lost=ranks,
          rendezvous=NAMESPACE, deadline=seconds)
@dataclass
class RecoverOrder(Message):
    """Controller → every survivor: leave the step, roll back to `step`, rejoin the world on
    the authenticated store's namespace `rendezvous`; `lost` are replaced; READY is awaited
    `deadline` s."""
    flow_id: int
    recovery_id: int
    step: int
    lost: List[int]
    rendezvous: str
    deadline: float


@_message(41, recovery_id=ints(1, 2**62), flow_id=NONNEG, rank=RANK, step=ints(0, MAX_STEP),
          lost=ranks, rendezvous=NAMESPACE, controller=ADDRESS, deadline=seconds,
          dp_ranks=ranks)
@dataclass
class ReplaceOrder(Message):
    """Controller → one survivor on the lost rank's host: ask that host's launcher (through
    this rank's TTP_RUN_DIR) to start a replacement for `rank`; `controller` is the acting
    controller's "host:port", where the replacement registers (with `dp_ranks`, the lost
    rank's DP group) before it joins the new world on `rendezvous`."""
    recovery_id: int
    flow_id: int
    rank: int
    step: int
    lost: List[int]
    rendezvous: str
    controller: str
    deadline: float
    dp_ranks: List[int]


@_message(42, recovery_id=ints(1, 2**62), rank=RANK, state=one_of(*REPLACE_STATES),
          pid=ints(0, 2**31 - 1))
@dataclass
class ReplaceStatus(Message):
    """Relay → controller: what the launcher did with the request (started, exited, failed).
    Taken only from the relay the recovery's plan chose for `rank`, a lost rank; from anyone
    else it is refused and logged (control/controller/recovery_coordinator.py)."""
    recovery_id: int
    rank: int
    state: str
    pid: int
    detail: str


@_message(43, recovery_id=ints(1, 2**62), rank=RANK, digest=text(64, "(?:[0-9a-f]{64})?"),
          seconds=seconds)
@dataclass
class RecoverReady(Message):
    """Any rank → controller: it holds the recovery's step, checked against the other copies
    by hash (`ok`), or why not; `digest` summarises its state for the log (the controller
    compares no digests). `rank` is the sender's own: a RecoverReady for another is refused."""
    recovery_id: int
    rank: int
    ok: bool
    detail: str
    digest: str
    seconds: float


@_message(44, recovery_id=ints(1, 2**62))
@dataclass
class RecoverCommit(Message):
    """Controller → every rank: every rank is ready; train on."""
    recovery_id: int


# -- codec ---------------------------------------------------------------------------------------
def problem(msg: Message) -> str:
    """What is wrong with `msg` ("" when nothing): the checks every decoded message passes."""
    for name, of_type, in_range in _SCHEMA[type(msg)]:
        v = getattr(msg, name)
        if not of_type(v) or (in_range is not None and not in_range(v)):
            return f"{type(msg).__name__}.{name}: bad value {_show(v)}"
    bad = msg.problem()
    return f"{type(msg).__name__}: {bad}" if bad else ""


def _show(v: Any) -> str:
    return ascii(v)[:80]


def encode_payload(msg: Message) -> bytes:
    """The body alone, so one message sent to many connections is serialised once.
    Refuses (ProtocolError) a message that the peer's decoder would refuse."""
    binary = _BINARY.get(type(msg))
    if binary is not None:
        return binary.pack(msg)  # its own checks: the struct settles the types
    bad = problem(msg)
    raw = _RAW.get(type(msg))
    if raw is not None:
        if bad:
            raise ProtocolError(f"refusing to send {bad}")
        return bytes(getattr(msg, raw))
    if bad:
        raise ProtocolError(f"refusing to send {bad}")
    body = {name: getattr(msg, name) for name, _, _ in _SCHEMA[type(msg)]}
    for name in _RANKS[type(msg)]:
        body[name] = ranksets.encode(body[name])
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


def _decode_payload(code: int, payload: bytes,
                    registry: Optional[Dict[int, Type[Message]]] = None) -> Message:
    cls = (_REGISTRY if registry is None else registry).get(code)
    if cls is None:
        raise ProtocolError(f"unknown message type {code}")
    binary = _BINARY.get(cls)
    if binary is not None:
        return binary.unpack(payload)
    if cls in _RAW:
        msg = cls(payload)
        bad = msg.problem()
        if bad:
            raise ProtocolError(f"{cls.__name__}: {bad}")
        return msg
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as exc:  # incl. UnicodeDecodeError, huge integers
        raise ProtocolError(f"{cls.__name__}: payload is not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{cls.__name__}: payload is not an object")
    schema = _SCHEMA[cls]
    if len(obj) != len(schema) or any(name not in obj for name, _, _ in schema):
        raise ProtocolError(f"{cls.__name__}: fields {_show(sorted(obj))} != "
                            f"{sorted(n for n, _, _ in schema)}")
    ranks_fields = _RANKS[cls]
    for name in ranks_fields:  # blocks: every rank in range, checked before they are expanded
        if not ranksets.valid_wire(obj[name], MAX_RANKS):
            raise ProtocolError(f"{cls.__name__}.{name}: bad value {_show(obj[name])}")
        try:  # blocks overlapping, or one twice: refused (the answer is cached with the list)
            obj[name] = ranksets.decode(obj[name], MAX_RANKS, unique=True)
        except ValueError:
            raise ProtocolError(f"{cls.__name__}.{name}: a rank named twice in "
                                f"{_show(obj[name])}") from None
    for name, of_type, in_range in schema:
        if name in ranks_fields:
            continue  # the blocks' check covers each rank of the list: O(blocks), not O(ranks)
        v = obj[name]
        if not of_type(v) or (in_range is not None and not in_range(v)):
            raise ProtocolError(f"{cls.__name__}.{name}: bad value {_show(v)}")
    msg = cls(**obj)
    bad = msg.problem()
    if bad:
        raise ProtocolError(f"{cls.__name__}: {bad}")
    return msg


class FrameDecoder:
    """Incremental decoder for one stream: feed bytes, get whole messages. Raises ProtocolError
    on the first bad frame; the decoder (and the connection) is unusable afterwards.

    Frames must carry the sequence numbers `seq`, `seq + 1`, ... With `handshake=True` a feed
    returns after the first message and keeps the rest buffered: the handshake frame changes
    the key, so the owner calls `rekey` and then `feed(b"")` for the frames behind it."""

    def __init__(self, key: bytes, max_payload: int = MAX_PAYLOAD, *, seq: int = 0,
                 handshake: bool = False,
                 registry: Optional[Dict[int, Type[Message]]] = None,
                 first_keys: Optional[Dict[int, bytes]] = None,
                 unverified_first: Tuple[int, ...] = ()) -> None:
        self._key = key
        self._max = max_payload
        self._seq = seq
        self._handshake = handshake
        self._held = False  # a handshake frame was returned; the rest waits for rekey
        self._buf = bytearray()
        self._registry = registry  # None: this module's messages
        # the first frame only: the key its type is made with (a listener that takes ranks
        # under the job key and node agents under the hop key), or no MAC check at all for
        # these types (a node agent reading a listener's challenge, made with a key it does
        # not hold: a forged nonce only makes the session keys disagree)
        self._first_keys = first_keys or {}
        self._unverified_first = unverified_first
        self._first = True

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
            first, self._first = self._first, False
            if not (first and code in self._unverified_first):
                key = self._first_keys.get(code, self._key) if first else self._key
                want = hmac.digest(key, body, "sha256")
                if not hmac.compare_digest(mac, want):
                    raise ProtocolError("bad HMAC: peer does not share TTP_AUTH_KEY (or the "
                                        "frame belongs to another connection)")
            if seq != self._seq:
                raise ProtocolError(f"frame sequence number {seq}, expected {self._seq}: a "
                                    "replayed, reordered or dropped frame")
            self._seq += 1
            out.append(_decode_payload(code, body[HEADER.size:], self._registry))
            self._held = self._handshake
        return out

    def wanted(self) -> int:
        """Bytes still missing from the frame being received: its header, or its payload and
        MAC once the header is in (at least 1: a bad header raises on the next feed). A
        listener reads no more than this from a peer that has not registered."""
        n = len(self._buf)
        if n < HEADER.size:
            return HEADER.size - n
        length = HEADER.unpack_from(self._buf)[4]
        return max(1, HEADER.size + min(length, self._max + 1) + MAC_LEN - n)

    def release(self) -> None:
        """Drop what is buffered (the connection is closed): the memory goes at once, not when
        the last reference to the decoder does."""
        self._buf = bytearray()

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
message = _message  # for the tiers' own messages (control/wire/tier.py)
decode_payload = _decode_payload  # a message carried inside another (an envelope, a Join)
