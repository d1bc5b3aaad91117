"""Hostile or broken checkpoint directories (mindio_ttp.faulttime.manifest), on small files
written here: every defect is a refusal with a reason, never an exception (a rank that raised
would leave the others waiting in the load's agreement collective), nothing outside the
iteration directory is opened, and a bad tracker is an error instead of Megatron's exit 0.
The manifest tests run with each digest a manifest may name (xxh3_128, blake3, sha256); with
`TTP_CHECKPOINT_KEY` set only the cryptographic ones are accepted."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mindio_ttp.faulttime import digest, manifest
from mindio_ttp.faulttime.manifest import ParallelLayout

DP2 = ParallelLayout(tp=1, pp=1, dp=2)


@pytest.fixture(params=sorted(digest.ALGOS), autouse=True)
def algo(request, monkeypatch) -> str:
    """The digest `written` lists files with (every test here runs with each)."""
    monkeypatch.setattr(f"{__name__}._ALGO", request.param)
    return request.param


_ALGO = digest.SHA256


def entry(data: bytes, algo: str = "") -> dict:
    algo = algo or _ALGO
    return {algo: digest.of_bytes(algo, data), "size": len(data)}


def written(tmp_path: Path, step: int = 5) -> Path:
    """A complete TTP checkpoint of `step` for DP2 (files, parts, merged manifest, marker)."""
    iter_dir = tmp_path / manifest.iter_dir_name(step)
    entries = {}
    for rel in DP2.expected_files():
        data = f"payload {rel}".encode()
        (iter_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (iter_dir / rel).write_bytes(data)
        entries[rel] = entry(data)
    manifest.write_part(iter_dir, 0, entries)
    manifest.merge_parts(iter_dir, step, DP2)
    assert manifest.verify(iter_dir, DP2) is None
    return iter_dir


def rewrite_manifest(iter_dir: Path, edit) -> None:
    path = iter_dir / manifest.MANIFEST
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def verify_within(iter_dir: Path, timeout_s: float = 20) -> str:
    """verify in a thread with a deadline: opening a FIFO planted by an attacker would block."""
    out: dict = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", manifest.verify(iter_dir, DP2)),
                              daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert not worker.is_alive(), "verify blocked: it opened something it should not have"
    return out["r"]


# -- tracker ------------------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"garbage", b"5.0", b"", b"-3", b"\xff\xfe", b"9" * 100])
def test_tracker_that_is_not_an_iteration_is_an_error_naming_the_file(tmp_path, content):
    (tmp_path / manifest.TRACKER).write_bytes(content)
    with pytest.raises(manifest.TrackerError, match=str(tmp_path / manifest.TRACKER)) as err:
        manifest.read_tracker(tmp_path)
    assert "remove it to start from scratch" in str(err.value)


def test_tracker_that_is_a_directory_or_links_to_dev_zero_is_an_error(tmp_path):
    (tmp_path / manifest.TRACKER).mkdir()
    with pytest.raises(manifest.TrackerError, match="not a regular file"):
        manifest.read_tracker(tmp_path)
    (tmp_path / manifest.TRACKER).rmdir()
    (tmp_path / manifest.TRACKER).symlink_to("/dev/zero")
    with pytest.raises(manifest.TrackerError):
        manifest.read_tracker(tmp_path)


def test_tracker_release_and_absent_are_not_errors(tmp_path):
    assert manifest.read_tracker(tmp_path)[0] is None
    (tmp_path / manifest.TRACKER).write_text("release\n")
    assert manifest.read_tracker(tmp_path)[0] is None
    (tmp_path / manifest.TRACKER).write_text(" 12\n")
    assert manifest.read_tracker(tmp_path) == (12, None)


# -- manifest schema ----------------------------------------------------------------------------
@pytest.mark.parametrize("text,reason", [
    ("[]", "a JSON list"),
    ('"files"', "a JSON str"),
    ("{not json", "not JSON"),
    ("[" * 200_000 + "]" * 200_000, "not JSON"),
])
def test_manifest_that_is_not_an_object_is_refused(tmp_path, text, reason):
    iter_dir = written(tmp_path)
    (iter_dir / manifest.MANIFEST).write_text(text)
    assert reason in verify_within(iter_dir)


def _without(entry: dict, key: str) -> dict:
    return {k: v for k, v in entry.items() if k != key}


@pytest.mark.parametrize("edit,reason", [
    (lambda m: {**m, "files": list(m["files"])}, "'files' is not an object"),
    (lambda m: {**m, "files": {k: _without(v, "size") for k, v in m["files"].items()}},
     "is not {<digest>"),
    (lambda m: {**m, "files": {k: {**v, "size": "12"} for k, v in m["files"].items()}},
     "is not {<digest>"),
    (lambda m: {**m, "files": {k: {**v, "size": True} for k, v in m["files"].items()}},
     "is not {<digest>"),
    # a digest nobody computes, two digests, a digest of the wrong length or case
    (lambda m: {**m, "files": {k: {"md5": "0" * 32, "size": v["size"]}
                               for k, v in m["files"].items()}}, "is not {<digest>"),
    (lambda m: {**m, "files": {k: {**v, "sha256": "0" * 64, "blake3": "0" * 64}
                               for k, v in m["files"].items()}}, "is not {<digest>"),
    (lambda m: {**m, "files": {k: {a: (h if a == "size" else h + "0")
                                   for a, h in v.items()} for k, v in m["files"].items()}},
     "is not {<digest>"),
    (lambda m: {**m, "files": {k: {a: (h if a == "size" else h.upper())
                                   for a, h in v.items()} for k, v in m["files"].items()}},
     "is not {<digest>"),
    (lambda m: {**m, "step": 4}, "names step 4"),
    (lambda m: {**m, "extra": 1}, "unexpected keys"),
    (lambda m: {**m, "format": "other/9"}, "unknown format"),
])
def test_malformed_manifest_fields_are_refused(tmp_path, edit, reason):
    iter_dir = written(tmp_path)
    rewrite_manifest(iter_dir, edit)
    assert reason in verify_within(iter_dir)


def test_oversized_manifest_is_refused_without_reading_it_all(tmp_path):
    iter_dir = written(tmp_path)
    with open(iter_dir / manifest.MANIFEST, "r+b") as f:
        f.truncate(manifest.MAX_MANIFEST_BYTES + 1)  # sparse: nothing is allocated
    assert "larger than" in verify_within(iter_dir)


@pytest.mark.parametrize("name", ["../../outside", "/etc/passwd", "mp_rank_00/../../../x"])
def test_manifest_entries_outside_the_iteration_are_refused_unopened(tmp_path, name):
    iter_dir = written(tmp_path)
    fifo = tmp_path / "outside"
    os.mkfifo(fifo)  # opening it for reading would block verify forever
    bogus = entry(b"")
    rewrite_manifest(iter_dir, lambda m: {**m, "files": {**m["files"], name: bogus}})
    assert "lists files this layout does not have" in verify_within(iter_dir)


def test_the_saved_steps_log_record_is_listed_verified_and_refused_when_altered(tmp_path):
    """The one optional file (log_record.py): listed, it is checked like every file; any other
    name is still refused."""
    iter_dir = written(tmp_path)
    data = b"a log record"
    (iter_dir / manifest.STEP_LOG).write_bytes(data)
    rewrite_manifest(iter_dir, lambda m: {**m, "files": {**m["files"],
                                                         manifest.STEP_LOG: entry(data)}})
    assert verify_within(iter_dir) is None
    assert manifest.listed(iter_dir, DP2, manifest.STEP_LOG) == entry(data)
    (iter_dir / manifest.STEP_LOG).write_bytes(b"a log recorD")
    assert "fails its checksum" in verify_within(iter_dir)
    other = {"ttp_other.pt": entry(data)}
    rewrite_manifest(iter_dir, lambda m: {**m, "files": {**m["files"], **other}})
    assert "lists files this layout does not have" in verify_within(iter_dir)


def _record(**edit) -> dict:
    import torch

    rec = {"iteration": 5, "loss_dict": {"lm loss": torch.tensor([6.1])},
           "total_loss_dict": {"lm loss": torch.tensor([0.0]), "advanced iterations": 1},
           "learning_rate": 7e-4, "loss_scale": torch.tensor(1.0), "skipped_iter": 0,
           "grad_norm": 1.5, "params_norm": None, "num_zeros_in_grad": None, "passed": False,
           "last_stage": True, "called": True}
    rec.update(edit)
    return rec


def test_a_valid_step_log_record_is_read_as_plain_numbers():
    from mindio_ttp.megatron_ttp import log_record

    rec = log_record.from_checkpoint(_record(), 5)
    assert rec["loss_dict"] == {"lm loss": pytest.approx(6.1)} and rec["loss_scale"] == 1.0


@pytest.mark.parametrize("edit, reason", [
    ({"iteration": 4}, "not of the step saved"),
    ({"called": False}, "not of the step saved"),
    ({"passed": 0}, "passed is not a bool"),
    ({"loss_dict": {"lm loss": "6.1"}}, "loss_dict['lm loss'] is not a number"),
    ({"loss_dict": {"lm loss": [1.0] * 3}}, "is not a number"),
    ({"learning_rate": None}, "learning_rate is not a number"),
    ({"grad_norm": True}, "grad_norm is not a number"),
    ({"skipped_iter": 0.0}, "skipped_iter is not an int"),
    ({"extra": 1}, "not a step log record"),
])
def test_a_step_log_record_with_a_wrong_field_is_refused_naming_it(edit, reason):
    from mindio_ttp.megatron_ttp import log_record

    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        log_record.from_checkpoint(_record(**edit), 5)


def test_a_tensor_of_many_elements_is_refused():
    import torch

    from mindio_ttp.megatron_ttp import log_record

    with pytest.raises(ValueError, match="tensor of 3 elements"):
        log_record.from_checkpoint(_record(loss_scale=torch.ones(3)), 5)


def test_listed_file_replaced_by_a_symlink_is_refused(tmp_path):
    iter_dir = written(tmp_path)
    victim = iter_dir / DP2.optim_file(0, 0, 1)
    outside = tmp_path / "same_bytes"
    outside.write_bytes(victim.read_bytes())  # same hash: only the link itself is wrong
    victim.unlink()
    victim.symlink_to(outside)
    assert "not a regular file" in verify_within(iter_dir)


def test_ttp_checkpoint_without_its_manifest_is_refused_not_taken_for_stock(tmp_path):
    iter_dir = written(tmp_path)
    (iter_dir / manifest.MANIFEST).unlink()
    assert "its ttp_manifest.json is gone" in verify_within(iter_dir)
    (iter_dir / manifest.MARKER).unlink()  # no trace of TTP left: a stock checkpoint
    assert verify_within(iter_dir) is None


# -- TTP_CHECKPOINT_KEY -------------------------------------------------------------------------
def test_keyed_manifest_refuses_a_rehashed_tampered_shard(tmp_path, monkeypatch, algo):
    if algo not in digest.CRYPTOGRAPHIC:
        pytest.skip("a keyed manifest lists only cryptographic digests (next test)")
    monkeypatch.setenv(manifest.CHECKPOINT_KEY_ENV, "s3cret")
    iter_dir = written(tmp_path)
    assert "mac" in json.loads((iter_dir / manifest.MANIFEST).read_text())
    victim = DP2.optim_file(0, 0, 0)
    forged = b"forged optimizer state"
    (iter_dir / victim).write_bytes(forged)

    def rehash(m):
        m["files"][victim] = entry(forged)
        return m

    rewrite_manifest(iter_dir, rehash)
    assert "MAC does not match" in verify_within(iter_dir)
    other = written(tmp_path / "b")  # intact, MACed with s3cret
    monkeypatch.setenv(manifest.CHECKPOINT_KEY_ENV, "another key")
    assert "MAC does not match" in verify_within(other)


def test_keyed_manifest_refuses_a_non_cryptographic_digest_even_with_a_valid_mac(
        tmp_path, monkeypatch):
    """Whoever can write the directory could make a second file with the same xxh3_128, so a
    signed manifest must not vouch for one, even MACed by the key's holder."""
    monkeypatch.setattr(f"{__name__}._ALGO", digest.XXH3_128)
    iter_dir = tmp_path / manifest.iter_dir_name(5)
    entries = {}
    for rel in DP2.expected_files():
        (iter_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (iter_dir / rel).write_bytes(rel.encode())
        entries[rel] = entry(rel.encode())
    manifest.write_part(iter_dir, 0, entries)
    monkeypatch.setenv(manifest.CHECKPOINT_KEY_ENV, "s3cret")
    merged = manifest.merge_parts(iter_dir, 5, DP2)
    assert merged["mac"] == manifest.manifest_mac(merged, b"s3cret")
    assert "xxh3_128 digest, which is not cryptographic" in verify_within(iter_dir)


def test_key_set_refuses_unkeyed_manifests_and_stock_checkpoints(tmp_path, monkeypatch):
    iter_dir = written(tmp_path)  # written without a key
    monkeypatch.setenv(manifest.CHECKPOINT_KEY_ENV, "s3cret")
    assert "MAC does not match" in verify_within(iter_dir)
    (iter_dir / manifest.MANIFEST).unlink()
    (iter_dir / manifest.MARKER).unlink()
    assert "only MACed checkpoints are accepted" in verify_within(iter_dir)


# -- fuzz ---------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=4),
    max_leaves=20)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.one_of(st.binary(max_size=300),
                         json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzzed_manifest_is_refused_never_raises(tmp_path, payload):
    iter_dir = tmp_path / manifest.iter_dir_name(5)
    if not iter_dir.exists():
        written(tmp_path)
    (iter_dir / manifest.MANIFEST).write_bytes(payload)
    reason = manifest.verify(iter_dir, DP2)
    assert isinstance(reason, str) and reason
