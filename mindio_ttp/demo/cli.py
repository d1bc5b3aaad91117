"""`ttp-demo` command line: reference run, faulty run with a dying checkpoint, resume, compare.

Exit codes: 0 the resumed run matched the uninterrupted one bit for bit; 1 it did not, or a run
misbehaved; 2 bad arguments; 3 no dying checkpoint was written (e.g. both holders of a shard were
lost, which the runtime refuses by design), so there was nothing to resume.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

from mindio_ttp import __version__
from mindio_ttp.demo.checkpoint import CheckpointError
from mindio_ttp.demo.model import ShardLayout
from mindio_ttp.demo.runner import WORLD, LaunchResult, launch
from mindio_ttp.testing.faults import Fault, FaultPlan, Phase

EXIT_MATCH, EXIT_MISMATCH, EXIT_USAGE, EXIT_NO_CHECKPOINT = 0, 1, 2, 3


def expected_step(phase: Phase, kill_step: int) -> int:
    """The dying checkpoint's step: a fault before step k's update leaves every survivor at k-1;
    inside the window the replica partner still finishes k; after it everyone has k."""
    return kill_step - 1 if phase is Phase.BEFORE else kill_step


def _ranks(text: str) -> List[int]:
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give ranks as e.g. 1 or 1,2") from None
    if not ranks or any(not 0 <= r < WORLD for r in ranks):
        raise argparse.ArgumentTypeError(f"{text!r}: ranks must be in 0..{WORLD - 1}")
    return ranks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ttp-demo",
        description="Kill a rank of a 4-rank CPU training job, write the dying checkpoint, resume "
        "from it and check the result bit for bit against an uninterrupted run.",
    )
    p.add_argument("--version", action="version", version=f"ttp-demo {__version__}")
    p.add_argument("--kill-rank", type=_ranks, default=[1], metavar="R[,R]",
                   help="rank(s) to fault (default 1; 1,2 faults two ranks at once)")
    p.add_argument("--kill-step", type=int, default=5, metavar="K", help="step of the fault (5)")
    p.add_argument("--fault", choices=[f.value for f in Fault], default=Fault.SIGKILL.value,
                   help="sigkill: the rank dies; exception: train raises; sigstop: the rank hangs")
    p.add_argument("--phase", choices=[Phase.BEFORE.value, Phase.INSIDE.value, Phase.AFTER.value],
                   default=Phase.INSIDE.value, help="where in the step (default inside the "
                   "optimizer-update window)")
    p.add_argument("--steps", type=int, default=8, help="steps of the whole run (8)")
    p.add_argument("--workdir", type=Path, help="keep checkpoints and logs here (default: a "
                   "temporary directory, removed at the end)")
    p.add_argument("--verbose", action="store_true", help="show every line the job prints "
                   "(default: progress lines, the runtime's decisions and ttprun's)")
    p.add_argument("--quiet", action="store_true", help="hide the job's output")
    return p  # fmt: skip


def _say(text: str = "") -> None:
    print(text, flush=True)


_RUNTIME_LINE = re.compile(r"^\S+ \S+ \[ttp rank \d+\] \w+ mindio_ttp\.controller: (.*)$")


def _echo(line: str, verbose: bool) -> None:
    """Show the job's progress, the controller's decisions and ttprun's own lines."""
    if verbose:
        _say(f"    | {line}")
        return
    match = _RUNTIME_LINE.match(line)
    if match and "further fault during the flow" not in line:
        line = f"runtime | {match.group(1)}"
    elif not line.startswith(("rank ", "ttprun:")):
        return
    _say(f"    | {line[:150]}{'...' if len(line) > 150 else ''}")


def _checkpoint_summary(faulty: LaunchResult) -> Optional[str]:
    loaded = faulty.load_checkpoint()
    if loaded is None:
        return None
    files = loaded.manifest["files"]
    slowest = max(float(e["seconds"]) for e in files.values())
    text = (
        f"dying checkpoint: step {loaded.state.step}, written by ranks {loaded.ranks} "
        f"({len(files)} shard files, {loaded.nbytes / 1024:.1f} KiB, slowest shard save "
        f"{1000 * slowest:.1f} ms) -> {loaded.path.name}, marked latest"
    )
    faults = faulty.fault_times()
    if faults:
        elapsed = float(loaded.manifest["renamed_at"]) - min(faults.values())
        text += f"\n      from the fault to the checkpoint in place: {elapsed:.2f} s"
    return text


def run_demo(args: argparse.Namespace, work: Path) -> int:
    layout = ShardLayout.for_world(WORLD)
    phase, fault = Phase(args.phase), Fault(args.fault)
    plan = FaultPlan()
    for rank in args.kill_rank:
        plan.fail_at(rank, args.kill_step, fault, phase)
    echo = None if args.quiet else (lambda line: _echo(line, args.verbose))
    shards = ", ".join(
        f"shard {s} on ranks {[r for r in range(WORLD) if layout.shard_of(r) == s]}"
        for s in range(layout.replica)
    )
    _say(f"ttp-demo: {WORLD} ranks (gloo, CPU), {args.steps} steps, ZeRO-1 optimizer: {shards}")
    _say(f"fault plan: {plan.describe()}; expected dying checkpoint: step "
         f"{expected_step(phase, args.kill_step)} (if every shard keeps a clean copy)")  # fmt: skip

    _say("[1/3] uninterrupted reference run under ttprun ...")
    ref = launch(work / "reference", args.steps)
    if ref.returncode != 0:
        _say(ref.output)
        _say(f"the reference run failed (ttprun exit {ref.returncode})")
        return EXIT_MISMATCH
    reference = ref.final_state()
    _say(f"      done in {ref.seconds:.1f} s: step {reference.step}, "
         f"state sha256 {reference.digest()[:16]}")  # fmt: skip

    _say(f"[2/3] the same run with the fault: {plan.describe()} ...")
    faulty = launch(work / "faulty", args.steps, plan, echo=echo)
    flow = faulty.flow or {}
    _say(f"      ttprun exited {faulty.returncode} after {faulty.seconds:.1f} s; runtime outcome: "
         f"{flow.get('outcome', 'none recorded')}")  # fmt: skip
    if faulty.returncode == 1:
        _say("      (exit 1 is expected: a rank was killed, so ttprun fails the job and a "
             "scheduler would restart it; the same command then resumes from the dying checkpoint)")
    try:
        summary = _checkpoint_summary(faulty)
    except CheckpointError as exc:
        _say(f"      the checkpoint is unusable: {exc}")
        return EXIT_MISMATCH
    if summary is None:
        reason = flow.get("reason", "the runtime recorded no outcome")
        _say(f"      no dying checkpoint was written (nothing marked latest): {reason}")
        _say("RESULT: NO CHECKPOINT - nothing to resume from (see the runtime's reason above)")
        return EXIT_NO_CHECKPOINT
    _say(f"      {summary}")

    _say("[3/3] resume from the dying checkpoint under ttprun ...")
    resumed = launch(work / "resumed", args.steps, resume=True, ckpt_dir=faulty.ckpt_dir,
                     echo=echo)  # fmt: skip
    if resumed.returncode != 0:
        _say(f"the resumed run failed (ttprun exit {resumed.returncode})")
        return EXIT_MISMATCH
    final = resumed.final_state()
    _say(f"      done in {resumed.seconds:.1f} s: step {final.step}, "
         f"state sha256 {final.digest()[:16]}")  # fmt: skip
    diffs = final.differences(reference)
    if diffs:
        _say(f"RESULT: MISMATCH - the resumed run differs from the uninterrupted one in {diffs}")
        return EXIT_MISMATCH
    names = ", ".join(sorted(final.tensors()))
    _say(f"RESULT: MATCH - the resumed run is bit-for-bit identical to the uninterrupted run "
         f"({names})")  # fmt: skip
    return EXIT_MATCH


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.kill_step <= args.steps:
        parser.error(f"--kill-step {args.kill_step} must be within 1..--steps ({args.steps})")
    started = time.monotonic()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ttp-demo-"))
    try:
        code = run_demo(args, work)
    finally:
        if args.workdir is None:
            _say(f"removing {work} (checkpoints and logs of this demo); pass --workdir DIR to "
                 "keep them")
            shutil.rmtree(work, ignore_errors=True)
    _say(f"ttp-demo finished in {time.monotonic() - started:.1f} s (exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
