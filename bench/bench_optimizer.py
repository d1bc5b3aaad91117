"""Bytes per rank per step and step time: ReplicatedOptimizer against Megatron's
DistributedOptimizer, same model, DP4 on CPU (gloo), fp32 and bf16, all measured in one run.

With bf16, Megatron 285068c keeps the grads in fp32 (``accumulate_allreduce_grads_in_fp32``,
``arguments.py:152-158``) while the params are all-gathered in bf16, so the partner swap of fp32
grad stripes costs more relative to stock: 1 + 2/(3(d-1)) times stock instead of
1 + 1/(2(d-1)). The table prints both the figure from the recorded calls and the formula.

The model is Megatron's GPT at 4 layers x hidden 512 (8 heads, seq 64): large enough that the
optimizer's traffic dominates. DistributedOptimizer runs on an unpatched copy of Megatron-LM
(torchrun, CPU adaptor injected), ReplicatedOptimizer on a copy patched with `ttp-patch apply
--device cpu` (ttprun). Every torch.distributed call of the workers is recorded by the test-only
audit hook (testkit/hooks/dist_audit): training-path calls (inside train_step) are converted to
bytes *sent* per rank with the usual ring costs (reduce-scatter and all-gather: (n-1)/n of the
full buffer; all-reduce: 2(n-1)/n; a send: its size; groups of one rank: nothing): computed from
the sizes of the tensors handed to each call, not measured on the wire. The raw bytes of the
tensors handed over are printed too. Step time is Megatron's own "elapsed time
per iteration", the median over iterations 3..N (the audit's small per-call cost is in both).

    python bench/bench_optimizer.py --megatron DIR   # a Megatron-LM checkout at 285068c
    python bench/bench_optimizer.py --megatron DIR --precision bf16   # one precision only
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit: the repository's rig

from mindio_ttp.demo.rehearsal.launch import (  # noqa: E402
    Launcher,
    PretrainJob,
    pick_free_port,
    tiny_gpt_args,
)
from mindio_ttp.demo.rehearsal.tree import stock_and_patched  # noqa: E402
from testkit.hooks import DIST_AUDIT_DIR, pythonpath  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ITERS = 8
DP = 4
MODEL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8"]
_ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def wire_bytes(record: dict) -> int:
    """Bytes this rank sends for one recorded call (ring algorithms)."""
    n, sizes, op = record.get("group_size", 0), record.get("tensor_bytes", []), record["op"]
    if n <= 1 or not sizes:
        return 0
    if op in ("_reduce_scatter_base", "reduce_scatter_tensor", "_all_gather_base",
              "all_gather_into_tensor"):
        return max(sizes) * (n - 1) // n
    if op in ("reduce_scatter", "all_gather"):
        return sum(sizes) * (n - 1) // (2 * n) if len(sizes) > 1 else sizes[0] * (n - 1)
    if op == "all_reduce":
        return 2 * sum(sizes) * (n - 1) // n
    if op == "batch_isend_irecv":
        return sum(b for b, kind in zip(sizes, record.get("p2p", [])) if kind == "isend")
    if op in ("broadcast", "send"):
        return sum(sizes)
    return 0


def measure(tree: Path, args: List[str], work: Path, name: str, launcher: Launcher,
            inject: bool) -> Tuple[Dict[str, float], float, Dict[str, int]]:
    audit = work / f"{name}-audit"
    audit.mkdir()
    env = {"PYTHONPATH": pythonpath(DIST_AUDIT_DIR),
           "TTP_DIST_AUDIT_DIR": str(audit), "TTP_CONTROLLER_PORT": str(pick_free_port())}
    log = work / f"{name}.log"
    with PretrainJob(tree, args, nproc=DP, log_path=log, launcher=launcher, env=env,
                     inject_adaptor=inject) as job:
        result = job.wait(1800)
    if result.timed_out or result.returncode != 0:
        raise SystemExit(f"{name} failed; see {log}")
    sent: Dict[int, int] = defaultdict(int)
    handed: Dict[int, int] = defaultdict(int)
    by_op: Dict[str, int] = defaultdict(int)
    for path in audit.glob("rank-*.jsonl"):
        rank = int(path.name.split("-")[1])
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["phase"] != "train" or rec["op"] == "new_group":
                continue
            sent[rank] += wire_bytes(rec)
            handed[rank] += rec["bytes"]
            by_op[rec["op"]] += wire_bytes(rec)
    times = [float(ms) for it, ms in _ELAPSED.findall(log.read_text()) if int(it) >= 3]
    per_rank = {"sent": statistics.mean(sent.values()) / ITERS,
                "handed": statistics.mean(handed.values()) / ITERS}
    return per_rank, statistics.median(times), {k: v // (DP * ITERS) for k, v in by_op.items()}


PRECISIONS = {"fp32": [], "bf16": ["--bf16"]}
# per-step bytes relative to stock, from the tensor sizes (module doc); d = DP size
EXPECTED = {"fp32": lambda d: 1 + 1 / (2 * (d - 1)), "bf16": lambda d: 1 + 2 / (3 * (d - 1))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", type=Path, required=True)
    parser.add_argument("--keep", type=Path, help="work in this new folder and keep the logs")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), action="append",
                        help="run only this precision (repeatable; default: fp32 and bf16)")
    opts = parser.parse_args()
    precisions = opts.precision or list(PRECISIONS)
    results = {}
    with stock_and_patched(opts.megatron, opts.keep, prefix="bench-optimizer-") as (
            work, stock_tree, ttp_tree, data):
        for precision in precisions:
            args = tiny_gpt_args(data, train_iters=ITERS, extra=MODEL + PRECISIONS[precision])
            results[precision] = (
                measure(stock_tree, args, work, f"distributed-{precision}", Launcher.TORCHRUN,
                        True),
                measure(ttp_tree, args, work, f"replicated-{precision}", Launcher.TTPRUN, False))
    print(f"GPT 4 layers x hidden 512, DP{DP}, CPU/gloo, {ITERS} iterations; per rank per step; "
          "MB sent computed from the tensor sizes handed to each call (ring costs), not "
          "measured on the wire")
    print("| precision | optimizer | MB sent | MB handed to collectives | step time (ms) |")
    print("|---|---|---:|---:|---:|")
    for precision, (stock, ttp) in results.items():
        for name, (b, t, _) in (("DistributedOptimizer (stock)", stock),
                                ("ReplicatedOptimizer", ttp)):
            print(f"| {precision} | {name} | {b['sent'] / 1e6:.2f} | {b['handed'] / 1e6:.2f} | "
                  f"{t:.0f} |")
    for precision, (stock, ttp) in results.items():
        ratio = ttp[0]["sent"] / stock[0]["sent"]
        print(f"{precision}: ratio sent {ratio:.3f} (from the tensor sizes: "
              f"{EXPECTED[precision](DP):.3f}); ratio step time {ttp[1] / stock[1]:.3f}")
        for name, (_, _, ops) in (("DistributedOptimizer", stock), ("ReplicatedOptimizer", ttp)):
            print(f"  {name}: bytes sent per rank per step by op: "
                  + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sorted(ops.items()) if v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
