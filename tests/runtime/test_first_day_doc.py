"""docs/first-day.md quotes ttprun's lines for 2 nodes x 8 devices; these tests render the same
lines from the code that prints them, so the page cannot drift from what a user will see."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mindio_ttp.config import Outcome
from mindio_ttp.drill import DrillSpec
from mindio_ttp.launch import check, drill
from mindio_ttp.launch.flow_record import FlowRecord
from mindio_ttp.launch.outcome import CheckpointArgs, Ending, closing_lines

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "first-day.md").read_text(encoding="utf-8")
SPEC = DrillSpec.parse("kill:rank=13:iter=20")
CKPT = CheckpointArgs.parse(["--save", "/shared/ckpt/gpt", "--load", "/shared/ckpt/gpt"])
RECOVERED = [{"recovery_id": 1, "iteration": 20, "replaced": [13]}]


def _said(lines) -> None:
    for line in lines:
        assert f"ttprun: {line}" in PAGE, line


def test_the_drill_banner_is_the_one_on_the_page() -> None:
    _said(drill.announce(SPEC, 16, {"TTP_AUTH_KEY": "ab" * 32}))


def test_the_in_memory_ending_and_verdict_are_the_ones_on_the_page(tmp_path: Path) -> None:
    ending = Ending(0, recoveries=RECOVERED)
    _said(closing_lines(ending, CKPT))
    _said(drill.verdict(SPEC, tmp_path, ending)[0])


def test_the_dying_checkpoint_ending_and_verdict_are_the_ones_on_the_page(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = time.mktime(time.strptime("2026-12-06 12:01:03", "%Y-%m-%d %H:%M:%S"))
    flow = FlowRecord(Outcome.SAVED, 20, tuple(r for r in range(16) if r != 13), 83, "", 0,
                      at, "/shared/ckpt/gpt/iter_0000020", 20)
    killed = {13: SimpleNamespace(exitcode=-9, timestamp=at)}
    ending = Ending(1, killed, flow, node="n1")
    _said(closing_lines(ending, CKPT))
    # the manifest check itself runs on real files in the drill tests; here, its words
    monkeypatch.setattr(drill, "verify_checkpoint", lambda path: (
        True, "its manifest verifies: the digests of all 17 files match"))
    _said(drill.verdict(SPEC, tmp_path, ending)[0])
    other = Ending(1, {r: SimpleNamespace(exitcode=83, timestamp=at) for r in range(8)}, flow)
    assert f"`ttprun: {closing_lines(other, CKPT)[0]}`" in PAGE


def test_the_check_failure_row_is_the_one_on_the_page() -> None:
    ctx = check.Context(2, "8", "static", "10.0.0.1:6000", 0, {}, "none", None,
                        "pretrain_gpt.py", [])
    infos = {n: {"addr": f"10.0.0.{n + 1}", "listen": {}, "problems": [], "ifaces": [],
                 "settings": {}, "controller_port": 8000} for n in (0, 1)}
    infos[0]["listen"]["controller"] = ["10.0.0.1", 8000]
    probes = {0: {"failed": [], "clock": [0.0, 0.001]},
              1: {"failed": [["controller", 0, "10.0.0.1", 8000, "timed out after 3.0 s"]],
                  "clock": None}}
    rows = {r.check: r for r in check.judge(2, infos, probes, {}, ctx)}
    row = rows["controller port 8000"]
    assert row.result == "FAIL"
    assert f"  controller port 8000  FAIL    {row.detail}" in PAGE, row.detail
