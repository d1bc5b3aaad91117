"""Per-step cost of the TTP hooks (the shipped path) against the same training step without.

Two processes run the real runtime (controller on rank 0, a processor with its heartbeat thread
on both, as in the guide) and train locally; each measured block of steps either makes the calls
the patched Megatron makes per step (``ttp_offer_update`` at the end of ReplicatedOptimizer's
``reduce_model_grads``, ``ttp_start_updating_os`` before the optimizer step,
``ttp_end_updating_os`` after it, ``ttp_set_ckpt_args`` once the iteration moved on) or does not.
Blocks alternate (ABBA, after a warm-up block), so drift on a shared machine hits both alike;
the ratio compares the median step times. The guide's barrier is a collective of the job, not a
hook, and is left out of both (no script here measures it: a gloo barrier on loopback says
nothing of NCCL/HCCL). The no-hook blocks split in two groups give the noise floor of the
comparison (A/A): an overhead below it is not a measurement. Tight loops of the calls alone give
their absolute cost: the three hooks, and ``ttp_offer_update``.

Jobs: the demo's tiny MLP (the worst case: a step of microseconds) and a realistic step, two
GPT-style transformer layers (hidden 512, 8 heads, FFN 2048, sequence 128, micro-batch 4; 6.3M
parameters, fp32, one thread per rank).

    python bench/bench_hooks.py [--blocks 40] [--steps 50] [--gpt-blocks 16] [--gpt-steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List

TINY = "tiny MLP (the demo's 212 params)"
GPT = "2 GPT layers, hidden 512, seq 128, mbs 4 (6.3M params)"
CALLS = 200_000


def build(name: str):
    """(model, inputs, targets) of a job."""
    import torch

    torch.manual_seed(0)
    if name == TINY:
        widths = [8, 16, 4]
        layers: List[torch.nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers[:-1]), torch.randn(16, 8), torch.randn(16, 4)

    def layer() -> torch.nn.Module:
        return torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)

    x = torch.randn(4, 128, 512)
    return torch.nn.Sequential(layer(), layer()), x, torch.randn_like(x)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import mindio_ttp.framework_ttp as ttp

    torch.set_num_threads(1)
    rank, world = args.rank, 2
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.dist_port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    results: Dict[str, Dict[str, float]] = {}

    @ttp.ttp_to_persist
    def train() -> None:
        dp_ranks = [0, 1]
        if rank == 0:
            ttp.ttp_init_controller(rank, world, len(dp_ranks) // 2, False)
            ttp.ttp_start_controller("127.0.0.1", 8000)
        ttp.ttp_init_processor(rank, dp_ranks, len(dp_ranks), world, len(dp_ranks) // 2, False)
        ttp.ttp_start_processor("127.0.0.1", 8000)
        ttp.ttp_register_save_ckpt_handler(lambda step, ranks, ckpt_args: None)
        ttp.ttp_register_rename_handler(lambda step, ckpt_args: None)
        dist.barrier()
        step = 0
        for name, blocks, steps in ((TINY, args.blocks, args.steps),
                                    (GPT, args.gpt_blocks, args.gpt_steps)):
            model, x, y = build(name)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            times: Dict[bool, List[float]] = {True: [], False: []}
            control: Dict[int, List[float]] = {0: [], 1: []}  # no-hook blocks split in two
            for block in range(-1, blocks):  # block -1 warms up and is not counted
                hooks = block in (-1,) or block % 4 in (0, 3)  # ABBA: order effects cancel
                for _ in range(steps):
                    t0 = time.perf_counter()
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if hooks:  # ReplicatedOptimizer: every collective of the update is done
                        ttp.ttp_offer_update(step + 1, opt.step)
                        ttp.ttp_start_updating_os(-1)
                    opt.step()
                    step += 1
                    if hooks:
                        ttp.ttp_end_updating_os(step)
                        ttp.ttp_set_ckpt_args((step, model, opt))
                    if block >= 0:
                        times[hooks].append(time.perf_counter() - t0)
                        if not hooks:
                            control[(block // 4) % 2].append(times[hooks][-1])
            with_h, without = statistics.median(times[True]), statistics.median(times[False])
            a, b = statistics.median(control[0]), statistics.median(control[1])
            results[name] = {"with": with_h, "without": without, "aa": abs(a - b) / min(a, b),
                             "params": sum(p.numel() for p in model.parameters())}

        def per_call(body) -> float:
            t0 = time.perf_counter()
            body()
            return 1e9 * (time.perf_counter() - t0) / CALLS

        def hooks_loop() -> None:
            nonlocal step
            for _ in range(CALLS):
                step += 1
                ttp.ttp_start_updating_os(-1)
                ttp.ttp_end_updating_os(step)
                ttp.ttp_set_ckpt_args((step, None))

        def offer_loop() -> None:
            nothing = lambda: None  # noqa: E731
            for i in range(CALLS):
                ttp.ttp_offer_update(step + 1 + i, nothing)

        def empty_loop() -> None:
            for _ in range(CALLS):
                pass

        empty = per_call(empty_loop)
        results["_calls"] = {"hooks": per_call(hooks_loop) - empty,
                             "offer": per_call(offer_loop) - empty}
        dist.barrier()

    train()
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=40, help="tiny MLP: blocks")
    p.add_argument("--steps", type=int, default=50, help="tiny MLP: steps per block")
    p.add_argument("--gpt-blocks", type=int, default=16, help="GPT layers: blocks")
    p.add_argument("--gpt-steps", type=int, default=3, help="GPT layers: steps per block")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dist-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.blocks, args.gpt_blocks) < 8:
        p.error("give at least 8 blocks: the A/A noise floor compares two groups of 4")
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-hooks-") as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, TTP_CONTROLLER_PORT=str(_free_port()), TTP_RUN_DIR=tmp,
                   TTP_AUTH_KEY=os.urandom(32).hex(), TTP_LOG_LEVEL="WARNING",
                   OMP_NUM_THREADS="1")  # fmt: skip
        dist_port = _free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", f"--rank={r}", f"--dist-port={dist_port}",
                 f"--out={out}", f"--blocks={args.blocks}", f"--steps={args.steps}",
                 f"--gpt-blocks={args.gpt_blocks}", f"--gpt-steps={args.gpt_steps}"], env=env,
            )  # fmt: skip
            for r in range(2)
        ]
        try:
            codes = [pr.wait(timeout=3600) for pr in procs]
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
                    pr.wait()
        if codes != [0, 0] or not out.is_file():
            raise SystemExit(f"bench workers failed: exit codes {codes}")
        results = json.loads(out.read_text())
    calls = results.pop("_calls")
    load = os.getloadavg()[0]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load:.2f} at the "
          "end; runtime up (controller + 2 processors, default heartbeats); alternating blocks "
          "(ABBA); median step time")  # fmt: skip
    print("| job | blocks x steps | step without hooks | step with hooks | overhead | noise "
          "floor (A/A) |")
    print("|---|---|---:|---:|---:|---:|")
    shape = {TINY: (args.blocks, args.steps), GPT: (args.gpt_blocks, args.gpt_steps)}
    for name, r in results.items():
        ratio = (r["with"] - r["without"]) / r["without"]
        b, n = shape[name]
        print(f"| {name} | {b} x {n} | {1e6 * r['without']:.1f} us | {1e6 * r['with']:.1f} us | "
              f"{100 * ratio:+.2f}% | {100 * r['aa']:.2f}% |")  # fmt: skip
    print(f"calls alone (tight loop, {CALLS} iterations, loop cost subtracted): the three hooks "
          f"{calls['hooks']:.0f} ns per step; ttp_offer_update {calls['offer']:.0f} ns per call")


if __name__ == "__main__":
    main()
