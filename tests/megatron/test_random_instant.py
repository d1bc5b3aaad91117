"""A single death at a random instant of the step, on real Megatron-LM 285068c (patched
`--device cpu`, ttprun, 4 CPU ranks, DP4): every one gives a dying checkpoint of the newest step
that every shard can provide, bit-identical to Megatron's own save of that iteration.

The phase-named faults (`before`, `barrier`, `inside`, `after`) hit the instants we thought of;
here a timer in the rank (`anytime`, testkit/hooks/fault_hook) SIGKILLs it after a random
delay within one step's length, so the kill also lands in the logging, the data loader, the
loss all-reduce, the guide's barrier, or the gap between steps.

Oracle, independent of the runtime: Megatron prints iteration k (on the last rank) only after
the parameter all-gather of k, which needs every rank to have finished updating k, so the
newest consistent step is at least the last printed one; and no rank can start updating k+2
before every rank reduced k+1's gradients, so it is at most one more. The checkpoint must be
that step, and equal, tensor for tensor, to an uninterrupted run's periodic save of it.
`TTP_RANDOM_KILLS` (default 3) sets the number of kills, `TTP_CHAOS_SEED` the seed. On gloo and
on the NCCL-like backend (testkit/nccl_like: a dead peer's collective spins until aborted).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from megatron_e2e import NCCL_LIKE, cases, run_job, tracker_step

from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints
from mindio_ttp.faulttime import manifest
from mindio_ttp.faulttime.manifest import ParallelLayout

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

DP4 = ParallelLayout(tp=1, pp=1, dp=4)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("random_instant")


@pytest.mark.parametrize("backend", cases(ci=["gloo"], extended=[NCCL_LIKE]))
def test_single_kills_at_random_instants_are_all_saved_bit_exact(
        backend, patched_megatron_tree, tiny_dataset, work, saved_every_iteration) -> None:
    seed = int(os.environ.get("TTP_CHAOS_SEED", time.time_ns() % 1_000_000))
    kills = int(os.environ.get("TTP_RANDOM_KILLS", "3"))
    rng = random.Random(seed)
    outcomes = []
    for i in range(kills):
        rank, step = rng.randrange(4), rng.randint(3, 7)
        what = (f"{backend}, seed {seed}, kill {i}: rank {rank} at a random instant of "
                f"iteration {step}")
        ckpt = work / f"kill{i}_{backend}_ckpt"
        result = run_job(patched_megatron_tree, tiny_dataset, work / f"kill{i}_{backend}.log",
                         ckpt, plan=f"{rank}:{step}:sigkill:anytime",
                         env_extra={"TTP_FAULT_SEED": f"{seed}-{i}"}, backend=backend)
        assert "FAULT: SIGKILL rank" in result.log, f"{what}: no kill\n{result.tail()}"
        assert result.returncode != 0, what
        saved = tracker_step(ckpt)
        printed = max(result.losses, default=0)
        assert saved is not None, f"{what}: no dying checkpoint\n{result.tail()}"
        assert printed <= saved <= printed + 1, (
            f"{what}: saved iteration {saved}, but the newest consistent one is "
            f"{printed} or {printed + 1} (last printed {printed})\n{result.tail()}")
        problem = manifest.verify(ckpt / manifest.iter_dir_name(saved), DP4)
        assert problem is None, f"{what}: {problem}"
        comparison = compare_checkpoints(ckpt, saved_every_iteration, saved)
        assert comparison.bit_exact, f"{what}: {comparison.summary()}"
        outcomes.append((rank, step, printed, saved))
    print(f"seed {seed}: (rank, iteration, last printed, saved) = {outcomes}")
