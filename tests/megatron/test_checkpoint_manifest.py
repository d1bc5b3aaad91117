"""Checkpoint names, manifest merge and verification (mindio_ttp.faulttime.manifest), on
files written here: no Megatron needed. These are the rules mega.load_checkpoint uses to refuse
a half-written or damaged dying checkpoint. Every test that writes a manifest runs with each
digest a manifest may name (xxh3_128, blake3, and sha256 as older manifests have it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindio_ttp.faulttime import digest, manifest
from mindio_ttp.faulttime.manifest import ParallelLayout

TP2_DP2 = ParallelLayout(tp=2, pp=1, dp=2)


@pytest.fixture(params=sorted(digest.ALGOS))
def algo(request) -> str:
    return request.param


@pytest.fixture
def it7(tmp_path: Path) -> Path:
    """An empty directory named like Megatron's iteration 7 (verify checks the name's step)."""
    path = tmp_path / manifest.iter_dir_name(7)
    path.mkdir()
    return path


def write_checkpoint(iter_dir: Path, par: ParallelLayout, algo: str, ranks: int = 2) -> None:
    """Files for every expected name, listed round-robin in `ranks` part manifests."""
    parts: dict = {}
    for i, rel in enumerate(par.expected_files()):
        data = f"payload {rel}".encode()
        (iter_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (iter_dir / rel).write_bytes(data)
        parts.setdefault(i % ranks, {})[rel] = {algo: digest.of_bytes(algo, data),
                                                "size": len(data)}
    for rank, entries in parts.items():
        manifest.write_part(iter_dir, rank, entries)


def test_names_follow_megatron_distributed_optimizer_layout():
    assert TP2_DP2.expected_files() == [
        "mp_rank_00/model_rng.pt", "mp_rank_00_000/optim.pt", "mp_rank_00_001/optim.pt",
        "mp_rank_01/model_rng.pt", "mp_rank_01_000/optim.pt", "mp_rank_01_001/optim.pt"]
    assert ParallelLayout(1, 2, 1).optim_file(0, 1, 0) == "mp_rank_00_001_000/optim.pt"
    assert manifest.iter_dir_name(42) == "iter_0000042"


def test_merged_checkpoint_verifies_and_parts_are_gone(it7, algo):
    write_checkpoint(it7, TP2_DP2, algo)
    merged = manifest.merge_parts(it7, 7, TP2_DP2)
    assert merged["step"] == 7 and len(merged["files"]) == 6
    assert not list(it7.glob(f"{manifest.PART_PREFIX}*"))
    assert manifest.verify(it7, TP2_DP2) is None


def test_merge_refuses_when_a_shard_file_was_never_written(it7, algo):
    write_checkpoint(it7, TP2_DP2, algo)
    part = it7 / f"{manifest.PART_PREFIX}1.json"
    entries = json.loads(part.read_text())
    entries.pop("mp_rank_01_001/optim.pt", None) or entries.pop("mp_rank_00_001/optim.pt")
    part.write_text(json.dumps(entries))
    with pytest.raises(RuntimeError, match="incomplete: no rank wrote"):
        manifest.merge_parts(it7, 7, TP2_DP2)


def test_flipped_byte_fails_the_checksum(it7, algo):
    write_checkpoint(it7, TP2_DP2, algo)
    manifest.merge_parts(it7, 7, TP2_DP2)
    victim = it7 / "mp_rank_01_000/optim.pt"
    data = bytearray(victim.read_bytes())
    data[3] ^= 0x01
    victim.write_bytes(bytes(data))
    assert "fails its checksum" in manifest.verify(it7, TP2_DP2)
    # ranks split the hashing: one whose share excludes the file does not notice ...
    assert manifest.verify(it7, TP2_DP2, hash_files=["mp_rank_00/model_rng.pt"]) is None
    # ... but a missing file is seen by the rank that owns it
    victim.unlink()
    assert "missing" in manifest.verify(it7, TP2_DP2, hash_files=["mp_rank_01_000/optim.pt"])


def test_unfinished_and_mismatched_checkpoints_are_refused(it7, algo):
    write_checkpoint(it7, TP2_DP2, algo)
    assert "unfinished TTP checkpoint" in manifest.verify(it7, TP2_DP2)
    manifest.merge_parts(it7, 7, TP2_DP2)
    assert "written for layout" in manifest.verify(it7, ParallelLayout(1, 1, 4))
    assert "does not exist" in manifest.verify(it7 / "nope", TP2_DP2)


def test_stock_checkpoint_without_manifest_is_checked_for_presence(it7):
    for rel in TP2_DP2.expected_files():
        (it7 / rel).parent.mkdir(parents=True, exist_ok=True)
        (it7 / rel).write_bytes(b"x")
    assert manifest.verify(it7, TP2_DP2) is None
    (it7 / "mp_rank_00_001/optim.pt").unlink()
    assert "lacks mp_rank_00_001/optim.pt" in manifest.verify(it7, TP2_DP2)


def test_tracker_and_fallback_candidates(tmp_path):
    assert manifest.read_tracker(tmp_path)[0] is None
    for step in (3, 8, 12):
        (tmp_path / manifest.iter_dir_name(step)).mkdir()
    (tmp_path / ".ttp_tmp_iter_0000009").mkdir()  # never a candidate
    manifest.write_tracker(tmp_path, 8)
    assert manifest.read_tracker(tmp_path) == (8, None)
    assert manifest.candidate_steps(tmp_path, 8) == [8, 3]
    (tmp_path / manifest.TRACKER).write_text("release")
    assert manifest.read_tracker(tmp_path) == (None, f"{tmp_path / manifest.TRACKER} says release")


def test_merged_manifest_names_each_files_digest(it7, algo):
    write_checkpoint(it7, TP2_DP2, algo)
    merged = manifest.merge_parts(it7, 7, TP2_DP2)
    assert {manifest.entry_algo(e) for e in merged["files"].values()} == {algo}


def test_a_digest_this_environment_cannot_compute_is_a_refusal_naming_the_package(
        it7, monkeypatch):
    """A manifest written where xxhash was installed, read where it is not."""
    write_checkpoint(it7, TP2_DP2, digest.XXH3_128)
    manifest.merge_parts(it7, 7, TP2_DP2)
    monkeypatch.setitem(__import__("sys").modules, "xxhash", None)  # import fails
    assert not digest.available(digest.XXH3_128)
    assert "pip install xxhash" in manifest.verify(it7, TP2_DP2)
