"""Mistakes that are caught by ttp-patch itself, not later on the cluster: a controller port the
runtime would refuse, an npu apply on a machine without the adaptor, an unfilled launch script,
and `verify --json` errors a pipeline can parse."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

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


def _fake_adaptor(tmp_path) -> str:
    """A directory holding an importable `megatron_npu` package (the Ascend adaptor's name)."""
    pkg = tmp_path / "site" / "megatron_npu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    return str(pkg.parent)


def test_npu_apply_without_megatron_npu_works_and_warns_naming_the_other_devices(
    repo: FixtureRepo, capsys
) -> None:
    if importlib.util.find_spec("megatron_npu") is not None:
        pytest.skip("this machine has megatron_npu")
    assert main(["apply", str(repo.root)]) == 0
    err = capsys.readouterr().err
    assert "applied (--device npu --port 8000)" in err
    warning = [ln for ln in err.splitlines() if "warning" in ln]
    assert len(warning) == 1 and "megatron_npu" in warning[0]
    assert "--device cuda" in warning[0] and "--device cpu" in warning[0]
    assert main(["verify", str(repo.root)]) == 0  # the tree is patched all the same
    assert b"import megatron_npu\n" in repo.read("pretrain_gpt.py")


def test_npu_apply_with_an_importable_megatron_npu_prints_no_warning(
    repo: FixtureRepo, capsys, tmp_path, monkeypatch
) -> None:
    monkeypatch.syspath_prepend(_fake_adaptor(tmp_path))
    assert main(["apply", str(repo.root)]) == 0
    err = capsys.readouterr().err
    assert "applied (--device npu" in err and "warning" not in err


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_other_devices_never_warn_about_megatron_npu(repo: FixtureRepo, capsys, device) -> None:
    assert main(["apply", str(repo.root), "--device", device]) == 0
    assert "megatron_npu" not in capsys.readouterr().err


def test_console_script_warns_on_stderr_only_and_pythonpath_silences_it(
    repo: FixtureRepo, tmp_path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(["ttp-patch", "apply", str(repo.root), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "warning" not in res.stdout
    assert "--device cuda" in res.stderr and "--device cpu" in res.stderr
    env["PYTHONPATH"] = _fake_adaptor(tmp_path)
    res = subprocess.run(["ttp-patch", "apply", str(repo.root)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "applied" in res.stderr and "warning" not in res.stderr
