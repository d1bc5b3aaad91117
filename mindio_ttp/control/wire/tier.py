"""The messages between tiers: rank -> node agent -> relay -> controller, and back.

Framing, MACs, session keys and sequence numbers are protocol.py's and session.py's; these are
the messages a tier connection carries besides them, in a registry of their own (`CODEC`): a
rank's direct connection to a controller never decodes them.

Up the tree:
* `NodeRegister` opens a node agent's connection (to a relay or a controller) under the hop key;
* `Join` carries ranks registering through it: each one the `Register` that rank sent its agent,
  checked again by the controller with protocol.py's own checks;
* `Left`: ranks this subtree lost (dead, hung, gone, moved away, or a lost route);
* `Reports`: the state reports of a flow's phase, many ranks per frame (13 bytes each);
* `Up`: one rank's message (a fault report, a save result, a store request...), as it sent it;
* `TierBeat`: one heartbeat per hop, with the subtree's progress counter and alive count.
Down the tree:
* `NodeAck` or `Redirect` (go to this relay instead), `TierAck`, `Refused` (a rank of a Join
  the controller refused), `UpstreamLost` (the parent lost its own parent: ranks lock);
* `Sealed`: an envelope (envelope.py), forwarded unchanged to every rank it names.
Between a rank and its agent: the rank's own protocol (Register, Heartbeat, StateReport...)
plus `Upstream` (where the controller is), `Sealed` and `UpstreamLost`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Type

from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire.protocol import Ranks

_OWN: Dict[int, Type[P.Message]] = {}
_INC = P.text(32, "[0-9a-f]{32}")
_HOST = P.text(255, r"[A-Za-z0-9_.:\-\[\]]+")


@P.message(60, registry=_OWN, host=P.ip_address, relay_port=P.ints(0, 65535),
           pid=P.ints(0, 2**31 - 1), local_world=P.ints(0, P.MAX_RANKS),
           children=P.ints(0, P.MAX_RANKS), world_size=P.ints(1, P.MAX_RANKS),
           challenge=P.NONCE, nonce=P.NONCE)
@dataclass
class NodeRegister(P.Message):
    """A node agent opens its connection to a relay or a controller. `host`/`relay_port`: where
    it takes other agents if it is made a relay (0: it does not); `children`: agents it already
    serves (a relay failing over keeps its subtree whole); `redirected`: a redirect to a relay
    failed, so the controller takes it itself."""
    host: str
    relay_port: int
    pid: int
    local_world: int
    children: int
    world_size: int
    failover: bool
    redirected: bool
    challenge: str = ""
    nonce: str = ""


@P.message(61, registry=_OWN, role=P.one_of("primary", "standby", "relay"),
           controller_rank=P.RANK, fault_id=P.FAULT_ID, incarnation=_INC, interval=P.seconds)
@dataclass
class NodeAck(P.Message):
    """The parent took the agent. `backups`: the standby controllers, for the agent's own
    failover; `incarnation`: the acting controller's (envelope.py); `interval`: how often the
    parent wants a TierBeat (its TTP_HEARTBEAT_INTERVAL: the judge sets the pace)."""
    role: str
    controller_rank: int
    backups: List[List[Any]] = field(default_factory=list)
    fault_id: str = ""
    incarnation: str = "0" * 32
    interval: float = 0.0


@P.message(62, registry=_OWN, host=P.ip_address, port=P.ints(1, 65535))
@dataclass
class Redirect(P.Message):
    """Connect to the relay at host:port instead (the controller then closes)."""
    host: str
    port: int
    reason: str


@P.message(63, registry=_OWN, raw=True)
@dataclass
class Join(P.Message):
    """Ranks registering through this connection: (u32 length, u32 rank) + that rank's Register
    payload, repeated. The rank in the framing lets a relay route without decoding; the
    controller decodes and checks every Register, and that it is the rank it says."""
    data: bytes

    def problem(self) -> str:
        n, i = len(self.data), 0
        while i < n:
            if i + MEMBER.size > n:
                return "a truncated member"
            length, rank = MEMBER.unpack_from(self.data, i)
            if rank >= P.MAX_RANKS:
                return f"rank {rank} out of range"
            i += MEMBER.size + length
        return "a truncated member" if i != n else ""


MEMBER = struct.Struct("!II")


@P.message(64, registry=_OWN, kind=P.one_of("dead", "hung", "gone", "moved", "lost"),
           ranks=P.ranks)
@dataclass
class Left(P.Message):
    """Ranks this connection no longer serves: `dead` (its process is gone), `hung` (silent
    for TTP_HEARTBEAT_TIMEOUT), `gone` (said goodbye), `moved` (the rank closed its socket and
    lives: it registers elsewhere), `lost` (the route below was lost: the ranks may come back
    another way)."""
    ranks: Ranks
    kind: str
    detail: str


REPORT_HEAD = struct.Struct("!QB")
REPORT = struct.Struct("!IqB")


@P.message(65, registry=_OWN, raw=True)
@dataclass
class Reports(P.Message):
    """A phase's state reports of many ranks: flow id u64, phase u8, then (rank u32, step i64
    (-2^63: none), updating u8) per rank."""
    data: bytes

    def problem(self) -> str:
        n = len(self.data) - REPORT_HEAD.size
        return "" if n >= 0 and n % REPORT.size == 0 else "bad length"


UP = struct.Struct("!IB")
# what a rank may send up through its agent (StateReport travels in Reports)
UP_TYPES = (P.FaultReport, P.SaveResult, P.RenameResult, P.StoreRequest, P.Goodbye,
            P.RecoverReady, P.ReplaceStatus)
_UP_CODES = {c.TYPE: c for c in UP_TYPES}


@P.message(66, registry=_OWN, raw=True)
@dataclass
class Up(P.Message):
    """One rank's message: rank u32, message type u8, its payload."""
    data: bytes

    def problem(self) -> str:
        return "" if len(self.data) >= UP.size else "too short"


@P.message(67, registry=_OWN, raw=True)
@dataclass
class Sealed(P.Message):
    """An envelope (envelope.py), forwarded unchanged."""
    data: bytes


@P.message(68, registry=_OWN, binary=True, seq=P.NONNEG, progress=P.NONNEG, alive=P.NONNEG)
@dataclass
class TierBeat(P.Message):
    """A hop's heartbeat: `progress` counts the step changes its subtree has seen (for
    TTP_STEP_TIMEOUT), `alive` its live ranks."""
    seq: int
    progress: int
    alive: int


@P.message(69, registry=_OWN, binary=True, seq=P.NONNEG)
@dataclass
class TierAck(P.Message):
    seq: int


@P.message(70, registry=_OWN)
@dataclass
class UpstreamLost(P.Message):
    """The sender lost its own parent and fails over for its subtree: ranks stop training
    (lock) until a controller decides, as on a controller's loss."""
    reason: str


@P.message(71, registry=_OWN, rank=P.RANK)
@dataclass
class Refused(P.Message):
    """The controller refused this rank of a Join (the agent tells the rank: a Reject)."""
    rank: int
    reason: str


@P.message(72, registry=_OWN, host=_HOST, port=P.ints(1, 65535),
           local_world=P.ints(0, P.MAX_RANKS))
@dataclass
class Upstream(P.Message):
    """Rank -> its agent, right behind its Register: where the controller is (the address the
    rank was started with) and how many ranks its node runs (0: unknown)."""
    host: str
    port: int
    local_world: int


@P.message(73, registry=_OWN, incarnation=_INC, role=P.one_of("primary", "standby"),
           controller_rank=P.RANK, fault_id=P.FAULT_ID, ranks=P.ranks)
@dataclass
class Welcome(P.Message):
    """Sealed by a controller (an envelope to these ranks): it took them. Each rank checks that
    its own registration nonce is here (envelope.Inbox) and from then on accepts this
    incarnation's envelopes. The rest is what a RegisterAck tells a direct rank."""
    incarnation: str
    role: str
    controller_rank: int
    fault_id: str
    backups: List[List[Any]]
    ranks: List[int]
    nonces: List[str]

    def problem(self) -> str:
        if len(self.ranks) != len(self.nonces):
            return "ranks and nonces differ in length"
        bad = next((n for n in self.nonces if not P.NONCE(n)), None)
        return "" if bad is None else f"bad nonce {bad[:40]!r}"


RESULT_HEAD = struct.Struct("!QB")
RESULT = struct.Struct("!Id")


@P.message(74, registry=_OWN, raw=True)
@dataclass
class Results(P.Message):
    """Save or rename results that succeeded, many ranks per frame: flow id u64, the result's
    message type u8 (SaveResult or RenameResult), then (rank u32, seconds f64) per rank. A
    failure travels alone, as the rank's own message in an `Up` (it carries its error)."""
    data: bytes

    def problem(self) -> str:
        n = len(self.data) - RESULT_HEAD.size
        return "" if n >= 0 and n % RESULT.size == 0 else "bad length"


def ack_due(conn: Any) -> Optional[P.Message]:
    """The one ack for every heartbeat of the read just handled (a loop that fell behind reads
    several, and acking each would keep it behind): a TierAck to a child, a HeartbeatAck to a
    rank; None when no heartbeat came. Clears the connection's due ack."""
    seq, conn.ack_due = conn.ack_due, None
    if seq is None or conn.closed:
        return None
    return TierAck(seq) if conn.child is not None else P.HeartbeatAck(seq)


# every message a tier connection decodes: the ranks' own and the tiers'
CODEC: Dict[int, Type[P.Message]] = {**P.MESSAGE_TYPES, **_OWN}
TYPES: Dict[int, Type[P.Message]] = dict(_OWN)


# -- packing and unpacking the raw messages -----------------------------------------------
Member = Tuple[int, bytes]  # a rank and its Register payload, as it sent it


def join(members: List[Member]) -> Join:
    return Join(b"".join(MEMBER.pack(len(p), r) + p for r, p in members))


def join_members(m: Join) -> List[Member]:
    """(rank, payload) of every member, not decoded (a relay routes by the rank)."""
    out, i, data = [], 0, m.data
    while i < len(data):
        length, rank = MEMBER.unpack_from(data, i)
        out.append((rank, bytes(data[i + MEMBER.size:i + MEMBER.size + length])))
        i += MEMBER.size + length
    return out


def members(m: Join) -> List[P.Register]:
    """Every Register of a Join, each checked as protocol.py checks a rank's own, and against
    the rank its framing names (ProtocolError refuses the whole frame: a sender that makes one
    bad member is not trusted for the rest)."""
    out = []
    for rank, payload in join_members(m):
        reg = P.decode_payload(P.Register.TYPE, payload)
        if reg.rank != rank:  # type: ignore[attr-defined]
            raise P.ProtocolError(f"Join: member framed as rank {rank} registers rank "
                                  f"{reg.rank}")  # type: ignore[attr-defined]
        out.append(reg)
    return out  # type: ignore[return-value]


def results(flow_id: int, code: int, entries: List[Tuple[int, float]]) -> Results:
    return Results(RESULT_HEAD.pack(flow_id, code)
                   + b"".join(RESULT.pack(r, s) for r, s in entries))


def result_entries(m: Results) -> Tuple[int, Type[P.Message], List[Tuple[int, float]]]:
    """(flow id, SaveResult or RenameResult, [(rank, seconds)]): every field range-checked."""
    flow_id, code = RESULT_HEAD.unpack_from(m.data)
    cls = {P.SaveResult.TYPE: P.SaveResult, P.RenameResult.TYPE: P.RenameResult}.get(code)
    if cls is None or flow_id >= 2**63:
        raise P.ProtocolError(f"Results: bad flow {flow_id} / type {code}")
    out = []
    for r, secs in RESULT.iter_unpack(memoryview(m.data)[RESULT_HEAD.size:]):
        if r >= P.MAX_RANKS or not P.seconds(secs):
            raise P.ProtocolError(f"Results: bad entry {(r, secs)}")
        out.append((r, secs))
    return flow_id, cls, out


_NONE = -(2**63)


def reports(flow_id: int, phase: int, entries: List[Tuple[int, Optional[int], bool]]) -> Reports:
    body = [REPORT_HEAD.pack(flow_id, phase)]
    body += [REPORT.pack(r, _NONE if s is None else s, 1 if u else 0) for r, s, u in entries]
    return Reports(b"".join(body))


def report_entries(m: Reports) -> Tuple[int, int, List[Tuple[int, Optional[int], bool]]]:
    """(flow id, phase, [(rank, step, updating)]): every field range-checked."""
    flow_id, phase = REPORT_HEAD.unpack_from(m.data)
    if phase not in (1, 2) or flow_id >= 2**63:
        raise P.ProtocolError(f"Reports: bad flow {flow_id} / phase {phase}")
    out: List[Tuple[int, Optional[int], bool]] = []
    for r, s, u in REPORT.iter_unpack(memoryview(m.data)[REPORT_HEAD.size:]):
        if r >= P.MAX_RANKS or u > 1 or (s < 0 and s != _NONE):
            raise P.ProtocolError(f"Reports: bad entry {(r, s, u)}")
        out.append((r, None if s == _NONE else s, bool(u)))
    return flow_id, phase, out


def up(rank: int, msg: P.Message) -> Up:
    return Up(UP.pack(rank, msg.TYPE) + P.encode_payload(msg))


def up_message(m: Up) -> Tuple[int, P.Message]:
    """(rank, its message): the rank in range, the type one a rank may send up, the message
    checked by protocol.py."""
    rank, code = UP.unpack_from(m.data)
    if rank >= P.MAX_RANKS or code not in _UP_CODES:
        raise P.ProtocolError(f"Up: bad rank {rank} or message type {code}")
    return rank, P.decode_payload(code, bytes(m.data[UP.size:]))
