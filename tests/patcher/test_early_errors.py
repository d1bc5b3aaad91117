"""Mistakes that are caught by ttp-patch itself, not later on the cluster: a controller port the
runtime would refuse, an npu apply on a machine without the adaptor, an unfilled launch script,
and `verify --json` errors a pipeline can parse."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
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


def _filled(tmp_path, **over: str) -> dict:
    """Every value the script asks for, the tokenizer files real ones (it checks they exist)."""
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text("{}")
    merges.write_text("#version: 0.2\n")
    data = _dataset(tmp_path, "x_text_document")
    return {**FILLED, "DATA_PATH": data, "VOCAB_FILE": str(vocab), "MERGE_FILE": str(merges),
            **over}


def _dataset(tmp_path, name: str) -> str:
    """A data prefix whose .bin and .idx exist (the script checks for both)."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"{name}{suffix}").write_bytes(b"")
    return str(tmp_path / name)


def test_data_path_is_checked_as_settings_md_says(repo: FixtureRepo, capsys,
                                                  tmp_path) -> None:
    """docs/settings.md said the script checks DATA_PATH exists; it only checked it was no
    placeholder, so a wrong prefix failed inside Megatron on every rank of every node."""
    assert main(["apply", str(repo.root), "--device", "cuda"]) == 0
    good = _dataset(tmp_path, "a_text_document")
    other = _dataset(tmp_path, "b_text_document")
    assert _run_script(repo, tmp_path, **_filled(tmp_path, DATA_PATH=good)).returncode == 0
    blend = f"0.3 {good} 0.7 {other}"  # Megatron's blend: weights and prefixes
    res = _run_script(repo, tmp_path, **_filled(tmp_path, DATA_PATH=blend))
    assert res.returncode == 0, res.stderr
    for wrong in (f"{tmp_path}/nope_text_document", f"{good}.bin", f"0.5 {good} 0.5 {tmp_path}/c"):
        res = _run_script(repo, tmp_path, **_filled(tmp_path, DATA_PATH=wrong))
        assert _missing(res) == ["DATA_PATH"], (wrong, res.stderr)
        named = wrong.split()[-1]
        assert f"DATA_PATH: no {named}.bin and {named}.idx" in res.stderr, res.stderr


def _missing(res: subprocess.CompletedProcess) -> list:
    """The values the script reported, in its order."""
    assert res.returncode == 2 and "ttprun" not in res.stdout, res.stderr
    head, _, rest = res.stderr.partition("set these")
    assert head == "pretrain_gpt_ttp.sh: cannot start; ", res.stderr
    return [ln.strip().split(":")[0].split("=")[0] for ln in rest.splitlines()[1:]]


def test_unfilled_npu_script_names_env_npu_sh_before_bash_fails_on_the_file(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    assert main(["apply", str(repo.root)]) == 0
    res = _run_script(repo, tmp_path)
    assert res.stdout == "" and "No such file" not in res.stderr
    assert _missing(res)[0] == "ENV_NPU_SH"
    res = _run_script(repo, tmp_path, ENV_NPU_SH=str(tmp_path / "nope.sh"), **_filled(tmp_path))
    assert _missing(res) == ["ENV_NPU_SH"] and "No such file" not in res.stderr
    assert f"ENV_NPU_SH={tmp_path}/nope.sh is not a file" in res.stderr


def test_every_unfilled_value_is_reported_at_once_and_nothing_is_sourced_first(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    """Before: one value per try, each try a round trip on the cluster."""
    assert main(["apply", str(repo.root)]) == 0
    res = _run_script(repo, tmp_path)  # one node: MASTER_ADDR is 127.0.0.1, not missing
    assert _missing(res) == ["ENV_NPU_SH", "DATA_PATH", "CHECKPOINT_PATH", "VOCAB_FILE",
                             "MERGE_FILE"]
    res = _run_script(repo, tmp_path, NNODES="2", ENV_NPU_SH=_env_npu_sh(tmp_path))
    assert _missing(res) == ["MASTER_ADDR", "DATA_PATH", "CHECKPOINT_PATH", "VOCAB_FILE",
                             "MERGE_FILE", "TTP_AUTH_KEY"]
    assert "export TTP_AUTH_KEY=$(python3 -c" in res.stderr  # shown, not run
    assert not (tmp_path / "sourced").exists()


@pytest.mark.parametrize("missing", sorted(FILLED))
def test_each_unfilled_value_is_named_and_nothing_is_sourced_first(
    repo: FixtureRepo, capsys, tmp_path, missing: str
) -> None:
    assert main(["apply", str(repo.root)]) == 0
    env = {k: v for k, v in _filled(tmp_path, NNODES="2", TTP_AUTH_KEY="ab" * 32).items()
           if k != missing}
    res = _run_script(repo, tmp_path, ENV_NPU_SH=_env_npu_sh(tmp_path), **env)
    assert _missing(res) == [missing]
    assert not (tmp_path / "sourced").exists()


def test_filled_npu_script_sources_the_adaptor_env_under_set_u_and_launches(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    assert main(["apply", str(repo.root)]) == 0
    res = _run_script(repo, tmp_path, ENV_NPU_SH=_env_npu_sh(tmp_path), **_filled(tmp_path))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "sourced").exists() and res.stdout.startswith("ttprun ")
    assert "--master_addr 10.0.0.1" in res.stdout and "--save /ckpt" in res.stdout
    assert " --bf16 " in res.stdout and "--fp16" not in res.stdout


@pytest.mark.parametrize("nodes,gpus", [(1, 8), (2, 8), (3, 8), (4, 2)])
def test_global_batch_fits_any_world_size(repo: FixtureRepo, capsys, tmp_path, nodes: int,
                                          gpus: int) -> None:
    """8 GPUs x 2 nodes: DP 16, and the example's micro-batch 8 x 16 does not divide its
    global batch 64 (Megatron's microbatches.py refused it). Now micro-batch x ranks, said."""
    assert main(["apply", str(repo.root), "--device", "cuda"]) == 0
    env = _filled(tmp_path, NNODES=str(nodes), GPUS_PER_NODE=str(gpus), TTP_AUTH_KEY="ab" * 32)
    res = _run_script(repo, tmp_path, **env)
    assert res.returncode == 0, res.stderr
    world = nodes * gpus
    micro = int(re.search(r"--micro-batch-size (\d+)", res.stdout).group(1))
    glob = int(re.search(r"--global-batch-size (\d+)", res.stdout).group(1))
    assert micro == 8 and glob % (micro * world) == 0  # DP = world without TP/PP
    assert f"{world} ranks on {nodes} node(s), global batch {glob} (micro-batch 8)" in res.stderr
    res = _run_script(repo, tmp_path, GLOBAL_BATCH_SIZE="1024", **env)
    assert "--global-batch-size 1024" in res.stdout  # the user's own value wins


def test_one_node_script_runs_on_localhost_without_master_addr(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    assert main(["apply", str(repo.root), "--device", "cuda"]) == 0
    env = {k: v for k, v in _filled(tmp_path).items() if k != "MASTER_ADDR"}
    res = _run_script(repo, tmp_path, **env)
    assert res.returncode == 0 and "--master_addr 127.0.0.1 " in res.stdout, res.stderr


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_unfilled_cuda_and_cpu_scripts_name_the_data_path(
    repo: FixtureRepo, capsys, tmp_path, device: str
) -> None:
    assert main(["apply", str(repo.root), "--device", device]) == 0
    res = _run_script(repo, tmp_path, MASTER_ADDR="10.0.0.1")
    assert "DATA_PATH" in _missing(res) and "ENV_NPU_SH" not in res.stderr


def test_script_exports_the_applied_port_and_the_runtime_uses_it(
    repo: FixtureRepo, capsys, tmp_path
) -> None:
    assert main(["apply", str(repo.root), "--device", "cuda", "--port", "9123"]) == 0
    res = _run_script(repo, tmp_path, **_filled(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "ttprun port=9123 " in res.stdout and "runtime port 9123" in res.stdout
    res = _run_script(repo, tmp_path, TTP_CONTROLLER_PORT="9200", **_filled(tmp_path))
    assert res.returncode == 0 and "runtime port 9200" in res.stdout  # the environment wins


@pytest.mark.parametrize("port", ["80", "65536", "abc", "08x", "1234567", "6000"])
def test_script_refuses_a_controller_port_the_runtime_would_refuse(
    repo: FixtureRepo, capsys, tmp_path, port: str
) -> None:
    assert main(["apply", str(repo.root), "--device", "cpu"]) == 0
    res = _run_script(repo, tmp_path, TTP_CONTROLLER_PORT=port, MASTER_PORT="6000",
                      **_filled(tmp_path))
    assert _missing(res) == ["TTP_CONTROLLER_PORT"]
    assert f"  TTP_CONTROLLER_PORT={port}:" in res.stderr
    assert "1024..65535" in res.stderr and "syntax error" not in res.stderr


def test_apply_port_equal_to_master_port_is_refused_at_apply(repo: FixtureRepo, capsys) -> None:
    """Before: accepted, and refused only by the script on the cluster."""
    refused(capsys, repo, ["apply", str(repo.root), "--port", "6000"], 2,
            "--port 6000 is MASTER_PORT in examples/pretrain_gpt_distributed.sh")


@pytest.mark.parametrize("device", ["npu", "cpu"])
def test_apply_ends_with_the_next_steps(repo: FixtureRepo, capsys, device: str) -> None:
    assert main(["apply", str(repo.root), "--device", device]) == 0
    err = capsys.readouterr().err
    steps = err[err.index("ttp-patch: next steps:"):]
    assert f"FILL IN' lines of {repo.root}/pretrain_gpt_ttp.sh" in steps
    assert ("ENV_NPU_SH" in steps) == (device == "npu")
    assert "TTP_AUTH_KEY" in steps and f"bash {repo.root}/pretrain_gpt_ttp.sh" in steps
    assert main(["apply", str(repo.root), "--device", device]) == 0  # nothing to do: no steps
    assert "next steps" not in capsys.readouterr().err


def test_help_says_npu_is_the_default_and_revert_gives_your_bytes_back(capsys) -> None:
    for words, needles in ((["apply", "--help"], ["npu (the default"]),
                           (["revert", "--help"], ["pre-apply bytes"])):
        with pytest.raises(SystemExit):
            main(words)
        out = " ".join(capsys.readouterr().out.split())
        for needle in needles:
            assert needle in out, out


def test_a_git_repository_that_is_not_megatron_is_named_as_such(tmp_path, capsys) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "README").write_text("not Megatron\n")
    git_init = ["git", "-C", str(other)]
    subprocess.run([*git_init, "init", "-q"], check=True)
    subprocess.run([*git_init, "add", "-A"], check=True)
    subprocess.run([*git_init, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm",
                    "x"], check=True)
    for command in ("apply", "status", "revert"):
        assert main([command, str(other)]) == 2
        err = capsys.readouterr().err
        assert "is a git repository" in err and "but not Megatron-LM" in err, err
        assert "git checkout -- pretrain_gpt.py" not in err


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


def test_ttprun_args_reach_ttprun_before_the_training_script(repo: FixtureRepo, capsys,
                                                             tmp_path) -> None:
    """The pre-flight check and the fire drill of docs/first-day.md through the script."""
    assert main(["apply", str(repo.root), "--device", "cuda"]) == 0
    res = _run_script(repo, tmp_path, TTPRUN_ARGS="--drill kill:rank=13:iter=20",
                      **_filled(tmp_path))
    assert res.returncode == 0, res.stderr
    args = res.stdout.splitlines()[0]
    assert " --master_port 6000 --drill kill:rank=13:iter=20 " in args, args
    assert args.index("--drill") < args.index("pretrain_gpt.py"), args
    res = _run_script(repo, tmp_path, **_filled(tmp_path))  # unset: nothing added
    assert " --master_port 6000 " in res.stdout and "--drill" not in res.stdout
