"""Train the tiny GPT on surveyed Megatron-LM commits and kill a rank: does Megatron build the
optimizer, and is the dying checkpoint there?

The expensive half of the commit survey (`bench/survey_commits.py --train` calls
:func:`train_one` once per distinct code of `megatron/` + `pretrain_gpt.py`). Per commit: a `git
clone --shared` of REPO at it (REPO is never written), `ttp-patch apply --allow-modified
--device cpu`, the tiny dataset built with that tree's own Megatron classes, then 4 CPU ranks
under `ttprun` (gloo, --use-distributed-optimizer, periodic save every 3) with rank 1 SIGKILLed
in the forward step of iteration 5, driven by the test-only fault hook of
testkit/hooks/fault_hook. Two results: *optimizer built* when rank 0 logged Megatron's "after
model, optimizer, and learning rate scheduler are built" (the ReplicatedOptimizer of the patch
constructed on every rank), and *passed* (trains through a fault) when the job did what
tests/megatron/test_e2e_dying_checkpoint.py asserts at 285068c: the launcher fails, the tracker
names step 4, iter_0000004 verifies against its manifest for the DP4 layout, and losses 1-4 were
logged.

    python bench/survey_train.py REPO COMMIT [COMMIT ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit: the repository's rig

from mindio_ttp.demo.rehearsal.data import make_tiny_dataset  # noqa: E402
from mindio_ttp.demo.rehearsal.launch import (  # noqa: E402
    Launcher,
    PretrainJob,
    pick_free_port,
    tiny_gpt_args,
)
from mindio_ttp.faulttime import manifest  # noqa: E402
from mindio_ttp.faulttime.manifest import ParallelLayout  # noqa: E402
from testkit.hooks import FAULT_HOOK_DIR, pythonpath  # noqa: E402

TTP_OT_S = 40  # as the e2e tests: seconds ttprun keeps survivors alive after a fault
N_ITERS = 10
PLAN = "1:5:sigkill:before"
JOB_TIMEOUT_S = 420.0
DP4 = ParallelLayout(tp=1, pp=1, dp=4)
BUILT_LINE = "after model, optimizer, and learning rate scheduler are built"
_ERROR_LINE = re.compile(r"^(?:\S+: )?(\w+(?:\.\w+)*(?:Error|Exception)\b.*)$", re.M)


@dataclass
class TrainResult:
    commit: str
    applied: bool = False
    dataset: bool = False
    optimizer_built: bool = False
    returncode: Optional[int] = None
    tracker_step: Optional[int] = None
    manifest_ok: bool = False
    losses: Optional[Dict[int, str]] = None
    passed: bool = False
    wall_s: float = 0.0
    error: str = ""
    # for a failure: the first error of the same commit unpatched (stock Megatron, torchrun):
    # "" when stock trains, None when not checked; the same error means the commit is broken
    # upstream, whatever the patch does
    stock_error: Optional[str] = None


def first_error(log: str) -> str:
    """The first exception line of a log (ranks print the same one), '' when none."""
    found = _ERROR_LINE.search(log)
    return found.group(1).strip()[:300] if found else ""


def train_one(repo: Path, commit: str, work: Path) -> TrainResult:
    res = TrainResult(commit)
    t0 = time.monotonic()
    tree = work / "Megatron-LM"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(repo), str(tree)],
                   check=True, timeout=300)
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", "--detach", commit],
                   check=True, timeout=300)
    applied = subprocess.run([sys.executable, "-m", "patcher", "apply", str(tree),
                              "--allow-modified", "--device", "cpu"],
                             capture_output=True, text=True, timeout=300)
    res.applied = applied.returncode == 0
    if not res.applied:
        res.error = applied.stderr[-1000:]
        return res
    try:
        data = make_tiny_dataset(tree, work / "data")
    except RuntimeError as exc:
        res.error = str(exc)[-1500:]
        return res
    res.dataset = True
    ckpt = work / "ckpt"
    record = work / "faults"
    record.mkdir()
    job_env = {
        "PYTHONPATH": pythonpath(FAULT_HOOK_DIR),
        "TTP_OT": str(TTP_OT_S),
        "TTP_CONTROLLER_PORT": str(pick_free_port()),
        "TTP_FAULT_PLAN": PLAN,
        "TTP_FAULT_RECORD_DIR": str(record),
    }
    args = tiny_gpt_args(data, train_iters=N_ITERS, save=ckpt, load=ckpt, save_interval=3)
    with PretrainJob(tree, args, nproc=4, log_path=work / "job.log", launcher=Launcher.TTPRUN,
                     env=job_env) as job:
        result = job.wait(JOB_TIMEOUT_S)
    res.returncode = result.returncode
    res.losses = result.losses
    res.optimizer_built = BUILT_LINE in result.log
    if result.timed_out:
        res.error = f"timed out after {JOB_TIMEOUT_S} s: {result.tail(1500)}"
    elif ckpt.is_dir():
        res.tracker_step = manifest.read_tracker(ckpt)[0]
        step4 = ckpt / manifest.iter_dir_name(4)
        res.manifest_ok = step4.is_dir() and manifest.verify(step4, DP4) is None
    res.passed = (
        not result.timed_out
        and result.returncode != 0
        and res.tracker_step == 4
        and res.manifest_ok
        and sorted(res.losses or {}) == [1, 2, 3, 4]
    )
    if not res.passed and not res.error:
        res.error = first_error(result.log) or result.tail(1500)
    res.wall_s = round(time.monotonic() - t0, 1)
    return res


def stock_error(repo: Path, commit: str, work: Path) -> str:
    """The first error of `commit` unpatched (torchrun, the CPU adaptor injected, 3
    iterations), or "" when it trains."""
    tree = work / "Megatron-LM"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(repo), str(tree)],
                   check=True, timeout=300)
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", "--detach", commit],
                   check=True, timeout=300)
    try:
        data = make_tiny_dataset(tree, work / "data")
    except RuntimeError as exc:
        return first_error(str(exc)) or str(exc)[-300:]
    args = tiny_gpt_args(data, train_iters=3)
    with PretrainJob(tree, args, nproc=4, log_path=work / "stock.log", launcher=Launcher.TORCHRUN,
                     inject_adaptor=True) as job:
        result = job.wait(JOB_TIMEOUT_S)
    if result.returncode == 0 and not result.timed_out:
        return ""
    return first_error(result.log) or result.tail(300)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repo", type=Path)
    p.add_argument("commits", nargs="+")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    results = []
    for commit in args.commits:
        with tempfile.TemporaryDirectory(prefix="ttp-survey-train-") as tmp:
            r = train_one(args.repo, commit, Path(tmp))
        results.append(r)
        print(f"{commit[:12]} applied={r.applied} dataset={r.dataset} "
              f"optimizer_built={r.optimizer_built} rc={r.returncode} "
              f"tracker={r.tracker_step} manifest_ok={r.manifest_ok} "
              f"losses={sorted(r.losses or {})} passed={r.passed} {r.wall_s}s "
              f"{r.error[-300:] if not r.passed else ''}", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
