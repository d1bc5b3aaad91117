"""Every knob of the runtime in one place: env-variable names, their defaults, exit codes.

Other modules (and `ttprun`) import the names from here so a spelling lives once. All times are
seconds as floats; `TTPConfig.from_env()` reads and validates them once at start-up so a typo in
an env variable fails loudly before training starts, not in the middle of a fault.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import math
import os
import stat
from dataclasses import dataclass
from typing import Mapping, Optional

log = logging.getLogger("mindio_ttp")

# -- env variable names (the MindIO ones plus ours) -------------------------------------------
ENV_OT = "TTP_OT"
ENV_AUTH_KEY = "TTP_AUTH_KEY"
ENV_AUTH_KEY_FILE = "TTP_AUTH_KEY_FILE"
ENV_INSECURE = "TTP_INSECURE_NO_AUTH"
ENV_RUN_DIR = "TTP_RUN_DIR"
ENV_LOG_LEVEL = "TTP_LOG_LEVEL"
ENV_LOG_PATH = "TTP_LOG_PATH"
ENV_HEARTBEAT_INTERVAL = "TTP_HEARTBEAT_INTERVAL"
ENV_HEARTBEAT_TIMEOUT = "TTP_HEARTBEAT_TIMEOUT"
ENV_SAVE_TIME_LIMIT = "TTP_SAVE_TIME_LIMIT"
ENV_RENAME_TIME_LIMIT = "TTP_RENAME_TIME_LIMIT"
ENV_COLLECT_TIMEOUT = "TTP_COLLECT_TIMEOUT"
ENV_UPDATE_GRACE = "TTP_UPDATE_GRACE"
ENV_CONNECT_TIMEOUT = "TTP_CONNECT_TIMEOUT"
ENV_HANDSHAKE_TIMEOUT = "TTP_HANDSHAKE_TIMEOUT"
ENV_CONTROLLER_PORT = "TTP_CONTROLLER_PORT"
ENV_STEP_TIMEOUT = "TTP_STEP_TIMEOUT"
# ttprun: warm spares per node (processes that imported torch and the entry's imports and wait
# to replace a lost rank); 0 = none. `ttprun --warm-spares N` sets it.
ENV_WARM_SPARES = "TTP_WARM_SPARES"
# "1": refuse to start when both holders of an optimizer shard share a host (default: warn)
ENV_REQUIRE_CROSS_HOST_REPLICAS = "TTP_REQUIRE_CROSS_HOST_REPLICAS"
# in-memory recovery (docs/recovery.md): "in-memory" (default) or "dying-checkpoint"
ENV_RECOVERY = "TTP_RECOVERY"
# seconds from the recovery order to every rank's READY; past it: the dying checkpoint
ENV_RECOVER_TIMEOUT = "TTP_RECOVER_TIMEOUT"
# set by ttprun in its workers: how it starts a lost rank's replacement ("cold"); unset: the
# launcher cannot (torchrun), so a fault ends in the dying checkpoint
ENV_REPLACEMENTS = "TTP_REPLACEMENTS"
# test-only: the host name a rank reports for that check (one machine plays several hosts)
ENV_TEST_HOSTNAME = "TTP_TEST_HOSTNAME"

# The controller's TCP port, inclusive: no privileged port (ranks do not run as root), and the
# one range everything holds a port to: the port argument, TTP_CONTROLLER_PORT, `ttp-patch
# apply --port` and its record.
CONTROLLER_PORT_RANGE = (1024, 65535)

FLOW_FINISHED_FILE = "flow-finished.json"
# Bytes a listener holds in partial frames of all not-yet-registered connections together.
# Per connection the cap is protocol.pre_auth_max_payload (a Register carries 8 B per rank), so
# without a total, (world_size + 64) connections could pin ~560 MiB at 8192 ranks. A real
# Register arrives whole and is consumed at once; only a flood fills this.
PRE_AUTH_BUFFER_BUDGET = 64 * 1024 * 1024
# The save handler waits at most this long for the device event recorded at the end of the
# update it saves (device_copy.py) before it refuses: that update's kernels normally finished
# long before a fault is handled; one that has not in this time waits on a hung kernel.
DEVICE_READY_TIMEOUT_S = 30.0
# In TTP_RUN_DIR: one empty file per rank whose processor started (rank-N). The launcher holds
# survivors for TTP_OT only when some rank of the attempt started the runtime: before that no
# rank holds anything a dying checkpoint could use.
RUNTIME_STARTED_DIR = "runtime-started"

DEFAULTS: dict[str, float] = {
    ENV_OT: 120.0,
    ENV_HEARTBEAT_INTERVAL: 2.0,
    ENV_HEARTBEAT_TIMEOUT: 6.0,
    ENV_SAVE_TIME_LIMIT: 90.0,
    ENV_RENAME_TIME_LIMIT: 15.0,
    ENV_COLLECT_TIMEOUT: 10.0,
    ENV_UPDATE_GRACE: 5.0,
    ENV_CONNECT_TIMEOUT: 60.0,
    # A listener closes a connection that has not completed the handshake (challenge, Register,
    # ack) within this; a rank gives up on a listener that has not. Long enough for every rank
    # of a large job connecting at once, short enough that a port held by another program ends
    # every rank within seconds instead of after TTP_CONNECT_TIMEOUT.
    ENV_HANDSHAKE_TIMEOUT: 10.0,
    # a cold replacement imports torch and Megatron and builds its model inside this bound
    ENV_RECOVER_TIMEOUT: 120.0,
}
RECOVERY_MODES = ("in-memory", "dying-checkpoint")


class ExitCode(enum.IntEnum):
    """Exit status of every process after a dying-checkpoint flow (all non-zero: the job failed
    and a scheduler should restart it). Kept distinct so a launcher can say what happened."""

    SAVED = 83  # a dying checkpoint was written and renamed into place: resume from it
    NO_CONSISTENT_STEP = 84  # no step had a clean replica of every shard: nothing saved
    SAVE_FAILED = 85  # a save or the rename failed / timed out: nothing marked latest
    NO_VERDICT = 86  # no exit order within TTP_OT, or no controller reachable
    NOT_CLAIMED = 87  # another part of the job holds this fault's claim (or no quorum): no save


class Outcome(str, enum.Enum):
    SAVED = "saved"
    NO_CONSISTENT_STEP = "no_consistent_step"
    SAVE_FAILED = "save_failed"
    NO_VERDICT = "no_verdict"
    NOT_CLAIMED = "not_claimed"

    @property
    def exit_code(self) -> int:
        return int(ExitCode[self.name])


def _float_env(env: Mapping[str, str], name: str) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return DEFAULTS[name]
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number: set it to seconds, e.g. "
                         f"{name}={DEFAULTS[name]:g}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def _optional_float_env(env: Mapping[str, str], name: str) -> float:
    """Like _float_env, but 0 or unset means 'off'."""
    raw = env.get(name, "").strip()
    if raw in ("", "0"):
        return 0.0
    return _float_env({name: raw}, name)


def _recovery_mode(env: Mapping[str, str]) -> str:
    raw = env.get(ENV_RECOVERY, "").strip().lower() or RECOVERY_MODES[0]
    if raw not in RECOVERY_MODES:
        raise ValueError(f"{ENV_RECOVERY}={raw!r}: use {' or '.join(RECOVERY_MODES)}")
    return raw


def _port_env(env: Mapping[str, str]) -> Optional[int]:
    raw = env.get(ENV_CONTROLLER_PORT)
    if raw is None or raw.strip() == "":
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_CONTROLLER_PORT}={raw!r} is not an integer port") from None
    lo, hi = CONTROLLER_PORT_RANGE
    if not lo <= port <= hi:
        raise ValueError(f"{ENV_CONTROLLER_PORT}={raw!r} is out of range: use {lo}..{hi}")
    return port


def warm_spares(env: Optional[Mapping[str, str]] = None) -> int:
    """``TTP_WARM_SPARES``: how many warm spares ``ttprun`` keeps per node (default 0)."""
    raw = (os.environ if env is None else env).get(ENV_WARM_SPARES, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_WARM_SPARES}={raw!r} is not a whole number: set the number of "
                         f"warm spares per node, e.g. {ENV_WARM_SPARES}=1") from None
    if value < 0:
        raise ValueError(f"{ENV_WARM_SPARES}={raw!r} is negative: use 0 (none) or more")
    return value


def _parse_key(raw: str, source: str) -> bytes:
    try:
        key = bytes.fromhex(raw.strip())
    except ValueError:
        raise ValueError(f"{source} must be hex (e.g. from `python -c \"import "
                         f"secrets; print(secrets.token_hex(32))\"`)") from None
    if len(key) < 16:
        raise ValueError(f"{source} is {len(key)} bytes: use at least 16 (32 hex chars)")
    return key


def read_key_file(path: str) -> bytes:
    """The key from a file only its owner can read (a group- or world-readable key is no
    secret on a shared cluster)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(f"{ENV_AUTH_KEY_FILE}={path}: cannot open ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{ENV_AUTH_KEY_FILE}={path} is not a regular file")
        if mode & 0o077:
            raise ValueError(f"{ENV_AUTH_KEY_FILE}={path} is readable by others (mode "
                             f"{stat.S_IMODE(mode):o}): run `chmod 600 {path}`")
        raw = f.read(1025)
    if len(raw) > 1024:
        raise ValueError(f"{ENV_AUTH_KEY_FILE}={path} is too large for a key")
    return _parse_key(raw.decode("ascii", "replace"), f"{ENV_AUTH_KEY_FILE}={path}")


def auth_key_from_env(env: Mapping[str, str]) -> bytes:
    """The per-job HMAC secret: TTP_AUTH_KEY (ttprun generates one on a single node), or
    TTP_AUTH_KEY_FILE. There is no derived default: a key computed from MASTER_ADDR and the
    like is known to anyone on the network, who could then end the job with one forged fault
    report. Only an explicit TTP_INSECURE_NO_AUTH=1 gets such a key, logged as insecure."""
    raw = env.get(ENV_AUTH_KEY)
    if raw:
        return _parse_key(raw, ENV_AUTH_KEY)
    if env.get(ENV_AUTH_KEY_FILE):
        return read_key_file(env[ENV_AUTH_KEY_FILE])
    if env.get(ENV_INSECURE) != "1":
        raise ValueError(
            f"no control-plane key: launch with ttprun (it generates one on a single node), or "
            f"give every rank the same secret in {ENV_AUTH_KEY} (e.g. `export {ENV_AUTH_KEY}="
            f"$(python -c 'import secrets; print(secrets.token_hex(32))')` distributed by your "
            f"scheduler) or in a chmod-600 file named by {ENV_AUTH_KEY_FILE}; "
            f"{ENV_INSECURE}=1 runs without a secret (anyone on the network can end the job)")
    seed = "|".join(env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
    log.warning("INSECURE: %s=1 and no %s: using a key derived from MASTER_ADDR/MASTER_PORT/"
                "TORCHELASTIC_RUN_ID; anyone who knows these can forge control messages and end "
                "the job", ENV_INSECURE, ENV_AUTH_KEY)
    return hashlib.sha256(b"mindio-ttp-weak-key|" + seed.encode()).digest()


@dataclass(frozen=True)
class TTPConfig:
    ot: float
    heartbeat_interval: float
    heartbeat_timeout: float
    save_time_limit: float
    rename_time_limit: float
    collect_timeout: float
    update_grace: float
    connect_timeout: float
    controller_port: Optional[int]
    run_dir: Optional[str]
    auth_key: bytes
    step_timeout: float = 0.0  # 0: off
    handshake_timeout: float = DEFAULTS[ENV_HANDSHAKE_TIMEOUT]
    recovery: str = RECOVERY_MODES[0]
    recover_timeout: float = DEFAULTS[ENV_RECOVER_TIMEOUT]
    replacements: str = ""  # what the launcher offers (ENV_REPLACEMENTS); "": none

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> TTPConfig:
        env = os.environ if env is None else env
        cfg = cls(
            ot=_float_env(env, ENV_OT),
            heartbeat_interval=_float_env(env, ENV_HEARTBEAT_INTERVAL),
            heartbeat_timeout=_float_env(env, ENV_HEARTBEAT_TIMEOUT),
            save_time_limit=_float_env(env, ENV_SAVE_TIME_LIMIT),
            rename_time_limit=_float_env(env, ENV_RENAME_TIME_LIMIT),
            collect_timeout=_float_env(env, ENV_COLLECT_TIMEOUT),
            update_grace=_float_env(env, ENV_UPDATE_GRACE),
            connect_timeout=_float_env(env, ENV_CONNECT_TIMEOUT),
            controller_port=_port_env(env),
            run_dir=env.get(ENV_RUN_DIR) or None,
            auth_key=auth_key_from_env(env),
            step_timeout=_optional_float_env(env, ENV_STEP_TIMEOUT),
            handshake_timeout=_float_env(env, ENV_HANDSHAKE_TIMEOUT),
            recovery=_recovery_mode(env),
            recover_timeout=_float_env(env, ENV_RECOVER_TIMEOUT),
            replacements=env.get(ENV_REPLACEMENTS, "").strip(),
        )
        if cfg.heartbeat_timeout <= cfg.heartbeat_interval:
            raise ValueError(
                f"{ENV_HEARTBEAT_TIMEOUT}={cfg.heartbeat_timeout:g} must be larger than "
                f"{ENV_HEARTBEAT_INTERVAL}={cfg.heartbeat_interval:g} (3 intervals is typical)")
        if cfg.collect_timeout <= cfg.update_grace:
            raise ValueError(f"{ENV_COLLECT_TIMEOUT} must exceed {ENV_UPDATE_GRACE}: a rank "
                             "inside its update window needs the grace to answer the collect")
        budget = cfg.collect_timeout + cfg.save_time_limit + cfg.rename_time_limit
        if budget >= cfg.ot:
            log.warning("%s=%g is shorter than collect + save + rename limits (%g s): processes "
                        "may exit before the dying checkpoint is renamed", ENV_OT, cfg.ot, budget)
        return cfg
