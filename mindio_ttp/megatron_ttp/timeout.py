"""The process-group timeout of a patched Megatron-LM 285068c (ttp-patch edit 6.2).

285068c hard-codes ``timeout=timedelta(minutes=10)`` in ``_initialize_distributed``
(``megatron/initialize.py:174-177``) and has no flag to change it, so a ``TTP_OT`` of 10 minutes
or more had the NCCL watchdog abort the survivors' communicators in the middle of the dying
save. The patched call asks here instead: Megatron's value, raised to what ``TTP_OT`` needs
(:func:`mindio_ttp.config.process_group_timeout_s`, the rule ttprun checks other trees by).
"""

from __future__ import annotations

import os
from datetime import timedelta

from mindio_ttp.config import (
    ENV_OT,
    PG_TIMEOUT_MARGIN_S,
    overtime_s,
    process_group_timeout_s,
)


def process_group_timeout(megatron_default: timedelta) -> timedelta:
    """``megatron_default``, or longer when TTP_OT needs it (said once, by rank 0)."""
    ot = overtime_s()
    default_s = megatron_default.total_seconds()
    seconds = process_group_timeout_s(ot, default_s)
    if seconds > default_s and os.environ.get("RANK", "0") == "0":
        print(f"mindio_ttp: process-group timeout {seconds:.0f} s ({ENV_OT}={ot:g} s + "
              f"{PG_TIMEOUT_MARGIN_S:.0f} s) instead of Megatron's {default_s:.0f} s, so that a "
              "collective hung on a lost rank outlasts the dying checkpoint", flush=True)
    return timedelta(seconds=seconds)
