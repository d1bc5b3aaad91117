"""The argument check edit 3.3 runs in get_megatron_optimizer: what it refuses and what it names.

Pure (a Namespace stands in for Megatron's parsed args); the same check on real Megatron is
test_without_distributed_optimizer_fails_at_optimizer_build
(test_replicated_optimizer_megatron.py).
"""

from __future__ import annotations

from argparse import Namespace

import pytest

from mindio_ttp.megatron_ttp import check_args
from mindio_ttp.megatron_ttp.args_check import NEEDS_REPLICATED, NO_RANDOM_INIT


def _args(**over: object) -> Namespace:
    base = dict(use_distributed_optimizer=True, fp16=False, bf16=False,
                data_parallel_random_init=False)
    return Namespace(**{**base, **over})


@pytest.mark.parametrize(("fp16", "bf16", "kind"), [
    (False, False, "FP32Optimizer"),
    (True, False, "Float16OptimizerWithFloat16Params"),
    (False, True, "Float16OptimizerWithFloat16Params"),
])
def test_missing_flag_names_the_optimizer_megatron_would_build(fp16, bf16, kind) -> None:
    with pytest.raises(RuntimeError) as info:
        check_args(_args(use_distributed_optimizer=False, fp16=fp16, bf16=bf16))
    assert str(info.value) == NEEDS_REPLICATED.format(kind=kind)
    assert "Add --use-distributed-optimizer" in str(info.value)


def test_random_init_is_refused() -> None:
    with pytest.raises(RuntimeError, match="drop the flag") as info:
        check_args(_args(data_parallel_random_init=True))
    assert str(info.value) == NO_RANDOM_INIT


def test_supported_args_pass_and_old_trees_without_random_init_flag_too() -> None:
    check_args(_args())
    args = _args()
    del args.data_parallel_random_init  # Megatron versions without the flag
    check_args(args)
