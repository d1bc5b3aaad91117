"""Optimizer memory per parameter: Megatron's stock DistributedOptimizer against
ReplicatedOptimizer, both measured on the same model by the same outside code.

    python bench/bench_optimizer_memory.py --megatron DIR [--layers 4] [--hidden 512]

Real Megatron-LM 285068c on 4 CPU ranks (DP4, gloo, fp32 Adam): the unpatched tree with stock
`DistributedOptimizer` (torchrun, the CPU adaptor injected) and the patched tree with
`ReplicatedOptimizer` (ttprun), 3 iterations each. testkit/hooks/optim_memory walks each rank's
optimizer object after its first step and adds up every tensor storage it reaches that is not
the model's own (parameters, buffers, gradient buffers and views of them): what the optimizer
allocated, whatever its class says of itself. With fp32 params the main params are views of the
model's, so what is counted is Adam's exp_avg and exp_avg_sq, plus ReplicatedOptimizer's step
record (RNG states, a few KiB). With fp16/bf16 params the fp32 main copy would count too (not
measured here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # testkit: the repository's rig

from mindio_ttp.demo.rehearsal.launch import (  # noqa: E402
    Launcher,
    pick_free_port,
    run_pretrain,
    tiny_gpt_args,
)
from mindio_ttp.demo.rehearsal.tree import stock_and_patched  # noqa: E402
from testkit.hooks import OPTIM_MEMORY_DIR, pythonpath  # noqa: E402

DP = 4
ITERS = 3  # more than tiny_gpt_args' 2 warm-up iterations (Megatron asserts it)


def measure(tree: Path, args, work: Path, name: str, launcher: Launcher,
            inject: bool) -> Dict[int, dict]:
    """Per rank: {"optimizer", "params", "bytes"} as the hook recorded them."""
    out = work / f"{name}-memory"
    out.mkdir()
    result = run_pretrain(tree, args, nproc=DP, log_path=work / f"{name}.log", timeout_s=1800,
                          launcher=launcher, inject_adaptor=inject,
                          env={"PYTHONPATH": pythonpath(OPTIM_MEMORY_DIR),
                               "TTP_OPTIM_MEMORY_DIR": str(out),
                               "TTP_CONTROLLER_PORT": str(pick_free_port())})
    if result.timed_out or result.returncode != 0:
        raise SystemExit(f"{name} failed (exit {result.returncode}): {result.tail(2000)}")
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--keep", type=Path, help="work in this new folder and keep the logs")
    opts = parser.parse_args()
    model = ["--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden),
             "--num-attention-heads", "8"]
    with stock_and_patched(opts.megatron, opts.keep, prefix="bench-optim-memory-") as (
            work, stock_tree, ttp_tree, data):
        args = tiny_gpt_args(data, train_iters=ITERS, extra=model)
        stock = measure(stock_tree, args, work, "distributed", Launcher.TORCHRUN, True)
        ttp = measure(ttp_tree, args, work, "replicated", Launcher.TTPRUN, False)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: GPT {opts.layers} layers x "
          f"hidden {opts.hidden}, DP{DP}, fp32 Adam, CPU/gloo; bytes the optimizer object "
          "holds beyond the model's own tensors, per rank, after the first step")
    print("| rank | params | DistributedOptimizer | B/param | ReplicatedOptimizer | B/param | "
          "ratio | Replicated - (own + partner's stock) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rank in sorted(stock):
        s, r = stock[rank], ttp[rank]
        partner = stock[(rank + DP // 2) % DP]["bytes"]
        print(f"| {rank} | {s['params']} | {s['bytes']} | {s['bytes'] / s['params']:.3f} | "
              f"{r['bytes']} | {r['bytes'] / r['params']:.3f} | {r['bytes'] / s['bytes']:.3f} | "
              f"{r['bytes'] - s['bytes'] - partner} B |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
