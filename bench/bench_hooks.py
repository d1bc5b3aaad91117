"""Per-step cost of the TTP hooks against the same training step without them.

Two processes run the real runtime (controller on rank 0, a processor with its heartbeat thread
on both, as in the guide) and train locally; each measured block of steps either makes the hook
calls the patched Megatron makes per step (``ttp_start_updating_os`` before the optimizer step,
``ttp_end_updating_os`` after it, ``ttp_set_ckpt_args`` once the iteration moved on) or does not.
Blocks alternate (ABBA, after a warm-up block), so drift on a shared machine hits both alike;
the ratio compares the median step times. The guide's barrier is a collective of the job, not a
hook, and is left out of both. A tight loop of the three calls alone gives their absolute cost;
the no-hook blocks split in two groups give the noise floor of the comparison (A/A).

    python bench/bench_hooks.py [--blocks 40] [--steps 50]
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

JOBS = {  # name: (layer widths, batch)
    "tiny MLP (the demo's 212 params)": ([8, 16, 4], 16),
    "MLP 4x512 (0.8M params)": ([512, 512, 512, 512], 32),
}


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
        for name, (widths, batch) in JOBS.items():
            layers: List[torch.nn.Module] = []
            for a, b in zip(widths, widths[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
            model = torch.nn.Sequential(*layers[:-1])
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            x = torch.randn(batch, widths[0])
            y = torch.randn(batch, widths[-1])
            times: Dict[bool, List[float]] = {True: [], False: []}
            control: Dict[int, List[float]] = {0: [], 1: []}  # no-hook blocks split in two
            for block in range(-1, args.blocks):  # block -1 warms up and is not counted
                hooks = block in (-1,) or block % 4 in (0, 3)  # ABBA: order effects cancel
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if hooks:
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
            results[name] = {"with": with_h, "without": without, "aa": abs(a - b) / min(a, b)}
        n = 200_000
        t0 = time.perf_counter()
        for _ in range(n):
            step += 1
            ttp.ttp_start_updating_os(-1)
            ttp.ttp_end_updating_os(step)
            ttp.ttp_set_ckpt_args((step, None))
        results["_calls"] = {"ns": 1e9 * (time.perf_counter() - t0) / n}
        dist.barrier()

    train()
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dist-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
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
                 f"--out={out}", f"--blocks={args.blocks}", f"--steps={args.steps}"], env=env,
            )  # fmt: skip
            for r in range(2)
        ]
        try:
            codes = [pr.wait(timeout=900) for pr in procs]
        finally:
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
                    pr.wait()
        if codes != [0, 0] or not out.is_file():
            raise SystemExit(f"bench workers failed: exit codes {codes}")
        results = json.loads(out.read_text())
    calls = results.pop("_calls")["ns"]
    print(f"runtime up (controller + 2 processors, default heartbeats); {args.blocks} alternating "
          f"blocks of {args.steps} steps; median step time")  # fmt: skip
    print("| job | step without hooks | step with hooks | overhead | noise floor (A/A) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = (r["with"] - r["without"]) / r["without"]
        print(f"| {name} | {1e6 * r['without']:.1f} us | {1e6 * r['with']:.1f} us | "
              f"{100 * ratio:+.2f}% | {100 * r['aa']:.2f}% |")  # fmt: skip
    print(f"the three hook calls alone: {calls:.0f} ns per step (tight loop, 200k steps)")


if __name__ == "__main__":
    main()
