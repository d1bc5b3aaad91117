"""One table of every TTP_* setting (mindio_ttp/config.py), checked by ttprun before any
worker starts and by the runtime, with the same code (issue 16, items 6 and 8)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mindio_ttp import config
from mindio_ttp.config import SettingsError, TTPConfig
from mindio_ttp.control.controller.server import Controller
from mindio_ttp.hooks import TTPError
from mindio_ttp.launch import preflight

from .conftest import ENV

ROOT = Path(__file__).resolve().parents[2]
KEY = "ab" * 32
BAD = {"TTP_OT": "0", "TTP_AUTH_KEY": "abcd", "TTP_HEARTBEAT_TIMEOUT": "nan",
       "TTP_LISTEN_PORTS": "9000-8000", "TTP_LOG_LEVEL": "LOUD"}

pytestmark = pytest.mark.smoke  # `pytest -m smoke`: README's quick check


def test_ttprun_refuses_every_bad_value_at_once_before_any_worker_starts(tmp_path: Path) -> None:
    """Before: a short key, TTP_OT=0 or nan passed ttprun and every rank died after model build
    and data load, one traceback each. Now: exit 2, one message, nothing started."""
    started = tmp_path / "started"
    script = tmp_path / "worker.py"
    script.write_text(f"open({str(started)!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTP_")}
    env.update(BAD, TORCH_NCCL_ASYNC_ERROR_HANDLING="3", HCCL_ASYNC_ERROR_HANDLING="1",
               TTP_HEARTBEAT_INTERVALL="1")
    done = subprocess.run(
        [sys.executable, "-m", "mindio_ttp.launch.agent", "--nproc-per-node=1",
         "--rdzv-backend=static", "--master-addr=127.0.0.1", "--master-port=1",
         "--node-rank=0", "--nnodes=1", str(script)],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert not started.exists()
    err = done.stderr
    assert err.count("ttprun: error:") == 1 and "5 settings are wrong" in err, err
    for needle in ("TTP_OT='0' must be a positive number", "TTP_AUTH_KEY is 2 bytes",
                   "TTP_HEARTBEAT_TIMEOUT='nan'", "TTP_LISTEN_PORTS='9000-8000' is empty",
                   "TTP_LOG_LEVEL='LOUD'", "nothing was started"):
        assert needle in err, err
    assert "abcd" not in err  # a key is never echoed, not even a bad one
    # legal values that defeat the dying checkpoint, and a misspelt name: warned about
    for needle in ("warning: your TORCH_NCCL_ASYNC_ERROR_HANDLING=3 kills the process",
                   "warning: your HCCL_ASYNC_ERROR_HANDLING=1 terminates the process",
                   "TTP_HEARTBEAT_INTERVALL is not a setting (ignored): did you mean "
                   "TTP_HEARTBEAT_INTERVAL?"):
        assert needle in err, err


def test_the_runtime_refuses_with_the_same_table() -> None:
    env = dict(BAD)
    with pytest.raises(SettingsError) as err:
        TTPConfig.from_env(env)
    assert err.value.problems == config.problems(env)
    assert preflight.check(env, multi_node=False)[0] == config.problems(env)


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "-inf", "1e12", "two"])
def test_ttp_ot_that_cannot_be_a_grace_period_is_refused(value: str) -> None:
    assert any(p.startswith(f"TTP_OT='{value}'") for p in config.problems({"TTP_OT": value}))


@pytest.mark.parametrize("key,why", [
    ("xyz", "must be hex"), ("ab" * 15, "is 15 bytes: use at least 16"),
    ("ab" * 513, "is 513 bytes: use at most 512"),
])
def test_keys_of_the_wrong_size_or_alphabet_are_refused(key: str, why: str) -> None:
    assert config.problems({"TTP_AUTH_KEY": key}) == [f"TTP_AUTH_KEY {why}" + (
        " (e.g. from `python -c \"import secrets; print(secrets.token_hex(32))\"`)"
        if why == "must be hex" else " (32 hex chars, e.g. from `python -c \"import secrets; "
        "print(secrets.token_hex(32))\"`)" if "least" in why else "")]


@pytest.mark.parametrize("name,what", [
    ("TTP_0T", "'0' (digit zero) where the setting has 'O'"),
    ("ttp_ot", "'t' (latin small letter t) where the setting has 'T'"),
    ("TTP_L0G_LEVEL", "'0' (digit zero)"),
    ("TTP_\u041eT", "'\u041e' (cyrillic capital letter o)"),
    ("TTP-OT", "'-' (hyphen-minus) where the setting has '_'"),
])
def test_look_alike_names_are_caught(name: str, what: str) -> None:
    """TTP_0T (a zero for the O) is two letters' worth of difference for difflib, so only
    the one-letter-off check let it pass in silence."""
    warnings = config.unknown_names({name: "1", "TTP_OT": "30", "PATH": "/bin"})
    meant = "TTP_LOG_LEVEL" if "L0G" in name else "TTP_OT"
    assert len(warnings) == 1 and f"it looks like {meant} but has {what}" in warnings[0], warnings
    assert "(ignored)" in warnings[0]


def test_help_names_the_values_of_the_recovery_mode() -> None:
    text = "\n".join(config.help_lines(width=200))
    assert "TTP_RECOVERY (mode, default in-memory; in-memory or dying-checkpoint)" in text


def test_save_limit_follows_ttp_ot_unless_set() -> None:
    """Before: 90 s whatever TTP_OT was, so the generated script's TTP_OT=360 still cut the
    save at 90 s. Then: TTP_OT - collect - rename - 5, which left the flow's other waits (the
    advance, each order's travel, the exit orders' flush: 28 s at the defaults) out, so a save
    that used its whole limit ended after the ranks' TTP_OT. Now every wait counts."""
    def limit(**env: str) -> float:
        return TTPConfig.from_env({"TTP_AUTH_KEY": KEY, **env}).save_time_limit

    # collect 10; advance: grace 5 + interval 2 + 1; the save order's travel 2 x 2 + 1; rename
    # 15 + 2 x 2 + 1; the exit orders' flush max(2, handshake 10); the margin 5
    others = 10 + (5 + 2 + 1) + (2 * 2 + 1) + (15 + 2 * 2 + 1) + 10
    assert limit() == 120 - others - 5 == 62.0
    assert limit(TTP_OT="360") == 360 - others - 5 == 302.0
    assert limit(TTP_OT="360", TTP_SAVE_TIME_LIMIT="42") == 42.0
    assert limit(TTP_OT="20") == 5.0  # never below TTP_OT / 4


def test_the_start_up_check_adds_up_what_the_flow_waits_for(caplog) -> None:
    """The check warns when TTP_OT is not longer than every wait of the flow (Deadlines.
    flow_budget): the same terms the flow awaits, not only the three limits."""
    def budget(**env: str) -> float:
        with caplog.at_level(logging.WARNING, logger="mindio_ttp"):
            caplog.clear()
            cfg = TTPConfig.from_env({"TTP_AUTH_KEY": KEY, **env})
        return cfg.deadlines.flow_budget

    assert budget() == 115.0 and not caplog.records  # the defaults fit TTP_OT=120
    # 10 + 15 + 90 = 115 < 120 passed the old check; with the waits around them it is 143
    assert budget(TTP_SAVE_TIME_LIMIT="90") == 143.0
    said = caplog.records[0].getMessage()
    assert "TTP_OT=120 is not longer than the flow may wait (143 s" in said
    assert "exit orders 10" in said


def test_docs_list_every_setting_exactly_as_the_table_does() -> None:
    doc = (ROOT / "docs/settings.md").read_text()
    assert config.markdown_table() in doc, "regenerate: python -m mindio_ttp.config"
    help_text = subprocess.run(["ttprun", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    tail = help_text[help_text.index("TTP settings"):]
    for s in config.SETTINGS:
        assert s.name in tail
    for code in ("83", "84", "85", "86", "87", "128+N"):
        assert f"  {code} " in tail


def test_a_secret_volume_key_is_followed_to_its_file_and_checked_there(tmp_path: Path) -> None:
    """Kubernetes mounts a Secret as key -> ..data/key, ..data -> ..<timestamp>/ (symlinks):
    refusing links made Secret volumes unusable. The file finally opened is what counts."""
    stamp = tmp_path / "..2026_12_04_00_00_00.1"
    stamp.mkdir()
    (stamp / "key").write_text(KEY + "\n")
    (tmp_path / "..data").symlink_to(stamp.name)
    (tmp_path / "key").symlink_to("..data/key")
    link = str(tmp_path / "key")
    (stamp / "key").chmod(0o644)  # the Secret volume's default mode
    with pytest.raises(ValueError, match=r"readable by others \(mode 644\).*defaultMode: 0400"):
        config.read_key_file(link)
    (stamp / "key").chmod(0o400)
    assert config.read_key_file(link) == bytes.fromhex(KEY)
    if os.geteuid() == 0:  # a file another user owns: they could rewrite the key
        os.chown(stamp / "key", 65534, 65534)
        with pytest.raises(ValueError, match="belongs to uid 65534"):
            config.read_key_file(link)


def _free_run(n: int) -> int:
    """The first of n consecutive ports that are free now."""
    for start in range(42000, 60000, 97):
        socks = []
        try:
            for p in range(start, start + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port run")


def test_standby_listeners_stay_inside_ttp_listen_ports() -> None:
    """So a firewall can open exactly these: each rank takes the first free port of the range
    from its own offset; a range with no free port left says what to do."""
    lo = _free_run(3)
    cfg = TTPConfig.from_env(dict(ENV, TTP_LISTEN_PORTS=f"{lo}-{lo + 2}"))
    made = []
    try:
        for rank in (1, 1, 1):  # the same offset: each next one finds its port taken
            c = Controller(cfg, 4, 2, host_rank=rank, standby=True)
            made.append(c)
            c.listen("127.0.0.1", 0, cfg.listen_ports, rank)
        assert sorted(c.address[1] for c in made) == [lo, lo + 1, lo + 2]
        assert made[0].address[1] == lo + 1
        extra = Controller(cfg, 4, 2, host_rank=3, standby=True)
        with pytest.raises(TTPError, match=f"every port of TTP_LISTEN_PORTS={lo}-{lo + 2} is "
                                           "in use"):
            extra.listen("127.0.0.1", 0, cfg.listen_ports, 3)
    finally:
        for c in made:
            c.stop()


def test_both_names_of_nccls_error_handling_are_set_and_a_legacy_value_is_warned() -> None:
    """D4: torch 2.1 reads only NCCL_ASYNC_ERROR_HANDLING, which torch's elastic agent sets to 1
    (abort, then kill) unless the launcher's environment has it: the survivors died in the
    dying save. Both names get 2; a user's legacy 1 or 3 is kept and warned about."""
    from mindio_ttp.faulttime import collective_env

    env: dict = {}
    collective_env.apply_defaults(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == env["NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert collective_env.user_value_warnings(env) == []
    mine = {"NCCL_ASYNC_ERROR_HANDLING": "1"}
    collective_env.apply_defaults(mine)
    assert mine["NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the user's value stays
    (warning,) = collective_env.user_value_warnings(mine)
    assert warning.startswith("your NCCL_ASYNC_ERROR_HANDLING=1 (the name torch 2.1 reads")
    assert "kills the process" in warning
