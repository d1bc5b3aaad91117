"""The demo's pieces on their own (checkpoint format, fault plans, training math) and the whole
`ttp-demo` command end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mindio_ttp.demo import checkpoint
from mindio_ttp.demo.checkpoint import CheckpointError
from mindio_ttp.demo.faults import Fault, FaultPlan, InjectedFault, Phase
from mindio_ttp.demo.model import ShardLayout, ShardState, emulate

LAYOUT = ShardLayout.for_world(4)


def _shards_at(step: int) -> list[ShardState]:
    """Shard states holding the emulated run's state at ``step``."""
    full = emulate(LAYOUT, step)
    shards = []
    for s in range(LAYOUT.replica):
        st = ShardState.fresh(LAYOUT, s)
        with torch.no_grad():
            st.params.copy_(full.params)
        st.exp_avg.copy_(full.exp_avg[s])
        st.exp_avg_sq.copy_(full.exp_avg_sq[s])
        st.step = step
        shards.append(st)
    return shards


def _save_all(root: Path, step: int) -> None:
    for rank, st in enumerate(_shards_at(step)):
        checkpoint.save_shard(root, step, rank, st)


# -- checkpoint -------------------------------------------------------------------------------
def test_saved_and_finalized_checkpoint_round_trips_bit_exact(tmp_path: Path) -> None:
    _save_all(tmp_path, 3)
    assert checkpoint.latest_step(tmp_path) is None, "nothing is latest before the rename"
    final = checkpoint.finalize(tmp_path, 3, LAYOUT)
    assert final.name == "step_0000003"
    loaded = checkpoint.load(tmp_path, LAYOUT)
    assert loaded is not None and loaded.state.differences(emulate(LAYOUT, 3)) == []
    assert loaded.ranks == [0, 1]
    assert sorted(os.listdir(final)) == ["manifest.json", "shard_0.pt", "shard_1.pt"]


def test_shard_file_holds_only_its_slice_of_the_parameters(tmp_path: Path) -> None:
    """The params are saved without a copy, yet not as a view of the whole flat vector."""
    layout = ShardLayout(4, 2, 2**20, 2**20)
    st = ShardState(layout, 1, torch.randn(2**20), torch.randn(2**19), torch.randn(2**19), 5)
    entry = checkpoint.save_shard(tmp_path, 5, 2, st)
    assert entry["bytes"] < 4 * (3 * 2**19) + 64 * 1024  # a whole-vector save is 4 MiB more
    part = torch.load(tmp_path / "step_0000005.tmp" / "shard_1.pt", weights_only=True)
    assert torch.equal(part["params"], st.params[2**19:]) and part["params"].numel() == 2**19


def test_finalize_refuses_an_existing_step_instead_of_adding_a_second(tmp_path: Path) -> None:
    _save_all(tmp_path, 2)
    first = checkpoint.finalize(tmp_path, 2, LAYOUT)
    before = sorted(os.listdir(first))
    _save_all(tmp_path, 2)
    with pytest.raises(CheckpointError, match="already exists"):
        checkpoint.finalize(tmp_path, 2, LAYOUT)
    assert sorted(p.name for p in tmp_path.glob("step_*") if p.is_dir()) == [
        "step_0000002", "step_0000002.tmp"]
    assert sorted(os.listdir(first)) == before
    assert checkpoint.load(tmp_path, LAYOUT).path == first


def test_finalize_refuses_a_missing_shard(tmp_path: Path) -> None:
    checkpoint.save_shard(tmp_path, 3, 0, _shards_at(3)[0])
    with pytest.raises(CheckpointError, match="shard 1 was not saved"):
        checkpoint.finalize(tmp_path, 3, LAYOUT)
    assert checkpoint.latest_step(tmp_path) is None


def test_finalize_refuses_a_shard_that_changed_after_its_save(tmp_path: Path) -> None:
    _save_all(tmp_path, 3)
    (tmp_path / "step_0000003.tmp" / "shard_1.pt").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match="does not match its manifest entry"):
        checkpoint.finalize(tmp_path, 3, LAYOUT)


def test_save_refuses_a_shard_at_another_step(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="its shard 0 is at step 3"):
        checkpoint.save_shard(tmp_path, 4, 0, _shards_at(3)[0])


def test_a_rank_dying_mid_write_leaves_only_a_part_file(tmp_path: Path) -> None:
    def die() -> None:
        raise InjectedFault("simulated death half-way")

    with pytest.raises(InjectedFault):
        checkpoint.save_shard(tmp_path, 3, 1, _shards_at(3)[1], midway=die)
    names = sorted(os.listdir(tmp_path / "step_0000003.tmp"))
    assert names == ["shard_1.pt.part"]


def test_loader_refuses_corrupt_and_incomplete_checkpoints(tmp_path: Path) -> None:
    _save_all(tmp_path, 3)
    final = checkpoint.finalize(tmp_path, 3, LAYOUT)
    good = (final / "shard_0.pt").read_bytes()
    (final / "shard_0.pt").write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="shard_0.pt is corrupt"):
        checkpoint.load(tmp_path, LAYOUT)
    (final / "shard_0.pt").unlink()
    with pytest.raises(CheckpointError, match="shard_0.pt is missing"):
        checkpoint.load(tmp_path, LAYOUT)
    (final / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        checkpoint.load(tmp_path, LAYOUT)
    (tmp_path / "latest").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        checkpoint.load(tmp_path, LAYOUT)


def test_loader_refuses_another_layout(tmp_path: Path) -> None:
    _save_all(tmp_path, 1)
    checkpoint.finalize(tmp_path, 1, LAYOUT)
    with pytest.raises(CheckpointError, match="relaunch with the same layout"):
        checkpoint.load(tmp_path, ShardLayout.for_world(8))


def test_no_latest_marker_means_no_checkpoint(tmp_path: Path) -> None:
    assert checkpoint.load(tmp_path, LAYOUT) is None


# -- fault plans and math -------------------------------------------------------------------
def test_fault_plan_text_round_trip_and_errors() -> None:
    plan = FaultPlan().fail_at(1, 5, Fault.SIGKILL, Phase.INSIDE).fail_at(3, 4, "exception", "save")
    assert FaultPlan.from_text(plan.to_text()).faults == plan.faults
    assert plan.to_text() == "3:4:exception:save,1:5:sigkill:inside"
    with pytest.raises(ValueError, match="expected rank:step:fault:phase"):
        FaultPlan.from_text("1:5:sigkill")
    with pytest.raises(ValueError, match="'segfault' is not a valid Fault"):
        FaultPlan.from_text("1:5:segfault:inside")
    with pytest.raises(ValueError, match="two faults registered"):
        plan.fail_at(1, 5, Fault.SIGSTOP, Phase.INSIDE)


def test_fault_plan_fires_only_at_its_key(tmp_path: Path) -> None:
    plan = FaultPlan().fail_at(2, 3, Fault.EXCEPTION, Phase.AFTER)
    plan.check(2, 3, Phase.BEFORE, tmp_path)
    plan.check(1, 3, Phase.AFTER, tmp_path)
    with pytest.raises(InjectedFault, match="rank 2 after the update of step 3"):
        plan.check(2, 3, Phase.AFTER, tmp_path)
    assert json.loads((tmp_path / "fault-2.json").read_text())["step"] == 3


def test_emulated_resume_is_bit_exact() -> None:
    assert emulate(LAYOUT, 6, start=emulate(LAYOUT, 2)).differences(emulate(LAYOUT, 6)) == []
    assert emulate(LAYOUT, 6).differences(emulate(LAYOUT, 5)) != []


def test_layout_refuses_uneven_shards() -> None:
    with pytest.raises(ValueError, match="divisible by the shard count"):
        ShardLayout.for_world(6, replica=4)


# -- the command ----------------------------------------------------------------------------
def test_demo_usage_error_exits_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mindio_ttp.demo", "--kill-step", "9", "--steps", "8"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--kill-step 9 must be within 1..--steps (8)" in done.stderr


@pytest.mark.slow
@pytest.mark.smoke
def test_demo_recovers_in_memory_by_default_bit_exact(tmp_path: Path) -> None:
    """README's first command shows the product's default: the killed rank is replaced and
    refilled from its partner, the job trains on to the end, and equals an uninterrupted run."""
    done = subprocess.run(
        [sys.executable, "-m", "mindio_ttp.demo", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, COLUMNS="1000"),  # whole lines, to match them
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "TTP_RECOVERY=in-memory" in out.splitlines()[0], out
    assert ("ttprun exited 0 after" in out and
            "recovered in memory: recovery 1 at step 5 replaced rank(s) [1]" in out), out
    assert "RESULT: MATCH - recovered in memory at step 5 (rank(s) [1] replaced" in out, out
    assert not (tmp_path / "faulty" / "ckpt" / "step_0000005").exists()  # nothing saved


def test_demo_recovery_option_defaults_to_the_products_default() -> None:
    from mindio_ttp.config import BY_NAME, ENV_RECOVERY
    from mindio_ttp.demo.cli import build_parser

    assert build_parser().parse_args([]).recovery == BY_NAME[ENV_RECOVERY].value == "in-memory"
    text = build_parser().format_help()
    assert "--recovery {in-memory,dying-checkpoint}" in text and "five target files" in text


@pytest.mark.slow
def test_demo_command_resumes_bit_exact(tmp_path: Path) -> None:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mindio_ttp.demo", "--workdir", str(tmp_path),
         "--recovery", "dying-checkpoint"],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, COLUMNS="1000"),  # whole lines, to match them
    )  # fmt: skip
    elapsed = time.monotonic() - start
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    savers = re.search(r"dying checkpoint: step 5, written by ranks \[(\d), (\d)\]", out)
    assert savers, out
    ranks = {int(r) for r in savers.groups()}
    assert 1 not in ranks and {r % 2 for r in ranks} == {0, 1}, "one clean holder per shard"
    assert "RESULT: MATCH" in out
    assert (tmp_path / "faulty" / "ckpt" / "step_0000005" / "manifest.json").is_file()
    print(f"ttp-demo took {elapsed:.1f} s")


@pytest.mark.slow
def test_demo_says_why_exit_1_and_what_it_removes(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mindio_ttp.demo", "--recovery", "dying-checkpoint"],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, TMPDIR=str(tmp_path), COLUMNS="1000"),  # whole lines
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "ttprun exited 1" in out and "exit 1 is expected: a rank was killed" in out, out
    removed = re.search(r"removing (\S+) \(checkpoints and logs of this demo\)", out)
    assert removed, out
    assert Path(removed.group(1)).parent == tmp_path and not Path(removed.group(1)).exists()


# -- ttp-demo --megatron: input it refuses before writing anything ----------------------------
def test_the_cli_checks_ranks_against_both_jobs_world() -> None:
    from mindio_ttp.demo import cli, megatron, runner

    assert cli.WORLD == runner.WORLD == megatron.WORLD


def _fake_megatron(root: Path, *, git: bool = True) -> Path:
    """Shaped like a Megatron-LM checkout (pretrain_gpt.py, megatron/) but not at 285068c."""
    (root / "megatron").mkdir(parents=True)
    (root / "pretrain_gpt.py").write_text("print('not megatron')\n")
    (root / "megatron" / "__init__.py").write_text("")
    if git:
        for cmd in (["init", "-q"], ["add", "-A"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"]):
            subprocess.run(["git", "-C", str(root), *cmd], check=True, capture_output=True)
    return root


def _demo_refuses(tmp_path: Path, *args: str) -> str:
    """Run `ttp-demo ARGS`; it must exit 2 and write nothing (TMPDIR stays empty)."""
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "mindio_ttp.demo", *args], capture_output=True, text=True,
        timeout=60, env=dict(os.environ, TMPDIR=str(scratch)),
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "", "nothing may start before the input is checked"
    assert list(scratch.iterdir()) == []
    return done.stderr


def test_megatron_dir_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    err = _demo_refuses(tmp_path, "--megatron", str(tmp_path / "nowhere"))
    assert f"--megatron {tmp_path / 'nowhere'}: no such directory" in err


def test_megatron_dir_without_pretrain_gpt_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    err = _demo_refuses(tmp_path, "--megatron", str(tmp_path / "src"))
    assert "not a Megatron-LM checkout (no pretrain_gpt.py and megatron/ in it)" in err


def test_megatron_dir_that_is_not_a_git_checkout_is_refused(tmp_path: Path) -> None:
    src = _fake_megatron(tmp_path / "src", git=False)
    err = _demo_refuses(tmp_path, "--megatron", str(src))
    assert "not a git checkout" in err
    assert "checkout 285068c8108e0e8e6538f54fe27c3ee86c5217a2" in err


def test_megatron_dir_inside_another_git_checkout_is_not_taken_for_it(tmp_path: Path) -> None:
    outer = _fake_megatron(tmp_path / "outer")
    src = _fake_megatron(outer / "vendored" / "Megatron-LM", git=False)
    assert "not a git checkout" in _demo_refuses(tmp_path, "--megatron", str(src))


def test_a_tree_ttp_patch_refuses_is_refused_with_its_words_and_left_alone(
    tmp_path: Path,
) -> None:
    """The demo takes every tree ttp-patch takes (any commit: ttp-patch decides, on a copy),
    and refuses the others with ttp-patch's own message, exit 2, nothing left behind."""
    src = _fake_megatron(tmp_path / "src")
    (src / "pretrain_gpt.py").write_text("print('changed, not committed')\n")
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-m", "mindio_ttp.demo", "--megatron", str(src)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TMPDIR=str(scratch)))
    assert done.returncode == 2, done.stdout + done.stderr
    out = " ".join(done.stdout.split())  # lines are wrapped at the terminal's width
    assert "has uncommitted changes; the copy takes them too" in out
    assert "ttp-patch apply --device cpu ..." in out
    assert "ttp-patch: error: megatron/training.py is missing from the work tree" in out
    assert "RESULT: REFUSED - ttp-patch does not patch this tree" in out
    assert list(scratch.iterdir()) == []
    status = subprocess.run(["git", "-C", str(src), "status", "--porcelain"],
                            capture_output=True, text=True, check=True).stdout
    assert status == " M pretrain_gpt.py\n", "the user's checkout must not be touched"
    done = subprocess.run([sys.executable, "-m", "mindio_ttp.demo", "--allow-modified"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--allow-modified is for --megatron DIR" in done.stderr


def test_long_lines_wrap_on_word_boundaries() -> None:
    from mindio_ttp.demo.wrap import wrap

    line = ("    | ttprun: dying checkpoint of iteration 30 saved in "
            "/a/rather/long/path/to/the/checkpoints/of/this/job/iter_0000030 and marked latest "
            "(exit 83 on the ranks that took part, not failures)")
    out = wrap(line, 72).splitlines()
    assert len(out) > 1 and all(ln.startswith("    | ") for ln in out)
    assert " ".join(ln[6:].strip() for ln in out) == line[6:]  # nothing cut, no word split
    assert all(len(ln) <= 72 or " " not in ln.strip() for ln in out)
    assert wrap("short", 72) == "short"


@pytest.mark.parametrize("args, message", [
    (["--phase", "before"], "--phase needs the toy job's in-step hooks"),
    (["--fault", "exception"], "--fault exception needs the toy job's hooks"),
    (["--kill-step", "10", "--steps", "10"], "--kill-step 10 must be within 1..--steps - 1 (9)"),
])  # fmt: skip
def test_megatron_options_the_real_job_cannot_honour_are_refused(tmp_path, args, message):
    src = _fake_megatron(tmp_path / "src")
    assert message in _demo_refuses(tmp_path, "--megatron", str(src), *args)


def test_keep_dir_that_is_not_empty_is_refused(tmp_path: Path) -> None:
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "mine.txt").write_text("the user's")
    err = _demo_refuses(tmp_path, "--keep", str(keep))
    assert f"--keep {keep}: exists and is not an empty directory" in err
    assert sorted(p.name for p in keep.iterdir()) == ["mine.txt"]
