"""Time lost per fault: in-memory recovery (warm spare, cold replacement) against a restart
from the dying checkpoint and a cold start, on real Megatron-LM 285068c on CPU.

The job is the tiny GPT of mindio_ttp.demo.rehearsal (DP4, --use-distributed-optimizer, a tree
patched with `ttp-patch apply --device cpu`), launched by `ttprun`, on gloo or (``--backend
nccl-like``) on the test rig's NCCL-like backend, where a collective with the dead rank spins
until aborted as on NCCL instead of raising as on gloo (testkit/nccl_like, docs/rehearsal.md).
Four paths, run in rounds with the order rotated each round, so load drifts hit every path
alike:

* in-memory (warm spare): TTP_RECOVERY=in-memory, `ttprun --warm-spares 1`;
* in-memory (cold replacement): the same with no spare;
* restart: `ttprun --max-restarts 1`, no in-memory recovery: the dying checkpoint, the
  launcher's restart, Megatron's start-up and the load of that checkpoint;
* cold start: a fresh launch with no checkpoint.

Each faulted run SIGKILLs rank 1 in the forward step of iteration FAULT_STEP (the test-only
fault hook, testkit/hooks/fault_hook). Measured, all wall-clock on this one machine:

* time lost: the fault (the hook's timestamp just before the kill) to the end of the first
  iteration after it that every rank completed (the hook's per-step records,
  TTP_STEP_RECORD_DIR); a cold start: the launch to the end of its first iteration;
* iterations lost: the newest iteration every rank had completed before the fault minus the
  one training went on from (0 when nothing done is thrown away);
* the split, from the lines the runtime logs anyway (TTP_LOG_PATH, one file per rank; each
  boundary is when the last rank concerned logged it): detect (fault -> the controller's FAULT
  line), stop (-> every survivor out of the step, groups destroyed: the recovery's "stopping
  -> regrouping"; a restart: the dying checkpoint's flow finished), regroup (-> every rank,
  the replacement included, through Megatron's start-up on the new store: "regrouping ->
  refilling"; a restart: every rank of the new attempt registered), refill (-> every rank
  refilled and verified: "verifying -> ready"), first step (-> the first iteration after the
  fault ended on every rank). A phase with no mark of its own is counted in the next one:
  a restart's runtime starts after Megatron has built the model and loaded the checkpoint, so
  its regroup holds the refill, and its refill shows "—"; a cold start has only regroup
  (launch -> every rank registered, after the model build), refill "—" and first step.

Medians over the rounds, with min-max. The last line is the ratio of the medians.

    TTP_MEGATRON_DIR=/path/to/Megatron-LM python bench/bench_recover.py   # checkout at 285068c
    python bench/bench_recover.py --megatron DIR --rounds 3 --big-rounds 1 --keep OUT
    python bench/bench_recover.py --backend nccl-like --big-rounds 0   # or nccl-like@2.1 ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # testkit/ (the fault hook) is not installed

from mindio_ttp.demo.rehearsal.data import make_tiny_dataset  # noqa: E402
from mindio_ttp.demo.rehearsal.launch import (  # noqa: E402
    Launcher,
    PretrainJob,
    pick_free_port,
    tiny_gpt_args,
)
from mindio_ttp.demo.rehearsal.tree import apply_ttp_patch, copy_megatron_tree  # noqa: E402
from testkit.hooks import GLOO, backend_setup  # noqa: E402

FAULT_RANK = 1
FAULT_STEP = 4
ITERS = 6
RUN_TIMEOUT_S = 900
# About 100M parameters (8 layers of hidden 1024, the tiny dataset's small vocabulary), all
# else as the tiny GPT; the fault comes earlier, as its iterations take seconds on a CPU.
BIG_ARGS = ("--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16")
BIG_FAULT_STEP, BIG_ITERS = 2, 3
SPLIT = ("detect", "stop", "regroup", "refill", "first step")
WARM, COLD, RESTART, FRESH = ("in-memory (warm spare)", "in-memory (cold replacement)",
                              "restart (--max-restarts)", "cold start")
PATHS = (WARM, COLD, RESTART, FRESH)
PATH_KEYS = {"warm": WARM, "cold": COLD, "restart": RESTART, "fresh": FRESH}
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[ttp rank (\d+)\] \w+ (.*)$")
_PARAMS = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank "
                     r"\(0, 0\): (\d+)")
# The runtime's own log lines that mark the phases: the controller's FAULT line, each rank's
# registration, and the recovery state machine's transitions (recovery/machine.py).
MARKS = {
    "detect": re.compile(r"mindio_ttp\.controller: .*FAULT"),
    "registered": re.compile(r"mindio_ttp\.processor: rank \d+: processor registered"),
    "stopped": re.compile(r"mindio_ttp\.recovery: recovery: stopping -> regrouping"),
    "regrouped": re.compile(r"mindio_ttp\.recovery: recovery: regrouping -> refilling"),
    "refilled": re.compile(r"mindio_ttp\.recovery: recovery: verifying -> ready"),
}
Marks = Dict[str, List[Tuple[float, int]]]  # mark -> [(time, rank)], in time order


@dataclass
class Run:
    """One launch of one path, and what its records say."""

    path: str
    lost_s: float = float("nan")
    iters_lost: Optional[int] = None
    split: Dict[str, float] = field(default_factory=dict)
    step_s: float = float("nan")  # median iteration before the fault, all ranks
    params: Optional[int] = None
    flow_at: Optional[float] = None  # when a dying-checkpoint flow finished, if one ran


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _log_marks(log_dir: Path) -> Marks:
    """Time and rank of every marked runtime log line."""
    found: Marks = {name: [] for name in MARKS}
    for path in log_dir.glob("ttp-rank*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = _LOG_LINE.match(line)
            if not m:
                continue
            for name, pattern in MARKS.items():
                if pattern.search(m.group(3)):
                    found[name].append((_stamp(m.group(1)), int(m.group(2))))
    return {name: sorted(times) for name, times in found.items()}


def _last_of_each(marks: Marks, name: str, after: float, ranks: Sequence[int],
                  others: Sequence[int] = ()) -> Optional[float]:
    """When the last of ``ranks`` (and of ``others`` that logged it) logged ``name``, its
    first time after ``after``; None unless every one of ``ranks`` did. (A replacement logs
    through the runtime only once its processor has started, after its first transitions.)"""
    first: Dict[int, float] = {}
    for t, rank in marks.get(name, []):
        if t >= after and (rank in ranks or rank in others):
            first.setdefault(rank, t)
    return max(first.values()) if all(r in first for r in ranks) else None


def _steps(record_dir: Path) -> List[dict]:
    steps = []
    for path in record_dir.glob("steps-*.jsonl"):
        steps += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return steps


def _complete(steps: List[dict], world: int) -> Dict[int, Tuple[float, float]]:
    """``{iteration: (last rank's start, last rank's end)}`` for iterations every rank ended,
    counting the last run of each (a replayed iteration ends again after the fault)."""
    by_step: Dict[int, Dict[int, dict]] = {}
    for s in sorted(steps, key=lambda s: s["end"]):
        by_step.setdefault(s["step"], {})[s["rank"]] = s
    return {step: (max(r["start"] for r in ranks.values()), max(r["end"] for r in ranks.values()))
            for step, ranks in by_step.items() if len(ranks) == world}


def measure_fault(run: Run, fault_at: float, steps: List[dict], marks: Marks,
                  world: int) -> Run:
    """Fill ``run`` from the records of a faulted launch (see the module doc)."""
    before = [s for s in steps if s["end"] < fault_at]
    after = [s for s in steps if s["start"] > fault_at]
    done_before = _complete(before, world)
    done_after = _complete(after, world)
    if not done_after:
        raise RuntimeError(f"{run.path}: no iteration completed on every rank after the fault")
    first = min(done_after)
    first_start, first_end = done_after[first]
    run.lost_s = first_end - fault_at
    newest = max(done_before) if done_before else 0
    run.iters_lost = max(0, newest - (first - 1))
    durations = sorted(end - start for start, end in done_before.values())
    run.step_s = statistics.median(durations) if durations else float("nan")

    everyone = list(range(world))
    detected = next((t for t, _ in marks.get("detect", []) if t >= fault_at), None)
    if run.path in (WARM, COLD):  # the state machine's transitions, the last rank's
        survivors = [r for r in everyone if r != FAULT_RANK]
        stopped = _last_of_each(marks, "stopped", fault_at, survivors)
        # survivors leave regrouping only once the replacement has joined them
        regrouped = _last_of_each(marks, "regrouped", fault_at, survivors, [FAULT_RANK])
        refilled = _last_of_each(marks, "refilled", fault_at, everyone)
    else:  # the runtime starts after Megatron's build and load: regroup holds the refill too
        stopped = run.flow_at
        regrouped = _last_of_each(marks, "registered", stopped or fault_at, everyone)
        refilled = None
    points = [("detect", detected), ("stop", stopped), ("regroup", regrouped),
              ("refill", refilled), ("first step", first_end)]
    previous = fault_at
    for name, at in points:
        if at is not None:
            run.split[name] = at - previous
            previous = at
    return run


def measure_cold(run: Run, launched_at: float, steps: List[dict], marks: Marks,
                 world: int) -> Run:
    done = _complete(steps, world)
    if not done:
        raise RuntimeError("cold start: no iteration completed on every rank")
    first_end = done[min(done)][1]
    run.lost_s = first_end - launched_at
    registered = _last_of_each(marks, "registered", launched_at, list(range(world)))
    if registered is not None:
        run.split["regroup"] = registered - launched_at
        run.split["first step"] = first_end - registered
    return run


@dataclass
class Bench:
    tree: Path
    data: object
    work: Path
    world: int = 4
    backend: str = GLOO

    def launch(self, path: str, tag: str, extra: Sequence[str] = (),
               fault_step: int = FAULT_STEP, iters: int = ITERS,
               plan: Optional[str] = None, env_extra: Optional[Dict[str, str]] = None) -> Run:
        """One run of ``path``; its files stay under ``work/tag``. `plan`: another fault plan
        than the SIGKILL of FAULT_RANK; `env_extra`: settings over the path's own."""
        out = self.work / tag
        for sub in ("logs", "records", "runs", "ckpt"):
            (out / sub).mkdir(parents=True, exist_ok=True)
        backend_env, backend_args = backend_setup(self.backend)
        env = {
            **backend_env,
            "TTP_OT": "120",
            "TTP_CONTROLLER_PORT": str(pick_free_port()),
            "TTP_LOG_PATH": str(out / "logs"),
            "TTP_RUN_DIR": str(out / "runs"),
            "TTP_STEP_RECORD_DIR": str(out / "records"),
            "TTP_FAULT_RECORD_DIR": str(out / "records"),
        }
        launcher_args: List[str] = []
        faulted = path != FRESH
        if faulted:
            env["TTP_FAULT_PLAN"] = plan or f"{FAULT_RANK}:{fault_step}:sigkill:before"
        if path in (WARM, COLD):
            env["TTP_RECOVERY"] = "in-memory"
            launcher_args += ["--warm-spares", "1" if path == WARM else "0"]
        if path == RESTART:
            env["TTP_RECOVERY"] = "dying-checkpoint"
            launcher_args += ["--max-restarts", "1"]
        env.update(env_extra or {})
        iters = iters if faulted else 3  # Megatron wants more iterations than warm-up ones
        ckpt = out / "ckpt"
        args = tiny_gpt_args(self.data, train_iters=iters, save=ckpt,  # type: ignore[arg-type]
                             load=ckpt, save_interval=10_000, extra=[*extra, *backend_args])
        log = out / "job.log"
        launched = time.time()
        with PretrainJob(self.tree, args, nproc=self.world, log_path=log,
                         launcher=Launcher.TTPRUN, env=env,
                         launcher_args=launcher_args) as job:
            result = job.wait(RUN_TIMEOUT_S)
        if result.timed_out or result.returncode != 0:
            raise SystemExit(f"{path}: launcher exit {result.returncode} "
                             f"(timed out: {result.timed_out}); see {log}")
        run = Run(path)
        params = _PARAMS.search(log.read_text(errors="replace"))
        run.params = int(params.group(1)) if params else None
        marks = _log_marks(out / "logs")
        steps = _steps(out / "records")
        if not faulted:
            return measure_cold(run, launched, steps, marks, self.world)
        fault = json.loads((out / "records" / f"fault-{FAULT_RANK}.json").read_text())
        flows = sorted((out / "runs").glob("*/flow-finished*.json"))
        if flows:
            run.flow_at = float(json.loads(flows[0].read_text())["time"])
        return measure_fault(run, float(fault["time"]), steps, marks, self.world)


def _median(values: List[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def _cell(values: List[float]) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(runs: Dict[str, List[Run]], title: str, fault_step: int = FAULT_STEP,
          backend: str = GLOO) -> List[str]:
    params = next((r.params for rs in runs.values() for r in rs if r.params), None)
    size = f"{params / 1e6:.1f}M parameters" if params else "size not printed"
    lines = [f"{title} ({size}, DP4 on {backend}, fault: SIGKILL rank {FAULT_RANK} in the "
             "forward step "
             f"of iteration {fault_step}; seconds, median (min-max) of "
             f"{max(len(r) for r in runs.values())} run(s))", "",
             "| path | time lost | iterations lost | " + " | ".join(SPLIT) + " |",
             "|---|---:|---:|" + "---:|" * len(SPLIT)]
    for path, rs in runs.items():
        if not rs:
            continue
        lost = sorted({r.iters_lost for r in rs if r.iters_lost is not None})
        lines.append(f"| {path} | {_cell([r.lost_s for r in rs])} | "
                     f"{'/'.join(map(str, lost)) if lost else '—'} | "
                     + " | ".join(_cell([r.split[s] for r in rs if s in r.split])
                                  for s in SPLIT) + " |")
    steps = [r.step_s for rs in runs.values() for r in rs]
    lines.append("")
    lines.append(f"one iteration before the fault (all ranks): {_median(steps):.2f} s")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", type=Path, default=os.environ.get("TTP_MEGATRON_DIR"),
                        help="a Megatron-LM checkout at 285068c (default $TTP_MEGATRON_DIR)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four paths, tiny GPT")
    parser.add_argument("--big-rounds", type=int, default=1,
                        help="rounds at about 100M parameters (in-memory warm spare and restart "
                        "only); 0 skips them")
    parser.add_argument("--keep", type=Path, help="work in this new folder and keep every log")
    parser.add_argument("--backend", default=GLOO,
                        help="gloo (default), or nccl-like[@2.1|@2.4|@2.6]: the test rig's "
                        "backend whose collectives spin on a dead peer until aborted, as NCCL's")
    parser.add_argument("--paths", default=",".join(PATH_KEYS),
                        help=f"comma-separated subset of {', '.join(PATH_KEYS)} (default: all)")
    opts = parser.parse_args()
    paths = tuple(PATH_KEYS[k.strip()] for k in opts.paths.split(",") if k.strip())
    if opts.megatron is None:
        parser.error("name a Megatron-LM 285068c checkout with --megatron or TTP_MEGATRON_DIR")
    started = time.time()
    load = os.getloadavg()[0]
    # SIGTERM unwinds like an error, so every running job is killed on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory(prefix="bench-recover-") as tmp:
        work = opts.keep or Path(tmp)
        tree = copy_megatron_tree(opts.megatron, work / "Megatron-LM")
        apply_ttp_patch(tree, "cpu")
        data = make_tiny_dataset(tree, work / "data")
        bench = Bench(tree, data, work, backend=opts.backend)
        tiny: Dict[str, List[Run]] = {p: [] for p in paths}
        for round_ in range(opts.rounds):
            order = paths[round_ % len(paths):] + paths[:round_ % len(paths)]
            for path in order:
                run = bench.launch(path, f"tiny-r{round_}-{PATHS.index(path)}")
                tiny[path].append(run)
                print(f"# round {round_}: {path}: {run.lost_s:.2f} s lost, split "
                      + ", ".join(f"{k} {v:.2f}" for k, v in run.split.items()), flush=True)
        big: Dict[str, List[Run]] = {p: [] for p in (WARM, RESTART) if p in paths}
        for round_ in range(opts.big_rounds):
            for path in (big if round_ % 2 == 0 else reversed(list(big))):
                run = bench.launch(path, f"big-r{round_}-{PATHS.index(path)}", BIG_ARGS,
                                   BIG_FAULT_STEP, BIG_ITERS)
                big[path].append(run)
                print(f"# ~100M round {round_}: {path}: {run.lost_s:.2f} s lost", flush=True)
    print(f"\nmeasured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
          f"{os.cpu_count()} cores, load average {load:.2f} at the start, "
          f"{(time.time() - started) / 60:.1f} min in all\n")
    for line in table(tiny, "tiny GPT", backend=opts.backend):
        print(line)
    if opts.big_rounds:
        print()
        for line in table(big, "about 100M parameters", BIG_FAULT_STEP, opts.backend):
            print(line)
    warm = _median([r.lost_s for r in tiny.get(WARM, [])])
    restart = _median([r.lost_s for r in tiny.get(RESTART, [])])
    step = _median([r.step_s for rs in tiny.values() for r in rs])
    print(f"\ngoal (tiny GPT): in-memory with a warm spare <= 1 s + one iteration "
          f"({1 + step:.2f} s): {warm:.2f} s; <= 20% of the restart: {warm / restart:.0%}")
    print(f"ratio in-memory (warm spare) / restart: {warm / restart:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
