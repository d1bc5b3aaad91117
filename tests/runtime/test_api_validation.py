"""Every public argument is checked, and the error says what to pass."""

from __future__ import annotations

import pytest

import mindio_ttp.framework_ttp as ttp
from mindio_ttp import config


@pytest.mark.parametrize("args,match", [
    ((-1, 4, 2, False), r"rank=-1 is out of range"),
    ((4, 4, 2, False), r"rank=4 is out of range"),
    ((0, 0, 2, False), r"world_size=0"),
    ((0, 4, 0, False), r"replica=0 .*DP >= 2"),
    ((0, 4, 2, True), r"enable_local_copy=True .*pass False"),
    ((0, 4, 2, 0), r"enable_local_copy must be True or False"),
    (("0", 4, 2, False), r"rank must be an int"),
    ((True, 4, 2, False), r"rank must be an int, got bool"),
])
def test_init_controller_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        ttp.ttp_init_controller(*args)


@pytest.mark.parametrize("args,match", [
    ((5, [0, 1, 2, 3], 4, 4, 2, False), r"rank=5 is out of range"),
    ((1, [0, 2], 2, 4, 1, False), r"rank 1 is not in its dp_ranks \[0, 2\]"),
    ((0, [0, 1, 2, 3], 3, 4, 2, False), r"dp_size=3 but dp_ranks has 4 ranks: pass len"),
    ((0, [0, 0, 1], 3, 4, 1, False), r"duplicates"),
    ((0, [0, 9], 2, 4, 1, False), r"dp_ranks\[\]=9 is out of range"),
    ((0, [0], 1, 4, 0, False), r"replica=0 .*DP >= 2"),
    ((0, [0, 1], 2, 4, 3, False), r"replica=3 is out of range"),
    ((0, [0, 1, 2], 3, 4, 2, False), r"replica=2 shards do not divide the DP group of 3"),
    ((0, "01", 2, 4, 1, False), r"dp_ranks must be a list"),
    ((0, [0, 1], 2, 4, 1, True), r"enable_local_copy=True"),
])
def test_init_processor_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        ttp.ttp_init_processor(*args)


@pytest.mark.parametrize("ip,port,match", [
    ("", 8000, "ip must be a non-empty string"),
    (None, 8000, "ip must be a non-empty string"),
    ("0.0.0.0", 8000, "unspecified address"),
    ("127.0.0.1", 80, r"port=80 is out of range: pass 1024 <= port <= 65535"),
    ("127.0.0.1", 70000, r"port=70000 is out of range"),
    ("127.0.0.1", "8000", "port must be an int"),
])
def test_start_calls_reject_bad_address(ip, port, match, monkeypatch):
    monkeypatch.delenv(config.ENV_CONTROLLER_PORT, raising=False)
    with pytest.raises(ValueError, match=match):
        ttp.ttp_start_controller(ip, port)
    with pytest.raises(ValueError, match=match):
        ttp.ttp_start_processor(ip, port)


def test_controller_port_env_must_be_valid(monkeypatch):
    monkeypatch.setenv(config.ENV_CONTROLLER_PORT, "nope")
    with pytest.raises(ValueError, match="TTP_CONTROLLER_PORT='nope' is not an integer"):
        ttp.ttp_start_processor("127.0.0.1", 8000)


@pytest.mark.parametrize("port", ["80", "1023", "65536"])
def test_controller_port_env_has_the_argument_range(port, monkeypatch):
    monkeypatch.setenv(config.ENV_CONTROLLER_PORT, port)
    with pytest.raises(ValueError, match=r"out of range: use 1024\.\.65535"):
        ttp.ttp_start_processor("127.0.0.1", 8000)


def test_handlers_must_accept_the_contract_arguments():
    with pytest.raises(ValueError, match=r"fn\(step, save_ranks, ckpt_args\)"):
        ttp.ttp_register_save_ckpt_handler(lambda step: None)
    with pytest.raises(ValueError, match=r"fn\(step, ckpt_args\)"):
        ttp.ttp_register_rename_handler(lambda a, b, c: None)
    with pytest.raises(ValueError, match="needs a callable"):
        ttp.ttp_register_save_ckpt_handler("save")
    ttp.ttp_register_save_ckpt_handler(lambda step, ranks, args: None)
    ttp.ttp_register_rename_handler(lambda step, *args: None)


def test_hot_path_arguments():
    with pytest.raises(ValueError, match="backup_step=-2"):
        ttp.ttp_start_updating_os(-2)
    with pytest.raises(ValueError, match=r"step=0 is out of range.*counted from 1"):
        ttp.ttp_end_updating_os(0)
    with pytest.raises(ValueError, match="step must be an int"):
        ttp.ttp_end_updating_os(1.5)
    with pytest.raises(ValueError, match="takes a tuple"):
        ttp.ttp_set_ckpt_args({"model": 1})
    with pytest.raises(ValueError, match="decorates a function"):
        ttp.ttp_to_persist(3)


def test_start_before_init_says_what_to_call(monkeypatch):
    monkeypatch.delenv(config.ENV_CONTROLLER_PORT, raising=False)
    monkeypatch.setattr(ttp, "_processor_args", None)
    with pytest.raises(ttp.TTPError, match="call ttp_init_processor"):
        ttp.ttp_start_processor("127.0.0.1", 8000)


@pytest.mark.parametrize("env,match", [
    ({"TTP_OT": "abc", "TTP_AUTH_KEY": "00" * 16}, "TTP_OT='abc' is not a number"),
    ({"TTP_HEARTBEAT_INTERVAL": "-1", "TTP_AUTH_KEY": "00" * 16}, "must be a positive number"),
    ({"TTP_HEARTBEAT_INTERVAL": "2", "TTP_HEARTBEAT_TIMEOUT": "1", "TTP_AUTH_KEY": "00" * 16},
     "must be larger"),
    ({"TTP_AUTH_KEY": "xyz"}, "TTP_AUTH_KEY must be hex"),
    ({"TTP_AUTH_KEY": "abcd"}, "use at least 16"),
])
def test_env_config_errors(env, match):
    with pytest.raises(ValueError, match=match):
        config.TTPConfig.from_env(env)


def test_missing_auth_key_is_refused_with_what_to_do():
    """No derivable default: MASTER_ADDR/MASTER_PORT are known to anyone on the network."""
    with pytest.raises(ValueError, match="no control-plane key") as err:
        config.TTPConfig.from_env({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    for hint in ("ttprun", "TTP_AUTH_KEY", "TTP_AUTH_KEY_FILE", "TTP_INSECURE_NO_AUTH=1"):
        assert hint in str(err.value)


def test_insecure_opt_in_derives_a_shared_key_and_says_so(caplog):
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TTP_INSECURE_NO_AUTH": "1"}
    a = config.TTPConfig.from_env(env).auth_key
    assert a == config.TTPConfig.from_env(dict(env)).auth_key
    assert a != config.TTPConfig.from_env(dict(env, MASTER_PORT="29501")).auth_key
    assert "INSECURE" in caplog.text


def test_key_file_must_be_private(tmp_path):
    key_file = tmp_path / "ttp.key"
    key_file.write_text("ab" * 32 + "\n")
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        config.TTPConfig.from_env({"TTP_AUTH_KEY_FILE": str(key_file)})
    key_file.chmod(0o600)
    assert config.TTPConfig.from_env({"TTP_AUTH_KEY_FILE": str(key_file)}).auth_key == \
        bytes.fromhex("ab" * 32)
    with pytest.raises(ValueError, match="cannot open"):
        config.TTPConfig.from_env({"TTP_AUTH_KEY_FILE": str(tmp_path / "absent")})


def test_defaults_match_the_documented_ones():
    cfg = config.TTPConfig.from_env({"TTP_AUTH_KEY": "00" * 16})
    assert cfg.ot == 120 and cfg.heartbeat_interval == 2 and cfg.heartbeat_timeout == 6
    assert [c.value for c in config.ExitCode] == [83, 84, 85, 86, 87]


def test_replica_must_agree_with_the_optimizers_shards(monkeypatch):
    """One source for the layout: ReplicatedOptimizer declares its shard count when built; a
    `replica` that disagrees would make the controller pick steps no holder has."""
    monkeypatch.setattr(ttp, "_optimizer_shards", None)
    ttp.declare_optimizer_shards(4)  # DP 8, two replicas
    with pytest.raises(ValueError, match=r"replica=2 shards per DP group, but the optimizer "
                                         r"keeps 4"):
        ttp.ttp_init_processor(0, list(range(8)), 8, 8, 2, False)
    with pytest.raises(ValueError, match=r"ttp_init_controller: replica=2"):
        ttp.ttp_init_controller(0, 8, 2, False)
    monkeypatch.setattr(ttp, "_processor_args", None)
    ttp.ttp_init_processor(0, list(range(8)), 8, 8, 4, False)  # agrees: accepted
    assert ttp._processor_args == (0, list(range(8)), 8, 4)


@pytest.mark.parametrize("port", [1, 1023, 1024, 8000, 65535, 65536])
def test_ttp_patch_accepts_exactly_the_ports_the_runtime_accepts(port):
    """`ttp-patch apply --port` writes the port the controller binds: a port apply takes and
    the runtime refuses would only fail on the cluster, at train()."""
    from patcher.errors import UsageError
    from patcher.options import Options

    try:
        config._port_env({config.ENV_CONTROLLER_PORT: str(port)})
        runtime_ok = True
    except ValueError:
        runtime_ok = False
    try:
        Options.build("npu", port)
        patcher_ok = True
    except UsageError as exc:
        patcher_ok = False
        assert "1024..65535" in exc.message
    assert patcher_ok == runtime_ok == (1024 <= port <= 65535)
