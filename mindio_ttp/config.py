"""Every setting of the runtime in one table (`SETTINGS`), its exit codes, and the one check.

Each ``TTP_*`` variable is one `Setting` row: name, type, default, allowed range, meaning and
the parser that turns its text into a value or says, in a ValueError, what is wrong. The same
`problems` runs in ``ttprun`` before any worker starts (exit 2, one message naming every bad
value) and in every rank (`TTPConfig.from_env`), so the two cannot disagree; `--help`, the
docs table (docs/settings.md, printed by ``python -m mindio_ttp.config``) and the README read
the same rows. Adding a setting is adding a row (and, if the runtime reads it, a field).
All times are seconds as floats.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import logging
import math
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

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
ENV_LISTEN_PORTS = "TTP_LISTEN_PORTS"
ENV_STEP_TIMEOUT = "TTP_STEP_TIMEOUT"
ENV_CHECKPOINT_KEY = "TTP_CHECKPOINT_KEY"
ENV_CPU_BUILD_DIR = "TTP_CPU_BUILD_DIR"
ENV_RDZV_NOTICE = "TTPRUN_RDZV_NOTICE_S"
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
# set by ttprun in a replacement's environment: the recovery it joins (recovery/rank.py)
ENV_RECOVERY_JOIN = "TTP_RECOVERY_JOIN"
# the control plane's tiers (docs/design.md, "The control plane in tiers"): "1" (default) each
# node's ranks reach the controller through that node's agent; "0" every rank connects itself
ENV_NODE_AGENT = "TTP_NODE_AGENT"
# agents per relay and per controller (0: the square root of the job's nodes, at least 32)
ENV_FANOUT = "TTP_FANOUT"
# set by ttprun in its workers: the AF_UNIX socket of this node's agent (its own process)
ENV_AGENT_SOCKET = "TTP_AGENT_SOCKET"
# set by `ttprun --drill` for its workers (mindio_ttp/drill.py): the fire drill of this launch
ENV_DRILL = "TTP_DRILL"
# ttprun --max-restarts: the port (or range) node 0 gives a restarted attempt's store
ENV_RESTART_STORE_PORTS = "TTP_RESTART_STORE_PORTS"

# The controller's TCP port, inclusive: no privileged port (ranks do not run as root), and the
# one range everything holds a port to: the port argument, TTP_CONTROLLER_PORT, `ttp-patch
# apply --port` and its record.
CONTROLLER_PORT_RANGE = (1024, 65535)
# Longest time any setting may name: a week. Larger values are typos (or inf in disguise) and
# would overflow the deadlines computed from them on some platforms.
MAX_SECONDS = 7 * 24 * 3600.0
KEY_BYTES = (16, 512)  # TTP_AUTH_KEY: at least 128 bits; at most what a key file may hold
# TTP_SAVE_TIME_LIMIT, when unset: what TTP_OT leaves after every other wait of the flow
# (Deadlines.flow_budget without the save), minus this margin for detection.
SAVE_LIMIT_MARGIN_S = 5.0
STORE_ANSWER_GRACE_S = 10.0  # an AuthStore call's answer, past the wait it asked for
CONTROLLER_STOP_GRACE_S = 10.0  # past the goodbye wait, then rank 0 kills a hung controller
AGENT_UNJOINED_GRACE_S = 10.0  # a node agent no rank ever reached, past TTP_CONNECT_TIMEOUT

FLOW_FINISHED_FILE = "flow-finished.json"
# The largest world the runtime accepts (the API's checks and the wire format's rank ranges).
MAX_WORLD = 100_000
# Bytes a listener holds in partial frames of all not-yet-registered connections together.
# Per connection the cap is protocol.pre_auth_max_payload (a Register carries 8 B per rank), so
# without a total, (world_size + 64) connections could pin ~560 MiB at 8192 ranks. A real
# Register arrives whole and is consumed at once; only a flood fills this.
PRE_AUTH_BUFFER_BUDGET = 64 * 1024 * 1024
# The authenticated store (control/controller/keyspace.py): what one rank's writes may hold at the
# acting
# controller (keys, values and bookkeeping, over every namespace), what all ranks' writes may
# hold together, and how many gets/waits one rank may leave pending. A gloo group's rendezvous
# costs each member about 8 B per member of the group, so 4 MiB is ~500k peers' worth per rank.
STORE_RANK_BUDGET = 4 * 1024 * 1024
STORE_TOTAL_BUDGET = 256 * 1024 * 1024
STORE_WAITS_PER_RANK = 64
# The save handler waits at most this long for the device event recorded at the end of the
# update it saves (device_copy.py) before it refuses: that update's kernels normally finished
# long before a fault is handled; one that has not in this time waits on a hung kernel.
DEVICE_READY_TIMEOUT_S = 30.0
# How long the fault-time abort (faulttime/abort.py) waits for every communicator's abort (and
# NPU's stop/restart) before it reports the stragglers as timed out and the save reads anyway,
# on its private stream: an abort can hang in NCCL's proxy thread (nccl #1013, #1777).
ABORT_TIMEOUT_S = 10.0
# How long the dying checkpoint's private read stream may take to pass what is queued ahead of
# it (device_copy.DeviceReader): an event on an otherwise idle stream passes in microseconds,
# unless the stream shares a hardware queue with a kernel the abort failed to end.
FALLBACK_PROBE_S = 5.0
# In TTP_RUN_DIR: one empty file per rank whose processor started (rank-N). The launcher holds
# survivors for TTP_OT only when some rank of the attempt started the runtime: before that no
# rank holds anything a dying checkpoint could use.
RUNTIME_STARTED_DIR = "runtime-started"
# In TTP_RUN_DIR: the recovery mode rank 0 found its process groups allow (one line), which
# ttprun prints once it appears (its own check at start sees the machine, not the groups).
RECOVERY_MODE_FILE = "recovery-mode"
# $TTP_RUN_DIR/job-complete.json: written by a rank once the job's final checkpoint is complete
# on every rank (ttp_job_complete); a worker lost after it fails nothing (ttprun exits 0)
JOB_COMPLETE_FILE = "job-complete.json"


# Megatron-LM 285068c's process-group timeout, hard-coded at 10 minutes
# (megatron/initialize.py:174-177; the --distributed-timeout-minutes flag came later). A
# survivor's collective hung on a dead peer fails when it runs out, and with
# TORCH_NCCL_ASYNC_ERROR_HANDLING the watchdog then aborts the communicators, so it must outlast
# TTP_OT by the time from the collective's start to the fault's detection: the step that was
# running when the peer died, plus TTP_HEARTBEAT_TIMEOUT. PG_TIMEOUT_MARGIN_S bounds that.
MEGATRON_PG_TIMEOUT_S = 600.0
PG_TIMEOUT_MARGIN_S = 300.0


def process_group_timeout_s(ot_s: float, floor_s: float = MEGATRON_PG_TIMEOUT_S) -> float:
    """The process-group timeout a patched tree runs with: Megatron's own unless TTP_OT needs
    more (the launcher checks other trees against the same rule)."""
    return max(floor_s, ot_s + PG_TIMEOUT_MARGIN_S)


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


# -- parsers: text -> value, or ValueError(what is wrong) -------------------------------------
Parser = Callable[[str], Any]


def seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number: give seconds, e.g. 10 or 2.5") from None
    if not math.isfinite(value) or not 0 < value <= MAX_SECONDS:
        raise ValueError(f"must be a positive number of seconds, at most {MAX_SECONDS:.0f}")
    return value


def seconds_or_off(raw: str) -> float:
    try:
        if float(raw) == 0:
            return 0.0
    except ValueError:
        pass
    return seconds(raw)


def port(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("is not an integer port") from None
    lo, hi = CONTROLLER_PORT_RANGE
    if not lo <= value <= hi:
        raise ValueError(f"is out of range: use {lo}..{hi}")
    return value


def port_range(raw: str) -> Tuple[int, int]:
    parts = raw.replace(":", "-").split("-")
    if len(parts) != 2:
        raise ValueError("must be a range LOW-HIGH, e.g. 29600-29663")
    try:
        lo, hi = port(parts[0].strip()), port(parts[1].strip())
    except ValueError as exc:
        raise ValueError(f"must be a range LOW-HIGH of ports: one {exc}") from None
    if lo > hi:
        raise ValueError(f"is empty: {lo} > {hi}")
    return lo, hi


def port_or_range(raw: str) -> Tuple[int, int]:
    """One port ("29400") or a range ("29400-29409"), as (low, high)."""
    if "-" not in raw and ":" not in raw:
        try:
            one = port(raw.strip())
        except ValueError as exc:
            raise ValueError(f"must be a port or a range LOW-HIGH: {exc}") from None
        return one, one
    return port_range(raw)


def flag(raw: str) -> bool:
    if raw.strip() not in ("0", "1"):
        raise ValueError("must be 1 (on) or 0 (off)")
    return raw.strip() == "1"


def hex_key(raw: str) -> bytes:
    try:
        key = bytes.fromhex(raw.strip())
    except ValueError:
        raise ValueError("must be hex (e.g. from `python -c \"import secrets; "
                         "print(secrets.token_hex(32))\"`)") from None
    lo, hi = KEY_BYTES
    if len(key) < lo:
        raise ValueError(f"is {len(key)} bytes: use at least {lo} ({2 * lo} hex chars, e.g. "
                         "from `python -c \"import secrets; print(secrets.token_hex(32))\"`)")
    if len(key) > hi:
        raise ValueError(f"is {len(key)} bytes: use at most {hi}")
    return key


def key_file(path: str) -> bytes:
    return read_key_file(path)


def log_level(raw: str) -> int:
    level = logging.getLevelName(raw.strip().upper())
    if not isinstance(level, int):
        raise ValueError("is not a level: use DEBUG, INFO, WARNING or ERROR")
    return level


def text(raw: str) -> str:
    return raw


def count(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ValueError("is not a whole number: give a count, e.g. 1") from None
    if value < 0:
        raise ValueError("is negative: use 0 (none) or more")
    return value


RECOVERY_MODES = ("in-memory", "dying-checkpoint")


def recovery_mode(raw: str) -> str:
    mode = raw.strip().lower()
    if mode not in RECOVERY_MODES:
        raise ValueError(f"must be {' or '.join(RECOVERY_MODES)}")
    return mode


@dataclass(frozen=True)
class Setting:
    """One environment variable: what the docs, ``ttprun --help`` and the check say of it."""

    name: str
    type: str
    default: str  # as documented ("" when unset has a meaning given in `meaning`)
    range: str
    meaning: str
    parse: Parser = text
    value: Any = None  # the parsed default the runtime uses when the variable is unset
    detail: str = ""  # more, for the docs table


SETTINGS: Tuple[Setting, ...] = (
    Setting(ENV_OT, "seconds", "120", "(0, 604800]",
            "grace period after a fault: survivors stay up this long to save",
            seconds, 120.0,
            "ttprun holds the survivors, the runtime waits for its exit order; past it a rank "
            "exits 86. The generated script sets 360"),
    Setting(ENV_AUTH_KEY, "hex", "made by ttprun on one node",
            f"{KEY_BYTES[0]}..{KEY_BYTES[1]} bytes",
            "the job's control-plane secret, the same on every node", hex_key, None,
            "HMAC-SHA256 of every control frame; never sent over the network"),
    Setting(ENV_AUTH_KEY_FILE, "path", "", "owner-only regular file",
            f"instead of {ENV_AUTH_KEY}: a file holding it", key_file, None,
            "owned by you (or root), mode 600 or 400, symlinks followed: a Kubernetes Secret "
            "volume works with `defaultMode: 0400`"),
    Setting(ENV_INSECURE, "0/1", "0", "0 or 1",
            "1: run without a secret (one node only)", flag, False,
            "a key derived from MASTER_ADDR/MASTER_PORT/run id: anyone on the network can end "
            "the job"),
    Setting(ENV_CONTROLLER_PORT, "port", "training.py's (apply --port, 8000)", "1024..65535",
            "the controller's TCP port on MASTER_ADDR", port, None,
            "overrides the port the start calls pass; must differ from MASTER_PORT"),
    Setting(ENV_LISTEN_PORTS, "port range", "(ephemeral)", "LOW-HIGH in 1024..65535",
            "ports for the ranks' standby listeners", port_range, None,
            "each rank listens on one port of this range on its own address, for a standby "
            "controller; give at least as many ports as ranks per node, and open them between "
            "nodes"),
    Setting(ENV_RESTART_STORE_PORTS, "port or range", "(ephemeral)",
            "PORT or LOW-HIGH in 1024..65535",
            "ttprun --max-restarts: where node 0 hosts a restarted attempt's store",
            port_or_range, None,
            "the first free port of the range, on node 0 (the static rendezvous' MASTER_ADDR, "
            "or the c10d round's first node); open it between nodes, as MASTER_PORT"),
    Setting(ENV_HEARTBEAT_INTERVAL, "seconds", "2 (without node agents: world size / 8192 "
            "when larger)", "(0, 604800]",
            "between a rank's heartbeats and its agent's (or controller's) acks, and between "
            "tiers", seconds, 2.0,
            "with node agents (the default) a rank heartbeats to its own node and each node once "
            "per interval up the tree, at any job size; with TTP_NODE_AGENT=0 the default keeps "
            "the controller under ~8,000 heartbeats a second: 12.2 s at 100,000 ranks "
            "(docs/design.md, how the control plane scales)"),
    Setting(ENV_HEARTBEAT_TIMEOUT, "seconds", f"6, or 3 x {ENV_HEARTBEAT_INTERVAL} when larger",
            f"> {ENV_HEARTBEAT_INTERVAL}",
            "silence after which a rank is hung (or the controller lost)", seconds, 6.0,
            "also the longest pause (GC, a GIL-holding call) a rank may take without being "
            "declared hung"),
    Setting(ENV_STEP_TIMEOUT, "seconds", "0 (off)", "0 or (0, 604800]",
            "a job-wide stall this long is a fault", seconds_or_off, 0.0,
            "every rank heartbeats but no rank's step changed for this long; set it above your "
            "longest step plus evaluation and checkpoint pauses"),
    Setting(ENV_COLLECT_TIMEOUT, "seconds", "10", f"> {ENV_UPDATE_GRACE}",
            "how long the controller waits for every rank's state", seconds, 10.0),
    Setting(ENV_UPDATE_GRACE, "seconds", "5", "(0, 604800]",
            "how long a rank inside its optimizer update may take to finish it", seconds, 5.0),
    Setting(ENV_SAVE_TIME_LIMIT, "seconds",
            f"{ENV_OT} - the flow's other waits - {SAVE_LIMIT_MARGIN_S:g}", "(0, 604800]",
            "limit of the save handler (writing the dying checkpoint)", seconds, None,
            "the other waits are collect, advance, rename and the exit orders with their "
            "slack (docs/design.md, \"Deadlines\"): 62 s at the defaults, 302 s at the "
            "generated script's TTP_OT=360, never below TTP_OT/4; a save past it fails "
            "(exit 85)"),
    Setting(ENV_RENAME_TIME_LIMIT, "seconds", "15", "(0, 604800]",
            "limit of the rename handler (moving the checkpoint into place)", seconds, 15.0),
    Setting(ENV_CONNECT_TIMEOUT, "seconds", "60", "(0, 604800]",
            "how long a rank retries reaching the controller at start", seconds, 60.0),
    # A listener closes a connection that has not completed the handshake (challenge, Register,
    # ack) within this; a rank gives up on a listener that has not. Long enough for every rank
    # of a large job connecting at once, short enough that a port held by another program ends
    # every rank within seconds instead of after TTP_CONNECT_TIMEOUT.
    Setting(ENV_HANDSHAKE_TIMEOUT, "seconds", "10 (without node agents: world size / 4096 "
            "when larger)",
            "(0, 604800]", "a connection must finish its handshake within this", seconds, 10.0,
            "long enough for the controller (or a standby, on a failover) to register every "
            "rank of a storm"),
    Setting(ENV_REQUIRE_CROSS_HOST_REPLICAS, "0/1", "0", "0 or 1",
            "1: refuse to start when both copies of a shard share a host", flag, False,
            "0 warns instead"),
    Setting(ENV_RECOVERY, "mode", RECOVERY_MODES[0], " or ".join(RECOVERY_MODES),
            "after a fault, go on in memory (replace the lost rank) or save and exit",
            recovery_mode, RECOVERY_MODES[0],
            "in-memory needs ttprun, --load and the patched tree's recovery hooks; whenever it "
            "cannot work or fails half-way, the dying checkpoint is written (docs/recovery.md)"),
    # a cold replacement imports torch and Megatron and builds its model inside this bound
    Setting(ENV_RECOVER_TIMEOUT, "seconds", "120", "(0, 604800]",
            "an in-memory recovery not finished within this falls back to the dying "
            "checkpoint", seconds, 120.0,
            "from the recovery order to every rank (the replacement too) refilled and checked; "
            "TTP_OT then counts again for the dying checkpoint"),
    Setting(ENV_REPLACEMENTS, "text", "set by ttprun", "",
            "how the launcher starts a lost rank's replacement (cold; node: a spare node "
            "takes over a lost node's ranks)", text, None,
            "set by ttprun for its workers, not by you: unset (another launcher), a fault ends "
            "in the dying checkpoint"),
    Setting(ENV_RECOVERY_JOIN, "JSON", "set by ttprun", "",
            "in a replacement process: the recovery it joins", text, None,
            "set by ttprun for a replacement only (its step, store, acting controller), not by "
            "you"),
    Setting(ENV_DRILL, "JSON", "set by ttprun --drill", "",
            "the fire drill of this launch (docs/first-day.md)", text, None,
            "set by `ttprun --drill KIND:rank=R:iter=N` for its workers, with its run "
            "directory, not by you: a TTP_DRILL ttprun did not set is dropped, and a worker "
            "started otherwise ignores it"),
    Setting(ENV_WARM_SPARES, "count", "0", ">= 0",
            "ttprun: warm spares per node, processes ready to replace a lost rank", count, 0,
            "each has imported torch, the training script's imports and torch._dynamo and "
            "waits; `ttprun --warm-spares N` sets it (docs/spares.md)"),
    Setting(ENV_CHECKPOINT_KEY, "text", "", "non-empty",
            "HMAC every checkpoint manifest with this secret", text, None,
            "a checkpoint without a valid MAC is then refused at load"),
    Setting(ENV_RUN_DIR, "directory", "made by ttprun", "",
            "where the outcome, flow-finished.json, is written", text, None,
            "set it to keep that file: ttprun makes a folder per launch inside it"),
    Setting(ENV_LOG_LEVEL, "level", "INFO", "DEBUG, INFO, WARNING, ERROR",
            "the runtime's log level", log_level, logging.INFO),
    Setting(ENV_LOG_PATH, "directory", "(stderr)", "",
            "each rank logs to ttp-rank<R>.log here", text),
    Setting(ENV_CPU_BUILD_DIR, "directory", "<tmp>/ttp_cpu_adaptor_build", "",
            "CPU rehearsals: where Megatron's dataset helpers are built", text),
    Setting(ENV_NODE_AGENT, "0/1", "1", "0 or 1",
            "1: each node's ranks reach the controller through one node agent; 0: every rank "
            "connects to the controller itself", flag, True,
            "the agent is ttprun's own process, or one the node's first rank starts under "
            "another launcher; it sees a local rank die or hang at once, whatever the job's "
            "size, and the controller serves one connection per relay (docs/design.md)"),
    Setting(ENV_FANOUT, "count", "0 (auto)", ">= 0",
            "node agents per relay and per controller", count, 0,
            "0: the square root of the job's nodes, at least 32; the controller takes that many "
            "agents itself and sends the rest to them as relays"),
    Setting(ENV_AGENT_SOCKET, "path", "set by ttprun", "",
            "the AF_UNIX socket of this node's agent", text, None,
            "set by ttprun for its workers, not by you"),
    Setting(ENV_RDZV_NOTICE, "seconds", "10", "(0, 604800]",
            "how often ttprun says it waits for other nodes", seconds, 10.0),
)
BY_NAME: Dict[str, Setting] = {s.name: s for s in SETTINGS}
DEFAULTS: Dict[str, float] = {s.name: s.value for s in SETTINGS
                              if s.parse in (seconds, seconds_or_off) and s.value is not None}


# Defaults that grow with the job (docs/design.md, "How the control plane scales"). The
# controller spends tens of microseconds of one core per heartbeat and ack, and about a hundred
# per registration handshake: these keep its steady load at a fraction of a core and give every
# rank of a start-up or failover storm time to finish its handshake, at any world size. A
# value set in the environment always wins.
HEARTBEATS_PER_S = 8192.0  # the controller's heartbeat budget: interval >= world_size / this
REGISTRATIONS_PER_S = 4096.0  # handshake timeout >= world_size / this


def heartbeat_timeout_for(interval: float) -> float:
    """TTP_HEARTBEAT_TIMEOUT when unset: three intervals, never below the table's default."""
    return max(BY_NAME[ENV_HEARTBEAT_TIMEOUT].value, 3 * interval)


def scaled_defaults(world_size: Optional[int]) -> Dict[str, float]:
    """The defaults of the settings that depend on the job's size (without node agents: with
    them no connection serves more than a node's ranks or a relay's agents)."""
    interval = max(BY_NAME[ENV_HEARTBEAT_INTERVAL].value, (world_size or 0) / HEARTBEATS_PER_S)
    return {
        ENV_HEARTBEAT_INTERVAL: interval,
        ENV_HEARTBEAT_TIMEOUT: heartbeat_timeout_for(interval),
        ENV_HANDSHAKE_TIMEOUT: max(BY_NAME[ENV_HANDSHAKE_TIMEOUT].value,
                                   (world_size or 0) / REGISTRATIONS_PER_S),
    }


class SettingsError(ValueError):
    """Every bad setting at once: one message, one line per problem."""

    def __init__(self, problems: List[str]) -> None:
        self.problems = list(problems)
        if len(problems) == 1:
            super().__init__(problems[0])
        else:
            super().__init__(f"{len(problems)} settings are wrong:\n  "
                             + "\n  ".join(problems))


def _raw(env: Mapping[str, str], name: str) -> Optional[str]:
    raw = env.get(name)
    return None if raw is None or raw.strip() == "" else raw


def _parse_all(env: Mapping[str, str],
               world_size: Optional[int] = None) -> Tuple[Dict[str, Any], List[str]]:
    values: Dict[str, Any] = {}
    problems: List[str] = []
    try:
        tiers = flag(_raw(env, ENV_NODE_AGENT) or "1")
    except ValueError:
        tiers = True  # reported with the rest below
    scaled = scaled_defaults(None if tiers else world_size)
    for s in SETTINGS:
        raw = _raw(env, s.name)
        if raw is None:
            values[s.name] = s.value
            if s.name == ENV_HEARTBEAT_TIMEOUT and values.get(ENV_HEARTBEAT_INTERVAL):
                values[s.name] = heartbeat_timeout_for(values[ENV_HEARTBEAT_INTERVAL])
            elif s.name in scaled:
                values[s.name] = scaled[s.name]
            continue
        try:
            values[s.name] = s.parse(raw)
        except ValueError as exc:
            why = str(exc)
            if not why.startswith(s.name):  # the key itself is never printed
                why = f"{s.name} {why}" if s.parse is hex_key else f"{s.name}={raw!r} {why}"
            problems.append(why)
            values[s.name] = None
    return values, problems


def _cross_checks(env: Mapping[str, str], v: Dict[str, Any]) -> List[str]:
    out = []
    hb, hb_to = v[ENV_HEARTBEAT_INTERVAL], v[ENV_HEARTBEAT_TIMEOUT]
    if hb is not None and hb_to is not None and hb_to <= hb:
        out.append(f"{ENV_HEARTBEAT_TIMEOUT}={hb_to:g} must be larger than "
                   f"{ENV_HEARTBEAT_INTERVAL}={hb:g} (3 intervals is typical)")
    collect, grace = v[ENV_COLLECT_TIMEOUT], v[ENV_UPDATE_GRACE]
    if collect is not None and grace is not None and collect <= grace:
        out.append(f"{ENV_COLLECT_TIMEOUT}={collect:g} must exceed {ENV_UPDATE_GRACE}="
                   f"{grace:g}: a rank inside its update window needs the grace to answer")
    if _raw(env, ENV_AUTH_KEY) and _raw(env, ENV_AUTH_KEY_FILE):
        out.append(f"both {ENV_AUTH_KEY} and {ENV_AUTH_KEY_FILE} are set: set one")
    return out


def problems(env: Mapping[str, str]) -> List[str]:
    """Every bad setting in `env`, one sentence each (empty: all fine). A missing key is not
    a problem here: ttprun makes one on a single node; the runtime asks for it itself."""
    values, found = _parse_all(env)
    return found + _cross_checks(env, values)


# Characters a name can hold by mistake in place of another that looks the same: the digit for
# the letter (TTP_0T), a lowercase letter, '-' for '_', and the Cyrillic and Greek capitals a
# copy from a document can bring along. Both sides of a comparison are folded the same way.
_LOOK_ALIKE = str.maketrans({
    "0": "O", "1": "I", "l": "I", "L": "I", "|": "I", "5": "S", "8": "B", "-": "_",
    "\u0410": "A", "\u0412": "B", "\u0415": "E", "\u041a": "K", "\u041c": "M", "\u041d": "H",
    "\u041e": "O", "\u0420": "P", "\u0421": "C", "\u0422": "T", "\u0425": "X", "\u0406": "I",
    "\u0391": "A", "\u0392": "B", "\u0395": "E", "\u0397": "H", "\u0399": "I", "\u039a": "K",
    "\u039c": "M", "\u039d": "N", "\u039f": "O", "\u03a1": "P", "\u03a4": "T", "\u03a7": "X",
})


def _folded(name: str) -> str:
    return name.translate(_LOOK_ALIKE).upper().translate(_LOOK_ALIKE)


_FOLDED = {_folded(n): n for n in BY_NAME}


def unknown_names(env: Mapping[str, str]) -> List[str]:
    """Warnings for names that look like a misspelt setting (they are ignored): one letter off
    (TTP_OTT), or made of look-alike characters (TTP_0T with a zero, ttp_ot, TTP-OT)."""
    out = []
    for name in sorted(env):
        if name in BY_NAME:
            continue
        folded = _folded(name)
        if folded in _FOLDED:
            out.append(f"{ascii(name)[1:-1]} is not a setting (ignored): it looks like "
                       f"{_FOLDED[folded]} but {_difference(name, _FOLDED[folded])}")
        elif folded.startswith(("TTP_", "TTPRUN_")):
            close = difflib.get_close_matches(name, list(BY_NAME), n=1, cutoff=0.85)
            if close:
                out.append(f"{name} is not a setting (ignored): did you mean {close[0]}?")
    return out


def _difference(typed: str, meant: str) -> str:
    """Which characters of `typed` differ from the setting `meant` (same length or not)."""
    pairs = [(a, b) for a, b in zip(typed, meant) if a != b]
    if len(typed) != len(meant) or not pairs:
        return f"is spelt {ascii(typed)}"
    a, b = pairs[0]
    return f"has {_char(a)} where the setting has {_char(b)}"


def _char(c: str) -> str:
    import unicodedata

    return f"{c!r} ({unicodedata.name(c, hex(ord(c))).lower()})"


def derived_save_limit(ot: float, others: float) -> float:
    """TTP_SAVE_TIME_LIMIT when unset: the part of TTP_OT that every other wait of the flow
    (`others`: Deadlines.flow_budget less the save's own limit) leaves to the save, never below
    a quarter of TTP_OT (a short TTP_OT, e.g. in tests, still gives the save some time; the
    start-up check then warns)."""
    return max(ot - others - SAVE_LIMIT_MARGIN_S, ot / 4)


def value(env: Mapping[str, str], name: str) -> Any:
    """One setting's value from `env` (its default when unset), parsed by its row of the table;
    a ValueError names the variable and what is wrong."""
    setting = BY_NAME[name]
    raw = _raw(env, name)
    if raw is None:
        return setting.value
    try:
        return setting.parse(raw)
    except ValueError as exc:
        why = str(exc)
        raise ValueError(why if why.startswith(name) else f"{name}={raw!r} {why}") from None


def overtime_s(env: Optional[Mapping[str, str]] = None) -> float:
    """TTP_OT in seconds (ValueError naming the variable when it is bad)."""
    return value(os.environ if env is None else env, ENV_OT)


def _port_env(env: Mapping[str, str]) -> Optional[int]:
    return value(env, ENV_CONTROLLER_PORT)


def warm_spares(env: Optional[Mapping[str, str]] = None) -> int:
    """``TTP_WARM_SPARES``: how many warm spares ``ttprun`` keeps per node (default 0)."""
    return value(os.environ if env is None else env, ENV_WARM_SPARES)


def _parse_key(raw: str, source: str) -> bytes:
    try:
        return hex_key(raw)
    except ValueError as exc:
        raise ValueError(f"{source} {exc}") from None


def read_key_file(path: str) -> bytes:
    """The key from a file only its owner can read (a group- or world-readable key is no
    secret on a shared cluster). Symlinks are followed (a Kubernetes Secret volume's files
    are links into a hidden folder): what counts is the file finally opened, checked with
    fstat on the open descriptor, so a link swapped after the check cannot point elsewhere."""
    where = f"{ENV_AUTH_KEY_FILE}={path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ValueError(f"{where}: cannot open ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        final = os.path.realpath(path)
        shown = path if final == os.path.abspath(path) else f"{path} (-> {final})"
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{ENV_AUTH_KEY_FILE}={shown} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise ValueError(f"{ENV_AUTH_KEY_FILE}={shown} belongs to uid {st.st_uid}, not "
                             f"to you (uid {os.geteuid()}) or root: its owner could change "
                             "the key; use a file of your own")
        if st.st_mode & 0o077:
            raise ValueError(
                f"{ENV_AUTH_KEY_FILE}={shown} is readable by others (mode "
                f"{stat.S_IMODE(st.st_mode):o}): run `chmod 600 {final}` (Kubernetes: "
                "`defaultMode: 0400` on the Secret volume)")
        raw = f.read(1025)
    if len(raw) > 1024:
        raise ValueError(f"{ENV_AUTH_KEY_FILE}={shown} is too large for a key")
    return _parse_key(raw.decode("ascii", "replace"), f"{ENV_AUTH_KEY_FILE}={shown}")


NO_KEY_MESSAGE = (
    f"no control-plane key: launch with ttprun (it generates one on a single node), or "
    f"give every rank the same secret in {ENV_AUTH_KEY} (e.g. `export {ENV_AUTH_KEY}="
    f"$(python -c 'import secrets; print(secrets.token_hex(32))')` distributed by your "
    f"scheduler) or in a chmod-600 file named by {ENV_AUTH_KEY_FILE}; "
    f"{ENV_INSECURE}=1 runs without a secret (anyone on the network can end the job)")


def auth_key_from_env(env: Mapping[str, str]) -> bytes:
    """The per-job HMAC secret: TTP_AUTH_KEY (ttprun generates one on a single node), or
    TTP_AUTH_KEY_FILE. There is no derived default: a key computed from MASTER_ADDR and the
    like is known to anyone on the network, who could then end the job with one forged fault
    report. Only an explicit TTP_INSECURE_NO_AUTH=1 gets such a key, logged as insecure."""
    raw = _raw(env, ENV_AUTH_KEY)
    if raw:
        return _parse_key(raw, ENV_AUTH_KEY)
    if _raw(env, ENV_AUTH_KEY_FILE):
        return read_key_file(env[ENV_AUTH_KEY_FILE])
    if env.get(ENV_INSECURE) != "1":
        raise ValueError(NO_KEY_MESSAGE)
    seed = "|".join(env.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
    _warn_insecure(f"INSECURE: {ENV_INSECURE}=1 and no {ENV_AUTH_KEY}: using a key derived from "
                   "MASTER_ADDR/MASTER_PORT/TORCHELASTIC_RUN_ID; anyone who knows these can "
                   "forge control messages and end the job")
    return hashlib.sha256(b"mindio-ttp-weak-key|" + seed.encode()).digest()


_insecure_warned = False


def _warn_insecure(text: str) -> None:
    """Logged, and written to stderr once per process whatever TTP_LOG_LEVEL says: a job
    anyone on the network can end must never run quietly."""
    global _insecure_warned
    log.warning("%s", text)
    if not _insecure_warned:
        _insecure_warned = True
        try:
            print(f"mindio_ttp: WARNING: {text}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # a closed stderr must not stop the start
            pass


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
    handshake_timeout: float = BY_NAME[ENV_HANDSHAKE_TIMEOUT].value
    listen_ports: Optional[Tuple[int, int]] = field(default=None)
    recovery: str = RECOVERY_MODES[0]
    recover_timeout: float = 120.0
    replacements: str = ""  # what the launcher offers (ENV_REPLACEMENTS); "": none
    node_agent: bool = True  # ENV_NODE_AGENT
    fanout: int = 0  # ENV_FANOUT; 0: auto

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None,
                 world_size: Optional[int] = None) -> TTPConfig:
        """The settings of this rank, checked by the same table as ttprun's check (a
        SettingsError lists every bad value at once). `world_size`: the job's, so that the
        heartbeat interval and the timeouts that follow it default to what the controller can
        serve for that many ranks; the controller and every processor pass the same one."""
        env = os.environ if env is None else env
        values, found = _parse_all(env, world_size)
        found += _cross_checks(env, values)
        key: Optional[bytes] = None
        if not any(p.startswith((ENV_AUTH_KEY, ENV_INSECURE)) for p in found):
            try:
                key = auth_key_from_env(env)
            except ValueError as exc:
                found.append(str(exc))
        if found:
            raise SettingsError(found)
        assert key is not None
        v = values
        save_limit = v[ENV_SAVE_TIME_LIMIT]
        cfg = cls(
            ot=v[ENV_OT],
            heartbeat_interval=v[ENV_HEARTBEAT_INTERVAL],
            heartbeat_timeout=v[ENV_HEARTBEAT_TIMEOUT],
            save_time_limit=0.0 if save_limit is None else save_limit,
            rename_time_limit=v[ENV_RENAME_TIME_LIMIT],
            collect_timeout=v[ENV_COLLECT_TIMEOUT],
            update_grace=v[ENV_UPDATE_GRACE],
            connect_timeout=v[ENV_CONNECT_TIMEOUT],
            controller_port=v[ENV_CONTROLLER_PORT],
            run_dir=env.get(ENV_RUN_DIR) or None,
            auth_key=key,
            step_timeout=v[ENV_STEP_TIMEOUT],
            handshake_timeout=v[ENV_HANDSHAKE_TIMEOUT],
            listen_ports=v[ENV_LISTEN_PORTS],
            recovery=v[ENV_RECOVERY],
            recover_timeout=v[ENV_RECOVER_TIMEOUT],
            replacements=(v[ENV_REPLACEMENTS] or "").strip(),
            node_agent=v[ENV_NODE_AGENT],
            fanout=v[ENV_FANOUT],
        )
        if save_limit is None:
            cfg = dataclasses.replace(cfg, save_time_limit=derived_save_limit(
                cfg.ot, cfg.deadlines.flow_budget_without_save))
        budget = cfg.deadlines.flow_budget
        if budget >= cfg.ot:
            log.warning("%s=%g is not longer than the flow may wait (%g s: %s): processes may "
                        "exit with no verdict before the dying checkpoint is renamed",
                        ENV_OT, cfg.ot, budget, cfg.deadlines.flow_budget_terms())
        return cfg

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self)


@dataclass(frozen=True)
class Deadlines:
    """Every wait derived from the settings, each with the one reason for its slack, so that
    what the flow waits for and what the start-up check adds up are the same. Built from a
    TTPConfig, or from a node agent's AgentSettings for the waits a node agent has (the
    heartbeat, handshake, connect and TTP_OT ones)."""

    cfg: Any

    # -- the flow (control/controller/flow.py) -------------------------------------------------
    @property
    def advance_wait(self) -> float:
        """Phase 2 (AdvanceTo): the update grace, one heartbeat for the reports to travel, and a
        second for scheduling on a busy node."""
        return self.cfg.update_grace + self.cfg.heartbeat_interval + 1.0

    def order_wait(self, limit: float) -> float:
        """A save or rename order of `limit` seconds: its answer comes at most one heartbeat
        after the handler's end, the order one heartbeat after it was sent, and a second."""
        return limit + 2 * self.cfg.heartbeat_interval + 1.0

    def save_retry_left(self, spent: float) -> float:
        """What TTP_OT leaves for ordering a save again, `spent` seconds after the fault: the
        rename and the exit orders (about four heartbeats' travel, and a second) must fit."""
        cfg = self.cfg
        return cfg.ot - spent - cfg.rename_time_limit - 4 * cfg.heartbeat_interval - 1.0

    @property
    def exit_flush(self) -> float:
        """How long the flow waits for every exit order to be written before its own rank's:
        as long as a storm's handshakes may take (scaled without node agents), at least 2 s."""
        return max(2.0, self.cfg.handshake_timeout)

    @property
    def flow_budget_without_save(self) -> float:
        """Every wait of a flow but the save handler's own limit (TTP_SAVE_TIME_LIMIT, when
        unset, is what TTP_OT leaves after this: config.derived_save_limit)."""
        cfg = self.cfg
        return (cfg.collect_timeout + self.advance_wait + self.order_wait(0.0)
                + self.order_wait(cfg.rename_time_limit) + self.exit_flush)

    @property
    def flow_budget(self) -> float:
        """The longest a flow may wait from the fault to its exit orders: collect, advance, the
        save order and the rename order, each with its slack, and the exit orders' flush. The
        start-up check warns when TTP_OT is not longer (a rank gives up TTP_OT after the fault)."""
        return self.flow_budget_without_save + self.cfg.save_time_limit

    def flow_budget_terms(self) -> str:
        """The sum above in words, for the start-up warning."""
        cfg = self.cfg
        return (f"collect {cfg.collect_timeout:g} + advance {self.advance_wait:g} + save "
                f"{self.order_wait(cfg.save_time_limit):g} + rename "
                f"{self.order_wait(cfg.rename_time_limit):g} + exit orders {self.exit_flush:g}")

    # -- failover ------------------------------------------------------------------------------
    @property
    def failover_try(self) -> float:
        """How long a failover target gets to send its challenge (a hung process accepts TCP
        connections in the kernel): a heartbeat timeout, at most 5 s so a list of dead
        targets is gone through quickly. Ranks and node agents alike."""
        return min(self.cfg.heartbeat_timeout, 5.0)

    @property
    def failover_floor(self) -> float:
        """A promoted standby waits this long at least for the rest of the job to fail over:
        two heartbeat intervals (every rank noticed) and half a second."""
        return 2 * self.cfg.heartbeat_interval + 0.5

    @property
    def failover_ceiling(self) -> float:
        """...and this long at most: the floor, then a storm's handshakes (TTP_HANDSHAKE_TIMEOUT,
        scaled with the job without node agents)."""
        return self.failover_floor + self.cfg.handshake_timeout

    @property
    def route_grace(self) -> float:
        """How long ranks whose node agent or relay was lost have to register another way
        before they count as dead (routes.py): their processors and agents re-register at once
        on EOF; a heartbeat interval and a second cover a busy node."""
        return self.cfg.heartbeat_interval + 1.0

    # -- the loops ---------------------------------------------------------------------------
    @property
    def controller_tick(self) -> float:
        """The longest the controller's loop sleeps: half a heartbeat interval, a quarter of
        the timeout, so a silence is judged within a quarter of its limit."""
        return min(self.cfg.heartbeat_interval / 2, self.cfg.heartbeat_timeout / 4)

    @property
    def agent_tick(self) -> float:
        """A node agent's: the controller's, at most half a second (it judges its local ranks,
        whose death it should pass up at once)."""
        return min(self.controller_tick, 0.5)

    # -- the end of a job ----------------------------------------------------------------------
    @property
    def goodbye_wait(self) -> float:
        """At the normal end of training, how long the controller waits for every rank's
        goodbye: two heartbeat timeouts (a rank a heartbeat behind, and its frame's travel)
        and a second."""
        return 2 * self.cfg.heartbeat_timeout + 1.0

    @staticmethod
    def controller_stop(goodbye_wait: float) -> float:
        """How long rank 0 waits for its controller process to stop before killing it."""
        return goodbye_wait + CONTROLLER_STOP_GRACE_S

    @property
    def orders_drain(self) -> float:
        """How long the controller process serves on after the exit orders, for every rank to
        read its own: a storm's handshakes, at least 10 s, and never past TTP_OT (a rank still
        connected then has stopped waiting for its verdict)."""
        return max(10.0, self.cfg.handshake_timeout, self.cfg.ot)

    @property
    def agent_unjoined(self) -> float:
        """A node agent that no rank reached exits after this: the ranks' own connect timeout
        and a margin."""
        return self.cfg.connect_timeout + AGENT_UNJOINED_GRACE_S

    @staticmethod
    def store_answer(wait_s: float) -> float:
        """An AuthStore call asking the controller to wait `wait_s` gets its answer within
        this, or fails (the store's own wait, and the travel of both frames on a busy node)."""
        return wait_s + STORE_ANSWER_GRACE_S


# -- the table, for people ----------------------------------------------------------------------
def markdown_table() -> str:
    """The docs/settings.md table of every TTP_* variable (a test keeps the file in step)."""
    rows = ["| variable | type | default | range | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        meaning = f"{s.meaning}; {s.detail}" if s.detail else s.meaning
        rows.append(f"| `{s.name}` | {s.type} | {s.default or '(unset)'} | {s.range or '-'} | "
                    f"{meaning} |")
    return "\n".join(rows) + "\n"


def help_lines(width: int = 96) -> List[str]:
    """``ttprun --help``'s list: name, type, default, meaning."""
    import textwrap

    out = []
    for s in SETTINGS:
        default = f", default {s.default}" if s.default else ""
        values = f"; {s.range}" if s.parse is recovery_mode else ""  # the values themselves
        out += textwrap.wrap(f"{s.name} ({s.type}{default}{values}): {s.meaning}", width,
                             initial_indent="  ", subsequent_indent="      ")
    return out


if __name__ == "__main__":  # pragma: no cover - `python -m mindio_ttp.config`
    sys.stdout.write(markdown_table())
