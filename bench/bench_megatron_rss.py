"""Peak host memory of real Megatron's periodic save and of the dying save, over the bytes the
rank writes, with the dying save's writer before (BytesIO) and after (checkpoint_writer).

    TTP_MEGATRON_DIR=... python bench/bench_megatron_rss.py [--hidden 256] [--layers 4]

One 4-rank CPU job per writer (the tiny GPT of mindio_ttp.demo.rehearsal, widened by
``--hidden`` / ``--layers``), on a tree patched with ``ttp-patch apply --device cpu``: a
periodic save at iteration 3, then rank 1 is SIGKILLed in iteration 5 and the survivors write
the dying checkpoint of step 4. testkit/hooks/rss_hook/ (on the workers' PYTHONPATH) resets each
rank's peak RSS before each save and records VmHWM - VmRSS-before after it. Reported per kind
of save: the largest per-rank peak extra over that rank's written bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mindio_ttp.demo.rehearsal.data import make_tiny_dataset  # noqa: E402
from mindio_ttp.demo.rehearsal.launch import (  # noqa: E402
    Launcher,
    PretrainJob,
    pick_free_port,
    tiny_gpt_args,
)
from mindio_ttp.demo.rehearsal.tree import apply_ttp_patch, copy_megatron_tree  # noqa: E402
from testkit.hooks import FAULT_HOOK_DIR, RSS_HOOK_DIR, pythonpath  # noqa: E402

FAULT_HOOK = FAULT_HOOK_DIR / "sitecustomize.py"


def run(tree: Path, data, work: Path, writer: str, hidden: int, layers: int) -> List[dict]:
    out = work / f"rss-{writer}"
    out.mkdir()
    env = {"PYTHONPATH": pythonpath(RSS_HOOK_DIR),
           "TTP_BENCH_RSS_DIR": str(out), "TTP_BENCH_WRITER": writer,
           "TTP_BENCH_CHAIN": str(FAULT_HOOK), "TTP_FAULT_PLAN": "1:5:sigkill:before",
           "TTP_OT": "60", "TTP_CONTROLLER_PORT": str(pick_free_port())}
    extra = ["--hidden-size", str(hidden), "--num-layers", str(layers),
             "--num-attention-heads", "8"]
    ckpt = work / f"ckpt-{writer}"
    args = tiny_gpt_args(data, train_iters=8, save=ckpt, save_interval=3, extra=extra)
    with PretrainJob(tree, args, nproc=4, log_path=work / f"{writer}.log",
                     launcher=Launcher.TTPRUN, env=env) as job:
        result = job.wait(600)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    if not any(r["kind"] == "dying" for r in records):
        raise RuntimeError(f"no dying save was measured (exit {result.returncode}):\n"
                           f"{result.tail()}")
    return records


def summarise(records: List[dict]) -> Dict[str, dict]:
    out = {}
    for kind in ("periodic", "dying"):
        rows = [r for r in records if r["kind"] == kind and r["written_bytes"] > 0]
        if not rows:
            continue
        worst = max(rows, key=lambda r: r["peak_extra"] / r["written_bytes"])
        out[kind] = {"ranks": len(rows), "worst_rank": worst["rank"],
                     "peak_extra_mib": worst["peak_extra"] / 2**20,
                     "written_mib": worst["written_bytes"] / 2**20,
                     "ratio": worst["peak_extra"] / worst["written_bytes"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    megatron = os.environ.get("TTP_MEGATRON_DIR")
    if not megatron:
        sys.exit("set TTP_MEGATRON_DIR to a Megatron-LM 285068c checkout")
    work = Path(tempfile.mkdtemp(prefix="ttp-bench-rss-"))
    data = make_tiny_dataset(Path(megatron), work / "data")
    tree = copy_megatron_tree(Path(megatron), work / "tree")
    apply_ttp_patch(tree, device="cpu")
    results = {}
    for writer in ("bytesio", "checkpoint_writer"):
        results[writer] = summarise(run(tree, data, work, writer, a.hidden, a.layers))
    print(f"real Megatron 285068c, 4 ranks (DP4), CPU, hidden {a.hidden}, {a.layers} layers")
    print("| save | dying-save writer | worst rank: peak extra RSS | its bytes written | ratio |")
    print("|---|---|---:|---:|---:|")
    for writer, kinds in results.items():
        for kind, s in kinds.items():
            print(f"| {kind} | {writer} | {s['peak_extra_mib']:.1f} MiB | "
                  f"{s['written_mib']:.1f} MiB | {s['ratio']:.2f} |")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    print(f"work dir: {work}")


if __name__ == "__main__":
    main()
