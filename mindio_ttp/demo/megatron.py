"""`ttp-demo --megatron DIR`: the CPU rehearsal on a real Megatron-LM tree, in one command.

DIR is any tree `ttp-patch apply` accepts (285068c, a fork or later commit with the same five
target files, or with ``--allow-modified`` any tree whose anchors are all found), as it is: its
HEAD plus the uncommitted changes of its tracked files. The steps of docs/rehearsal.md, each
announced as it starts: (1) copy the tree with ``git clone --shared`` (the user's checkout is
only read) and ``ttp-patch apply --device cpu [--allow-modified]`` the copy (a refusal is
ttp-patch's own message, exit 2); (2) make a small dataset with Megatron's own tokenizer and
indexed-dataset writer; (3) train the tiny GPT on 4 CPU ranks under ``ttprun`` and, once
iteration K is logged, SIGKILL a rank from outside, as ``kill -9``, the OOM killer or a lost
node would (nothing in the tree knows it is coming); (4) show the dying checkpoint: iteration,
directory, the tracker that marks it latest, its checked manifest; (5) run the same command
again, which resumes from it; (6) train the same job uninterrupted and compare the printed
losses and the final checkpoint bit for bit.

The kill lands wherever the rank is, so the saved iteration is K or a little later (the runtime
saves the newest step every shard has a clean copy of); the comparison resumes from whatever was
saved. Everything is written under one work directory; the caller decides whether it stays.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from mindio_ttp.config import ENV_RECOVERY, FLOW_FINISHED_FILE, RECOVERY_MODES, Outcome
from mindio_ttp.demo.rehearsal.data import TinyDataset
from mindio_ttp.demo.rehearsal.tree import PatchRefused
from mindio_ttp.launch.flow_record import FlowRecord, FlowRecordError, read_flow_record

if TYPE_CHECKING:
    from mindio_ttp.demo.rehearsal.launch import PretrainJob  # imports psutil

WORLD = 4
DEFAULT_ITERS = 10
DEFAULT_KILL_AFTER = 4
JOB_TIMEOUT_S = 300.0  # one training run; a healthy one takes 15-40 s on two cores
POLL_S = 0.05
BUILD_DIR_ENV = "TTP_CPU_BUILD_DIR"  # mindio_ttp.cpu_adaptor.helpers_build reads it
# Megatron-LM 285068c's own imports on CPU, and psutil, which the launch helpers use.
REQUIRED_MODULES = ("psutil", "pybind11", "regex", "six")

Say = Callable[[str], None]


class Verdict(enum.Enum):
    """How the rehearsal ended; the CLI maps it to its exit code."""

    MATCH = "match"
    MISMATCH = "mismatch"
    NO_CHECKPOINT = "no checkpoint"
    BAD_INPUT = "bad input"  # ttp-patch refused the tree


class BadInput(ValueError):
    """The demo cannot start with these inputs; the message says what to do (exit 2)."""


@dataclass(frozen=True)
class MegatronOptions:
    """What `ttp-demo --megatron` was asked for, resolved once from the command line."""

    source: Path
    commit: str = ""  # the source's HEAD, the commit the copy is made at
    allow_modified: bool = False
    with_changes: bool = False  # copy the uncommitted changes of tracked files too
    iters: int = DEFAULT_ITERS
    kill_ranks: Tuple[int, ...] = (1,)
    kill_after: int = DEFAULT_KILL_AFTER
    kill_signal: signal.Signals = signal.SIGKILL
    echo: str = "events"  # "all" (--verbose), "events" (default), "none" (--quiet)
    recovery: str = RECOVERY_MODES[0]  # TTP_RECOVERY for the runs (the product's default)


@dataclass(frozen=True)
class SourceTree:
    """The checked --megatron DIR: its HEAD, whether its tracked files have uncommitted changes
    the copy takes too, and what to tell the user."""

    path: Path
    head: str
    with_changes: bool
    notes: List[str]


def check_source(source: Path) -> SourceTree:
    """Refuse (BadInput) anything but the top of a git checkout of Megatron-LM; whether
    ttp-patch accepts its files is ttp-patch's to say, on the copy (stage 1)."""
    if not source.is_dir():
        raise BadInput(f"--megatron {source}: no such directory; give the path of a Megatron-LM "
                       "checkout")
    if not (source / "pretrain_gpt.py").is_file() or not (source / "megatron").is_dir():
        raise BadInput(f"--megatron {source}: not a Megatron-LM checkout (no pretrain_gpt.py and "
                       f"megatron/ in it); give the top folder of a clone")
    if shutil.which("git") is None:
        raise BadInput("git is not installed: the demo copies the tree with git clone --shared")
    top = _git(source, "rev-parse", "--show-toplevel")
    head = _git(source, "rev-parse", "HEAD")
    if head is None or top is None or Path(top).resolve() != source.resolve():
        raise BadInput(f"--megatron {source}: not a git checkout (or not its top folder); the demo "
                       "clones it and ttp-patch needs a git tree: git clone "
                       "https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout "
                       "285068c8108e0e8e6538f54fe27c3ee86c5217a2")
    notes = []
    changed = bool(_git(source, "status", "--porcelain", "--untracked-files=no"))
    applied = (Path(_git(source, "rev-parse", "--absolute-git-dir") or source / ".git")
               / "ttp-patch.json").is_file()
    if changed and applied:
        notes.append(f"note: {source} is patched by ttp-patch; the demo copies its HEAD "
                     f"{head[:7]} without those edits and patches the copy with --device cpu")
    elif changed:
        notes.append(f"note: {source} has uncommitted changes; the copy takes them too, as "
                     "ttp-patch apply would")
    return SourceTree(source, head, changed and not applied, notes)


def check_requirements() -> None:
    """Refuse (BadInput) before any work when Megatron's imports or a compiler are missing."""
    missing = [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise BadInput(f"missing Python modules {missing} (Megatron-LM imports them): pip "
                       f"install {' '.join(missing)}")
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise BadInput(f"no C++ compiler ({compiler}): Megatron's dataset helpers are compiled "
                       "at start-up; install g++ or set CXX")


def _git(cwd: Path, *args: str) -> Optional[str]:
    done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                          timeout=60)
    return done.stdout.strip() if done.returncode == 0 else None


class _LogFollower:
    """New complete lines of a log file another process is writing."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self._partial = path, 0, b""

    def lines(self, final: bool = False) -> List[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        *done, self._partial = data.split(b"\n")
        if final and self._partial:
            done.append(self._partial)
            self._partial = b""
        return [line.decode("utf-8", "replace") for line in done]


@dataclass
class TrainingRun:
    """One ttprun launch of the tiny GPT: exit code, printed losses, what the flow recorded."""

    name: str
    returncode: int
    seconds: float
    log: Path
    losses: Dict[int, str]
    flow: Optional[FlowRecord] = None
    flow_problem: Optional[str] = None
    killed: Dict[int, int] = field(default_factory=dict)  # rank -> pid
    killed_at: Optional[float] = None  # time.time() of the kill
    killed_after: Optional[int] = None  # the last iteration logged before the kill


class MegatronRehearsal:
    """The six stages on one work directory (see the module docstring)."""

    def __init__(self, options: MegatronOptions, work: Path, say: Say) -> None:
        self.opts, self.work, self.say = options, work, say
        self.in_memory = options.recovery == RECOVERY_MODES[0]
        self.stages = 5 if self.in_memory else 6
        self.tree = work / "Megatron-LM"
        self.data_dir = work / "data"
        self.ckpt = work / "ckpt"
        self.ref_ckpt = work / "ckpt-reference"
        self.logs = work / "logs"
        self.runs = work / "runs"

    # -- the stages ----------------------------------------------------------------------------
    def run(self) -> Verdict:
        o = self.opts
        self.say(f"ttp-demo --megatron: Megatron-LM {o.commit[:7]} from {o.source}, tiny "
                 f"GPT on {WORLD} CPU ranks (gloo, --use-distributed-optimizer), {o.iters} "
                 f"iterations; {o.kill_signal.name} to {_ranks(o.kill_ranks)} once iteration "
                 f"{o.kill_after} is logged; {ENV_RECOVERY}={o.recovery}; work directory "
                 f"{self.work}")
        with self._child_environment():
            try:
                self._prepare_tree()
            except PatchRefused as exc:
                self.say(f"      {exc}")
                self.say("RESULT: REFUSED - ttp-patch does not patch this tree (its message "
                         "above says why)")
                return Verdict.BAD_INPUT
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                self.say(f"      failed: {exc}")
                self.say("RESULT: FAILED - the demo could not prepare the tree or the data")
                return Verdict.MISMATCH
            try:
                data = self._make_dataset()
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                self.say(f"      failed: {exc}")
                self.say("RESULT: FAILED - the demo could not prepare the tree or the data")
                return Verdict.MISMATCH
            faulty = self._train_with_fault(data)
            if not faulty.killed:
                self.say("RESULT: FAILED - the run was not interrupted, so there is nothing "
                         "to show")
                return Verdict.MISMATCH
            if self.in_memory:
                recovered = self._show_recovery(faulty)
                if recovered is None:
                    return Verdict.MISMATCH
                return self._compare(data, faulty, None, recovered)
            saved, verdict = self._show_checkpoint(faulty)
            if saved is None:
                return verdict
            resumed = self._resume(data, saved)
            if resumed is None:
                return Verdict.MISMATCH
            return self._compare(data, faulty, resumed, saved)

    def _prepare_tree(self) -> None:
        from mindio_ttp.demo.rehearsal.tree import (
            apply_ttp_patch,
            copy_megatron_tree,
            copy_work_tree_changes,
        )

        o = self.opts
        flags = "--device cpu" + (" --allow-modified" if o.allow_modified else "")
        self.say(f"[1/{self.stages}] copying {o.source} to {self.tree} (git clone --shared: your "
                 f"checkout is only read) and patching the copy: ttp-patch apply {flags} ...")
        t0 = time.monotonic()
        copy_megatron_tree(o.source, self.tree, o.commit)
        if o.with_changes:
            copy_work_tree_changes(o.source, self.tree)
        said = apply_ttp_patch(self.tree, device="cpu", allow_modified=o.allow_modified)
        done = [ln for ln in said.splitlines() if ln.startswith("ttp-patch: applied")]
        self.say(f"      {done[-1] if done else 'ttp-patch: applied'} "
                 f"({time.monotonic() - t0:.1f} s)")

    def _make_dataset(self) -> TinyDataset:
        from mindio_ttp.demo.rehearsal.data import make_tiny_dataset

        self.say(f"[2/{self.stages}] generating a small dataset in {self.data_dir} (synthetic "
                 "text, a BPE trained on it, Megatron's own .bin/.idx writer) ...")
        t0 = time.monotonic()
        data = make_tiny_dataset(self.tree, self.data_dir)
        size = sum(p.stat().st_size for p in self.data_dir.iterdir() if p.is_file())
        self.say(f"      --data-path {data.prefix} ({size / 1024:.0f} KiB in all, "
                 f"{time.monotonic() - t0:.1f} s)")
        return data

    def _train_with_fault(self, data: TinyDataset) -> TrainingRun:
        o = self.opts
        self.say(f"[3/{self.stages}] training on {WORLD} CPU ranks under ttprun ({o.iters} "
                 f"iterations, --save/--load {self.ckpt}); {o.kill_signal.name} to "
                 f"{_ranks(o.kill_ranks)} once iteration {o.kill_after} is logged ...")
        run = self._train("faulty", data, self.ckpt, kill=True)
        if not run.killed:
            self.say(f"      the run ended (exit {run.returncode}) before iteration "
                     f"{o.kill_after} was logged, so nothing was killed")
            self._tail(run.log)
        else:
            self.say(f"      ttprun exited {run.returncode} after {run.seconds:.1f} s"
                     + (" (1 is deliberate: a rank was lost, so a scheduler would restart the "
                        "job; the same command then resumes)" if run.returncode == 1 else "")
                     + (" (the job went on: no restart)" if run.returncode == 0 else ""))
        return run

    def _show_recovery(self, faulty: TrainingRun) -> Optional[int]:
        """The in-memory recovery: which rank was replaced at which iteration, checked."""
        from mindio_ttp.launch.outcome import read_recovered

        self.say(f"[4/{self.stages}] the in-memory recovery ...")
        found = [r for launch in sorted(p for p in (self.runs / "faulty").glob("*")
                                         if p.is_dir()) for r in read_recovered(launch)]
        if faulty.returncode != 0 or not found:
            flow = faulty.flow
            why = (f"the runtime fell back to the dying checkpoint ({flow.outcome.value}: "
                   f"{flow.reason})" if flow is not None else
                   faulty.flow_problem or "no recovery committed and no flow recorded")
            self.say(f"      no in-memory recovery committed (ttprun exit {faulty.returncode}): "
                     f"{why}; see {faulty.log}")
            self.say("RESULT: NOT RECOVERED - the job did not recover in memory (the reason "
                     "above); --recovery dying-checkpoint shows the other mode")
            return None
        r = found[0]
        self.say(f"      recovery {r['recovery_id']} at iteration {r['iteration']}: rank(s) "
                 f"{r['replaced']} replaced by a new process on the same node, refilled from "
                 "their replica partners; every copy's hash compared before the commit; no "
                 "checkpoint written or read, no restart")
        return int(r["iteration"])

    def _show_checkpoint(self, faulty: TrainingRun) -> Tuple[Optional[int], Verdict]:
        from mindio_ttp.faulttime import manifest

        o = self.opts
        self.say(f"[4/{self.stages}] the dying checkpoint ...")
        flow = faulty.flow
        if flow is None or flow.outcome is not Outcome.SAVED:
            why = (faulty.flow_problem or "the runtime recorded no flow" if flow is None
                   else f"{flow.outcome.value}: {flow.reason}")
            self.say(f"      none was written ({why}); see {faulty.log}")
            self.say("RESULT: NO CHECKPOINT - nothing to resume from (the last regular "
                     "checkpoint, if any, stays latest)")
            return None, Verdict.NO_CHECKPOINT
        step = flow.step
        assert step is not None  # FlowRecord refuses a saved record without a step
        tracked, problem = manifest.read_tracker(self.ckpt)
        iter_dir = self.ckpt / manifest.iter_dir_name(step)
        layout = manifest.ParallelLayout(tp=1, pp=1, dp=WORLD)
        refused = (manifest.verify(iter_dir, layout) if (iter_dir / manifest.MANIFEST).is_file()
                   else f"has no {manifest.MANIFEST}")
        if tracked != step or refused:
            self.say(f"      the runtime says iteration {step} was saved in {flow.checkpoint}, "
                     f"but {manifest.TRACKER} names {tracked} ({problem or 'no problem'}) and "
                     f"{iter_dir} {refused or 'verifies'}")
            self.say("RESULT: FAILED - the dying checkpoint is not usable")
            return None, Verdict.MISMATCH
        files = [p for p in iter_dir.rglob("*.pt")]
        size = sum(p.stat().st_size for p in files)
        self.say(f"      iteration {step} in {flow.checkpoint or iter_dir}, marked latest "
                 f"({manifest.TRACKER} says {tracked})")
        self.say(f"      {len(files)} files, {size / 1024:.0f} KiB, each digest checked against "
                 f"{manifest.MANIFEST}; written by ranks {list(flow.ranks)} (rank "
                 f"{', '.join(map(str, faulty.killed))} lost)")
        if faulty.killed_at is not None:
            self.say(f"      why iteration {step}: the newest one of which every optimizer "
                     "shard still had a clean copy on a live rank")
            self.say(f"      from the {o.kill_signal.name} (after iteration "
                     f"{faulty.killed_after} was logged) "
                     f"to the checkpoint in place: {flow.time - faulty.killed_at:.2f} s")
        return step, Verdict.MATCH

    def _resume(self, data: TinyDataset, saved: int) -> Optional[TrainingRun]:
        self.say(f"[5/{self.stages}] resuming: the same command again; Megatron loads iteration "
                 f"{saved} from {self.ckpt} and trains to {self.opts.iters} ...")
        run = self._train("resumed", data, self.ckpt, kill=False)
        # It trains from saved + 1 on. Before that it may print the saved iteration's own line,
        # from the checkpoint's record of it, when the interrupted run stopped before printing
        # it (log_record.py); nothing older.
        first = min((i for i in run.losses if i > saved), default=None)
        earliest = min(run.losses, default=None)
        if run.returncode != 0 or first != saved + 1 or (earliest or 0) < saved:
            self.say(f"      the resumed run failed: exit {run.returncode}, first iteration "
                     f"logged {earliest} (expected {saved + 1}, or {saved} from the "
                     "checkpoint's record)")
            self._tail(run.log)
            self.say("RESULT: FAILED - the resumed run did not continue from the checkpoint")
            return None
        replayed = (f"; iteration {saved}'s line printed from the checkpoint's record"
                    if saved in run.losses else "")
        self.say(f"      done in {run.seconds:.1f} s: iterations {first}-{max(run.losses)}"
                 f"{replayed}")
        return run

    def _compare(self, data: TinyDataset, faulty: TrainingRun, resumed: Optional[TrainingRun],
                 saved: int) -> Verdict:
        from mindio_ttp.demo.rehearsal.checkpoints import compare_checkpoints

        n = self.opts.iters
        self.say(f"[{self.stages}/{self.stages}] the uninterrupted reference run ({n} iterations, "
                 f"--save {self.ref_ckpt}) and the comparison ...")
        ref = self._train("reference", data, self.ref_ckpt, kill=False)
        if ref.returncode != 0 or sorted(ref.losses) != list(range(1, n + 1)):
            self.say(f"      the reference run failed (exit {ref.returncode})")
            self._tail(ref.log)
            self.say("RESULT: FAILED - no reference to compare with")
            return Verdict.MISMATCH
        self.say(f"      done in {ref.seconds:.1f} s")
        combined = {**faulty.losses, **(resumed.losses if resumed is not None else {})}
        # A step the dying checkpoint holds may have finished on the ranks without its log line
        # being printed (the flow stops them between the update and Megatron's log): the
        # resumed run prints it from the checkpoint's record of it (log_record.py), except when
        # no saver kept one; then nothing to compare there, and the final checkpoint below
        # still proves the state. After `saved` every loss must be there.
        last_logged = max((i for i in faulty.losses if i <= saved), default=0)
        unlogged = [i for i in range(last_logged + 1, saved + 1) if i not in combined]
        if unlogged:
            self.say(f"      iteration(s) {', '.join(map(str, unlogged))}: finished before the "
                     "fault but not logged by the interrupted run (stopped before its log line); "
                     "not compared")
        differ = [i for i in range(1, n + 1)
                  if i not in unlogged and combined.get(i) != ref.losses[i]]
        if differ:
            shown = ", ".join(f"{i}: {combined.get(i, 'missing')} vs {ref.losses[i]}"
                              for i in differ[:5])
            self.say(f"      losses differ at {len(differ)} of {n} iterations ({shown})")
        elif resumed is None:
            self.say(f"      losses: all {n - len(unlogged)} printed values equal (one run, "
                     f"recovered in memory after iteration {saved})")
        elif saved in resumed.losses and saved not in faulty.losses:
            self.say(f"      losses: all {n - len(unlogged)} printed values equal (1-{saved - 1} "
                     f"from the interrupted run, {saved} from the checkpoint's record of it, "
                     f"{saved + 1}-{n} from the resumed one)")
        else:
            self.say(f"      losses: all {n - len(unlogged)} printed values equal (1-{saved} "
                     f"from the interrupted run, {saved + 1}-{n} from the resumed one)")
        comparison = compare_checkpoints(self.ckpt, self.ref_ckpt, n)
        self.say(f"      final checkpoint, iteration {n}: {comparison.summary()}")
        if differ or not comparison.bit_exact:
            self.say(f"RESULT: MISMATCH - the {'recovered' if resumed is None else 'resumed'} "
                     "run differs from the uninterrupted one (see above)")
            return Verdict.MISMATCH
        if resumed is None:
            self.say(f"RESULT: MATCH - {self.opts.kill_signal.name} after iteration "
                     f"{faulty.killed_after}, recovered in memory at iteration {saved}: the "
                     "losses and every tensor of the final checkpoint are bit for bit those "
                     "of the uninterrupted run")
            return Verdict.MATCH
        self.say(f"RESULT: MATCH - {self.opts.kill_signal.name} after iteration "
                 f"{faulty.killed_after}, resumed from the dying checkpoint of iteration "
                 f"{saved}: the losses and every tensor of the final checkpoint are bit for bit "
                 "those of the uninterrupted run")
        return Verdict.MATCH

    # -- one training run ------------------------------------------------------------------------
    def _train(self, name: str, data: TinyDataset, ckpt: Path, *, kill: bool) -> TrainingRun:
        from mindio_ttp.demo.rehearsal.launch import (
            Launcher,
            PretrainJob,
            parse_losses,
            pick_free_port,
            tiny_gpt_args,
        )

        o = self.opts
        log = self.logs / f"{name}.log"
        run_dir = self.runs / name
        # the runtime's own defaults (TTP_OT and the rest), as a user's job gets them
        env = {"TTP_CONTROLLER_PORT": str(pick_free_port()), "TTP_RUN_DIR": str(run_dir),
               ENV_RECOVERY: o.recovery}
        args = tiny_gpt_args(data, train_iters=o.iters, save=ckpt, load=ckpt)
        run = TrainingRun(name, -1, 0.0, log, {})
        follower = _LogFollower(log)
        with PretrainJob(self.tree, args, nproc=WORLD, log_path=log, launcher=Launcher.TTPRUN,
                         env=env) as job:
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while job.popen.poll() is None and time.monotonic() < deadline:
                self._follow(follower.lines(), run, job if kill else None)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    job.popen.wait(timeout=POLL_S)
            result = job.wait(max(1.0, deadline - time.monotonic()))
        self._follow(follower.lines(final=True), run, None)
        if result.timed_out:
            self.say(f"      {name} run: ttprun did not finish within {JOB_TIMEOUT_S:.0f} s; "
                     f"it and its ranks were killed; see {log}")
        run.returncode, run.seconds = result.returncode, result.wall_s
        run.losses = parse_losses(result.log)
        run.flow, run.flow_problem = _flow_of(run_dir)
        return run

    def _follow(self, lines: Sequence[str], run: TrainingRun,
                job: Optional[PretrainJob]) -> None:
        from mindio_ttp.demo.rehearsal.launch import parse_losses

        for line in lines:
            self._echo(line)
            logged = parse_losses(line)
            if job is None or run.killed or not logged or max(logged) < self.opts.kill_after:
                continue
            pids = job.worker_pids()
            run.killed_after = max(logged)
            run.killed_at = time.time()
            for rank in self.opts.kill_ranks:
                pid = pids.get(rank)
                if pid is None:
                    continue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, self.opts.kill_signal)
                    run.killed[rank] = pid
            who = ", ".join(f"{r} (pid {p})" for r, p in run.killed.items()) or "(none alive)"
            self.say(f"      iteration {run.killed_after} logged: sent "
                     f"{self.opts.kill_signal.name} to rank {who}")

    def _tail(self, log: Path, n: int = 20) -> None:
        """The end of a failed run's log, where Megatron's or ttprun's error is."""
        try:
            lines = log.read_text(errors="replace").splitlines()[-n:]
        except OSError as exc:
            lines = [f"(cannot read it: {exc})"]
        self.say(f"      the last {len(lines)} lines of {log}:")
        for line in lines:
            self.say(f"    | {line}")

    def _echo(self, line: str) -> None:
        """Show the lines that tell the story (all of them with --verbose)."""
        mode = self.opts.echo
        if mode == "all":
            self.say(f"    | {line}")
            return
        shown = None if mode == "none" else story_line(line)
        if shown is not None:
            self.say(f"    | {shown}")

    @contextlib.contextmanager
    def _child_environment(self) -> Iterator[None]:
        """Everything the children write goes into the work directory: their temp dir (torch
        elastic's per-launch log folders, torch's compile cache) and the build of Megatron's
        dataset helpers, unless the user set TTP_CPU_BUILD_DIR (then that is used and kept)."""
        saved = {name: os.environ.get(name) for name in ("TMPDIR", BUILD_DIR_ENV)}
        tmp = self.work / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        os.environ["TMPDIR"] = str(tmp)
        if saved[BUILD_DIR_ENV]:
            self.say(f"      Megatron's dataset helpers are built in (and kept in) "
                     f"${BUILD_DIR_ENV}={saved[BUILD_DIR_ENV]}")
        else:
            os.environ[BUILD_DIR_ENV] = str(self.work / "build")
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


_RUNTIME_LINE = re.compile(r"^\S+ \S+ \[ttp rank \d+\] \w+ mindio_ttp\.controller: (.*)$")
# controller lines that are bookkeeping, not the story: state changes, timings, echoes of the
# survivors' own gloo errors once the flow has started, the standbys
_QUIET_RUNTIME = (" -> ", "further fault during the flow", " done in ", "standby", "listening")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def story_line(line: str) -> Optional[str]:
    """The line as shown by default, or None: the controller's decisions (fault seen, states
    collected, step chosen, outcome), ttprun's lines, the checkpoint's and Megatron's load."""
    match = _RUNTIME_LINE.match(line)
    if match:
        text = match.group(1)
        if any(q in text for q in _QUIET_RUNTIME):
            return None
        return f"runtime | {text}"
    if line.startswith("ttprun: "):
        return line.split(": {", 1)[0]  # the flow record itself is said in words below it
    if (line.startswith("ttp: ") or "successfully loaded checkpoint" in line
            or (line.startswith("mindio_ttp: ") and "checkpoint" in line)):
        return line.strip()
    return None


def _flow_of(run_dir: Path) -> Tuple[Optional[FlowRecord], Optional[str]]:
    """ttprun keeps its per-launch directory under TTP_RUN_DIR; read the flow record there."""
    for path in sorted(run_dir.glob(f"*/{FLOW_FINISHED_FILE}")):
        try:
            return read_flow_record(path), None
        except (OSError, FlowRecordError) as exc:
            return None, f"{path}: {exc}"
    return None, None
