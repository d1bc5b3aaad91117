"""What the whole patch costs per training step: patched Megatron (ttprun, ReplicatedOptimizer,
the guide's barrier, the four hooks, the runtime's threads) against stock Megatron
(torchrun, DistributedOptimizer), same model, same seed, DP4 on 4 CPU ranks (gloo).

    python bench/bench_step.py --megatron DIR [--model tiny|100m] [--rounds 7] [--iters 40]
        [--profile-rounds 1] [--json OUT]

Step time: Megatron's own "elapsed time per iteration" (log interval 1), median over the
iterations after the first WARMUP of a run. Runs alternate stock/patched and patched/stock in
successive rounds (so load drifts and order effects hit both alike); each round gives one ratio
patched / stock, and the table reports the median ratio and its spread (min-max) over rounds,
with /proc/loadavg at each run's start. Both trees are copies of the same checkout (stock as
it is, the other patched with `ttp-patch apply --device cpu`); both run with the CPU adaptor.

``--profile-rounds N`` adds N rounds with the test-only step profile hook
(testkit/hooks/step_profile) on both sides: where a step's time goes (forward-backward, the
optimizer's three calls and their parts, the guide's barrier, the partner stripe's update, the
stripe swap, the hooks), median per iteration over the post-warm-up iterations of every rank.
The hook's wrappers cost a few microseconds per call; profiled runs are not in the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit: the repository's rig

from mindio_ttp.demo.rehearsal.launch import (  # noqa: E402
    Launcher,
    PretrainJob,
    parse_iteration_ms,
    pick_free_port,
    tiny_gpt_args,
)
from mindio_ttp.demo.rehearsal.tree import stock_and_patched  # noqa: E402
from testkit.hooks import STEP_PROFILE_DIR, pythonpath  # noqa: E402

DP = 4
WARMUP = 5
MODELS = {
    "tiny": [],  # tiny_gpt_args: 2 layers, hidden 64
    "100m": ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16"],
}
STOCK, PATCHED = "stock", "patched"
RUN_TIMEOUT_S = 1800


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def run_once(tree: Path, args: List[str], work: Path, name: str, side: str,
             profile: bool) -> Tuple[float, str, Path]:
    """One job; (median ms per iteration after the warm-up, loadavg at its start, profile dir)."""
    prof = work / f"{name}-profile"
    env = {"TTP_CONTROLLER_PORT": str(pick_free_port())}
    if profile:
        prof.mkdir()
        env.update(PYTHONPATH=pythonpath(STEP_PROFILE_DIR), TTP_STEP_PROFILE_DIR=str(prof))
    log = work / f"{name}.log"
    load = _loadavg()
    launcher = Launcher.TORCHRUN if side == STOCK else Launcher.TTPRUN
    with PretrainJob(tree, args, nproc=DP, log_path=log, launcher=launcher, env=env,
                     inject_adaptor=side == STOCK) as job:
        result = job.wait(RUN_TIMEOUT_S)
    if result.timed_out or result.returncode != 0:
        raise SystemExit(f"{name} failed (exit {result.returncode}); see {log}")
    times = [ms for it, ms in parse_iteration_ms(log.read_text()).items() if it > WARMUP]
    if not times:
        raise SystemExit(f"{name}: no iteration times after the warm-up in {log}")
    return statistics.median(times), load, prof


def profile_table(dirs: Dict[str, List[Path]]) -> List[str]:
    """Median seconds per iteration of each section, over every rank's post-warm-up steps."""
    per: Dict[str, Dict[str, List[float]]] = {}
    for side, paths in dirs.items():
        for prof in paths:
            for path in prof.glob("rank-*.jsonl"):
                for line in path.read_text().splitlines():
                    rec = json.loads(line)
                    if rec["iteration"] <= WARMUP:
                        continue
                    row = per.setdefault(side, {})
                    row.setdefault("train_step (all of it)", []).append(rec["step"])
                    for name in set(rec["sections"]) | set(row) - {"train_step (all of it)"}:
                        row.setdefault(name, []).append(rec["sections"].get(name, 0.0))
    names = sorted({n for row in per.values() for n in row},
                   key=lambda n: -statistics.median(per.get(PATCHED, {}).get(n, [0.0])))
    out = ["| section (median ms per step, all ranks) | stock | patched | patched - stock |",
           "|---|---:|---:|---:|"]
    for n in names:
        s = statistics.median(per.get(STOCK, {}).get(n, [0.0])) * 1e3
        p = statistics.median(per.get(PATCHED, {}).get(n, [0.0])) * 1e3
        out.append(f"| {n} | {s:.2f} | {p:.2f} | {p - s:+.2f} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--profile-rounds", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="work in this new folder and keep the logs")
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    if opts.iters <= WARMUP + 2:
        parser.error(f"--iters must exceed the {WARMUP} warm-up iterations by a few")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows: List[dict] = []
    prof_dirs: Dict[str, List[Path]] = {STOCK: [], PATCHED: []}
    with stock_and_patched(opts.megatron, opts.keep, prefix="bench-step-") as (
            work, stock_tree, ttp_tree, data):
        args = tiny_gpt_args(data, train_iters=opts.iters, extra=MODELS[opts.model])
        trees = {STOCK: stock_tree, PATCHED: ttp_tree}
        for r in range(opts.rounds + opts.profile_rounds):
            profile = r >= opts.rounds
            order = (STOCK, PATCHED) if r % 2 == 0 else (PATCHED, STOCK)
            got = {}
            for side in order:
                name = f"r{r}-{side}{'-profile' if profile else ''}"
                ms, load, prof = run_once(trees[side], args, work, name, side, profile)
                got[side] = (ms, load)
                if profile:
                    prof_dirs[side].append(prof)
                print(f"round {r} {side}{' (profiled)' if profile else ''}: {ms:.1f} ms per "
                      f"iteration, loadavg {load}", flush=True)
            if not profile:
                rows.append({"round": r, "order": list(order),
                             STOCK: got[STOCK][0], PATCHED: got[PATCHED][0],
                             "ratio": got[PATCHED][0] / got[STOCK][0],
                             "load": {s: got[s][1] for s in got}})
        prof_lines = profile_table(prof_dirs) if opts.profile_rounds else []
    ratios = [row["ratio"] for row in rows]
    print(f"\n{started}: Megatron GPT '{opts.model}' ({' '.join(MODELS[opts.model]) or 'tiny'}), "
          f"DP{DP} on 4 CPU ranks, gloo, {opts.iters} iterations per run, median of iterations "
          f"> {WARMUP}; {len(rows)} interleaved rounds")
    print("| round | order | stock ms | patched ms | patched / stock | loadavg (stock; patched) |")
    print("|---:|---|---:|---:|---:|---|")
    for row in rows:
        print(f"| {row['round']} | {' then '.join(row['order'])} | {row[STOCK]:.1f} | "
              f"{row[PATCHED]:.1f} | {row['ratio']:.3f} | {row['load'][STOCK]}; "
              f"{row['load'][PATCHED]} |")
    if ratios:
        print(f"patched / stock per step: median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}); medians of the runs: stock "
              f"{statistics.median(r[STOCK] for r in rows):.1f} ms, patched "
              f"{statistics.median(r[PATCHED] for r in rows):.1f} ms")
    for line in prof_lines:
        print(line)
    if opts.json:
        opts.json.write_text(json.dumps({"model": opts.model, "rows": rows,
                                         "profile": prof_lines}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
