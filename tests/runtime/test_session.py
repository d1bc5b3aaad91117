"""The handshake without sockets: the KDF against RFC 5869's own test vectors, and both ends of
the handshake driven against each other."""

from __future__ import annotations

import pytest

from mindio_ttp.control.wire import protocol as P
from mindio_ttp.control.wire import session as S

from .fakes import KEY


@pytest.mark.parametrize("salt,ikm,info,okm", [
    ("000102030405060708090a0b0c", "0b" * 22, "f0f1f2f3f4f5f6f7f8f9",  # RFC 5869 A.1
     "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865"),
    ("", "0b" * 22, "",  # RFC 5869 A.3: no salt, no info
     "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8"),
])
def test_hkdf_matches_the_rfc_5869_test_vectors(salt, ikm, info, okm):
    got = S.hkdf_sha256(bytes.fromhex(salt), bytes.fromhex(ikm), bytes.fromhex(info), 42)
    assert got.hex() == okm


def test_session_keys_differ_by_direction_connection_and_job_key():
    nl, nr = S.new_nonce(), S.new_nonce()
    lr, rl = S.session_keys(KEY, nl, nr)
    assert lr != rl and len(lr) == len(rl) == 32
    assert S.session_keys(KEY, nl, nr) == (lr, rl)  # both ends derive the same
    assert S.session_keys(KEY, S.new_nonce(), nr)[0] != lr
    assert S.session_keys(KEY, nl, S.new_nonce())[0] != lr
    assert S.session_keys(b"another job key!", nl, nr)[0] != lr
    assert lr != KEY and rl != KEY


@pytest.mark.parametrize("nonce,match", [("zz" * 16, "not hex"), ("ab" * 8, "8 bytes, under 16"),
                                         ("", "0 bytes")])
def test_a_short_or_malformed_nonce_is_a_protocol_error(nonce, match):
    with pytest.raises(P.ProtocolError, match=match):
        S.session_keys(KEY, S.new_nonce(), nonce)


def register() -> P.Register:
    return P.Register(1, 4, [0, 1, 2, 3], 2, "127.0.0.1", 0, 0, 3, False, False, False)


def test_both_ends_agree_and_later_frames_flow_both_ways():
    listener, rank = S.ListenerHandshake(KEY, 4096), S.RankHandshake(KEY)
    challenge = rank.dec.feed(listener.challenge())
    reg = listener.dec.feed(rank.answer(challenge[0], register()))
    assert len(reg) == 1 and reg[0].challenge == listener.nonce and reg[0].nonce
    listener.accept(reg[0])
    ack = rank.dec.feed(listener.tx.seal(P.RegisterAck("primary", 0, [])))
    assert ack == [P.RegisterAck("primary", 0, [])]
    assert listener.dec.feed(rank.tx.seal(P.Heartbeat(1, 1, 3, False))) == \
        [P.Heartbeat(1, 1, 3, False)]
    # what the listener sends is sealed under neither the job key nor the other direction's key
    frame = listener.tx.seal(P.HeartbeatAck(1))
    with pytest.raises(P.ProtocolError, match="bad HMAC"):
        P.FrameDecoder(KEY, seq=2).feed(frame)
    with pytest.raises(P.ProtocolError, match="bad HMAC"):
        listener.dec.feed(frame)


def test_a_register_for_another_challenge_is_refused_and_so_is_a_second_one():
    first, second = S.ListenerHandshake(KEY, 4096), S.ListenerHandshake(KEY, 4096)
    rank = S.RankHandshake(KEY)
    answer = rank.answer(rank.dec.feed(first.challenge())[0], register())
    reg = second.dec.feed(answer)[0]  # authentic (job key), but made for `first`
    with pytest.raises(P.ProtocolError, match="answers another connection's challenge"):
        second.accept(reg)
    first.accept(first.dec.feed(answer)[0])
    with pytest.raises(P.ProtocolError, match="second Register"):
        first.accept(reg)


def test_the_rank_refuses_anything_but_a_challenge_first():
    rank = S.RankHandshake(KEY)
    with pytest.raises(P.ProtocolError, match="first frame is a RegisterAck, not a Challenge"):
        rank.answer(P.RegisterAck("primary", 0, []), register())
