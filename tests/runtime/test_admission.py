"""Who waits for a handshake, and who gives way (control/wire/admission.py), on its own: a flood
from one address only displaces itself, the source holding the most gives way first, only
connections that have had their chance give way, and a recovery's expected host keeps its
newest. The same policy against real sockets: test_control_plane_attacks.py,
test_recovery_attacks.py."""

from __future__ import annotations

from mindio_ttp.control.wire.admission import CANDIDATES, Admission


def filled(per_source: dict, t0: float = 0.0, cap: int = 100, per: int = 4) -> Admission:
    """`per_source`: address -> how many connections (named "addr#i"), accepted at t0 + i."""
    a: Admission[str] = Admission(cap, per_source=per, evict_after=1.0)
    for source, n in per_source.items():
        for i in range(n):
            a.add(f"{source}#{i}", source, t0 + i)
    return a


def test_a_full_source_gives_way_with_its_oldest_idle_connection():
    a = filled({"10.0.0.9": 4})
    assert a.crowded("10.0.0.1", lambda c: True) == (False, None)  # another source: room
    assert a.crowded("10.0.0.9", lambda c: True) == (True, "10.0.0.9#0")
    # its oldest has bytes we have not read (its Register waits for a turn): the next one
    assert a.crowded("10.0.0.9", lambda c: c != "10.0.0.9#0") == (True, "10.0.0.9#1")
    assert a.crowded("10.0.0.9", lambda c: False) == (True, None)  # refuse the newcomer


def test_the_source_holding_the_most_gives_way_first_and_only_what_had_its_chance():
    a = filled({"10.0.0.1": 2, "10.0.0.9": 4}, per=8)
    now = 10.0  # every connection is older than a second
    assert list(a.give_way(now, lambda c: True))[:4] == [f"10.0.0.9#{i}" for i in range(4)]
    # at t = 2.5 only #0 .. #1 of each source are a second old
    assert list(a.give_way(2.5, lambda c: True)) == ["10.0.0.9#0", "10.0.0.9#1",
                                                      "10.0.0.1#0", "10.0.0.1#1"]
    assert list(a.give_way(now, lambda c: False)) == []  # everyone is being served: nobody


def test_a_recoverys_expected_host_keeps_its_newest_connections():
    a = filled({"10.0.0.1": 3, "10.0.0.9": 3}, per=8)
    out = list(a.give_way(10.0, lambda c: True, kept={"10.0.0.1": 2}))
    assert "10.0.0.1#1" not in out and "10.0.0.1#2" not in out and "10.0.0.1#0" in out


def test_bookkeeping_and_bounded_work():
    a = filled({"10.0.0.9": 3}, per=64)
    assert len(a) == 3 and a.room == 97 and "10.0.0.9#1" in a
    assert a.remove("10.0.0.9#1") and not a.remove("10.0.0.9#1")
    assert a.from_source("10.0.0.9") == 2 and list(a) == ["10.0.0.9#0", "10.0.0.9#2"]
    a.remove("10.0.0.9#0")
    a.remove("10.0.0.9#2")
    assert a.from_source("10.0.0.9") == 0 and len(a) == 0
    many = filled({"10.0.0.9": 50}, per=64)
    looked = []
    list(many.give_way(100.0, lambda c: looked.append(c) or False))
    assert len(looked) == CANDIDATES  # a source's idleness is a syscall each: bounded
