"""Shared fixtures of the runtime tests: a real controller on loopback."""

from __future__ import annotations

import pytest

from mindio_ttp.config import TTPConfig
from mindio_ttp.control.controller.server import Controller

from .fakes import KEY

ENV = {"TTP_AUTH_KEY": KEY.hex(), "TTP_HEARTBEAT_INTERVAL": "0.1", "TTP_HEARTBEAT_TIMEOUT": "0.8",
       "TTP_UPDATE_GRACE": "0.3", "TTP_COLLECT_TIMEOUT": "1", "TTP_SAVE_TIME_LIMIT": "1",
       "TTP_RENAME_TIME_LIMIT": "1", "TTP_OT": "20"}
DP = [0, 1, 2, 3]


@pytest.fixture
def ctl():
    """The primary controller of a 4-rank job (one DP group, replica 2), serving on loopback."""
    c = Controller(TTPConfig.from_env(ENV), 4, 2, host_rank=0)
    c.listen("127.0.0.1", 0)
    c.start()
    yield c
    c.stop()
