"""Mistakes that are caught by ttp-patch itself, not later on the cluster: a controller port the
runtime would refuse, an npu apply on a machine without the adaptor, an unfilled launch script,
and `verify --json` errors a pipeline can parse."""

from __future__ import annotations

import json

import pytest
from conftest import FixtureRepo
from test_refusals import refused

from patcher.cli import main

RECORD = ".git/ttp-patch.json"


@pytest.mark.parametrize("port", ["1", "80", "1023", "65536", "70000"])
def test_apply_port_outside_the_runtime_range_is_refused_with_the_range(
    repo: FixtureRepo, capsys, port: str
) -> None:
    for cmd in ("apply", "diff"):
        err = refused(capsys, repo, [cmd, str(repo.root), "--port", port], 2,
                      f"--port {port} is out of range", "1024..65535")
        assert "Traceback" not in err


@pytest.mark.parametrize("port", ["1024", "65535"])
def test_apply_accepts_both_ends_of_the_range_and_the_record_reads_back(
    repo: FixtureRepo, capsys, port: str
) -> None:
    assert main(["apply", str(repo.root), "--device", "cpu", "--port", port]) == 0
    assert json.loads((repo.root / RECORD).read_text())["port"] == int(port)
    assert f"    port = {port}\n".encode() in repo.read("megatron/training.py")
    assert main(["verify", str(repo.root)]) == 0  # the record check takes it too
