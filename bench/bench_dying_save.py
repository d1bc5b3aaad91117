"""The whole dying save on real Megatron-LM 285068c on CPU, from the controller's verdict to the
tracker naming the step, split into its parts; and the disk's own write bandwidth beside it.

    python bench/bench_dying_save.py --megatron DIR [--hidden 1024] [--layers 10] [--nproc 2]
        [--runs 3] [--dir DIR] [--json OUT]

The job: the tiny GPT of mindio_ttp.demo.rehearsal widened by ``--hidden`` / ``--layers`` (the
defaults: 10 layers of hidden 1024, ~126M parameters), DP ``--nproc`` on CPU ranks (gloo,
--use-distributed-optimizer, a tree patched with ``ttp-patch apply --device cpu``) under
``ttprun`` with ``TTP_RECOVERY=dying-checkpoint``, the checkpoint directory on ``--dir``'s
filesystem. Rank 1 is SIGKILLed in the forward step of iteration FAULT_STEP (the test-only
fault hook); the survivors write the dying checkpoint of the step before. At DP2 the survivor
writes everything: the model file and both DP positions' optimizer files, ~16 bytes per
parameter (~2 GiB at the defaults).

Measured, wall clock, from the lines the runtime logs anyway (TTP_LOG_PATH, millisecond
stamps) and the fault hook's record:

* fault -> verdict: the fault (the hook's timestamp) to the controller's "ordering save" line;
* verdict -> latest: to the rename handler's "marked latest" line (the tracker is written);
* the saver's own split, from its "dying save of step" line (mindio_ttp/megatron_ttp/save.py):
  device ready (the device's event and the abort: nothing on CPU), exchange (fp32 params for
  the model file when the live ones are not the step's), serialize (torch.save's own work:
  pickling, zip records; on a GPU the device-to-host copies are in here too), write (the write
  calls into the page cache), digest (what the main thread waited for the digest), fsync,
  rename (per file, with the directory fsync), part manifest, other (state dicts);
* the rename handler's split: merge the part manifests (and write marker and manifest),
  rename the directory, write the tracker;
* the rest of verdict -> latest: the orders' round trips and the handlers' start (what
  neither split holds).

The floor: ``dd`` of as many bytes as the saver wrote, on the same filesystem, run before each
job: ``conv=fdatasync`` (through the page cache, then flushed: what a buffered writer can
reach) and ``oflag=direct`` (the device itself). The checkpoint is then verified as the load
does (``manifest.verify``: every file re-read and its digest checked): ``verify s``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional

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
from mindio_ttp.faulttime import manifest  # noqa: E402
from testkit.hooks import FAULT_HOOK_DIR, pythonpath  # noqa: E402

FAULT_RANK = 1
FAULT_STEP = 3
RUN_TIMEOUT_S = 1500
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[ttp rank (\d+)\] \w+ (.*)$")
_VERDICT = re.compile(r"mindio_ttp\.controller: .*ordering save on rank")
_SAVE = re.compile(r"mindio_ttp\.checkpoint: dying save of step (\d+) on rank (\d+): (\d+) "
                   r"file\(s\), (\d+) bytes in ([0-9.]+) s: (.*)$")
_LATEST = re.compile(r"mindio_ttp\.checkpoint: dying checkpoint of (?:step|iteration) (\d+) "
                     r"marked latest: merge manifest ([0-9.]+) s, rename ([0-9.]+) s, "
                     r"tracker ([0-9.]+) s")
_PART = re.compile(r"([a-z][a-z ]*?) ([0-9.]+)(?: \(([^)]*)\))?(?:,|$)")


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def dd_floor(where: Path, nbytes: int) -> Dict[str, float]:
    """MiB/s of dd writing `nbytes` of zeros in 16 MiB blocks to a file on `where`."""
    out = {}
    count = max(1, -(-nbytes // (16 << 20)))
    for name, flag in (("dd conv=fdatasync", "conv=fdatasync"), ("dd oflag=direct",
                                                                 "oflag=direct")):
        target = where / "ttp-dd-floor"
        t0 = time.perf_counter()
        done = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M",
                               f"count={count}", flag], capture_output=True, text=True,
                              timeout=600)
        took = time.perf_counter() - t0
        target.unlink(missing_ok=True)
        if done.returncode == 0:
            out[name] = count * 16 / took
    return out


def parse(log_dir: Path, fault_at: float) -> dict:
    verdict = latest = None
    saves: List[dict] = []
    rename: Optional[dict] = None
    for path in sorted(log_dir.glob("ttp-rank*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = _LOG_LINE.match(line)
            if not m:
                continue
            at, text = _stamp(m.group(1)), m.group(3)
            if _VERDICT.search(text) and at >= fault_at - 1:
                verdict = at if verdict is None else min(verdict, at)
            s = _SAVE.search(text)
            if s:
                parts = {p.group(1): float(p.group(2)) for p in _PART.finditer(s.group(6))}
                algo = next((p.group(3) for p in _PART.finditer(s.group(6)) if p.group(3)), "")
                saves.append({"at": at, "rank": int(s.group(2)), "files": int(s.group(3)),
                              "bytes": int(s.group(4)), "seconds": float(s.group(5)),
                              "parts": parts, "algo": algo})
            r = _LATEST.search(text)
            if r:
                latest = at
                rename = {"merge manifest": float(r.group(2)), "rename": float(r.group(3)),
                          "tracker": float(r.group(4))}
    if verdict is None or latest is None or not saves or rename is None:
        raise SystemExit(f"the logs in {log_dir} lack the verdict, save or latest line")
    return {"verdict": verdict, "latest": latest, "saves": saves, "rename": rename}


def run_once(tree: Path, data, work: Path, tag: str, nproc: int, extra: List[str],
             save_root: Path) -> dict:
    out = work / tag
    for sub in ("logs", "records", "runs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    ckpt = Path(tempfile.mkdtemp(prefix=f"ttp-dying-{tag}-", dir=save_root))
    env = {"PYTHONPATH": pythonpath(FAULT_HOOK_DIR), "TTP_OT": "600",
           "TTP_RECOVERY": "dying-checkpoint",
           "TTP_FAULT_PLAN": f"{FAULT_RANK}:{FAULT_STEP}:sigkill:before",
           "TTP_CONTROLLER_PORT": str(pick_free_port()), "TTP_LOG_PATH": str(out / "logs"),
           "TTP_RUN_DIR": str(out / "runs"), "TTP_FAULT_RECORD_DIR": str(out / "records")}
    args = tiny_gpt_args(data, train_iters=FAULT_STEP + 2, save=ckpt, extra=extra)
    load = _loadavg()
    try:
        with PretrainJob(tree, args, nproc=nproc, log_path=out / "job.log",
                         launcher=Launcher.TTPRUN, env=env) as job:
            result = job.wait(RUN_TIMEOUT_S)
        if result.timed_out:
            raise SystemExit(f"{tag}: timed out; see {out / 'job.log'}")
        fault = json.loads((out / "records" / f"fault-{FAULT_RANK}.json").read_text())
        got = parse(out / "logs", float(fault["time"]))
        step, _ = manifest.read_tracker(ckpt)
        if step != FAULT_STEP - 1:
            raise SystemExit(f"{tag}: the tracker names {step}, not {FAULT_STEP - 1}")
        layout = manifest.ParallelLayout(tp=1, pp=1, dp=nproc)
        t0 = time.perf_counter()
        reason = manifest.verify(ckpt / manifest.iter_dir_name(step), layout)
        got["verify"] = time.perf_counter() - t0
        if reason is not None:
            raise SystemExit(f"{tag}: the dying checkpoint does not verify: {reason}")
        got["fault"] = float(fault["time"])
        got["load"] = [load, _loadavg()]
        return got
    finally:
        subprocess.run(["rm", "-rf", str(ckpt)], check=False)


def _med(values: List[float]) -> str:
    return (f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
            if len(values) > 1 else f"{values[0]:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--megatron", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="the filesystem the checkpoint is written to")
    ap.add_argument("--keep", type=Path, help="work in this new folder and keep the logs")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    extra = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", "16"]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs, floors = [], []
    with tempfile.TemporaryDirectory(prefix="bench-dying-") as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tree = copy_megatron_tree(a.megatron, work / "ttp" / "Megatron-LM")
        apply_ttp_patch(tree, "cpu")
        data = make_tiny_dataset(tree, work / "data")
        guess = 16 * 12 * a.hidden * a.hidden * a.layers  # refined after the first run
        for r in range(a.runs):
            nbytes = max(s["bytes"] for s in runs[-1]["saves"]) if runs else guess
            floors.append(dd_floor(a.dir, nbytes))
            runs.append(run_once(tree, data, work, f"run{r}", a.nproc, extra, a.dir))
            worst = max(runs[-1]["saves"], key=lambda s: s["seconds"])
            print(f"run {r}: verdict -> latest {runs[-1]['latest'] - runs[-1]['verdict']:.3f} s,"
                  f" worst saver {worst['bytes'] / 2**20:.0f} MiB in {worst['seconds']:.3f} s; "
                  f"loadavg {runs[-1]['load']}; floor {floors[-1]}", flush=True)
    fs = subprocess.run(["df", "-T", str(a.dir)], capture_output=True, text=True).stdout
    fs_type = fs.splitlines()[-1].split()[1] if fs.count("\n") >= 2 else "?"
    worst = [max(run["saves"], key=lambda s: s["seconds"]) for run in runs]
    nbytes = worst[0]["bytes"]
    total = [run["latest"] - run["verdict"] for run in runs]
    print(f"\n{started}: real Megatron, {a.layers} layers x hidden {a.hidden}, DP{a.nproc} on "
          f"CPU, rank {FAULT_RANK} killed in iteration {FAULT_STEP}; the slowest saver wrote "
          f"{len(worst) and worst[0]['files']} files, {nbytes / 2**20:.0f} MiB "
          f"(digest {worst[0]['algo']}), on {a.dir} ({fs_type}); {len(runs)} runs, median "
          f"(min-max); loadavg per run: {[run['load'] for run in runs]}")
    print("| part | seconds | share of verdict -> latest |")
    print("|---|---:|---:|")
    rows = [("fault -> verdict (not in the total)",
             [run["verdict"] - run["fault"] for run in runs]),
            ("**verdict -> latest**", total)]
    for name in worst[0]["parts"]:
        rows.append((f"saver: {name}", [w["parts"].get(name, 0.0) for w in worst]))
    for name in runs[0]["rename"]:
        rows.append((f"rename handler: {name}", [run["rename"][name] for run in runs]))
    rest = [t - w["seconds"] - sum(run["rename"].values())
            for t, w, run in zip(total, worst, runs)]
    rows.append(("orders, hand-offs (the rest)", rest))
    for name, values in rows:
        share = statistics.median(values) / statistics.median(total)
        print(f"| {name} | {_med(values)} | {'' if 'not in' in name else f'{share:.0%}'} |")
    write_rate = [w["bytes"] / 2**20 / w["seconds"] for w in worst]
    print(f"saver throughput: {_med(write_rate)} MiB/s over its whole handler; verify as the "
          f"load does: {_med([run['verify'] for run in runs])} s")
    for name in floors[0]:
        print(f"floor, {name}: {_med([f[name] for f in floors if name in f])} MiB/s "
              f"(so {nbytes / 2**20 / statistics.median(f[name] for f in floors if name in f):.3f}"
              f" s for the saver's bytes)")
    if a.json:
        a.json.write_text(json.dumps({"runs": runs, "floors": floors, "dir": str(a.dir),
                                      "fs": fs_type}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
