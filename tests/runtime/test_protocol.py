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

from mindio_ttp.control import protocol as P
from mindio_ttp.control import ranksets

KEY = bytes(range(32))
INT = st.integers(-(2**63) + 1, 2**63 - 1)  # -(2**63) stands for None in binary frames
FIELD = {
    "int": INT,
    "Optional[int]": st.none() | INT,
    "float": st.floats(allow_nan=False, allow_infinity=False),
    "bool": st.booleans(),
    "str": st.text(max_size=40),
    "List[int]": st.lists(INT, max_size=20),
    "List[List[Any]]": st.lists(st.tuples(INT, st.text(max_size=20), st.integers(0, 65535))
                                .map(list), max_size=3),
    "Ranks": st.lists(st.integers(0, ranksets.MAX_RANKS - 1), max_size=20),
}


def message_of(cls):
    return st.builds(cls, **{f.name: FIELD[f.type] for f in fields(cls)})


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
    with pytest.raises(P.ProtocolError, match="stands for None"):
        P.encode(P.Heartbeat(1, 1, -(2**63), False), KEY)


def test_rank_lists_travel_as_blocks_of_constant_size():
    """A save order for half of 100,000 ranks (the first half of each pipeline stage) is as
    small as one for 8, and an encoding that would expand past MAX_RANKS is refused unread."""
    savers = [r for stage in range(16) for r in range(stage * 6250, stage * 6250 + 3125)]
    big = P.encode(P.SaveOrder(1, 5, savers, 60.0, "h:1", "ab" * 16), KEY)
    small = P.encode(P.SaveOrder(1, 5, list(range(4)), 60.0, "h:1", "ab" * 16), KEY)
    assert len(big) - len(small) < 16
    assert P.decode_one(big, KEY).save_ranks == savers
    huge = json.dumps({"flow_id": 1, "step": 5, "save_ranks": [[0, 1, 1000, 1, 1000]],
                       "time_limit": 1.0, "store": "h:1", "tag": "ab" * 16}).encode()
    with pytest.raises(P.ProtocolError, match="SaveOrder.save_ranks: bad value"):
        P.FrameDecoder(KEY).feed(frame(P.SaveOrder.TYPE, huge))
