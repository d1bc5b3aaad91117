"""The real Megatron-LM 285068c (env TTP_MEGATRON_DIR; skipped without it).

Every test works on its own `git clone --shared` of that checkout in tmp_path: nothing is
ever written into the tree TTP_MEGATRON_DIR names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List

import pytest
from conftest import SCRIPT, TARGETS, git, porcelain

from patcher.cli import main
from patcher.repo import PINNED_COMMIT
from testkit.patcher_pin import unpin

pytestmark = pytest.mark.megatron
PATCHES = Path(__file__).resolve().parents[2] / "patches" / "285068c"
DEVICES = ["npu", "cuda", "cpu"]


@pytest.fixture
def clone(megatron_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    unpin(monkeypatch)
    dst = tmp_path / "Megatron-LM"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(megatron_dir),
                    str(dst)], check=True, timeout=120)
    git(dst, "checkout", "-q", "--detach", PINNED_COMMIT)
    return dst


@pytest.mark.parametrize("device", DEVICES)
def test_apply_verify_compile_patches_reapply_revert(clone: Path, device: str, capsys) -> None:
    before = porcelain(clone)
    head = {p: (clone / p).read_bytes() for p in TARGETS}
    assert main(["apply", str(clone), "--device", device]) == 0
    assert main(["verify", str(clone)]) == 0
    for path in TARGETS:  # compile only: the runtime modules they import may not exist here
        compile((clone / path).read_bytes(), str(clone / path), "exec", dont_inherit=True)
    subprocess.run(["bash", "-n", str(clone / SCRIPT)], check=True, timeout=30)
    git(clone, "apply", "--check", "-R", str(PATCHES / f"{device}.patch"))
    capsys.readouterr()
    assert main(["diff", str(clone)]) == 0
    assert capsys.readouterr().out == (PATCHES / f"{device}.patch").read_text(), (
        "patches/ is stale: run `python -m patcher.regenerate $TTP_MEGATRON_DIR`"
    )
    applied = {p: (clone / p).read_bytes() for p in TARGETS + [SCRIPT]}
    assert main(["apply", str(clone), "--device", device]) == 0
    assert {p: (clone / p).read_bytes() for p in TARGETS + [SCRIPT]} == applied
    assert main(["revert", str(clone)]) == 0
    assert porcelain(clone) == before
    assert {p: (clone / p).read_bytes() for p in TARGETS} == head


@pytest.mark.parametrize("device", DEVICES)
def test_plain_git_apply_of_patches_reads_as_applied(clone: Path, device: str, capsys) -> None:
    git(clone, "apply", str(PATCHES / f"{device}.patch"))
    capsys.readouterr()
    assert main(["verify", str(clone), "--json", "--device", device]) == 0
    assert json.loads(capsys.readouterr().out)["overall"] == "applied"
    assert main(["revert", str(clone)]) == 0  # no record: proven ours from the content
    assert porcelain(clone) == ""


def _script_flags(script: str) -> List[str]:
    launch = script[script.index("ttprun ") :]
    return re.findall(r"^\s+(--[a-z0-9-]+)", launch, flags=re.M)


@pytest.mark.parametrize("device", DEVICES)
def test_launch_script_flags_exist_in_megatron(clone: Path, device: str) -> None:
    assert main(["apply", str(clone), "--device", device]) == 0
    script = (clone / SCRIPT).read_text()
    arguments = (clone / "megatron" / "arguments.py").read_text()
    flags = _script_flags(script)
    assert "--use-distributed-optimizer" in flags  # ReplicatedOptimizer needs it
    unknown = [f for f in flags if f"'{f}'" not in arguments]
    assert unknown == []
    if device == "cpu":
        for flag in ("--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                     "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion"):
            assert flag in flags
        assert "--distributed-backend gloo" in script and "--fp16" not in flags
        assert "--bf16" not in flags  # no half-precision kernels on CPU
        assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in script
    else:  # bf16: no loss scale to tune; the example's --fp16 is replaced, not added to
        assert "--bf16" in flags and "--fp16" not in flags


def test_apply_plus_verify_wall_time(clone: Path) -> None:
    t0 = time.perf_counter()
    subprocess.run(["ttp-patch", "apply", str(clone)], check=True, timeout=60,
                   capture_output=True)
    subprocess.run(["ttp-patch", "verify", str(clone)], check=True, timeout=60,
                   capture_output=True)
    elapsed = time.perf_counter() - t0
    print(f"apply + verify on the real tree: {elapsed:.2f} s")
    assert elapsed < 10  # the target is < 2 s; this bound only catches pathologies under load


CHILD = textwrap.dedent(
    """
    import datetime, json, os, sys, types
    root, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # Only parallel_state (and megatron/core/utils.py it imports) may run: megatron/__init__.py
    # pulls in apex and the rest of Megatron, so the two packages are stood up empty.
    for name, sub in (("megatron", "megatron"), ("megatron.core", "megatron/core")):
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(root, sub)]
        sys.modules[name] = mod
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=datetime.timedelta(seconds=60))
    import megatron.core.parallel_state as ps
    assert ps.__file__.startswith(root), ps.__file__
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    print(json.dumps({
        "rank": rank,
        "dp": list(ps.get_data_parallel_all_rank()),
        "all": ps.get_all_data_parallel_ranks(),
        "dp_world": dist.get_world_size(ps.get_data_parallel_group()),
    }))
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_patched_parallel_state_tp2_four_gloo_ranks(clone: Path, free_port: int) -> None:
    assert main(["apply", str(clone), "--device", "cuda"]) == 0
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(clone), str(rank), str(free_port)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(4)
    ]
    results = {}
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            doc = json.loads(out.strip().splitlines()[-1])
            results[doc["rank"]] = doc
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for rank in range(4):
        assert results[rank]["dp"] == [rank % 2, rank % 2 + 2]
        assert results[rank]["all"] == [[0, 2], [1, 3]]
        assert results[rank]["dp_world"] == 2


@pytest.mark.slow
def test_cpu_launch_script_trains_with_ttprun(clone: Path, tmp_path: Path) -> None:
    """The generated script is runnable as is on a CPU machine: a few real iterations, saved."""
    from mindio_ttp.demo.rehearsal.data import make_tiny_dataset
    from mindio_ttp.demo.rehearsal.launch import pick_free_port

    assert main(["apply", str(clone), "--device", "cpu"]) == 0
    data = make_tiny_dataset(clone, tmp_path / "data")
    env = dict(os.environ, DATA_PATH=str(data.prefix), VOCAB_FILE=str(data.vocab_file),
               MERGE_FILE=str(data.merge_file), CHECKPOINT_PATH=str(tmp_path / "ckpt"),
               MASTER_PORT=str(pick_free_port()), TTP_CONTROLLER_PORT=str(pick_free_port()))
    env.pop("TTP_MEGATRON_DIR", None)
    res = subprocess.run(["bash", str(clone / SCRIPT), "--train-iters", "4", "--eval-iters", "1",
                          "--log-interval", "1"], env=env, capture_output=True, text=True,
                         timeout=480, start_new_session=True)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    losses = re.findall(r"iteration\s+(\d+)/\s+4 \|.*lm loss: ([0-9.E+-]+)", log)
    assert [int(i) for i, _ in losses] == [1, 2, 3, 4]
    assert "controller" in log  # the TTP start-up block ran
    assert (tmp_path / "ckpt" / "iter_0000004").is_dir()
