"""The real-Megatron test harness (``mindio_ttp.demo.rehearsal``) on fakes, without Megatron.

A fake tree (a ``megatron`` package and a ``pretrain_gpt.py`` that prints Megatron-style log
lines) stands in for Megatron, so the launcher, the adaptor-injecting runner, rank discovery,
timeouts, log parsing and checkpoint comparison are checked in CI.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from mindio_ttp.demo.rehearsal.data import learn_merges, synthetic_documents
from mindio_ttp.demo.rehearsal.launch import (
    PretrainJob,
    parse_iteration_ms,
    parse_losses,
    run_pretrain,
)

LOG = (
    " iteration        1/      20 | consumed samples:            8 | elapsed time per iteration "
    "(ms): 85.1 | learning rate: 5.000E-04 | global batch size:     8 | lm loss: 6.481288E+00 |"
    " loss scale: 1.0 | grad norm: 1.234 |\n"
    " iteration        2/      20 | consumed samples:           16 | elapsed time per iteration "
    "(ms): 22.5 | learning rate: 1.000E-03 | global batch size:     8 | lm loss: 6.471716E+00 |\n"
)

FAKE_PRETRAIN = """
import os, sys, time
if "--hang" in sys.argv:
    time.sleep(600)
import torch
import megatron
rank = int(os.environ["RANK"])
print(f"rank {rank} sees {torch.cuda.device_count()} device", flush=True)
if rank == 0:
    for it in (1, 2, 3):
        print(f" iteration {it:8d}/       3 | elapsed time per iteration (ms): {10.0 * it} |"
              f" lm loss: {7 - it:.6E} |", flush=True)
"""


@pytest.fixture
def fake_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "megatron").mkdir(parents=True)
    (tree / "megatron" / "__init__.py").write_text("")
    (tree / "pretrain_gpt.py").write_text(textwrap.dedent(FAKE_PRETRAIN))
    return tree


def test_log_parsing_keeps_printed_losses_exactly() -> None:
    assert parse_losses(LOG) == {1: "6.481288E+00", 2: "6.471716E+00"}
    assert parse_iteration_ms(LOG) == {1: 85.1, 2: 22.5}


def test_corpus_is_seeded_and_bpe_merges_most_frequent_pair_first() -> None:
    assert synthetic_documents(5, 1) == synthetic_documents(5, 1) != synthetic_documents(5, 2)
    words = {("a", "b", "c"): 3, ("a", "b"): 2, ("c", "d"): 4}
    assert learn_merges(words, 2) == [("a", "b"), ("c", "d")]
    assert learn_merges(words, 10)[-1] == ("ab", "c")


def _save(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def test_checkpoint_comparison_is_bit_exact_and_reads_megatron_classes_opaquely(
    tmp_path: Path,
) -> None:
    (tmp_path / "megatron" / "model").mkdir(parents=True)
    for init in ("megatron/__init__.py", "megatron/model/__init__.py"):
        (tmp_path / init).write_text("")
    (tmp_path / "megatron/model/enums.py").write_text(
        "import enum\nclass ModelType(enum.Enum):\n    encoder_or_decoder = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        from megatron.model.enums import ModelType

        def ckpt(weight: torch.Tensor, lr: float) -> dict:
            return {"args": {"model_type": ModelType.encoder_or_decoder, "lr": lr},
                    "iteration": 3, "model": {"w": weight},
                    "rng_state": [{"random_rng_state": (3, tuple(range(5)), None)}]}

        w = torch.randn(4)
        _save(tmp_path / "a/iter_0000003/mp_rank_00/model_rng.pt", ckpt(w, 0.1))
        _save(tmp_path / "b/iter_0000003/mp_rank_00/model_rng.pt", ckpt(w.clone(), 0.2))
        bumped = w.clone()
        bumped[0] = torch.nextafter(bumped[0], torch.tensor(10.0))
        _save(tmp_path / "c/iter_0000003/mp_rank_00/model_rng.pt", ckpt(bumped, 0.1))
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.split(".")[0] == "megatron"]:
            del sys.modules[name]

    same = compare_checkpoints(tmp_path / "a", tmp_path / "b", 3)
    assert same.bit_exact, same.summary()  # args differ, and are skipped
    assert same.tensors == 1
    one_ulp = compare_checkpoints(tmp_path / "a", tmp_path / "c", 3)
    assert not one_ulp.bit_exact and one_ulp.differing == [
        "iter_0000003/mp_rank_00/model_rng.pt:/model/w"]
    _save(tmp_path / "b/iter_0000003/mp_rank_01/model_rng.pt", {"x": 1})
    extra_file = compare_checkpoints(tmp_path / "a", tmp_path / "b", 3)
    assert not extra_file.bit_exact and "mp_rank_01" in extra_file.missing[0]
    assert not compare_checkpoints(tmp_path / "a", tmp_path / "b", 4).bit_exact  # no files


@pytest.mark.slow
def test_runner_injects_adaptor_and_job_reports_losses(fake_tree: Path, tmp_path: Path,
                                                       free_port: int) -> None:
    result = run_pretrain(fake_tree, [], nproc=2, log_path=tmp_path / "run.log",
                          master_port=free_port, timeout_s=120, inject_adaptor=True)
    assert result.returncode == 0, result.tail()
    assert "rank 0 sees 1 device" in result.log and "rank 1 sees 1 device" in result.log
    assert result.losses == {1: "6.000000E+00", 2: "5.000000E+00", 3: "4.000000E+00"}
    assert result.ms_per_iter(skip=1) == 25.0


def _gone(pids: list) -> bool:
    return not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in pids)


@pytest.mark.slow
def test_job_finds_ranks_and_timeout_kills_launcher_and_ranks(fake_tree: Path, tmp_path: Path,
                                                              free_port: int) -> None:
    # torch elastic puts each rank in its own session: killing the launcher's group is not
    # enough, the ranks must be killed one by one or they outlive the test as orphans.
    with PretrainJob(fake_tree, ["--hang"], nproc=2, log_path=tmp_path / "hang.log",
                     master_port=free_port) as job:
        ranks = job.wait_for_workers(2, timeout_s=60)
        assert sorted(ranks) == [0, 1] and job.popen.pid not in ranks.values()
        result = job.wait(timeout_s=1)
    assert result.timed_out and result.returncode != 0
    assert _gone(list(ranks.values()))


@pytest.mark.slow
def test_ranks_left_behind_by_a_dead_launcher_are_reported_and_killed(
    fake_tree: Path, tmp_path: Path, free_port: int
) -> None:
    with PretrainJob(fake_tree, ["--hang"], nproc=2, log_path=tmp_path / "orphan.log",
                     master_port=free_port) as job:
        ranks = job.wait_for_workers(2, timeout_s=60)
        job.popen.kill()  # the launcher alone dies; its ranks would be orphaned
        result = job.wait(timeout_s=30)
    assert not result.timed_out
    assert set(ranks.values()) <= set(result.leftovers)
    assert _gone(result.leftovers)
