"""Mistakes that are caught by ttp-patch itself, not later on the cluster: a controller port the
runtime would refuse, an npu apply on a machine without the adaptor, an unfilled launch script,
and `verify --json` errors a pipeline can parse."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPT, FixtureRepo
from test_refusals import refused

from patcher.cli import main
from testkit.patcher_pin import child_env

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
    # no PYTHONPATH of the user's; the test's own hook (the fixture's pin) stays
    env = child_env(env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    res = subprocess.run(["ttp-patch", "apply", str(repo.root), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "warning" not in res.stdout
    assert "--device cuda" in res.stderr and "--device cpu" in res.stderr
    env = child_env(env={**env, "PYTHONPATH": _fake_adaptor(tmp_path)})
    res = subprocess.run(["ttp-patch", "apply", str(repo.root)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "applied" in res.stderr and "warning" not in res.stderr


def _run_script(repo: FixtureRepo, tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    """The generated script under bash, with a stand-in `ttprun` first on PATH that records
    what it was started with (its arguments and TTP_CONTROLLER_PORT) instead of training."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    ttprun = bin_dir / "ttprun"
    ttprun.write_text(
        '#!/bin/bash\necho "ttprun port=${TTP_CONTROLLER_PORT:-unset} args=$*"\n'
        # the port the runtime's start-up calls resolve, given training.py's literal 8000
        f'exec {sys.executable} -c "import mindio_ttp.framework_ttp as t; '
        'print(\'runtime port\', t._port(8000))"\n'
    )
    ttprun.chmod(0o755)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(repo.root / SCRIPT)], env={**base, **env},
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


def _env_npu_sh(tmp_path) -> str:
    """An env_npu.sh as the adaptor writes them: it extends a variable that may be unset."""
    path = tmp_path / "env_npu.sh"
    path.write_text(f'export LD_LIBRARY_PATH=/usr/local/Ascend/lib:$LD_LIBRARY_PATH\n'
                    f'touch {tmp_path}/sourced\n')
    return str(path)


FILLED = {"MASTER_ADDR": "10.0.0.1", "DATA_PATH": "/data/x_text_document",
          "CHECKPOINT_PATH": "/ckpt"}


def test_unfilled_npu_script_names_env_npu_sh_before_bash_fails_on_the_file(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    assert main(["apply", str(repo.root)]) == 0
    res = _run_script(repo, tmp_path)
    assert res.returncode == 2 and res.stdout == ""
    assert "pretrain_gpt_ttp.sh: set ENV_NPU_SH" in res.stderr
    assert "No such file" not in res.stderr and "ttprun" not in res.stdout
    res = _run_script(repo, tmp_path, ENV_NPU_SH=str(tmp_path / "nope.sh"), **FILLED)
    assert res.returncode == 2 and "No such file" not in res.stderr
    assert f"ENV_NPU_SH={tmp_path}/nope.sh is not a file" in res.stderr


@pytest.mark.parametrize("missing", sorted(FILLED))
def test_each_unfilled_value_is_named_and_nothing_is_sourced_first(
    repo: FixtureRepo, capsys, tmp_path, missing: str
) -> None:
    assert main(["apply", str(repo.root)]) == 0
    env = {k: v for k, v in FILLED.items() if k != missing}
    res = _run_script(repo, tmp_path, ENV_NPU_SH=_env_npu_sh(tmp_path), **env)
    assert res.returncode == 2 and f"pretrain_gpt_ttp.sh: set {missing}:" in res.stderr
    assert not (tmp_path / "sourced").exists() and "ttprun" not in res.stdout


def test_filled_npu_script_sources_the_adaptor_env_under_set_u_and_launches(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    assert main(["apply", str(repo.root)]) == 0
    res = _run_script(repo, tmp_path, ENV_NPU_SH=_env_npu_sh(tmp_path), **FILLED)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "sourced").exists() and res.stdout.startswith("ttprun ")
    assert "--master_addr 10.0.0.1" in res.stdout and "--save /ckpt" in res.stdout
    assert " --bf16 " in res.stdout and "--fp16" not in res.stdout


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_unfilled_cuda_and_cpu_scripts_name_the_data_path(
    repo: FixtureRepo, capsys, tmp_path, device: str
) -> None:
    assert main(["apply", str(repo.root), "--device", device]) == 0
    res = _run_script(repo, tmp_path, MASTER_ADDR="10.0.0.1")
    assert res.returncode == 2 and "pretrain_gpt_ttp.sh: set DATA_PATH:" in res.stderr
    assert "ENV_NPU_SH" not in res.stderr


def test_script_exports_the_applied_port_and_the_runtime_uses_it(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    assert main(["apply", str(repo.root), "--device", "cuda", "--port", "9123"]) == 0
    res = _run_script(repo, tmp_path, **FILLED)
    assert res.returncode == 0, res.stderr
    assert "ttprun port=9123 " in res.stdout and "runtime port 9123" in res.stdout
    res = _run_script(repo, tmp_path, TTP_CONTROLLER_PORT="9200", **FILLED)
    assert res.returncode == 0 and "runtime port 9200" in res.stdout  # the environment wins


@pytest.mark.parametrize("port", ["80", "65536", "abc", "08x", "1234567", "6000"])
def test_script_refuses_a_controller_port_the_runtime_would_refuse(
    repo: FixtureRepo, capsys, tmp_path, port: str
) -> None:
    assert main(["apply", str(repo.root), "--device", "cpu"]) == 0
    res = _run_script(repo, tmp_path, TTP_CONTROLLER_PORT=port, MASTER_PORT="6000", **FILLED)
    assert res.returncode == 2 and "ttprun" not in res.stdout
    assert f"pretrain_gpt_ttp.sh: TTP_CONTROLLER_PORT={port}:" in res.stderr
    assert "1024..65535" in res.stderr and "syntax error" not in res.stderr


def _json_refusal(capsys, args, code: int, error_type: str) -> dict:
    """A `--json` command that fails: the exit code as without --json, the message on stderr,
    and on stdout one JSON object naming the error."""
    assert main(list(args)) == code
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["overall"] == "error" and doc["error"]["type"] == error_type
    assert doc["error"]["exit_code"] == code and doc["error"]["message"] in err
    return doc


@pytest.mark.parametrize("cmd", ["verify", "status"])
def test_json_error_when_dir_is_missing_not_a_directory_or_not_a_repo(
    tmp_path, capsys, cmd: str
) -> None:
    doc = _json_refusal(capsys, [cmd, str(tmp_path / "nope"), "--json"], 2, "UsageError")
    assert "no such directory" in doc["error"]["message"]
    (tmp_path / "f").write_text("x")
    _json_refusal(capsys, [cmd, str(tmp_path / "f"), "--json"], 2, "UsageError")
    doc = _json_refusal(capsys, [cmd, str(tmp_path), "--json"], 2, "NotAGitRepo")
    assert doc["directory"] == str(tmp_path) and doc["error"]["hint"]


def test_json_error_for_wrong_commit_and_corrupt_record(repo: FixtureRepo, capsys,
                                                        tmp_path: Path) -> None:
    # Another HEAD with byte-identical target files is accepted now (forks), so the
    # commit refusal that status/verify can still meet is a repository without commits.
    empty = tmp_path / "empty"
    empty.mkdir()
    subprocess.run(["git", "init", "-q", str(empty)], check=True)
    doc = _json_refusal(capsys, ["verify", str(empty), "--json"], 2, "WrongCommit")
    assert "no commits" in doc["error"]["message"]
    assert main(["apply", str(repo.root), "--device", "cpu"]) == 0
    (repo.root / RECORD).write_text("{not json")
    capsys.readouterr()
    doc = _json_refusal(capsys, ["verify", str(repo.root), "--json"], 2, "ManifestError")
    assert "revert --force" in doc["error"]["hint"]


def test_json_error_when_another_ttp_patch_holds_the_lock(repo: FixtureRepo, capsys) -> None:
    fd = os.open(repo.root / ".git" / "ttp-patch.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _json_refusal(capsys, ["verify", str(repo.root), "--json"], 2, "Busy")
    finally:
        os.close(fd)


def test_json_error_for_bad_arguments_keeps_argparse_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["verify", ".", "--json", "--device", "tpu"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["error"]["type"] == "UsageError" and "invalid choice" in doc["error"]["message"]
    assert "invalid choice" in err
    with pytest.raises(SystemExit):
        main(["verify", ".", "--device", "tpu"])
    assert capsys.readouterr().out == ""  # without --json stdout stays empty


def test_json_error_for_a_bug_then_the_traceback_as_before(repo: FixtureRepo, capsys,
                                                           monkeypatch) -> None:
    import patcher.cli

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(patcher.cli, "status", broken)
    with pytest.raises(KeyError):
        main(["verify", str(repo.root), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["type"] == "InternalError" and "boom" in doc["error"]["message"]


def test_console_verify_json_error_parses_with_the_unchanged_exit_code(tmp_path) -> None:
    res = subprocess.run(["ttp-patch", "verify", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "not a git repository" in res.stderr
    assert json.loads(res.stdout)["error"]["type"] == "NotAGitRepo"
