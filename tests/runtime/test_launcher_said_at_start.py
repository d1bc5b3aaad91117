"""What a user loses is said at start, not at the fault: a launcher other than ttprun (no grace
period, no in-memory recovery), --save without --load (no resume, no in-memory recovery)."""

from __future__ import annotations

import secrets

import pytest

import mindio_ttp.framework_ttp as ttp
from mindio_ttp import config
from mindio_ttp.launch import preflight

pytestmark = pytest.mark.smoke  # `pytest -m smoke`: README's quick check


@pytest.mark.parametrize("replacements", [None, "cold"])
def test_a_launcher_other_than_ttprun_is_named_at_start(monkeypatch, capfd, free_port,
                                                        replacements) -> None:
    monkeypatch.setenv(config.ENV_AUTH_KEY, secrets.token_hex(32))
    monkeypatch.setenv(config.ENV_CONTROLLER_PORT, str(free_port))
    monkeypatch.delenv(config.ENV_RUN_DIR, raising=False)
    if replacements is None:
        monkeypatch.delenv(config.ENV_REPLACEMENTS, raising=False)  # torchrun, srun, ...
    else:
        monkeypatch.setenv(config.ENV_REPLACEMENTS, replacements)  # what ttprun sets
    try:
        ttp.ttp_init_controller(0, 2, 1, False)
        ttp.ttp_start_controller("127.0.0.1", free_port)
        ttp.ttp_init_processor(0, [0, 1], 2, 2, 1, False)
        ttp.ttp_start_processor("127.0.0.1", free_port)
    finally:
        ttp.ttp_shutdown()
    err = capfd.readouterr().err  # the runtime logs to stderr, its own handler
    said = [line for line in err.splitlines() if "not launched by ttprun" in line]
    if replacements is None:
        assert len(said) == 1 and said[0].endswith(f"WARNING mindio_ttp: {ttp.NOT_TTPRUN}"), err
        assert "TTP_OT grace period" in said[0] and "in-memory recovery" in said[0]
    else:
        assert said == [], err


@pytest.mark.parametrize("args, warned", [
    (["--save", "/c"], "--save /c without --load: this run starts from iteration 0"),
    (["--save", "/c", "--load", "/d"], "--load /d is not --save /c"),
    (["--save", "/c", "--load", "/c"], None),
    (["--steps", "3"], None),
])
def test_save_without_load_is_warned_before_any_worker_starts(args, warned) -> None:
    problems, warnings = preflight.check({}, multi_node=False, script_args=args)
    assert problems == []
    found = [w for w in warnings if "--save" in w]
    if warned is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith(warned), found
        assert "in-memory recovery" in found[0] or "does not resume" in found[0]
