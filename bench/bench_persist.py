"""Dying-checkpoint persist time vs a plain ``torch.save`` of the same state on the same disk.

The dying checkpoint path is the demo's: every shard is digested (xxh3_128; blake3 with
``TTP_CHECKPOINT_KEY``: mindio_ttp/faulttime/digest.py) in the same pass as it is written into a
``.part`` file, fsynced, renamed, then the rename handler writes the manifest, moves the
directory into place and replaces ``latest``; torch's zip CRC-32 is off for its files (the
digest covers them). The like-for-like baseline is ``torch.save`` of the same tensors into one
file plus ``fsync`` (durable, which is what a checkpoint written seconds before the job is killed
needs) with the same CRC setting; torch.save with its default CRC, with and without fsync, is
shown for reference. Runs are interleaved (ABCD DCBA ...) and the median is reported, so drift on
a shared machine hits every method alike.

    python bench/bench_persist.py [--mparams 16] [--repeats 9] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_megatron_writer import torch_save_file  # noqa: E402

from mindio_ttp.demo import checkpoint  # noqa: E402
from mindio_ttp.demo.model import ShardLayout, ShardState  # noqa: E402
from mindio_ttp.faulttime import digest  # noqa: E402

BASELINE = "torch.save + fsync, CRC off"


def make_shards(numel: int, world: int = 4) -> List[ShardState]:
    """One ShardState per distinct shard, over a flat vector of ``numel`` parameters."""
    base = ShardLayout.for_world(world)
    layout = ShardLayout(base.world, base.replica, numel, -(-numel // base.replica) * base.replica)
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(layout.padded, generator=gen)
    shards = []
    for s in range(layout.replica):
        m = torch.randn(layout.shard_numel, generator=gen)
        v = torch.rand(layout.shard_numel, generator=gen)
        shards.append(ShardState(layout, s, params, m, v, step=7))
    return shards


def dying_checkpoint(root: Path, shards: List[ShardState]) -> None:
    for rank, st in enumerate(shards):  # serial: on a cluster each shard is a different rank
        checkpoint.save_shard(root, 7, rank, st)
    checkpoint.finalize(root, 7, shards[0].layout)


def plain_state(shards: List[ShardState]) -> Dict[str, torch.Tensor]:
    layout = shards[0].layout
    out: Dict[str, torch.Tensor] = {}
    for st in shards:
        out[f"params.{st.shard}"] = st.params.detach()[layout.bounds(st.shard)]
        out[f"exp_avg.{st.shard}"] = st.exp_avg
        out[f"exp_avg_sq.{st.shard}"] = st.exp_avg_sq
    return out


def hash_only(blob: bytes) -> None:
    digest.of_bytes(digest.default_algo(), blob)


def run(mparams: float, repeats: int, base_dir: Path) -> Dict[str, float]:
    torch.set_num_threads(1)
    shards = make_shards(int(mparams * 1_000_000))
    state = plain_state(shards)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    blob = b"".join(t.contiguous().numpy().tobytes() for t in state.values())
    algo = digest.default_algo()
    cases: Dict[str, Callable[[Path], None]] = {
        "torch.save, CRC on": lambda d: torch_save_file(d / "plain.pt", state, fsync=False),
        "torch.save + fsync, CRC on": lambda d: torch_save_file(d / "plain.pt", state, True),
        BASELINE: lambda d: torch_save_file(d / "plain.pt", state, fsync=True, crc=False),
        f"dying checkpoint ({algo}, CRC off)": lambda d: dying_checkpoint(d, shards),
        f"({algo} of the same bytes alone, 1 core)": lambda d: hash_only(blob),
    }
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for i in range(repeats + 1):  # the first round warms the page cache and allocator
        for name, fn in (cases.items() if i % 2 else reversed(cases.items())):
            work = Path(tempfile.mkdtemp(prefix="bench-persist-", dir=base_dir))
            try:
                start = time.perf_counter()
                fn(work)
                elapsed = time.perf_counter() - start
            finally:
                shutil.rmtree(work, ignore_errors=True)
            if i:
                times[name].append(elapsed)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med[BASELINE]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: state {nbytes / 2**20:.0f} MiB "
          f"(params + exp_avg + exp_avg_sq, 2 shards), {repeats} interleaved repeats, median; "
          f"disk: {base_dir}; load average {os.getloadavg()[0]:.2f} at the end")  # fmt: skip
    print(f"| method | median s (min-max) | MiB/s | vs {BASELINE} |")
    print("|---|---:|---:|---:|")
    for name, t in med.items():
        print(f"| {name} | {t:.3f} ({min(times[name]):.3f}-{max(times[name]):.3f}) | "
              f"{nbytes / 2**20 / t:.0f} | {100 * base / t:.0f}% |")  # fmt: skip
    return {name: base / t for name, t in med.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mparams", type=float, default=16.0, help="millions of parameters (16)")
    p.add_argument("--repeats", type=int, default=9, help="interleaved repeats (>= 7)")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="disk to use")
    args = p.parse_args()
    if args.repeats < 7:
        p.error("--repeats must be at least 7: a median of fewer runs moves with the load")
    args.dir.mkdir(parents=True, exist_ok=True)
    run(args.mparams, args.repeats, args.dir)


if __name__ == "__main__":
    main()
