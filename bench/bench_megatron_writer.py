"""The Megatron dying-save writer against torch.save + fsync of the same tensors, and the host
memory each way of writing adds, on state dicts shaped like Megatron 285068c's checkpoint files.

    python bench/bench_megatron_writer.py [--hidden 768] [--layers 4] [--repeats 9] [--dir DIR]
        [--methods NAME ...] [--burn N] [--json OUT]

    # the two sizes of docs/benchmarks.md: 41.4M parameters (277 MiB), and ~2 GiB per rank
    python bench/bench_megatron_writer.py --repeats 9
    python bench/bench_megatron_writer.py --hidden 1792 --layers 7 --repeats 9

Files (one model-parallel rank, DP position 0 of 4): ``mp_rank_00/model_rng.pt`` (args, the
GPT model state dict in fp32: embedding, per layer QKV / dense / MLP / layer norms, the RNG
states) and ``mp_rank_00_000/optim.pt`` (one DP position's distributed-optimizer state: fp32
param, exp_avg, exp_avg_sq per group, the scheduler). Methods, each writing both files into a
fresh directory of the same filesystem (``--dir``; default the temp directory's):

* ``torch.save + fsync, CRC off`` (the baseline): what Megatron's own save does, made durable,
  with torch's zip CRC-32 off as the writer has it; it computes no digest at all;
* ``torch.save(path) + fsync, CRC off``: the same through torch's C++ file writer, as
  Megatron's ``torch.save(state_dict, checkpoint_name)`` writes, then the file fsynced;
* ``torch.save + fsync, CRC on``: torch's default, for reference;
* ``writer, <digest>, inline|helper``: ``checkpoint_writer.write_torch`` (streamed into a
  ``.part`` file, digested in the same pass, fsync, rename, directory fsync), with the digest
  of an unkeyed manifest (xxh3_128) or of a signed one (blake3), or the sha256 of before,
  computed inline after each buffer's write or on the helper thread beside it. ``(default,
  ...)`` marks what the writer picks by itself, which depends on whether a core is free
  (``HashingWriter.helper_pays``). Two alternatives measured for the
  design: ``no sync_file_range`` (no writeback started after each 16 MiB chunk) and
  ``blake3 on all cores`` (blake3's own thread pool hashing each buffer); and ``files in
  parallel``: the two files written at once, each on its own thread.

Every file a writer wrote is re-read and its digest recomputed after the timed part
(``verify s``: what the load's check costs per method), and must equal the one the writer
returned. Throughput: interleaved repeats (ABC CBA ..., so order effects cancel), median; the
spread (min-max) and the process CPU time (all threads) are printed too. ``vs baseline``:
baseline median / method median; ``per repeat``: the median of that ratio taken within each
repeat. Peak memory: each method once in a fresh process, VmHWM after the save minus VmHWM
before it (the state already resident), over the state size. ``--burn N`` runs N busy
processes beside the bench (a loaded node); /proc/loadavg is printed at start and end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mindio_ttp.faulttime import checkpoint_writer, digest  # noqa: E402

MODEL_FILE = "mp_rank_00/model_rng.pt"
OPTIM_FILE = "mp_rank_00_000/optim.pt"


def megatron_states(hidden: int, layers: int, vocab: int, dp: int) -> Dict[str, dict]:
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    encoder: Dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"layers.{i}."
        encoder[p + "input_layernorm.weight"] = w(hidden)
        encoder[p + "input_layernorm.bias"] = w(hidden)
        encoder[p + "self_attention.query_key_value.weight"] = w(3 * hidden, hidden)
        encoder[p + "self_attention.query_key_value.bias"] = w(3 * hidden)
        encoder[p + "self_attention.dense.weight"] = w(hidden, hidden)
        encoder[p + "self_attention.dense.bias"] = w(hidden)
        encoder[p + "post_attention_layernorm.weight"] = w(hidden)
        encoder[p + "post_attention_layernorm.bias"] = w(hidden)
        encoder[p + "mlp.dense_h_to_4h.weight"] = w(4 * hidden, hidden)
        encoder[p + "mlp.dense_h_to_4h.bias"] = w(4 * hidden)
        encoder[p + "mlp.dense_4h_to_h.weight"] = w(hidden, 4 * hidden)
        encoder[p + "mlp.dense_4h_to_h.bias"] = w(hidden)
    encoder["final_layernorm.weight"] = w(hidden)
    encoder["final_layernorm.bias"] = w(hidden)
    embedding = {"word_embeddings": {"weight": w(vocab, hidden)},
                 "position_embeddings": {"weight": w(1024, hidden)}}
    rng = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state(),
           "cuda_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    args = Namespace(hidden_size=hidden, num_layers=layers, padded_vocab_size=vocab,
                     iteration=4, consumed_train_samples=64)
    model = {"args": args, "checkpoint_version": 3.0, "iteration": 4,
             "model": {"language_model": {"embedding": embedding, "encoder": encoder}},
             "rng_state": [rng]}
    numel = sum(t.numel() for t in encoder.values()) + vocab * hidden + 1024 * hidden
    shard = -(-numel // dp)
    group = {"param": w(shard), "exp_avg": w(shard), "exp_avg_sq": w(shard).abs()}
    optim = {"optimizer": {"optimizer": {"state": {0: group}, "param_groups": [
        {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01, "step": 4,
         "params": [0]}]}, "grad_scaler": None},
        "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 64, "decay_style": "cosine"}}
    return {MODEL_FILE: model, OPTIM_FILE: optim}


def model_params(hidden: int, layers: int, vocab: int) -> int:
    """Parameters of the GPT whose files these are (model_rng.pt's model state dict)."""
    return sum(t.numel() for t in _tensors(megatron_states(hidden, layers, vocab, 4)[MODEL_FILE]))


def _tensors(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif torch.is_tensor(x) and x.dtype.is_floating_point and x.dim() > 0:
        yield x


def state_bytes(states: Dict[str, dict]) -> int:
    total = 0

    def walk(x) -> None:
        nonlocal total
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif torch.is_tensor(x):
            total += x.numel() * x.element_size()

    walk(states)
    return total


def torch_save_file(path: Path, state: dict, fsync: bool, crc: bool = True) -> None:
    """torch.save into a file object, as training scripts do; `crc=False`: torch's zip CRC-32
    off, as checkpoint_writer has it (the like-for-like baseline of the writers)."""
    with contextlib.ExitStack() as stack:
        if not crc:
            stack.enter_context(checkpoint_writer._without_torch_crc32())
        with open(path, "wb") as f:
            torch.save(state, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def _writer(algo: str, helper: bool, writeback: bool = True,
            blake3_threads: bool = False) -> Callable[[Path, dict], object]:
    """The writer; `writeback=False`: without sync_file_range after each chunk;
    `blake3_threads`: blake3 on its own thread pool (all cores) instead of one thread."""
    def write(p: Path, s: dict) -> object:
        start_writeback, threads = checkpoint_writer._START_WRITEBACK, digest.BLAKE3_THREADS
        if not writeback:
            checkpoint_writer._START_WRITEBACK = lambda fd, offset, nbytes: None
        digest.BLAKE3_THREADS = blake3_threads
        try:
            return checkpoint_writer.write_torch(p, s, algo=algo, helper=helper)
        finally:
            checkpoint_writer._START_WRITEBACK, digest.BLAKE3_THREADS = start_writeback, threads

    return write


def torch_save_path(path: Path, state: dict) -> None:
    """What Megatron's save does, `torch.save(state, path)` (torch's C++ file writer), then
    the file fsynced; CRC off."""
    with checkpoint_writer._without_torch_crc32():
        torch.save(state, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


BASELINE = "torch.save + fsync, CRC off"  # the same bytes durably, the same CRC setting
PARALLEL = " (files in parallel)"
METHODS: Dict[str, Callable[[Path, dict], object]] = {
    BASELINE: lambda p, s: torch_save_file(p, s, fsync=True, crc=False),
    "torch.save(path) + fsync, CRC off": torch_save_path,
    "torch.save + fsync, CRC on": lambda p, s: torch_save_file(p, s, fsync=True),
}
for _algo in (digest.XXH3_128, digest.BLAKE3, digest.SHA256):
    for _helper in (False, True):
        _name = f"writer, {_algo}, {'helper' if _helper else 'inline'}"
        _name += " (default, a core free)" if _helper else " (default, no core free)"
        METHODS[_name] = _writer(_algo, _helper)
METHODS["writer, xxh3_128, inline, no sync_file_range"] = _writer(digest.XXH3_128, False, False)
METHODS["writer, blake3 on all cores, inline"] = _writer(digest.BLAKE3, False, True, True)
METHODS["writer, xxh3_128, inline" + PARALLEL] = METHODS[
    "writer, xxh3_128, inline (default, no core free)"]
WRITERS = [m for m in METHODS if m.startswith("writer")]


def write_all(method: str, root: Path, states: Dict[str, dict]) -> Dict[str, object]:
    """Both files, one after the other, or each on its own thread (methods named PARALLEL)."""
    for rel in states:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
    if method.endswith(PARALLEL):
        write = METHODS[method]
        with ThreadPoolExecutor(len(states)) as pool:
            futures = {rel: pool.submit(write, root / rel, state) for rel, state in states.items()}
            return {rel: f.result() for rel, f in futures.items()}
    return {rel: METHODS[method](root / rel, state) for rel, state in states.items()}


def verify_all(root: Path, written: Dict[str, object]) -> float:
    """Re-read every file a writer wrote and check its digest (what the load does); seconds."""
    t0 = time.perf_counter()
    for rel, w in written.items():
        got = digest.of_file(root / rel, w.algo)  # type: ignore[attr-defined]
        if got != w.digest:  # type: ignore[attr-defined]
            raise SystemExit(f"{root / rel}: digest {got} on re-read, the writer said "
                             f"{w.digest}")  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def burn() -> None:
    while True:
        pass


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def peak_child(method: str, root: Path, hidden: int, layers: int, vocab: int) -> None:
    states = megatron_states(hidden, layers, vocab, dp=4)
    before = _hwm()
    write_all(method, root, states)
    print(json.dumps({"extra": _hwm() - before, "state": state_bytes(states)}))


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--repeats", type=int, default=9, help="interleaved repeats (>= 7)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    ap.add_argument("--methods", nargs="+", default=None, metavar="NAME",
                    help="only these methods (substrings of their names; the baseline always)")
    ap.add_argument("--burn", type=int, default=0, help="busy processes beside the bench")
    ap.add_argument("--no-peaks", action="store_true", help="skip the peak-RSS children")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.repeats < 7 and not a.child:
        ap.error("--repeats must be at least 7: a median of fewer runs moves with the load")
    base = Path(tempfile.mkdtemp(prefix="ttp-bench-mw-", dir=a.dir))
    if a.child:
        try:
            peak_child(a.child, base, a.hidden, a.layers, a.vocab)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    methods = [m for m in METHODS if m == BASELINE or a.methods is None
               or any(k in m for k in a.methods)]
    states = megatron_states(a.hidden, a.layers, a.vocab, dp=4)
    nbytes = state_bytes(states)
    times: Dict[str, list] = {m: [] for m in methods}
    cpu: Dict[str, list] = {m: [] for m in methods}
    verify: Dict[str, list] = {m: [] for m in methods}
    phases: Dict[str, Dict[str, list]] = {m: {} for m in methods}
    sizes: Dict[str, int] = {}
    load_start = _loadavg()
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(a.burn)]
    for proc in burners:
        proc.start()
    try:
        for m in methods:  # warm-up: page cache, allocator
            write_all(m, base / "warm", states)
            shutil.rmtree(base / "warm")
        for r in range(a.repeats):
            for m in (methods if r % 2 == 0 else list(reversed(methods))):
                d = base / f"{r}-{m.replace(' ', '_').replace(',', '')}"
                c0, t0 = time.process_time(), time.perf_counter()
                written = write_all(m, d, states)
                times[m].append(time.perf_counter() - t0)
                cpu[m].append(time.process_time() - c0)
                sizes[m] = sum(f.stat().st_size for f in d.rglob("*.pt"))
                if m in WRITERS:
                    verify[m].append(verify_all(d, written))
                    for w in written.values():
                        for k, v in w.phases.items():  # type: ignore[attr-defined]
                            phases[m].setdefault(k, [0.0] * a.repeats)[r] += v
                shutil.rmtree(d)
    finally:
        for proc in burners:
            proc.kill()
            proc.join()
        shutil.rmtree(base, ignore_errors=True)
    load_end = _loadavg()
    peaks = {}
    for m in methods if not a.no_peaks else []:
        cmd = [sys.executable, __file__, "--child", m, "--hidden", str(a.hidden), "--layers",
               str(a.layers), "--vocab", str(a.vocab)] + (["--dir", str(a.dir)] if a.dir else [])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, check=True)
        peaks[m] = json.loads(done.stdout.strip().splitlines()[-1])
    med = {m: statistics.median(v) for m, v in times.items()}
    params = model_params(a.hidden, a.layers, a.vocab)
    where = a.dir if a.dir is not None else Path(tempfile.gettempdir())
    fs = subprocess.run(["df", "-T", str(where)], capture_output=True, text=True).stdout
    fs_type = fs.splitlines()[-1].split()[1] if fs.count("\n") >= 2 else "?"
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: GPT of {a.layers} layers, "
          f"hidden {a.hidden}, vocab {a.vocab} ({params / 1e6:.1f}M parameters), DP position 0 "
          f"of 4: state {nbytes / 2**20:.0f} MiB in 2 files ({MODEL_FILE}, {OPTIM_FILE}) on "
          f"{where} ({fs_type}); {a.repeats} interleaved repeats, median; {a.burn} busy "
          f"processes beside; /proc/loadavg {load_start} at the start, {load_end} at the end")
    print("| method | median s (min-max) | MiB/s | CPU s | vs baseline | per repeat (min-max) "
          "| verify s | peak extra RSS / state |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in methods:
        pairs = [b / w for b, w in zip(times[BASELINE], times[m])]
        peak = f"{peaks[m]['extra'] / peaks[m]['state']:.2f}" if m in peaks else "-"
        ver = f"{statistics.median(verify[m]):.3f}" if verify[m] else "-"
        print(f"| {m} | {med[m]:.3f} ({min(times[m]):.3f}-{max(times[m]):.3f}) | "
              f"{sizes[m] / 2**20 / med[m]:.0f} | {statistics.median(cpu[m]):.3f} | "
              f"{med[BASELINE] / med[m]:.0%} | {statistics.median(pairs):.0%} "
              f"({min(pairs):.0%}-{max(pairs):.0%}) | {ver} | {peak} |")
    print("writer phases, median s over repeats (both files): "
          + "; ".join(f"{m}: " + ", ".join(f"{k} {statistics.median(v):.3f}"
                                           for k, v in phases[m].items())
                      for m in methods if phases[m]))
    if a.json:
        a.json.write_text(json.dumps({"state_bytes": nbytes, "params": params, "dir": str(where),
                                      "fs": fs_type, "times": times, "cpu": cpu,
                                      "verify": verify, "phases": phases, "median": med,
                                      "peaks": peaks, "load": [load_start, load_end],
                                      "burn": a.burn}, indent=1))


if __name__ == "__main__":
    main()
