"""Device bugs seen on CPU: every torch.distributed call of real Megatron workers, audited.

The workers run with dist_audit/sitecustomize.py (from outside the tree), which records each
collective's group, tensor devices and the phase it ran in. One job trains with a periodic
save, is SIGKILLed on rank 1 after the update of step 5 and before its param all-gather (so the
survivors are behind on the weights and the fault-time exchange runs), and a second job resumes
from the dying checkpoint. On NCCL/HCCL the asserted properties are what keeps the glue working:
Megatron's groups and backend on the training path, no collective in `state_dict`, device
tensors on the training and load paths, CPU tensors only on the fault-time gloo groups.
Needs TTP_MEGATRON_DIR.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import List

import pytest
from megatron_e2e import N_ITERS, run_job, tracker_step

from testkit.hooks import DIST_AUDIT_DIR, pythonpath

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

AUDIT_HOOK_DIR = DIST_AUDIT_DIR
FAULT_STEP = 5


def audited_env(audit_dir: Path) -> dict:
    audit_dir.mkdir(parents=True, exist_ok=True)
    return {"PYTHONPATH": pythonpath(DIST_AUDIT_DIR),
            "TTP_DIST_AUDIT_DIR": str(audit_dir)}


def records(audit_dir: Path) -> List[dict]:
    out = []
    for path in sorted(audit_dir.glob("rank-*.jsonl")):
        rank = int(path.name.split("-")[1])
        for line in path.read_text().splitlines():
            if line.strip():
                out.append({**json.loads(line), "rank": rank})
    return out


@pytest.fixture(scope="module")
def audited(patched_megatron_tree, tiny_dataset, tmp_path_factory):
    work = tmp_path_factory.mktemp("audit")
    ckpt = work / "ckpt"
    first = run_job(patched_megatron_tree, tiny_dataset, work / "killed.log", ckpt,
                    plan=f"1:{FAULT_STEP}:sigkill:after", save_interval=3,
                    env_extra=audited_env(work / "killed"))
    assert tracker_step(ckpt) == FAULT_STEP, first.tail()
    resumed = run_job(patched_megatron_tree, tiny_dataset, work / "resumed.log", ckpt,
                      env_extra=audited_env(work / "resumed"))
    assert resumed.returncode == 0, resumed.tail()
    assert sorted(resumed.losses) == list(range(FAULT_STEP + 1, N_ITERS + 1))
    return records(work / "killed"), records(work / "resumed")


def _training_groups(recs):
    """Groups the workers created: all must be on the job's backend (no `backend=`)."""
    return [r["group"] for r in recs if r["op"] == "new_group"]


def test_no_group_is_created_with_an_explicit_backend(audited):
    for recs in audited:
        groups = _training_groups(recs)
        assert groups, "the audit saw no new_group: it is not installed"
        explicit = [g for g in groups if g["backend"] is not None]
        assert not explicit, f"groups created with an explicit backend: {explicit[:4]}"


def test_training_path_uses_megatrons_groups_and_device_tensors(audited):
    for recs in audited:
        train = [r for r in recs if r["phase"] == "train" and r["op"] != "new_group"]
        ops = Counter(r["op"] for r in train)
        print(dict(ops))
        # stock reduce-scatter and all-gather, and the partner swap
        assert ops["_reduce_scatter_base"] and ops["_all_gather_base"], ops
        assert ops["batch_isend_irecv"], ops
        for r in train:
            group = r["group"]
            assert group == "default" or (isinstance(group, dict) and group["backend"] is None), r
            assert set(r["devices"]) <= {r["megatron_device"]}, r
        swaps = [r for r in train if r["op"] == "batch_isend_irecv"]
        assert all(len(r["group"]["ranks"]) == 2 for r in swaps), swaps[:2]
        assert all(r["devices"] for r in swaps)


def test_state_dict_issues_no_collective(audited):
    killed, _ = audited
    calls = [r for r in killed if r["op"] == "state_dict"]
    assert {r["rank"] for r in calls} == {0, 1, 2, 3}, "the periodic save at step 3 ran"
    inside = [r for r in killed if r["phase"] == "state_dict" and r["op"] != "state_dict"]
    assert not inside, inside[:4]


def test_load_collectives_are_on_megatrons_device(audited):
    _, resumed = audited
    load = [r for r in resumed if r["phase"] == "load"]
    assert any(r["op"] == "all_reduce" for r in load), "the checkpoint vote ran"
    for r in load:
        assert set(r["devices"]) <= {r["megatron_device"]}, r
        assert r["group"] == "default" or r["group"]["backend"] is None, r


def test_fault_time_exchange_uses_only_its_gloo_groups_with_cpu_tensors(audited):
    killed, _ = audited
    fault = [r for r in killed if r["phase"] == "fault-save"]
    savers = {r["rank"] for r in fault}
    assert savers and 1 not in savers, fault[:4]
    assert all(r["group"] == "fault-gloo" and r["op"].startswith("pg.") for r in fault), [
        r for r in fault if r["group"] != "fault-gloo"][:4]
    assert all(set(r["devices"]) <= {"cpu"} for r in fault)
    ops = Counter(r["op"] for r in fault)
    # rank 1 died before its gather: the writer's params are behind, so the other saver sends
    # its main params to the writer alone (a 2-rank group each), and the decision took no
    # collective at all (one flag on the save order's store)
    assert ops["pg.send"] and ops["pg.recv"], ops
    assert not ops["pg.allreduce"] and not ops["pg.allgather"], ops
    receivers = {r["rank"] for r in fault if r["op"] == "pg.recv"}
    senders = {r["rank"] for r in fault if r["op"] == "pg.send"}
    assert len(receivers) == 1 and not receivers & senders, (receivers, senders)
