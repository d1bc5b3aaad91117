"""The codemods on our fixture files, in memory: byte goldens, fixed point, detection, anchors."""

from __future__ import annotations

import pytest
from conftest import TARGETS, fixture_files, golden

from patcher import launch_script
from patcher.edits import ALL_EDITS, State
from patcher.engine import assess_module, parse, plan_file
from patcher.errors import AnchorError, UnreadableTarget
from patcher.options import Device, Options

DEVICES = ["npu", "cuda", "cpu"]
FILES = fixture_files()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", TARGETS)
def test_output_is_byte_identical_to_golden(device: str, path: str) -> None:
    plan = plan_file(path, FILES[path], Options.build(device))
    assert plan.after == golden(device, path)


@pytest.mark.parametrize("device", DEVICES)
def test_launch_script_is_byte_identical_to_golden(device: str) -> None:
    example = FILES[launch_script.EXAMPLE]
    script = launch_script.build(example, Device(device), 8000)
    assert script == golden(device, launch_script.SCRIPT)


def _torchrun_shaped(example: bytes) -> bytes:
    """285068c's example rewritten the way Megatron's own example reads from 2023-02 on
    (`torchrun $DISTRIBUTED_ARGS pretrain_gpt.py $GPT_ARGS $DATA_ARGS`, flags in multi-line
    blocks, file names in variables): the same launch, so the same script must come out."""
    text = example.decode()
    head, launch = text.split("python -m torch.distributed.launch", 1)
    flags = [ln.strip().rstrip("\\").strip() for ln in launch.splitlines()[2:] if ln.strip()]
    flags = [f.replace("gpt2-vocab.json", "$VOCAB_FILE").replace("gpt2-merges.txt", "$MERGE_FILE")
             for f in flags]
    head = head.replace(
        'DISTRIBUTED_ARGS="--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank '
        '$NODE_RANK --master_addr $MASTER_ADDR --master_port $MASTER_PORT"',
        'VOCAB_FILE=gpt2-vocab.json\nMERGE_FILE=gpt2-merges.txt\n\nDISTRIBUTED_ARGS="\n'
        '    --nproc_per_node $GPUS_PER_NODE \\\n    --nnodes $NNODES \\\n'
        '    --node_rank $NODE_RANK \\\n    --master_addr $MASTER_ADDR \\\n'
        '    --master_port $MASTER_PORT\n"')
    assert "VOCAB_FILE=" in head
    half = len(flags) // 2
    blocks = "".join(
        f'{name}="\n' + " \\\n".join(f"    {f}" for f in part) + '\n"\n\n'
        for name, part in (("GPT_ARGS", flags[:half]), ("DATA_ARGS", flags[half:])))
    return (head + blocks + "torchrun $DISTRIBUTED_ARGS pretrain_gpt.py \\\n"
            "    $GPT_ARGS \\\n    $DATA_ARGS\n").encode()


@pytest.mark.parametrize("device", DEVICES)
def test_torchrun_shaped_example_gives_the_same_script(device: str) -> None:
    example = _torchrun_shaped(FILES[launch_script.EXAMPLE])
    assert b"torch.distributed.launch" not in example and b"$GPT_ARGS" in example
    script = launch_script.build(example, Device(device), 8000)
    assert script == golden(device, launch_script.SCRIPT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", TARGETS)
def test_second_pass_changes_nothing(device: str, path: str) -> None:
    patched = golden(device, path)
    plan = plan_file(path, patched, Options.build(device))
    assert plan.after == patched
    assert {r.state for _, r in plan.results} == {State.APPLIED}


@pytest.mark.parametrize("path", TARGETS)
def test_pristine_file_reads_as_all_missing_with_device_known(path: str) -> None:
    results = assess_module(path, parse(path, FILES[path]), Options.build("npu"))
    assert [r.state for _, r in results] == [State.MISSING] * len(results)


def test_every_seed_edit_has_a_stable_unique_id() -> None:
    numbers = [e.number for e in ALL_EDITS]
    assert numbers == [
        "0",
        "1",
        "2.1",
        "2.2",
        "2.3",
        "2.4",
        "2.5",
        "2.6",
        "2.7",
        "2.8",
        "2.9",
        "2.10",
        "2.11",
        "2.12",
        "2.13",
        "3.1",
        "3.2",
        "3.3",
        "4.1",
        "4.2",
        "4.3",
        "6.1",
        "6.2",
        "6.3",
    ]
    assert len({e.id for e in ALL_EDITS}) == 24


def test_only_the_port_literal_changes_with_port() -> None:
    path = "megatron/training.py"
    default = plan_file(path, FILES[path], Options.build("npu")).after
    other = plan_file(path, FILES[path], Options.build("npu", port=29123)).after
    assert default.replace(b"    port = 8000\n", b"    port = 29123\n") == other


def test_decoys_in_evaluate_and_nested_def_are_untouched() -> None:
    after = golden("npu", "megatron/training.py").decode()
    evaluate = after[after.index("def evaluate(") :]
    assert "ttp." not in evaluate
    nested = after[after.index("    def report(step):") : after.index("    while iteration")]
    assert "ttp." not in nested
    assert after.count("ttp.ttp_set_ckpt_args(") == 1
    assert after.count("# begin to init ttp processor & controller") == 1


def test_continuation_layout_of_opt_ty_is_kept() -> None:
    after = golden("npu", "megatron/optimizer/__init__.py").decode()
    assert (
        "        opt_ty = ReplicatedOptimizer \\\n"
        "            if args.use_distributed_optimizer else \\\n"
        "            Float16OptimizerWithFloat16Params\n"
    ) in after


OPTIMIZER_FACTORY_285068C = (  # the head of get_megatron_optimizer as 285068c spells it
    "def get_megatron_optimizer(model,\n"
    "                           no_weight_decay_cond=None,\n"
    "                           scale_lr_cond=None,\n"
    "                           lr_mult=1.0):\n"
    "    args = get_args()\n"
    "\n"
    "    # Base optimizer.\n"
)


def test_check_args_goes_first_in_the_optimizer_factory() -> None:
    path = "megatron/optimizer/__init__.py"
    text = FILES[path].decode()
    head = text[text.index("def get_megatron_optimizer(") : text.index("    optimizer = Adam")]
    after = plan_file(path, text.replace(head, OPTIMIZER_FACTORY_285068C).encode(),
                      Options.build("npu")).after.decode()
    assert (
        "                           lr_mult=1.0):\n"
        "    args = get_args()\n"
        "    # mindio_ttp needs --use-distributed-optimizer: say so now, not at train()\n"
        "    from mindio_ttp.megatron_ttp import check_args\n"
        "    check_args(args)\n"
        "\n"
        "    # Base optimizer.\n"
    ) in after


def test_a_guide_only_optimizer_file_misses_just_the_check() -> None:
    path = "megatron/optimizer/__init__.py"
    text = golden("npu", path).decode()
    check = ("    # mindio_ttp needs --use-distributed-optimizer: say so now, not at train()\n"
             "    from mindio_ttp.megatron_ttp import check_args\n"
             "    check_args(args)\n")
    assert text.count(check) == 1
    results = assess_module(path, parse(path, text.replace(check, "").encode()),
                            Options.build("npu"))
    states = {e.id: r.state for e, r in results}
    assert states == {"optimizer/import-replicated": State.APPLIED,
                      "optimizer/replicated-opt-ty": State.APPLIED,
                      "optimizer/check-args": State.MISSING}


def test_check_without_its_import_is_drift() -> None:
    path = "megatron/optimizer/__init__.py"
    text = golden("npu", path).decode()
    text = text.replace("    from mindio_ttp.megatron_ttp import check_args\n", "")
    with pytest.raises(AnchorError, match="optimizer/check-args"):
        plan_file(path, text.encode(), Options.build("npu"))


# For each edit: the fixture text that holds its anchor, and a change that removes the anchor.
BREAK_ANCHOR = {
    "pretrain/compat-import": ("import torch\nfrom functools", "import numpy\nfrom functools"),
    "pretrain/adaptor-import": ("import torch\nfrom functools", "import numpy\nfrom functools"),
    "training/import-ttp": (
        "from megatron.model.vision.knn_monitor import compute_feature_bank\n",
        "",
    ),
    "training/ttp-load-checkpoint": (
        "= load_checkpoint(model, optimizer, opt_param_scheduler)",
        "= load_checkpoint(model, optimizer)",
    ),
    "training/barrier-after-reduce": (
        "optimizer.reduce_model_grads(args, timers)",
        "optimizer.reduce_model_grads(args)",
    ),
    "training/start-updating-os": (
        "timers('optimizer', log_level=1).start(",
        "timers('optimizer', log_level=2).start(",
    ),
    "training/end-updating-os": (
        "num_zeros_in_grad = optimizer.step(args, timers)",
        "num_zeros_in_grad = optimizer.step(args)",
    ),
    "training/persist-train": ("def train(forward_step_func", "def train_model(forward_step_func"),
    "training/start-ttp": (
        "    # Tracking loss.\n    total_loss_dict = {}\n",
        "    # Tracking loss.\n    total_loss_dict = dict()\n",
    ),
    "training/set-ckpt-args": (
        "        iteration += 1\n        args.consumed",
        "        iteration = iteration + 1\n        args.consumed",
    ),
    "training/in-memory-recovery": ("def pretrain(train_valid", "def pretrain_model(train_valid"),
    "training/step-log": ("def training_log(loss_dict", "def log_training(loss_dict"),
    "training/step-losses": ("def train_step(forward_step_func", "def one_step(forward_step_func"),
    "training/final-checkpoint-saved": (
        "iteration != 0:\n        save_checkpoint(iteration, model,",
        "iteration != 0:\n        save_checkpoint_and_time(iteration, model,"),
    "training/reuse-model-on-recovery": ("def get_model(model_provider_func",
                                         "def build_model(model_provider_func"),
    "optimizer/import-replicated": (
        "from .optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer",
        "from .optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params",
    ),
    "optimizer/replicated-opt-ty": (
        "opt_ty = DistributedOptimizer \\",
        "opt_ty = SomeOptimizer \\",
    ),
    "optimizer/check-args": (
        "    args = get_args()\n    optimizer = Adam",
        "    args = megatron.get_args()\n    optimizer = Adam",
    ),
    "parallel-state/all-dp-ranks-var": (
        "_GLOBAL_MEMORY_BUFFER = None",
        "_GLOBAL_MEMORY_BUFFER = {}",
    ),
    "parallel-state/global-all-dp-ranks": ("    global _DATA_PARALLEL_GLOBAL_RANKS\n", ""),
    "parallel-state/dp-rank-getters": (
        "def model_parallel_is_initialized():",
        "def model_parallel_ready():",
    ),
    "initialize/import-ttp": ("from datetime import timedelta\n", "import datetime\n"),
    "initialize/pg-timeout": (
        "        timeout=timedelta(minutes=10))\n\n\ndef _decoy",
        "        timeout=my_timeout())\n\n\ndef _decoy",
    ),
    "initialize/pg-store": (
        "    # Call the init process\n    torch.distributed.init_process_group(",
        "    # Call the init process\n    torch.distributed.initialize_process_group(",
    ),
}


@pytest.mark.parametrize("edit", ALL_EDITS, ids=lambda e: e.id)
def test_missing_anchor_is_refused_naming_edit_file_function_anchor(edit) -> None:
    old, new = BREAK_ANCHOR[edit.id]
    text = FILES[edit.file].decode()
    assert text.count(old) == 1, "the break must hit exactly the anchor"
    broken = text.replace(old, new).encode()
    with pytest.raises(AnchorError) as info:
        plan_file(edit.file, broken, Options.build("npu"))
    msg = info.value.message
    assert edit.id in msg and edit.file in msg and edit.anchor_text() in msg
    assert (f"function {edit.scope}()" if edit.scope else "module level") in msg


def test_duplicated_anchor_is_refused() -> None:
    path = "megatron/training.py"
    line = "    optimizer.reduce_model_grads(args, timers)\n"
    text = FILES[path].decode().replace(line, line + line)
    with pytest.raises(AnchorError, match="found 2 times"):
        plan_file(path, text.encode(), Options.build("npu"))


HAND_MADE = {  # the guide's edits typed by hand: other spacing, no comments, another port
    "megatron/training.py": [
        (
            "    optimizer.reduce_model_grads(args, timers)\n",
            "    optimizer.reduce_model_grads(args, timers)\n    torch.distributed.barrier( )\n",
        ),
        ("    # begin to init ttp processor & controller\n", ""),
        ("    port = 8000\n", "    port = 9100\n"),
        ("len(dp_ranks)//2", "len(dp_ranks) // 2"),
    ],
}


def test_edits_made_by_hand_following_the_guide_are_detected() -> None:
    path = "megatron/training.py"
    text = golden("npu", path).decode()
    text = text.replace("    # all rank need to barrier\n    torch.distributed.barrier()\n", "")
    for old, new in HAND_MADE[path]:
        assert old in text
        text = text.replace(old, new)
    results = assess_module(path, parse(path, text.encode()), Options(device=None, port=None))
    assert {e.id: r.state for e, r in results} == {e.id: State.APPLIED for e, _ in results}


def test_half_present_insertion_is_drift_not_missing() -> None:
    path = "megatron/training.py"
    text = golden("npu", path).decode().replace("    ttp.ttp_start_processor(masterIp, port)\n", "")
    results = dict(
        (e.id, r) for e, r in assess_module(path, parse(path, text.encode()), Options.build("npu"))
    )
    assert results["training/start-ttp"].state is State.DRIFTED
    assert results["training/set-ckpt-args"].state is State.APPLIED
    with pytest.raises(AnchorError, match="training/start-ttp"):
        plan_file(path, text.encode(), Options.build("npu"))


def _pretrain_states(text: bytes, opts: Options):
    path = "pretrain_gpt.py"
    return {e.id: r for e, r in assess_module(path, parse(path, text), opts)}


def test_device_is_read_back_from_pretrain_gpt() -> None:
    path = "pretrain_gpt.py"
    for device in ("npu", "cpu"):
        results = _pretrain_states(golden(device, path), Options(None, None))
        assert results["pretrain/compat-import"].state is State.APPLIED
        assert results["pretrain/adaptor-import"].state is State.APPLIED
        assert results["pretrain/adaptor-import"].inferred["device"] is Device(device)
    npu_file = golden("npu", path)
    cpu_opts = Options.build("cpu")
    assert _pretrain_states(npu_file, cpu_opts)["pretrain/adaptor-import"].state is State.DRIFTED


def test_a_tree_patched_by_the_guide_alone_gets_compat_before_the_adaptor() -> None:
    """`import torch; import megatron_npu` (the guide's edit 1 by hand, or an older ttp-patch):
    the compatibility import goes between them, since megatron_npu imports Megatron modules."""
    path = "pretrain_gpt.py"
    guide_only = golden("npu", path).replace(b"import mindio_ttp.compat\n", b"")
    states = _pretrain_states(guide_only, Options.build("npu"))
    assert states["pretrain/compat-import"].state is State.MISSING
    assert states["pretrain/adaptor-import"].state is State.APPLIED
    assert plan_file(path, guide_only, Options.build("npu")).after == golden("npu", path)


def test_compat_import_after_megatron_is_drift() -> None:
    path = "pretrain_gpt.py"
    late = golden("cuda", path).replace(b"import mindio_ttp.compat\n", b"").replace(
        b"from megatron.training import pretrain\n",
        b"from megatron.training import pretrain\nimport mindio_ttp.compat\n")
    states = _pretrain_states(late, Options.build("cuda"))
    assert states["pretrain/compat-import"].state is State.DRIFTED
    assert "not right after `import torch`" in states["pretrain/compat-import"].detail
    with pytest.raises(AnchorError, match="pretrain/compat-import"):
        plan_file(path, late, Options.build("cuda"))


def test_only_the_timeout_and_store_of_initialize_distributed_change() -> None:
    path = "megatron/initialize.py"
    before, after = FILES[path].decode(), golden("npu", path).decode()
    assert after.count("mega.process_group_timeout(timedelta(minutes=10))") == 1
    assert after.count("timeout=timedelta(minutes=10))") == 1  # the decoy's
    assert after.index("mega.process_group_timeout") < after.index("def _decoy")
    assert after.count("store=mega.process_group_store())") == 1
    assert after.index("store=mega.process_group_store())") < after.index("def _decoy")
    assert len(after.splitlines()) == len(before.splitlines()) + 2  # the import, the store


def test_a_later_megatrons_timeout_flag_is_wrapped_too() -> None:
    """Megatron-LM from 2023-03 reads --distributed-timeout-minutes: under --allow-modified the
    flag's value stays the floor the runtime raises to what TTP_OT needs."""
    path = "megatron/initialize.py"
    later = FILES[path].replace(b"timeout=timedelta(minutes=10))\n\n\ndef _decoy",
                                b"timeout=timedelta(minutes=args.distributed_timeout_minutes))"
                                b"\n\n\ndef _decoy")
    after = plan_file(path, later, Options.build("cuda")).after.decode()
    assert "mega.process_group_timeout(timedelta(minutes=args.distributed_timeout_minutes))" \
        in after


def test_crlf_is_refused_with_a_way_out() -> None:
    data = FILES["pretrain_gpt.py"].replace(b"\n", b"\r\n")
    with pytest.raises(UnreadableTarget, match="CR/CRLF") as info:
        plan_file("pretrain_gpt.py", data, Options.build("npu"))
    assert "autocrlf" in (info.value.hint or "")


def test_non_utf8_is_refused() -> None:
    data = FILES["pretrain_gpt.py"].replace(b"toy GPT", b"toy \xff GPT")
    with pytest.raises(UnreadableTarget, match="not UTF-8"):
        plan_file("pretrain_gpt.py", data, Options.build("npu"))


def test_unparseable_file_is_refused_with_its_position() -> None:
    data = FILES["pretrain_gpt.py"].replace(b"def model_provider(", b"def model_provider((")
    with pytest.raises(UnreadableTarget, match=r"pretrain_gpt.py:\d+:\d+: cannot parse"):
        plan_file("pretrain_gpt.py", data, Options.build("npu"))
