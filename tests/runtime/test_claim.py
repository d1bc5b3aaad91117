"""The per-fault claim (faulttime/claim.py) with real files, locks and processes, and the
controller's rule without a claim directory (strict majority) against scripted processors."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from mindio_ttp.config import Outcome, TTPConfig
from mindio_ttp.control.controller.server import Controller
from mindio_ttp.control.wire import protocol as P
from mindio_ttp.faulttime import claim as C

from .fakes import FakeRank
from .test_controller import DP, ENV

_FORK = multiprocessing.get_context("fork")


def _space(tmp_path: Path) -> C.ClaimSpace:
    return C.ClaimSpace(tmp_path, "f" * 32)


def _race(directory: str, fault: str, who: int, go, results) -> None:
    go.wait(10)
    won, why = C.acquire(C.ClaimSpace(Path(directory), fault), f"racer{who}")
    results.put((who, won is not None, why))
    if won is not None:
        time.sleep(1.0)  # hold the claim (and its lock) while the others try


def test_exactly_one_of_many_racing_processes_wins(tmp_path: Path) -> None:
    go, results = _FORK.Event(), _FORK.Queue()
    procs = [_FORK.Process(target=_race, args=(str(tmp_path), "a" * 32, i, go, results))
             for i in range(6)]
    for p in procs:
        p.start()
    go.set()
    got = [results.get(timeout=20) for _ in procs]
    for p in procs:
        p.join(10)
    winners = [who for who, won, _ in got if won]
    assert len(winners) == 1, got
    for _who, won, why in got:
        if not won:
            assert "claimed by a live flow" in why, why
    record = json.loads((tmp_path / f"fault-{'a' * 32}.json").read_text())
    assert record["holder"] == f"racer{winners[0]}" and record["state"] == C.CLAIMED


def _hold_then_die(directory: str, state: str, ready) -> None:
    won, _ = C.acquire(C.ClaimSpace(Path(directory), "f" * 32), "dead-flow")
    assert won is not None
    if state != C.CLAIMED:
        won.update(state, step=5)
    ready.set()
    time.sleep(60)  # killed by the test, as a controller's rank is


@pytest.mark.parametrize("state,taken", [(C.CLAIMED, True), (C.RENAMING, False),
                                         (C.DONE, False)])
def test_a_dead_claimant_is_taken_over_only_before_any_rename_order(
        tmp_path: Path, state: str, taken: bool) -> None:
    ready = _FORK.Event()
    holder = _FORK.Process(target=_hold_then_die, args=(str(tmp_path), state, ready))
    holder.start()
    try:
        assert ready.wait(20)
        won, why = C.acquire(_space(tmp_path), "successor")
        assert won is None and "claimed by a live flow" in why and "dead-flow" in why
    finally:
        holder.kill()
        holder.join(10)
    won, why = C.acquire(_space(tmp_path), "successor")
    assert (won is not None) == taken, why
    record = json.loads(_space(tmp_path).path.read_text())
    if taken:
        assert record["holder"] == "successor" and record["generation"] == 2
        assert "dead-flow" in record["took_over_from"]
    else:
        assert "may have renamed a checkpoint" in why
        assert record["holder"] == "dead-flow" and record["state"] == state


def test_an_empty_claim_is_never_taken_over(tmp_path: Path) -> None:
    _space(tmp_path).path.write_bytes(b"")  # a claimant that died between create and write
    won, why = C.acquire(_space(tmp_path), "successor")
    assert won is None and "unreadable or empty" in why


def test_register_refuses_an_unwritable_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot create .ttp-claims"):
        C.register(tmp_path / "file")
    assert C.registered_directory() is None and C.registered("f" * 32) is None


@pytest.fixture
def no_claim_ctl():
    c = Controller(TTPConfig.from_env(ENV), 4, 2, host_rank=0, claims=lambda: None)
    c.listen("127.0.0.1", 0)
    c.start()
    yield c
    c.stop()


def test_without_a_claim_directory_exactly_half_saves_nothing(no_claim_ctl) -> None:
    fakes = [FakeRank(no_claim_ctl.address, r, 4, DP, 2) for r in range(4)]
    try:
        deadline = time.monotonic() + 5
        while len(no_claim_ctl.registered) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        fakes[2].close()
        fakes[3].close()  # ranks 0 and 1 hold both shards: a save would be possible
        assert no_claim_ctl.decided.wait(10)
        d = no_claim_ctl.decision
        assert d.outcome is Outcome.NOT_CLAIMED and d.step is None, d
        assert "only 2 of 4 ranks answered" in d.reason and "ttp_set_checkpoint_dir" in d.reason
        assert not any(f.of_type(P.SaveOrder) for f in fakes)
        assert fakes[0].got_exit.wait(3) and fakes[0].exit.exit_code == 87
    finally:
        for f in fakes:
            f.close()


def test_with_a_claim_directory_the_flow_claims_before_its_save_order(tmp_path: Path) -> None:
    space = C.ClaimSpace(tmp_path, "b" * 32)
    ctl = Controller(TTPConfig.from_env(ENV), 4, 2, host_rank=0, claims=lambda: space)
    ctl.listen("127.0.0.1", 0)
    ctl.start()
    fakes = [FakeRank(ctl.address, r, 4, DP, 2) for r in range(4)]
    try:
        deadline = time.monotonic() + 5
        while len(ctl.registered) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        fakes[2].close()
        fakes[3].close()
        assert ctl.decided.wait(10)
        assert ctl.decision.outcome is Outcome.SAVED, ctl.decision
        record = json.loads(space.path.read_text())
        assert record["state"] == C.DONE and record["holder"] == ctl.name
        assert record["answered"] == 2 and record["outcome"] == "saved"
        orders = fakes[0].of_type(P.SaveOrder)
        assert orders and orders[0].store == f"ttp-save/{orders[0].tag}"
        assert len(orders[0].tag) == 32
        assert os.stat(space.path).st_size > 0
    finally:
        for f in fakes:
            f.close()
        ctl.stop()


@pytest.mark.parametrize("bad", ["../../../tmp/x", "A" * 32, "a" * 31, "", None, "a" * 31 + "\n"])
def test_a_fault_id_is_checked_before_it_names_a_file(tmp_path: Path, bad) -> None:
    with pytest.raises(ValueError, match="not 32 lowercase hex digits"):
        C.ClaimSpace(tmp_path, bad)
    C.register(tmp_path)
    try:
        with pytest.raises(ValueError):
            C.registered(bad)
    finally:
        C.reset()


def test_the_primary_hands_its_fault_id_to_every_rank_and_its_standby(tmp_path: Path) -> None:
    """Both halves of a partition claim under one id: the primary's, which every rank got when
    it registered (over the authenticated channel), and so every standby it hosts."""
    from mindio_ttp import hooks
    from mindio_ttp.control.rank.processor import Processor

    ctl = Controller(TTPConfig.from_env(ENV), 4, 2, host_rank=0)
    ctl.listen("127.0.0.1", 0)
    ctl.start()
    hooks.STATE.reset()
    proc = Processor(TTPConfig.from_env(ENV), 2, DP, 4, 2)
    proc.exit_fn = lambda code: None
    try:
        proc.start("127.0.0.1", ctl.address[1])
        assert ctl.fault_id is not None and len(ctl.fault_id) == 32
        assert proc.fault_id == ctl.fault_id == proc.standby.fault_id
        C.register(tmp_path)
        assert proc.standby.flow._claims() == C.ClaimSpace(tmp_path / C.CLAIM_DIR, ctl.fault_id)
    finally:
        C.reset()
        proc._stop.set()
        proc._mail.wake()
        proc.standby.stop()
        ctl.stop()
        hooks.STATE.reset()
