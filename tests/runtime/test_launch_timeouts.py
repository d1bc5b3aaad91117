"""ttprun's process-group timeout check (mindio_ttp.launch.timeouts) on small fake trees shaped
like the three kinds of Megatron-LM it meets, and the runtime side the patched tree calls.
The real 285068c tree: tests/megatron/test_pg_timeout_megatron.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Optional

import pytest

from mindio_ttp.launch.timeouts import group_timeout, timeout_warning
from mindio_ttp.megatron_ttp import process_group_timeout

INIT_CALL = """
import torch
from datetime import timedelta

def _initialize_distributed():
    torch.distributed.init_process_group(
        backend=args.distributed_backend,
        world_size=args.world_size, rank=args.rank,
        timeout={timeout})
"""
ARGS_WITH_FLAG = """
def _add_distributed_args(parser):
    group = parser.add_argument_group(title='distributed')
    group.add_argument('--distributed-timeout-minutes', type=int, default=10,
                       help='Timeout minutes for torch.distributed.')
    return parser
"""
ARGS_WITHOUT_FLAG = "def _add_distributed_args(parser):\n    return parser\n"


def make_tree(root: Path, timeout: str, arguments: str = ARGS_WITHOUT_FLAG) -> str:
    (root / "megatron").mkdir(parents=True)
    (root / "megatron" / "initialize.py").write_text(INIT_CALL.format(timeout=timeout))
    (root / "megatron" / "arguments.py").write_text(arguments)
    (root / "pretrain_gpt.py").write_text("")
    return str(root / "pretrain_gpt.py")


def warn(script: str, ot: float, *args: str) -> Optional[str]:
    return timeout_warning(script, list(args), ot)


def test_285068c_hard_codes_ten_minutes_and_the_advice_is_ttp_patch(tmp_path: Path) -> None:
    script = make_tree(tmp_path, "timedelta(minutes=10)")
    assert warn(script, 300) is None  # 300 + 300 s margin fits in 600 s
    said = warn(script, 600)
    assert said is not None and "600 s, hard-coded in" in said and "TTP_OT (600 s)" in said
    assert "run `ttp-patch apply` on this tree" in said and "lower TTP_OT to at most 300 s" in said
    assert "--distributed-timeout-minutes" not in said  # 285068c would refuse the flag


def test_a_tree_patched_by_ttp_patch_follows_ttp_ot(tmp_path: Path) -> None:
    script = make_tree(tmp_path, "mega.process_group_timeout(timedelta(minutes=10))")
    found = group_timeout(script, [])
    assert found is not None and found.seconds is None
    assert warn(script, 3600) is None


def test_later_megatron_gets_the_flag_as_advice(tmp_path: Path) -> None:
    script = make_tree(tmp_path, "timedelta(minutes=args.distributed_timeout_minutes)",
                       ARGS_WITH_FLAG)
    said = warn(script, 600)
    assert said is not None and "Megatron's default --distributed-timeout-minutes (10)" in said
    assert "pass --distributed-timeout-minutes 15 or more" in said
    assert warn(script, 600, "--distributed-timeout-minutes", "15") is None
    said = warn(script, 600, "--distributed-timeout-minutes=12")
    assert said is not None and "720 s, --distributed-timeout-minutes 12" in said


def test_the_flag_given_to_a_megatron_without_it_is_called_out(tmp_path: Path) -> None:
    script = make_tree(tmp_path, "timedelta(minutes=10)")
    said = warn(script, 120, "--distributed-timeout-minutes", "30")
    assert said is not None and "not an argument of the Megatron-LM" in said
    assert "unrecognized arguments" in said


def test_nothing_is_said_where_the_tree_does_not_tell(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    assert warn(str(tmp_path / "train.py"), 3600) is None  # no Megatron beside it
    script = make_tree(tmp_path / "odd", "my_timeout()")
    assert warn(script, 3600) is None
    assert timeout_warning("some.module", [], 3600, is_module=True) is None


def test_the_patched_tree_gets_megatrons_timeout_or_what_ttp_ot_needs(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    ten = timedelta(minutes=10)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TTP_OT", "120")
    assert process_group_timeout(ten) == ten
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("TTP_OT", "900")
    assert process_group_timeout(ten) == timedelta(seconds=1200)
    assert "process-group timeout 1200 s (TTP_OT=900 s + 300 s)" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "3")
    assert process_group_timeout(ten) == timedelta(seconds=1200)
    assert capsys.readouterr().out == ""  # said once, by rank 0
    monkeypatch.setenv("TTP_OT", "soon")
    with pytest.raises(ValueError, match="TTP_OT='soon' is not a number"):
        process_group_timeout(ten)
