"""The one checkpoint writer (mindio_ttp/faulttime/checkpoint_writer.py): digests, atomicity
under a kill or an exception, and the host memory a save stages."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import blake3
import pytest
import torch
import xxhash

from mindio_ttp.faulttime import checkpoint_writer, digest, manifest


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("algo", sorted(digest.ALGOS))
@pytest.mark.parametrize("helper", [False, True], ids=["inline", "helper"])
def test_digest_is_that_of_the_file_and_torch_load_reads_it(tmp_path: Path, algo: str,
                                                            helper: bool) -> None:
    """Large storages are written in chunks and hashed inline or on the helper thread, small
    records inline: either way the digest is that of the bytes on disk, in order (checked
    against the reference implementation: hashlib, or the package itself on a re-read)."""
    big = torch.arange(9 * 2**20, dtype=torch.float32)  # 36 MiB: three chunks of the big path
    state = {"big": big, "small": torch.ones(10), "mid": torch.randn(300_000),
             "nested": {"step": 7, "half": torch.randn(1000).half()}}
    path = tmp_path / "sub" / "x.pt"
    written = checkpoint_writer.write_torch(path, state, algo=algo, helper=helper)
    data = path.read_bytes()
    assert written.size == len(data)
    assert written.algo == algo
    reference = {"sha256": lambda b: hashlib.sha256(b).hexdigest(),
                 "xxh3_128": lambda b: xxhash.xxh3_128(b).hexdigest(),
                 "blake3": lambda b: blake3.blake3(b).hexdigest()}[algo]
    assert written.digest == reference(data) == digest.of_file(path, algo)
    assert written.entry() == {algo: written.digest, "size": len(data)}
    assert set(written.phases) == {"serialize", "write", "digest", "fsync", "rename"}
    assert sum(written.phases.values()) <= written.seconds + 1e-6
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["big"], big) and torch.equal(loaded["mid"], state["mid"])
    assert loaded["nested"]["step"] == 7
    assert torch.equal(loaded["nested"]["half"], state["nested"]["half"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.pt"]  # no .part left


def test_an_exception_mid_write_leaves_only_a_part_file_and_the_tracker(tmp_path: Path) -> None:
    manifest.write_tracker(tmp_path, 5)
    iter_dir = tmp_path / "iter_0000006"

    def die() -> None:
        raise Boom("half-way")

    with pytest.raises(Boom):
        checkpoint_writer.write_torch(iter_dir / "mp_rank_00" / "model_rng.pt",
                                      {"w": torch.randn(2**20)}, midway=die)
    assert [p.name for p in (iter_dir / "mp_rank_00").iterdir()] == ["model_rng.pt.part"]
    assert manifest.read_tracker(tmp_path) == (5, None)


def test_a_kill_mid_write_leaves_no_complete_looking_file_and_no_tracker_change(
        tmp_path: Path) -> None:
    """A real SIGKILL after the first bytes: the caller's next steps (manifest, tracker) never
    run, and what is on disk cannot be taken for a file."""
    manifest.write_tracker(tmp_path, 5)
    script = textwrap.dedent(f"""
        import os, signal, torch
        from pathlib import Path
        from mindio_ttp.faulttime import checkpoint_writer
        from mindio_ttp.faulttime import manifest
        root = Path({str(tmp_path)!r})
        kill = lambda: os.kill(os.getpid(), signal.SIGKILL)
        checkpoint_writer.write_torch(root / "iter_0000006/x/optim.pt",
                                      {{"a": torch.randn(2**21)}}, midway=kill)
        manifest.write_tracker(root, 6)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert [p.name for p in (tmp_path / "iter_0000006/x").iterdir()] == ["optim.pt.part"]
    part = tmp_path / "iter_0000006/x/optim.pt.part"
    assert part.stat().st_size < 4 * 2**21  # torn: the tensor was not all written
    assert manifest.read_tracker(tmp_path) == (6 - 1, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000006", "latest_checkpointed_iteration.txt"]


def test_write_bytes_replaces_atomically_and_leaves_no_part(tmp_path: Path) -> None:
    target = tmp_path / "m.json"
    checkpoint_writer.write_bytes(target, b'{"a": 1}')
    checkpoint_writer.write_bytes(target, b'{"a": 2}')
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_the_largest_buffer_staged_is_one_tensor_not_the_file(tmp_path: Path) -> None:
    """torch.save hands the writer each storage itself; nothing accumulates the file."""
    tensors = {f"t{i}": torch.randn(2**20 * (i + 1)) for i in range(4)}  # 4..16 MiB, 40 total
    path = tmp_path / "x.pt"
    with open(path, "wb") as f:
        writer = checkpoint_writer.HashingWriter(f)
        torch.save(tensors, writer)
        writer.abandon()
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    assert writer.max_write == largest
    assert writer.size > 2.4 * largest


_PEAK = textwrap.dedent("""
    import io, json, sys, torch
    from pathlib import Path
    from mindio_ttp.faulttime import checkpoint_writer

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    out, how = Path(sys.argv[1]), sys.argv[2]
    state = {"a": torch.randn(24 * 2**20), "b": torch.randn(8 * 2**20)}  # 128 MiB
    size = sum(t.numel() * 4 for t in state.values())
    before = hwm()
    if how == "writer":
        checkpoint_writer.write_torch(out, state)
    else:  # what Megatron's _save did before the writer
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        checkpoint_writer.write_bytes(out, data)
    print(json.dumps({"extra": hwm() - before, "size": size}))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_peak_host_memory_of_a_save_is_not_a_copy_of_the_file(tmp_path: Path) -> None:
    """Peak RSS above the state while saving 128 MiB: the writer adds almost nothing, the
    BytesIO path it replaced adds a file-sized copy (the check sees copies when there are)."""
    result = {}
    for how in ("writer", "bytesio"):
        done = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / f"{how}.pt"), how],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        result[how] = json.loads(done.stdout.strip().splitlines()[-1])
    size = result["writer"]["size"]
    assert result["writer"]["extra"] < 0.15 * size, result
    assert result["bytesio"]["extra"] > 0.9 * size, result


def test_the_digest_follows_the_manifests_mode(tmp_path: Path, monkeypatch) -> None:
    """Unkeyed: xxh3_128; TTP_CHECKPOINT_KEY set: blake3 (cryptographic); either on the
    helper thread only while a core is free, and a writer left to choose does so."""
    monkeypatch.delenv("TTP_CHECKPOINT_KEY", raising=False)
    assert checkpoint_writer.write_torch(tmp_path / "a.pt", {"x": torch.ones(3)}).algo == \
        "xxh3_128"
    monkeypatch.setenv("TTP_CHECKPOINT_KEY", "k")
    assert checkpoint_writer.write_torch(tmp_path / "b.pt", {"x": torch.ones(3)}).algo == \
        "blake3"
    cores = len(os.sched_getaffinity(0))
    for load, helper in ((cores - 1.5, True), (cores - 0.5, False), (3.0 * cores, False)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        for algo in ("xxh3_128", "blake3", "sha256"):
            assert checkpoint_writer.HashingWriter.helper_pays(algo) is helper, (algo, load)
            with open(tmp_path / f"{algo}-{load}", "wb") as f:
                w = checkpoint_writer.HashingWriter(f, algo=algo)
                assert (w._hasher is not None) is helper, (algo, load)
                w.abandon()


def test_a_missing_package_falls_back_to_sha256_saying_so_once(monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import fails
    monkeypatch.setattr(digest, "_said", set())
    with caplog.at_level("WARNING", logger="mindio_ttp.checkpoint"):
        assert digest.for_mode(keyed=False) == "sha256"
        assert digest.for_mode(keyed=False) == "sha256"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "pip install xxhash" in said[0]
    with pytest.raises(LookupError, match="pip install xxhash"):
        digest.new("xxh3_128")
