"""The striped ReplicatedOptimizer end to end on real Megatron: fp16 with dynamic loss scaling,
bf16, DP8, and faults on both sides of the param all-gather (the dying save then either writes
the live weights or swaps main params): the dying checkpoint resumes bit-exact against the
uninterrupted run. Needs TTP_MEGATRON_DIR."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from megatron_e2e import N_ITERS, copy_checkpoints, loss_table, run_job, tracker_step

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints, load_checkpoint_file
from testkit.hooks import pythonpath

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

# dynamic loss scaling that both skips steps (overflow) and grows the scale within 10 steps
FP16 = ["--fp16", "--initial-loss-scale", "131072", "--loss-scale-window", "2",
        "--hysteresis", "1"]
CASES = {
    # name: (extra Megatron args, ranks, fault plan, step the dying checkpoint holds)
    "bf16_after_update": (["--bf16"], 4, "1:5:sigkill:after", 5),
    "fp16_dynamic_scale_inside": (FP16, 4, "2:5:sigkill:inside", 5),
    "fp16_dynamic_scale_before": (FP16, 4, "3:6:sigkill:before", 5),
    "dp8_after_update": (["--global-batch-size", "16"], 8, "6:5:sigkill:after", 5),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("striped")


@pytest.mark.parametrize("name", list(CASES))
def test_dying_checkpoint_resumes_bit_exact(name, patched_megatron_tree, tiny_dataset, work):
    extra, nproc, plan, saved = CASES[name]
    kwargs = dict(extra=extra, nproc=nproc, timeout_s=400)
    ref_ckpt = work / f"{name}_ref"
    ref = run_job(patched_megatron_tree, tiny_dataset, work / f"{name}_ref.log", ref_ckpt,
                  **kwargs)
    assert ref.returncode == 0, ref.tail()
    assert ref.losses, ref.tail()
    if "--fp16" in extra:  # the scaler must really be dynamic here: skips and growth
        scales = [float(x) for x in re.findall(r"loss scale: ([0-9.]+)", ref.log)]
        print("loss scales:", scales)
        assert len(set(scales)) > 2 and len(ref.losses) < N_ITERS, ref.tail()
    else:
        assert sorted(ref.losses) == list(range(1, N_ITERS + 1)), ref.tail()
    ckpt = work / f"{name}_killed"
    killed = run_job(patched_megatron_tree, tiny_dataset, work / f"{name}_killed.log", ckpt,
                     plan=plan, **kwargs)
    assert killed.returncode != 0
    assert tracker_step(ckpt) == saved, killed.tail()
    resumed_ckpt = copy_checkpoints(ckpt, work / f"{name}_resumed")
    resumed = run_job(patched_megatron_tree, tiny_dataset, work / f"{name}_resumed.log",
                      resumed_ckpt, **kwargs)
    assert resumed.returncode == 0, resumed.tail()
    print(loss_table({"uninterrupted": ref.losses, "resumed": resumed.losses}))
    assert resumed.losses == {i: v for i, v in ref.losses.items() if i > saved}
    comparison = compare_checkpoints(resumed_ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, comparison.summary()


GROUP_STEP_HOOK = Path(__file__).resolve().parent / "group_step_adam"


def test_step_kept_in_param_groups_resumes_with_the_right_step(patched_megatron_tree,
                                                               tiny_dataset, work):
    """An optimizer that keeps `step` in its param groups (like apex FusedAdam), where some DP
    position's stripe has no parameter of one group: the dying checkpoint resumes bit-exact,
    and every saved group counts every update."""
    env = {"PYTHONPATH": pythonpath(GROUP_STEP_HOOK),
           "TTP_TEST_GROUP_STEP_ADAM": "1"}
    kwargs = dict(env_extra=env, save_interval=4)
    ref_ckpt = work / "groupstep_ref"
    ref = run_job(patched_megatron_tree, tiny_dataset, work / "groupstep_ref.log", ref_ckpt,
                  **kwargs)
    assert ref.returncode == 0, ref.tail()
    ckpt = work / "groupstep_killed"
    killed = run_job(patched_megatron_tree, tiny_dataset, work / "groupstep_killed.log", ckpt,
                     plan="2:7:sigkill:before", **kwargs)
    assert tracker_step(ckpt) == 6, killed.tail()
    groups = {}
    for path in sorted((ckpt / "iter_0000006").rglob("optim.pt")):
        saved = load_checkpoint_file(path)["optimizer"]["optimizer"]["param_groups"]
        groups[path.parent.name] = [(g.get("weight_decay"), g.get("step")) for g in saved]
    print(groups)
    assert any(len(g) == 1 for g in groups.values()), "no stripe lacks a group: not exercised"
    assert all(step == 6 for g in groups.values() for _, step in g), groups
    resumed = run_job(patched_megatron_tree, tiny_dataset, work / "groupstep_resumed.log",
                      ckpt, **kwargs)
    assert resumed.returncode == 0, resumed.tail()
    assert resumed.losses == {i: v for i, v in ref.losses.items() if i > 6}
    comparison = compare_checkpoints(ckpt, ref_ckpt, N_ITERS)
    assert comparison.bit_exact, comparison.summary()
