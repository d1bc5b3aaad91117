"""`ttp-demo` command line: a fault in a 4-rank CPU job, recovered in memory (the default,
as under ttprun) or saved in the dying checkpoint and resumed, compared bit for bit with an
uninterrupted run (``--recovery in-memory|dying-checkpoint``).

Two jobs: the toy 4-rank job (default, seconds), or with ``--megatron DIR`` the real Megatron-LM
tiny GPT on a patched copy of DIR (mindio_ttp.demo.megatron, a minute or two).

Exit codes: 0 the resumed run matched the uninterrupted one bit for bit; 1 it did not, or a run
misbehaved; 2 bad arguments or input (e.g. DIR is not a tree ttp-patch patches); 3 no
dying checkpoint was written (e.g. both holders of a shard were lost, which the runtime refuses
by design), so there was nothing to resume.

Files: everything goes into one work directory. ``--keep DIR`` puts it in DIR (new or empty) and
keeps it; otherwise it is a temporary directory, removed after a MATCH and kept (and said so)
after anything else, so the logs of a failure are there to read.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

from mindio_ttp import __version__
from mindio_ttp.config import ENV_RECOVERY, RECOVERY_MODES
from mindio_ttp.demo.faults import Fault, FaultPlan, Phase
from mindio_ttp.demo.wrap import wrap

if TYPE_CHECKING:
    from mindio_ttp.demo.megatron import SourceTree
    from mindio_ttp.demo.runner import LaunchResult

# Ranks of both jobs (mindio_ttp.demo.runner.WORLD, mindio_ttp.demo.megatron.WORLD). The jobs'
# modules import torch, which takes seconds: they are imported only once the input is checked.
WORLD = 4

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
        description="Kill a rank of a 4-rank CPU training job and check, bit for bit against an "
        "uninterrupted run, what the runtime does: recover in memory (a replacement refilled "
        "from its replica partner, no restart: the default, as under ttprun) or write the "
        "dying checkpoint and resume from it (--recovery dying-checkpoint).",
    )
    p.add_argument("--version", action="version", version=f"ttp-demo {__version__}")
    p.add_argument("--recovery", choices=list(RECOVERY_MODES), default=RECOVERY_MODES[0],
                   help=f"what the runtime does after the fault ({ENV_RECOVERY}; default "
                   f"{RECOVERY_MODES[0]}, the product's default under ttprun): recover in "
                   "memory, or write the dying checkpoint and resume from it")
    p.add_argument("--megatron", type=Path, metavar="DIR",
                   help="run the real Megatron-LM tiny GPT instead of the toy job: DIR is a git "
                   "checkout of Megatron-LM that `ttp-patch apply` accepts (285068c, or a fork "
                   "or later commit with the same five target files), as it is, uncommitted "
                   "changes included (only read: a copy is patched and trained)")
    p.add_argument("--allow-modified", action="store_true",
                   help="with --megatron: patch the copy with `ttp-patch apply "
                   "--allow-modified` (target files that differ from 285068c's)")
    p.add_argument("--kill-rank", type=_ranks, default=[1], metavar="R[,R]",
                   help="rank(s) to fault (default 1; 1,2 faults two ranks at once)")
    p.add_argument("--kill-step", type=int, metavar="K", help="step of the fault (toy: 5); "
                   "with --megatron the ranks are signalled once iteration K is logged (4)")
    p.add_argument("--fault", choices=[f.value for f in Fault], help="sigkill (default): the "
                   "rank dies; exception: train raises (toy only); sigstop: the rank hangs")
    p.add_argument("--phase", choices=[Phase.BEFORE.value, Phase.INSIDE.value, Phase.AFTER.value],
                   help="where in the step (toy only; default inside the optimizer-update "
                   "window)")
    p.add_argument("--steps", type=int, help="steps (iterations) of the whole run (toy: 8, "
                   "--megatron: 10)")
    p.add_argument("--keep", "--workdir", dest="keep", type=Path, metavar="DIR",
                   help="write everything (tree copy, dataset, checkpoints, logs) into DIR, new "
                   "or empty, and keep it (default: a temporary directory, removed after a "
                   "MATCH)")
    p.add_argument("--verbose", action="store_true", help="show every line the job prints "
                   "(default: progress lines, the runtime's decisions and ttprun's)")
    p.add_argument("--quiet", action="store_true", help="hide the job's output")
    return p  # fmt: skip


def _say(text: str = "") -> None:
    print(wrap(text), flush=True)


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
    _say(f"    | {line}")


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
    """The toy job (``args`` resolved by ``main``: every option has its value)."""
    from mindio_ttp.demo.model import ShardLayout
    from mindio_ttp.demo.runner import launch

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
    in_memory = args.recovery == RECOVERY_MODES[0]
    what = ("recovered in memory at" if in_memory else "dying checkpoint:")
    _say(f"ttp-demo: {WORLD} ranks (gloo, CPU), {args.steps} steps, ZeRO-1 optimizer: {shards}; "
         f"{ENV_RECOVERY}={args.recovery}")
    _say(f"fault plan: {plan.describe()}; expected: {what} step "
         f"{expected_step(phase, args.kill_step)} (if every shard keeps a clean copy)")
    env = {ENV_RECOVERY: args.recovery}
    total = 3

    _say(f"[1/{total}] uninterrupted reference run under ttprun ...")
    ref = launch(work / "reference", args.steps, env=env)
    if ref.returncode != 0:
        _say(ref.output)
        _say(f"the reference run failed (ttprun exit {ref.returncode})")
        return EXIT_MISMATCH
    reference = ref.final_state()
    _say(f"      done in {ref.seconds:.1f} s: step {reference.step}, "
         f"state sha256 {reference.digest()[:16]}")  # fmt: skip

    _say(f"[2/{total}] the same run with the fault: {plan.describe()} ...")
    faulty = launch(work / "faulty", args.steps, plan, echo=echo, env=env)
    flow = faulty.flow or {}
    recovered = faulty.recoveries()
    _say(f"      ttprun exited {faulty.returncode} after {faulty.seconds:.1f} s; "
         + (f"recovered in memory: {_recoveries(recovered)}" if recovered else
            f"runtime outcome: {flow.get('outcome', 'none recorded')}"))
    if in_memory and faulty.returncode == 0 and recovered:
        return _compare_final(faulty, reference, f"recovered in memory at step "
                              f"{recovered[0]['iteration']} (rank(s) "
                              f"{recovered[0]['replaced']} replaced, no restart, nothing read "
                              "from disk)", total)
    if in_memory:
        _say("      no in-memory recovery committed: the runtime fell back to the dying "
             "checkpoint (its reason is in the lines above); showing that instead")
    return _dying_checkpoint(args, work, faulty, reference, echo, env, total)


def _recoveries(recovered: list) -> str:
    return "; ".join(f"recovery {r['recovery_id']} at step {r['iteration']} replaced rank(s) "
                     f"{r['replaced']}" for r in recovered)


def _dying_checkpoint(args: argparse.Namespace, work: Path, faulty: LaunchResult, reference: Any,
                      echo: Any, env: dict, total: int) -> int:
    from mindio_ttp.demo.checkpoint import CheckpointError
    from mindio_ttp.demo.runner import launch

    flow = faulty.flow or {}
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

    _say(f"[3/{total}] resume from the dying checkpoint under ttprun ...")
    resumed = launch(work / "resumed", args.steps, resume=True, ckpt_dir=faulty.ckpt_dir,
                     echo=echo, env=env)  # fmt: skip
    if resumed.returncode != 0:
        _say(f"the resumed run failed (ttprun exit {resumed.returncode})")
        return EXIT_MISMATCH
    return _compare_final(resumed, reference, "resumed from the dying checkpoint", None)


def _compare_final(run: LaunchResult, reference: Any, how: str,
                   stage_total: Optional[int]) -> int:
    if stage_total is not None:
        _say(f"[3/{stage_total}] the final state against the uninterrupted run's ...")
    final = run.final_state()
    _say(f"      done in {run.seconds:.1f} s: step {final.step}, "
         f"state sha256 {final.digest()[:16]}")  # fmt: skip
    diffs = final.differences(reference)
    if diffs:
        _say(f"RESULT: MISMATCH - the run {how} differs from the uninterrupted one in {diffs}")
        return EXIT_MISMATCH
    names = ", ".join(sorted(final.tensors()))
    _say(f"RESULT: MATCH - {how}: bit-for-bit identical to the uninterrupted run ({names})")
    return EXIT_MATCH


@dataclass(frozen=True)
class WorkDir:
    """Where the demo writes, and whether it was asked to keep it."""

    path: Path
    keep: bool
    contents: str  # what the user is told it holds

    @classmethod
    def choose(cls, keep: Optional[Path], contents: str) -> WorkDir:
        if keep is None:
            return cls(Path(tempfile.mkdtemp(prefix="ttp-demo-")), False, contents)
        path = keep.absolute()
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ValueError(f"--keep {keep}: exists and is not an empty directory; give a new "
                             "or empty one (the demo writes its whole run there)")
        path.mkdir(parents=True, exist_ok=True)
        return cls(path, True, contents)

    def finish(self, code: Optional[int]) -> None:
        """Say what happens to the directory: kept, or removed (only after a MATCH)."""
        if self.keep:
            _say(f"kept {self.path} ({self.contents})")
        elif code == EXIT_MATCH:
            _say(f"removing {self.path} ({self.contents}); pass --keep DIR to keep them")
            shutil.rmtree(self.path, ignore_errors=True)
        elif code == EXIT_USAGE:  # refused before any run: nothing worth keeping
            _say(f"removing {self.path} (the refused copy; nothing ran)")
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            _say(f"kept {self.path} ({self.contents}) to look at what went wrong; remove it "
                 f"with: rm -rf {self.path}")


def _resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in each mode's defaults and refuse options the mode cannot honour (exit 2)."""
    if args.megatron is None and args.allow_modified:
        parser.error("--allow-modified is for --megatron DIR (the toy job patches nothing)")
    if args.megatron is not None:
        from mindio_ttp.demo import megatron

        if args.phase is not None:
            parser.error("--phase needs the toy job's in-step hooks; with --megatron the rank "
                         "is signalled from outside (choose --fault sigkill or sigstop)")
        if args.fault == Fault.EXCEPTION.value:
            parser.error("--fault exception needs the toy job's hooks; with --megatron use "
                         "sigkill or sigstop")
        args.steps = megatron.DEFAULT_ITERS if args.steps is None else args.steps
        args.kill_step = megatron.DEFAULT_KILL_AFTER if args.kill_step is None else args.kill_step
        if not 1 <= args.kill_step < args.steps:
            parser.error(f"--kill-step {args.kill_step} must be within 1..--steps - 1 "
                         f"({args.steps - 1}): the ranks are signalled after iteration K is "
                         "logged, which must not be the last")
    else:
        args.steps = 8 if args.steps is None else args.steps
        args.kill_step = 5 if args.kill_step is None else args.kill_step
        args.phase = args.phase or Phase.INSIDE.value
        if not 1 <= args.kill_step <= args.steps:
            parser.error(f"--kill-step {args.kill_step} must be within 1..--steps "
                         f"({args.steps})")
    args.fault = args.fault or Fault.SIGKILL.value


def _run_megatron(args: argparse.Namespace, work: Path, source: SourceTree) -> int:
    from mindio_ttp.demo.megatron import MegatronOptions, MegatronRehearsal, Verdict

    options = MegatronOptions(
        source=source.path, commit=source.head, allow_modified=args.allow_modified,
        with_changes=source.with_changes, iters=args.steps, kill_ranks=tuple(args.kill_rank),
        kill_after=args.kill_step,
        kill_signal=signal.SIGSTOP if args.fault == Fault.SIGSTOP.value else signal.SIGKILL,
        echo="none" if args.quiet else "all" if args.verbose else "events",
        recovery=args.recovery,
    )  # fmt: skip
    verdict = MegatronRehearsal(options, work, _say).run()
    return {Verdict.MATCH: EXIT_MATCH, Verdict.MISMATCH: EXIT_MISMATCH,
            Verdict.NO_CHECKPOINT: EXIT_NO_CHECKPOINT,
            Verdict.BAD_INPUT: EXIT_USAGE}[verdict]  # fmt: skip


def _check_megatron_input(args: argparse.Namespace) -> SourceTree:
    """DIR, the tools and --keep, before anything is written (BadInput / ValueError: exit 2)."""
    from mindio_ttp.demo.megatron import check_requirements, check_source

    source = check_source(args.megatron.absolute())
    check_requirements()
    if args.keep is not None:
        keep = args.keep.absolute()
        if keep == source.path or source.path in keep.parents:
            raise ValueError(f"--keep {args.keep} is inside --megatron {args.megatron}; keep the "
                             "demo's files outside your checkout")
    return source


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve(parser, args)
    started = time.monotonic()
    try:
        source = _check_megatron_input(args) if args.megatron is not None else None
        notes = source.notes if source is not None else []
        contents = ("the patched copy of Megatron-LM, the dataset, checkpoints and logs"
                    if args.megatron is not None else "checkpoints and logs of this demo")
        work = WorkDir.choose(args.keep, contents)
    except ValueError as exc:  # BadInput is one
        print(f"ttp-demo: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for note in notes:
        _say(note)
    # a scheduler's or a user's SIGTERM unwinds like Ctrl-C: the jobs' ranks are killed and the
    # work directory is accounted for (their own sessions would not get the signal)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    code: Optional[int] = None
    try:
        if source is not None:
            code = _run_megatron(args, work.path, source)
        else:
            code = run_demo(args, work.path)
    finally:
        work.finish(code)
    _say(f"ttp-demo finished in {time.monotonic() - started:.1f} s (exit {code})")
    return code


if __name__ == "__main__":
    sys.exit(main())
