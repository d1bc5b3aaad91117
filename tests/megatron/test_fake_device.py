"""The dying checkpoint on a device whose work completes after the host call returns, rehearsed
on real Megatron-LM with a fake device (testkit/hooks/fake_device): the model file must never
hold params the device had not finished gathering. Needs TTP_MEGATRON_DIR.

On NCCL the param all-gather returns to the host as soon as it is enqueued; if a peer dies
inside it, the survivors' params stay those of the step before (the copies wait behind the
hung all-gather), while their optimizer state is the new step's. Here the fake device hangs the
all-gather of iteration 5 on every rank, and rank 1 dies right before it: the survivors'
optimizer files hold step 5, their live params do not. The checkpoint must still equal,
tensor for tensor, Megatron's own save of iteration 5 in an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron_e2e import run_job, tracker_step

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from testkit.hooks import FAKE_DEVICE_DIR, pythonpath

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

STEP, ITERS = 5, 6


def test_params_still_gathering_on_the_device_are_not_saved_as_the_step(
        patched_megatron_tree, tiny_dataset, tmp_path: Path) -> None:
    ref_ckpt = tmp_path / "ref_ckpt"
    ref = run_job(patched_megatron_tree, tiny_dataset, tmp_path / "ref.log", ref_ckpt,
                  iters=ITERS, save_interval=STEP)
    assert ref.returncode == 0, ref.tail()
    ckpt = tmp_path / "ckpt"
    env = {"PYTHONPATH": pythonpath(FAKE_DEVICE_DIR), "TTP_FAKE_DEVICE": "1",
           "TTP_FAKE_DEVICE_HANG_GATHER": str(STEP)}
    killed = run_job(patched_megatron_tree, tiny_dataset, tmp_path / "killed.log", ckpt,
                     iters=ITERS, plan=f"1:{STEP}:sigkill:after", env_extra=env)
    assert f"all-gather of iteration {STEP} is enqueued and hangs" in killed.log, killed.tail()
    assert killed.returncode != 0
    assert tracker_step(ckpt) == STEP, killed.tail()
    comparison = compare_checkpoints(ckpt, ref_ckpt, STEP)
    assert comparison.bit_exact, comparison.summary()
