"""Frame codec: round trips for every message class, a fuzzed decoder that only ever returns
authentic messages or raises ProtocolError, and the per-direction sequence numbers."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindio_ttp.control.wire import protocol as P

KEY = bytes(range(32))
INT = st.integers(-(2**63), 2**63 - 1)
NONNEG = st.integers(0, 2**63 - 1)
RANK = st.integers(0, P.MAX_RANKS - 1)
HEX = st.binary(min_size=16, max_size=16).map(bytes.hex)
IP = st.ip_addresses().map(str).filter(P.ip_address)
TEXT = st.text(max_size=40)
SECONDS = st.floats(0, P.MAX_SECONDS, allow_nan=False)
# what each field may hold, by name (every message class uses these names); by type otherwise
VALID = {
    "rank": RANK, "controller_rank": RANK, "world_size": st.integers(1, P.MAX_RANKS),
    "replica": st.integers(1, P.MAX_RANKS), "dp_ranks": st.lists(RANK, max_size=20, unique=True),
    "save_ranks": st.lists(RANK, max_size=20, unique=True),
    "ranks": st.lists(RANK, max_size=20, unique=True),
    "host": IP, "standby_port": st.integers(0, 65535), "pid": st.integers(0, 2**31 - 1),
    "step": st.none() | NONNEG, "challenge": HEX, "nonce": HEX,
    "role": st.sampled_from(["primary", "standby"]),
    "backups": st.lists(st.tuples(RANK, IP, st.integers(1, 65535)).map(list), max_size=3),
    "fault_id": st.just("") | HEX, "seq": NONNEG, "kind": st.sampled_from(P.FAULT_KINDS),
    "flow_id": NONNEG, "limit": NONNEG, "grace": SECONDS, "phase": st.sampled_from([1, 2]),
    "time_limit": SECONDS, "seconds": SECONDS, "exit_code": st.integers(0, 255),
    "store": st.from_regex(r"[a-z0-9][a-z0-9/._-]{0,20}", fullmatch=True),
    "tag": HEX, "outcome": st.sampled_from([o.value for o in P.Outcome]),
    "req": st.integers(1, 2**63 - 1), "timeout": SECONDS, ("step", "int"): NONNEG,
    # the in-memory recovery's messages
    "recovery_id": st.integers(1, 2**62), "lost": st.lists(RANK, max_size=20, unique=True),
    "deadline": SECONDS, "state": st.sampled_from(P.REPLACE_STATES),
    "digest": st.just("") | st.binary(min_size=32, max_size=32).map(bytes.hex),
    "rendezvous": st.from_regex(r"[a-z0-9][a-z0-9/._-]{0,20}", fullmatch=True),
    "controller": st.tuples(IP, st.integers(1, 65535)).map(
        lambda a: f"[{a[0]}]:{a[1]}" if ":" in a[0] else f"{a[0]}:{a[1]}"),
}
BY_TYPE = {
    "int": INT, "Optional[int]": st.none() | INT, "bool": st.booleans(), "str": TEXT,
    "float": st.floats(allow_nan=False, allow_infinity=False), "List[int]": st.lists(INT),
    "List[str]": st.lists(TEXT, max_size=4),
}


@st.composite
def store_request(draw):
    op = draw(st.sampled_from(P.STORE_OPS))
    (klo, khi), (vlo, vhi) = P._STORE_ARITY[op]
    keys = draw(st.lists(TEXT, min_size=klo, max_size=min(khi, 4)))
    values = draw(st.lists(st.binary(max_size=64).map(P.b64encode), min_size=vlo, max_size=vhi))
    return P.StoreRequest(draw(VALID["req"]), draw(VALID["store"]), op, keys, values,
                          draw(INT), draw(SECONDS))


@st.composite
def register(draw):
    """A DP group (no rank twice) and a replica count that divides it."""
    reg = draw(st.builds(P.Register, **{f.name: _strategy(f.name, f.type)
                                        for f in fields(P.Register)}))
    reg.dp_ranks = draw(st.lists(RANK, min_size=1, max_size=20, unique=True))
    n = len(reg.dp_ranks)
    reg.replica = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    return reg


def message_of(cls):
    if cls is P.StoreRequest:
        return store_request()
    if cls is P.Register:
        return register()
    if cls is P.StoreReply:
        return st.builds(cls, req=VALID["req"], ok=st.booleans(),
                         values=st.lists(st.binary(max_size=64).map(P.b64encode), max_size=1),
                         number=INT, error=TEXT)
    return st.builds(cls, **{f.name: _strategy(f.name, f.type) for f in fields(cls)})


def _strategy(name: str, of_type: str):
    for key in ((name, of_type), name):
        if key in VALID:
            return VALID[key]
    return BY_TYPE[of_type]


MESSAGES = st.one_of(*[message_of(c) for c in P.MESSAGE_TYPES.values()])


def frame(code: int, payload: bytes, key: bytes = KEY, version: int = P.VERSION,
          seq: int = 0) -> bytes:
    head = P.HEADER.pack(P.MAGIC, version, code, seq, len(payload))
    return head + payload + hmac.new(key, head + payload, hashlib.sha256).digest()


def test_every_message_class_has_a_unique_code():
    assert len(P.MESSAGE_TYPES) == len({c.__name__ for c in P.MESSAGE_TYPES.values()})
    assert all(code == cls.TYPE for code, cls in P.MESSAGE_TYPES.items())


@settings(max_examples=300, deadline=None)
@given(MESSAGES)
def test_round_trip(msg):
    assert P.decode_one(P.encode(msg, KEY), KEY) == msg


@settings(max_examples=100, deadline=None)
@given(st.lists(MESSAGES, min_size=1, max_size=5), st.data())
def test_any_chunking_of_a_stream_gives_the_same_messages(msgs, data):
    stream = b"".join(P.encode(m, KEY, seq) for seq, m in enumerate(msgs))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    dec, got, prev = P.FrameDecoder(KEY), [], 0
    for c in cuts + [len(stream)]:
        got += dec.feed(stream[prev:c])
        prev = c
    assert got == msgs and dec.pending == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_never_crash_the_decoder(data):
    dec = P.FrameDecoder(KEY)
    try:
        msgs = dec.feed(data)
    except P.ProtocolError:
        return
    assert msgs == []  # random bytes never carry a valid HMAC


JSONISH = st.recursive(st.none() | st.booleans() | INT | st.floats() | st.text(max_size=10),
                       lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                           c, max_size=6),
                       max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 255), JSONISH | st.binary(max_size=100))
def test_fuzz_authenticated_garbage_payloads_are_rejected_not_crashing(code, payload):
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    try:
        msgs = P.FrameDecoder(KEY).feed(frame(code, raw))
    except P.ProtocolError:
        return
    # accepted only if it really is a well-typed message of that code
    assert len(msgs) == 1 and type(msgs[0]) is P.MESSAGE_TYPES[code]


@settings(max_examples=200, deadline=None)
@given(MESSAGES, st.data())
def test_fuzz_any_corrupted_byte_is_rejected_or_incomplete(msg, data):
    good = bytearray(P.encode(msg, KEY))
    i = data.draw(st.integers(0, len(good) - 1))
    good[i] ^= data.draw(st.integers(1, 255))
    try:
        msgs = P.FrameDecoder(KEY).feed(bytes(good))
    except P.ProtocolError:
        return
    assert msgs == []  # a corrupted length field only leaves the frame incomplete


def test_wrong_key_is_rejected():
    with pytest.raises(P.ProtocolError, match="HMAC"):
        P.decode_one(P.encode(P.Goodbye(3), KEY), b"x" * 32)


def test_other_version_is_rejected():
    other = P.VERSION + 1
    with pytest.raises(P.ProtocolError,
                       match=f"version {other}, this runtime speaks {P.VERSION}: run the same"):
        P.FrameDecoder(KEY).feed(frame(15, b'{"rank":1}', version=other))


def test_a_version_1_frame_is_named_as_such():
    """Version 1 had an 8-byte header and no sequence number: still refused by its version."""
    head = struct.pack("!2sBBI", P.MAGIC, 1, 15, 10)
    v1 = head + b'{"rank":1}'
    v1 += hmac.new(KEY, v1, hashlib.sha256).digest()
    with pytest.raises(P.ProtocolError, match="version 1"):
        P.FrameDecoder(KEY).feed(v1)


def test_replayed_and_reordered_frames_are_refused_by_sequence_number():
    a, b = P.encode(P.Goodbye(1), KEY, 0), P.encode(P.Goodbye(2), KEY, 1)
    dec = P.FrameDecoder(KEY)
    assert dec.feed(a) == [P.Goodbye(1)]
    with pytest.raises(P.ProtocolError, match="sequence number 0, expected 1: a replayed"):
        dec.feed(a)  # the same authentic frame again
    with pytest.raises(P.ProtocolError, match="sequence number 1, expected 0"):
        P.FrameDecoder(KEY).feed(b + a)  # reordered
    with pytest.raises(P.ProtocolError, match="sequence number 2, expected 1"):
        P.FrameDecoder(KEY).feed(a + P.encode(P.Goodbye(3), KEY, 2))  # one dropped


def test_handshake_mode_holds_the_frames_behind_the_first_until_rekey():
    other = bytes(range(100, 132))
    dec = P.FrameDecoder(KEY, handshake=True)
    assert dec.feed(P.encode(P.Goodbye(1), KEY, 0) + P.encode(P.Goodbye(2), other, 1)) == \
        [P.Goodbye(1)]
    assert dec.feed(b"") == [] and dec.pending > 0
    dec.rekey(other, 1)
    assert dec.feed(b"") == [P.Goodbye(2)] and dec.pending == 0


def test_bytes_piling_up_behind_a_held_handshake_frame_are_bounded():
    dec = P.FrameDecoder(KEY, 64, handshake=True)
    dec.feed(P.encode(P.Goodbye(1), KEY, 0))
    with pytest.raises(P.ProtocolError, match="behind a handshake frame"):
        for _ in range(10):
            dec.feed(b"\0" * 64)


def test_oversize_length_is_rejected_before_buffering():
    head = struct.pack("!2sBBQI", P.MAGIC, P.VERSION, 15, 0, P.MAX_PAYLOAD + 1)
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.FrameDecoder(KEY).feed(head)


def test_field_types_are_checked():
    with pytest.raises(P.ProtocolError, match="Heartbeat.updating"):
        P.FrameDecoder(KEY).feed(frame(4, struct.pack("!qqqB", 1, 1, 2, 7)))
    with pytest.raises(P.ProtocolError, match="fields"):
        P.FrameDecoder(KEY).feed(frame(15, b'{"rank":1,"extra":2}'))
    with pytest.raises(P.ProtocolError, match="Goodbye.rank"):
        P.FrameDecoder(KEY).feed(frame(15, b'{"rank":true}'))


def test_binary_frames_have_exactly_their_size():
    good = struct.pack("!qqqB", 1, 1, 2, 0)
    assert P.FrameDecoder(KEY).feed(frame(4, good)) == [P.Heartbeat(1, 1, 2, False)]
    for bad in (good[:-1], good + b"\0"):
        with pytest.raises(P.ProtocolError, match="Heartbeat: payload is"):
            P.FrameDecoder(KEY).feed(frame(4, bad))
    assert P.FrameDecoder(KEY).feed(frame(4, struct.pack("!qqqB", 1, 1, -(2**63), 1))) == \
        [P.Heartbeat(1, 1, None, True)]
    with pytest.raises(P.ProtocolError, match="refusing to send Heartbeat.step"):
        P.encode(P.Heartbeat(1, 1, -(2**63), False), KEY)


def test_rank_lists_travel_as_blocks_of_constant_size():
    """A save order for half of 100,000 ranks (the first half of each pipeline stage) is as
    small as one for 8, and an encoding that would expand past MAX_RANKS is refused unread."""
    savers = [r for stage in range(16) for r in range(stage * 6250, stage * 6250 + 3125)]
    big = P.encode(P.SaveOrder(1, 5, savers, 60.0, "ns/1", "ab" * 16), KEY)
    small = P.encode(P.SaveOrder(1, 5, list(range(4)), 60.0, "ns/1", "ab" * 16), KEY)
    assert len(big) - len(small) < 16
    assert P.decode_one(big, KEY).save_ranks == savers
    huge = json.dumps({"flow_id": 1, "step": 5, "save_ranks": [[0, 1, 1000, 1, 1000]],
                       "time_limit": 1.0, "store": "ns/1", "tag": "ab" * 16}).encode()
    with pytest.raises(P.ProtocolError, match="SaveOrder.save_ranks: bad value"):
        P.FrameDecoder(KEY).feed(frame(P.SaveOrder.TYPE, huge))


# -- one layer of validation: valid MACs over hostile bodies ------------------------------------
HOSTILE = st.one_of(
    st.none(), st.booleans(), INT, st.integers(min_value=2**63, max_value=2**70),
    st.integers(min_value=-(2**70), max_value=-(2**63) - 1), st.floats(),
    st.text(max_size=20), st.sampled_from(["\ud800", "a\udfffb", "\x00", "h", "0.0.0.0", "::",
                                           "224.0.0.1", "127.0.0.1\x00", "1" * 70000]),
    st.lists(st.integers(-5, 70000) | st.text(max_size=3), max_size=4),
    st.lists(st.lists(st.integers(-1, 70000) | st.sampled_from(["\ud800", "h", "127.0.0.1"]),
                      max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


JSON_TYPES = [c for c in P.MESSAGE_TYPES.values() if c not in P._BINARY]


@st.composite
def hostile_body(draw):
    """(message class, JSON body): every field of one class, each valid (as it travels: rank
    lists as blocks) or hostile."""
    cls = draw(st.sampled_from(JSON_TYPES))
    valid = json.loads(P.encode_payload(draw(message_of(cls))))
    body = {f.name: draw(st.just(valid[f.name]) | HOSTILE) for f in fields(cls)}
    return cls, body


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(P._BINARY, key=lambda c: c.TYPE)), st.data())
def test_fuzz_binary_payloads_are_refused_or_valid(cls, data):
    payload = data.draw(st.binary(min_size=P._BINARY[cls].struct.size,
                                  max_size=P._BINARY[cls].struct.size))
    try:
        (msg,) = P.FrameDecoder(KEY).feed(frame(cls.TYPE, payload))
    except P.ProtocolError:
        return
    assert P.problem(msg) == "" and P.decode_one(P.encode(msg, KEY), KEY) == msg


def used_as_the_runtime_uses_it(msg: P.Message) -> None:
    """What the controller, the processor and the handlers do with decoded fields, the way that
    crashed a listener before (issue 18): encode strings, connect to hosts, range-check."""
    import socket as _socket

    for f in fields(msg):
        v = getattr(msg, f.name)
        for s in ([v] if isinstance(v, str) else v if isinstance(v, list) else []):
            if isinstance(s, str):
                s.encode("utf-8")  # a lone surrogate raised UnicodeEncodeError in session.accept
    if isinstance(msg, P.Register):
        assert 0 <= msg.rank < P.MAX_RANKS and 0 <= msg.standby_port <= 65535
        _socket.getaddrinfo(msg.host, msg.standby_port or 1, flags=_socket.AI_NUMERICHOST)
        assert len(bytes.fromhex(msg.challenge)) >= 16 and len(bytes.fromhex(msg.nonce)) >= 16
    if isinstance(msg, (P.Backups, P.RegisterAck)):
        for _rank, host, port in msg.backups:
            assert 0 < port <= 65535
            _socket.getaddrinfo(host, port, flags=_socket.AI_NUMERICHOST)
    if isinstance(msg, (P.StoreRequest, P.StoreReply)):
        for v in msg.values:
            P.b64decode(v)


@settings(max_examples=500, deadline=None)
@given(hostile_body())
def test_fuzz_valid_macs_over_hostile_bodies_are_refused_or_safe_to_use(drawn):
    """A key holder (a bug, a compromised host) can MAC anything: the decoder either refuses
    the body with ProtocolError or hands out a message every use of which is safe, and that
    this runtime would send itself; nothing else is ever raised."""
    cls, body = drawn
    try:  # NaN and Infinity go out as JSON's extensions, which json.loads takes back
        msgs = P.FrameDecoder(KEY).feed(frame(cls.TYPE, json.dumps(body).encode()))
    except P.ProtocolError:
        return
    (msg,) = msgs
    used_as_the_runtime_uses_it(msg)
    assert P.decode_one(P.encode(msg, KEY), KEY) == msg


@pytest.mark.parametrize("field,bad", [
    ("challenge", "\ud800"), ("host", "\ud800"), ("host", "node7"), ("host", "0.0.0.0"),
    ("standby_port", 70000), ("standby_port", -1), ("rank", -1), ("rank", P.MAX_RANKS),
    ("dp_ranks", [0, -3]), ("nonce", "zz" * 16), ("pid", True), ("step", -1),
])
def test_a_signed_register_with_a_bad_field_is_refused_by_the_decoder(field, bad):
    good = P.Register(1, 4, [0, 1, 2, 3], 2, "127.0.0.1", 5000, 42, 3, False, False, False,
                      "ab" * 16, "cd" * 16)
    assert P.decode_one(P.encode(good, KEY), KEY) == good
    body = json.loads(P.encode_payload(good))  # as it travels: dp_ranks as blocks
    body[field] = bad
    with pytest.raises(P.ProtocolError, match=f"Register.{field}: bad value"):
        P.FrameDecoder(KEY).feed(frame(P.Register.TYPE, json.dumps(body).encode()))
    with pytest.raises(P.ProtocolError, match="refusing to send"):
        P.encode(P.Register(**body), KEY)  # nor does this runtime send one
