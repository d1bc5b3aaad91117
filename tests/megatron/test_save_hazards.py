"""Two hazards of the dying save on real Megatron-LM (4 CPU ranks, DP4), each checked against
Megatron's own save of the same iteration in an uninterrupted run, tensor for tensor. Needs
TTP_MEGATRON_DIR.

* **Params still gathering on the device.** On NCCL the param all-gather returns to the host
  as soon as it is enqueued; if a peer dies inside it, the survivors' params stay those of the
  step before (the copies wait behind the hung all-gather), while their optimizer state is the
  new step's. A fake device (testkit/hooks/fake_device) hangs the all-gather of iteration 5 on
  every rank and rank 1 dies right before it: the model file must still hold step 5.
* **A saver dies while it writes.** Rank 2 dies before iteration 5, so ranks 0 (shard 0, and the
  model file) and 1 (shard 1) save step 4; rank 1 is SIGKILLed half-way through its first file.
  The flow orders the save again with shard 1 on rank 3: one checkpoint, complete. (In a DP-only
  job the model-file writer is rank 0 whenever rank 0 saves, and rank 0 hosts the controller: its
  loss mid-write is a controller takeover, whose flow picks savers among the live ranks.)
  With rank 2 lost inside the param all-gather of 5 instead, rank 0 (kept) prepares a second
  time after its first attempt aborted the spinning all-gather, which then "completes" on torn
  buffers on NCCL (D2 of issue 22): the model file must still hold step 5.

Each runs on gloo and on the NCCL-like backend (testkit/nccl_like: a collective with a dead peer
spins until aborted, as on NCCL; megatron_e2e.cases)."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_e2e import NCCL_LIKE, cases, run_job, tracker_step

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from mindio_ttp.faulttime import manifest
from testkit.hooks import FAKE_DEVICE_DIR, pythonpath

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def test_params_still_gathering_on_the_device_are_not_saved_as_the_step(
        patched_megatron_tree, tiny_dataset, saved_every_iteration, tmp_path: Path) -> None:
    step = 5
    ckpt = tmp_path / "ckpt"
    env = {"PYTHONPATH": pythonpath(FAKE_DEVICE_DIR), "TTP_FAKE_DEVICE": "1",
           "TTP_FAKE_DEVICE_HANG_GATHER": str(step)}
    killed = run_job(patched_megatron_tree, tiny_dataset, tmp_path / "killed.log", ckpt,
                     plan=f"1:{step}:sigkill:after", env_extra=env)
    assert f"all-gather of iteration {step} is enqueued and hangs" in killed.log, killed.tail()
    assert killed.returncode != 0
    assert tracker_step(ckpt) == step, killed.tail()
    comparison = compare_checkpoints(ckpt, saved_every_iteration, step)
    assert comparison.bit_exact, comparison.summary()


@pytest.mark.parametrize("backend", cases(ci=["gloo", NCCL_LIKE]))  # both in CI: 30 s
@pytest.mark.parametrize("lost, step", [("2:5:sigkill:before", 4),
                                        ("2:5:sigkill:after", 5)])
def test_a_saver_killed_while_it_writes_is_replaced(
        lost, step, backend, patched_megatron_tree, tiny_dataset, saved_every_iteration,
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    killed = run_job(patched_megatron_tree, tiny_dataset, tmp_path / "killed.log", ckpt,
                     plan=f"{lost},1:{step}:sigkill:save", backend=backend)
    log = killed.log
    assert f"FAULT: SIGKILL rank 1 while saving the checkpoint of step {step}" in log, \
        killed.tail()
    assert "ordering it again, from rank(s) [0, 3]" in log, killed.tail()
    assert killed.returncode != 0
    assert tracker_step(ckpt) == step, killed.tail()
    names = sorted(p.name for p in ckpt.iterdir())
    assert [n for n in names if n.startswith("iter_")] == [manifest.iter_dir_name(step)], names
    assert not [n for n in names if n.startswith(".ttp_tmp")], f"staging left behind: {names}"
    comparison = compare_checkpoints(ckpt, saved_every_iteration, step)
    assert comparison.bit_exact, comparison.summary()
