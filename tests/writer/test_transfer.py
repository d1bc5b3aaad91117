"""megatron_ttp/transfer.py between two real gloo processes: a nested state (what a refill
carries: optimizer state dicts, fp32/bf16/int64 tensors, an RNG ByteTensor, numpy and Python
RNG states, plain values) arrives equal, each tensor on its own storage (torch.set_rng_state
takes the received one), whatever the dtypes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from mindio_ttp.demo.ports import pick_free_port

REPO = Path(__file__).resolve().parents[2]

MEMBER = textwrap.dedent("""
    import json, random, sys
    from datetime import timedelta
    import numpy as np
    import torch
    import torch.distributed as dist
    from mindio_ttp.megatron_ttp import transfer

    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    pair = dist.new_group([0, 1])

    def state():
        g = torch.Generator().manual_seed(7)
        torch.manual_seed(5); random.seed(3); np.random.seed(4)
        return {
            "stripes": {1: {"optimizer": {"state": {0: {"exp_avg": torch.randn(5, 3, generator=g),
                                                        "step": torch.tensor(4.0)}},
                                          "param_groups": [{"lr": 1e-3, "params": [0]}]},
                            "fp16_mains": [[torch.randn(7, generator=g).bfloat16()]],
                            "fp32_mains": [[], [torch.arange(6, dtype=torch.int64)]]}},
            "rng": {"torch_rng_state": torch.get_rng_state(),
                    "np_rng_state": np.random.get_state(), "random_rng_state": random.getstate()},
            "consumed": 32, "empty": torch.empty(0), "tuple": (1, "a", None),
        }

    if rank == 0:
        transfer.send_tree(state(), 0, pair)
        report = {}
    else:
        got = transfer.recv_tree(0, pair)
        want = state()
        mains = got["stripes"][1]["fp16_mains"][0][0]
        torch.manual_seed(99)
        torch.set_rng_state(got["rng"]["torch_rng_state"])  # its own storage: no crash
        report = {
            "exp_avg": torch.equal(got["stripes"][1]["optimizer"]["state"][0]["exp_avg"],
                                   want["stripes"][1]["optimizer"]["state"][0]["exp_avg"]),
            "step": got["stripes"][1]["optimizer"]["state"][0]["step"].item(),
            "bf16": mains.dtype == torch.bfloat16 and torch.equal(
                mains, want["stripes"][1]["fp16_mains"][0][0]),
            "int64": got["stripes"][1]["fp32_mains"][1][0].tolist(),
            "own_storage": mains.untyped_storage().nbytes() == mains.numel() * 2,
            "rng": torch.equal(torch.get_rng_state(), want["rng"]["torch_rng_state"]),
            "np": all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                      for a, b in zip(got["rng"]["np_rng_state"], want["rng"]["np_rng_state"])),
            "random": got["rng"]["random_rng_state"] == want["rng"]["random_rng_state"],
            "plain": [got["consumed"], list(got["tuple"]), got["empty"].numel(),
                      got["stripes"][1]["optimizer"]["param_groups"]],
        }
    with open(out, "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()
""")


def test_a_refill_tree_crosses_over_gloo_unchanged(tmp_path: Path) -> None:
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    port = str(pick_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port,
                               str(tmp_path / f"rank{r}.json")], cwd=REPO)
             for r in (0, 1)]
    try:
        assert [p.wait(120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    got = json.loads((tmp_path / "rank1.json").read_text())
    assert got == {"exp_avg": True, "step": 4.0, "bf16": True, "int64": [0, 1, 2, 3, 4, 5],
                   "own_storage": True, "rng": True, "np": True, "random": True,
                   "plain": [32, [1, "a", None], 0, [{"lr": 1e-3, "params": [0]}]]}
